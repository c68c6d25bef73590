//! SIGINT/SIGTERM become a readable eventfd for the event loop, and a flag
//! for work that runs before the loop does (bringing a backup up to date).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use vmm_sys_util::eventfd::EventFd;

static STOP_FD: AtomicI32 = AtomicI32::new(-1);
static STOP_REQUESTED: AtomicBool = AtomicBool::new(false);

/// Set once SIGINT or SIGTERM arrived.
pub fn stop_requested() -> &'static AtomicBool {
    &STOP_REQUESTED
}

extern "C" fn on_stop_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // An atomic store is async-signal-safe.
    STOP_REQUESTED.store(true, Ordering::SeqCst);
    let fd = STOP_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let one = 1u64;
        // SAFETY: write(2) is async-signal-safe; `fd` is an eventfd that lives
        // for the whole process (it is leaked on purpose in `install`).
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
}

/// Route SIGINT and SIGTERM to the returned eventfd.
pub fn install() -> std::io::Result<&'static EventFd> {
    let evt: &'static EventFd = Box::leak(Box::new(EventFd::new(libc::EFD_NONBLOCK)?));
    STOP_FD.store(evt.as_raw_fd(), Ordering::Relaxed);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        vmm_sys_util::signal::register_signal_handler(sig, on_stop_signal).map_err(std::io::Error::from)?;
    }
    Ok(evt)
}
