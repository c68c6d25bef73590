//! Where a disk request's file I/O runs (`--disk-io`): inside the device
//! thread's pass over the queue (`sync`), which a pause of the VM waits
//! for; or after the pass, by the same thread with the device unlocked
//! (`async`), so a pause never waits for the disk.
//!
//! The I/O never touches guest memory: a write's data is copied out of the
//! guest's buffers when the device issues the request, and a read's data
//! comes back in a buffer of its own, which the device copies into the
//! guest's when it completes the request, in a pass (only while the VM
//! runs). Operations run one at a time in the order they were submitted,
//! and their results come back in that order.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use super::{STATUS_IOERR, STATUS_OK};
use crate::devices::virtio::DeferredIo;
use crate::hooks::Hooks;
use crate::sync::{self, Lock};

crate::switch! {
    /// How a disk runs its requests' I/O (`--disk-io`).
    pub enum DiskIo {
        /// After the pass, with the device unlocked: requests in flight at a
        /// pause stay on the device's pending list, saved with it, and complete
        /// in a pass after the resume.
        Async = "async",
        /// In the device thread's pass: a pause waits for the request in progress.
        Sync = "sync",
    }
}

/// Tests only: `FTVM_TEST_FAULT=slow-disk:MS` makes every disk write take
/// MS milliseconds longer, so requests are in flight when the VM pauses.
pub fn write_delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        let spec = std::env::var("FTVM_TEST_FAULT").ok()?;
        let ms: u64 = spec.strip_prefix("slow-disk:")?.parse().ok()?;
        tracing::warn!(ms, "test fault injected: every disk write takes {ms} ms longer");
        Some(Duration::from_millis(ms))
    })
}

/// What the I/O side does for one request.
#[derive(Debug)]
pub enum Op {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    Flush,
    /// Nothing to do on the disk: the status (and data) the request gets,
    /// decided when it was issued (a bad request, the device id). It goes
    /// through the same queue so completions keep their order.
    Reply {
        status: u8,
        data: Vec<u8>,
    },
}

/// A finished operation: the `seq` it was submitted with, its status byte,
/// and the data for the guest's buffers (a read's).
#[derive(Debug)]
pub struct Done {
    pub seq: u64,
    pub status: u8,
    pub data: Vec<u8>,
}

/// The disk image and what its writes are reported to.
pub struct DiskFile {
    pub file: File,
    pub path: PathBuf,
    pub hooks: Arc<Hooks>,
}

impl DiskFile {
    fn run(&self, op: Op) -> (u8, Vec<u8>) {
        match op {
            Op::Read { offset, len } => {
                let mut buf = vec![0u8; len];
                match self.file.read_exact_at(&mut buf, offset) {
                    Ok(()) => (STATUS_OK, buf),
                    Err(_) => (STATUS_IOERR, Vec::new()),
                }
            }
            Op::Write { offset, data } => {
                if let Some(delay) = write_delay() {
                    std::thread::sleep(delay);
                }
                match self.file.write_all_at(&data, offset) {
                    Ok(()) => {
                        // Told once the data is in the image, before the
                        // request can complete: a replicated VM journals it
                        // into the epoch it reached the disk in.
                        if let Some(observer) = self.hooks.disk_writes() {
                            observer.written(offset, &data);
                        }
                        (STATUS_OK, Vec::new())
                    }
                    // ENOSPC on a full host disk lands here: the guest sees IOERR
                    // for this write and everything written before stays intact.
                    Err(e) => {
                        tracing::warn!(disk = %self.path.display(), offset, error = %e, "disk write failed");
                        (STATUS_IOERR, Vec::new())
                    }
                }
            }
            Op::Flush => match self.file.sync_data() {
                Ok(()) => (STATUS_OK, Vec::new()),
                Err(_) => (STATUS_IOERR, Vec::new()),
            },
            Op::Reply { status, data } => (status, data),
        }
    }
}

/// Runs a disk's operations and hands their results back in order.
pub struct Backend {
    disk: Arc<DiskFile>,
    mode: Mode,
}

enum Mode {
    Sync { done: VecDeque<Done> },
    Async(Arc<Deferred>),
}

/// The operations of a disk with `--disk-io async`: queued by the device
/// when it issues them, run by the device thread after its pass, with the
/// device unlocked (`DeferredIo::run`).
pub struct Deferred {
    disk: Arc<DiskFile>,
    state: Mutex<DeferredState>,
    /// Signalled when an operation finished running.
    finished: Condvar,
}

#[derive(Default)]
struct DeferredState {
    ops: VecDeque<(u64, Op)>,
    done: VecDeque<Done>,
    /// An operation is running now (its thread holds no lock meanwhile).
    running: bool,
}

impl Deferred {
    fn lock(&self) -> MutexGuard<'_, DeferredState> {
        self.state.locked()
    }
}

impl DeferredIo for Deferred {
    fn run(&self) -> bool {
        let mut ran = false;
        loop {
            let (seq, op) = {
                let mut st = self.lock();
                let Some(next) = st.ops.pop_front() else { break };
                st.running = true;
                next
            };
            let (status, data) = self.disk.run(op);
            let mut st = self.lock();
            st.done.push_back(Done { seq, status, data });
            st.running = false;
            self.finished.notify_all();
            ran = true;
        }
        ran
    }
}

impl Backend {
    pub fn new(disk: DiskFile, io: DiskIo) -> Backend {
        let disk = Arc::new(disk);
        let mode = match io {
            DiskIo::Sync => Mode::Sync { done: VecDeque::new() },
            DiskIo::Async => Mode::Async(Arc::new(Deferred { disk: disk.clone(), state: Mutex::default(), finished: Condvar::new() })),
        };
        Backend { disk, mode }
    }

    pub fn io(&self) -> DiskIo {
        match self.mode {
            Mode::Sync { .. } => DiskIo::Sync,
            Mode::Async(_) => DiskIo::Async,
        }
    }

    /// What the device thread runs after each pass (async only).
    pub fn deferred(&self) -> Option<Arc<dyn DeferredIo>> {
        match &self.mode {
            Mode::Sync { .. } => None,
            Mode::Async(d) => Some(d.clone()),
        }
    }

    /// Run `op` (sync: now; async: queue it for the device thread); its
    /// result comes back from `next_done` after those of every operation
    /// submitted before.
    pub fn submit(&mut self, seq: u64, op: Op) {
        match &mut self.mode {
            Mode::Sync { done } => {
                let (status, data) = self.disk.run(op);
                done.push_back(Done { seq, status, data });
            }
            Mode::Async(d) => d.lock().ops.push_back((seq, op)),
        }
    }

    /// The oldest result not taken yet.
    pub fn next_done(&mut self) -> Option<Done> {
        match &mut self.mode {
            Mode::Sync { done } => done.pop_front(),
            Mode::Async(d) => d.lock().done.pop_front(),
        }
    }

    /// Forget every operation: wait for the one running (if any), drop
    /// those not started and every result not taken.
    pub fn forget(&mut self) {
        match &mut self.mode {
            Mode::Sync { done } => done.clear(),
            Mode::Async(d) => {
                let mut st = d.lock();
                st.ops.clear();
                while st.running {
                    st = sync::wait(&d.finished, st);
                }
                st.done.clear();
            }
        }
    }
}

impl Drop for Backend {
    /// Operations already submitted still reach the disk (a write the guest
    /// issued is not dropped on the floor).
    fn drop(&mut self) {
        if let Mode::Async(d) = &self.mode {
            d.run();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_as_the_command_line_names_them() {
        for io in [DiskIo::Sync, DiskIo::Async] {
            assert_eq!(io.to_string().parse::<DiskIo>(), Ok(io));
        }
        assert_eq!(DiskIo::default(), DiskIo::Async);
        assert_eq!("fast".parse::<DiskIo>().unwrap_err(), "unknown value 'fast' (expected async or sync)");
    }
}
