//! Where the layers above the VMM (fault tolerance, benchmarks, tests) see
//! and steer what a VM does, without the VMM knowing why.
//!
//! The VMM calls a hook when one is installed and otherwise does the plain
//! thing: frames go to the TAP, host input reaches the guest, idle and disk
//! writes pass unremarked.

use std::io::Write;
use std::sync::{Arc, Mutex, RwLock};

use crate::sync::{Lock, ReadWrite};

/// Receives every frame the guest transmits (with its virtio-net header).
pub trait FrameSink: Send + Sync {
    fn send(&self, frame: &[u8]);

    /// Whether the sink takes another frame now. While it says no, the
    /// network card leaves the guest's frames in its transmit queue (the
    /// guest sees a full ring, as behind a slow link) until the sink wakes
    /// the device ([`crate::devices::Waker`]).
    fn accepting(&self) -> bool {
        true
    }
}

/// Told of every guest disk write once it reached the disk image.
pub trait DiskWriteObserver: Send + Sync {
    fn written(&self, offset: u64, data: &[u8]);

    /// Whether the disk may serve another request now. While it says no,
    /// requests stay in the guest's queue until the observer wakes the
    /// device ([`crate::devices::Waker`]).
    fn accepting(&self) -> bool {
        true
    }
}

/// Sees every frame from the host network before the guest does.
pub trait HostInputFilter: Send + Sync {
    /// Whether to deliver `frame` to the guest.
    fn admit(&self, frame: &[u8]) -> bool;

    /// The network card ended a pass of reading the TAP: every frame it
    /// read since the previous call was shown to `admit`. A filter that
    /// keeps frames to handle them together does so now.
    fn pass_end(&self) {}
}

/// Stands between the guest's TCP and the network's (a proxy that
/// acknowledges the guest's held data itself): sees host frames after the
/// input filter and may rewrite them, and makes up frames for the guest.
pub trait GuestProxy: Send + Sync {
    /// Rewrite `frame` (from the host, with its virtio-net header) in place
    /// before the guest gets it; false: the guest does not get it.
    fn rewrite(&self, frame: &mut [u8]) -> bool;

    /// Frames made up for the guest since the last call, in order: the
    /// network card delivers them after its transmit pass, before more
    /// host input.
    fn take_made_up(&self) -> Vec<Vec<u8>>;
}

/// Told when every vCPU waits in the wait hypercall (nothing to run).
pub trait IdleObserver: Send + Sync {
    fn all_idle(&self);
}

/// Where guest console output goes.
pub trait ConsoleSink: Send + Sync {
    fn write(&self, bytes: &[u8]);
}

/// Declares `Hooks` with one slot per hook, and for each `NAME()` that
/// reads it and `set_NAME(..)` that installs (`Some`) or removes (`None`) it.
macro_rules! hooks {
    ($($(#[$doc:meta])* $name:ident, $set:ident: $hook:ident;)*) => {
        /// The hooks of one VM; each may be installed or removed at any time.
        #[derive(Default)]
        pub struct Hooks {
            $($name: RwLock<Option<Arc<dyn $hook>>>,)*
        }

        impl Hooks {
            $(
                $(#[$doc])*
                pub fn $set(&self, hook: Option<Arc<dyn $hook>>) {
                    *self.$name.write_locked() = hook;
                }

                pub fn $name(&self) -> Option<Arc<dyn $hook>> {
                    self.$name.read_locked().clone()
                }
            )*
        }
    };
}

hooks! {
    /// Frames the guest sends go to the hook instead of straight to the TAP.
    tx, set_tx: FrameSink;
    disk_writes, set_disk_writes: DiskWriteObserver;
    host_input, set_host_input: HostInputFilter;
    guest_proxy, set_guest_proxy: GuestProxy;
    idle, set_idle: IdleObserver;
    /// Guest console output goes to the hook instead of the VM's console.
    console, set_console: ConsoleSink;
}

/// A console sink chosen when the VM is built.
#[derive(Clone)]
pub struct Console(Arc<dyn ConsoleSink>);

impl Console {
    pub fn new(sink: Arc<dyn ConsoleSink>) -> Console {
        Console(sink)
    }

    /// An in-memory buffer (tests and benchmarks read it back).
    pub fn capture() -> (Console, Arc<Mutex<Vec<u8>>>) {
        let buf = Arc::new(Mutex::new(Vec::new()));
        (Console(Arc::new(Capture(buf.clone()))), buf)
    }

    pub fn write(&self, bytes: &[u8]) {
        self.0.write(bytes);
    }
}

/// The VMM's standard output: the normal case for `ftvm run`.
impl Default for Console {
    fn default() -> Self {
        Console(Arc::new(Stdout))
    }
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Console")
    }
}

struct Stdout;

/// Writes of guest console output to the VMM's stdout that failed.
static CONSOLE_WRITE_ERRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// The kind of the last failure while writes fail (one warning a streak).
static CONSOLE_FAILING: Mutex<Option<std::io::ErrorKind>> = Mutex::new(None);

/// Guest console writes to stdout that failed so far (their output was
/// dropped), for `ftvm status` and Prometheus.
pub fn console_write_errors() -> u64 {
    CONSOLE_WRITE_ERRORS.load(std::sync::atomic::Ordering::Relaxed)
}

impl ConsoleSink for Stdout {
    fn write(&self, bytes: &[u8]) {
        let mut out = std::io::stdout().lock();
        // A closed or full stdout must not stop the guest: the output is
        // dropped, counted, and warned about once per streak.
        let result = out.write_all(bytes).and_then(|_| out.flush());
        drop(out);
        let mut failing = CONSOLE_FAILING.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(()) => {
                if let Some(kind) = failing.take() {
                    tracing::warn!("guest console output reaches stdout again after {kind}");
                }
            }
            Err(e) => {
                CONSOLE_WRITE_ERRORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if *failing != Some(e.kind()) {
                    tracing::warn!("cannot write the guest's console output to stdout: {e}; it is dropped (and counted) while this lasts, the VM goes on");
                    *failing = Some(e.kind());
                }
            }
        }
    }
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl ConsoleSink for Capture {
    fn write(&self, bytes: &[u8]) {
        self.0.locked().extend_from_slice(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Count(Mutex<usize>);

    impl FrameSink for Count {
        fn send(&self, _frame: &[u8]) {
            *self.0.locked() += 1;
        }
    }

    #[test]
    fn hooks_install_and_remove() {
        let hooks = Hooks::default();
        assert!(hooks.tx().is_none());
        let count = Arc::new(Count(Mutex::new(0)));
        hooks.set_tx(Some(count.clone()));
        hooks.tx().expect("installed").send(b"x");
        assert_eq!(*count.0.locked(), 1);
        hooks.set_tx(None);
        assert!(hooks.tx().is_none());
    }

    /// A proxy that raises a byte of every host frame and makes up one frame per frame it saw.
    #[derive(Default)]
    struct Raise(Mutex<Vec<Vec<u8>>>);

    impl GuestProxy for Raise {
        fn rewrite(&self, frame: &mut [u8]) -> bool {
            frame[0] += 1;
            self.0.locked().push(vec![frame[0]]);
            frame[0] < 10
        }
        fn take_made_up(&self) -> Vec<Vec<u8>> {
            std::mem::take(&mut *self.0.locked())
        }
    }

    #[test]
    fn a_guest_proxy_installs_rewrites_and_hands_over_what_it_made_up() {
        let hooks = Hooks::default();
        assert!(hooks.guest_proxy().is_none());
        hooks.set_guest_proxy(Some(Arc::new(Raise::default())));
        let proxy = hooks.guest_proxy().expect("installed");
        let mut frame = [1u8, 2];
        assert!(proxy.rewrite(&mut frame));
        assert_eq!(frame, [2, 2]);
        let mut last = [9u8];
        assert!(!proxy.rewrite(&mut last), "dropped");
        assert_eq!(proxy.take_made_up(), vec![vec![2], vec![10]]);
        assert!(proxy.take_made_up().is_empty(), "taken once");
        hooks.set_guest_proxy(None);
        assert!(hooks.guest_proxy().is_none());
    }

    #[test]
    fn captured_console_reads_back() {
        let (console, buf) = Console::capture();
        console.write(b"hello ");
        console.clone().write(b"world");
        assert_eq!(&*buf.locked(), b"hello world");
    }
}
