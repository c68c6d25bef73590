//! The device thread: doorbells and host I/O in, used buffers out.

use std::os::fd::{AsRawFd, RawFd};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::gate::Gate;
use super::Slot;
use crate::memory::GuestMemory;
use crate::run_control::Events;

const TOKEN_HOST: u64 = 1 << 32;
const TOKEN_STOP: u64 = 2 << 32;

/// A device thread: wait for doorbells or host I/O, then give the device a
/// full pass (every queue and the host side), so no kick that arrived while
/// paused is lost.
pub fn serve(slot: &Slot, gate: &Gate, mem: &GuestMemory, events: &Events) {
    crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Device);
    let Ok(epoll) = Epoll::new() else {
        tracing::error!("device thread cannot create epoll");
        return;
    };
    let add = |fd, set, token| epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(set, token));
    let mut ok = add(slot.stop.as_raw_fd(), EventSet::IN, TOKEN_STOP).is_ok();
    for (q, evt) in slot.notify.iter().enumerate() {
        ok &= add(evt.as_raw_fd(), EventSet::IN, q as u64).is_ok();
    }
    // The host descriptor watched: it comes and goes with the device's
    // host input (`set_host_input`), which rings the doorbell to bring us here.
    let mut watched = None;
    ok &= watch_host(&epoll, slot.lock().host_fd(), &mut watched);
    if !ok {
        tracing::error!("device thread cannot watch its descriptors");
        return;
    }
    let mut ready = vec![EpollEvent::default(); 8];
    // Work left by a restore (requests issued again) runs now.
    run_deferred(slot);
    while gate.wait_running() {
        let n = match epoll.wait(100, &mut ready) {
            Ok(n) if ready[..n].iter().any(|e| e.data() == TOKEN_STOP) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
            Err(e) => {
                tracing::error!(error = %e, "device thread epoll failed");
                return;
            }
        };
        let mut transport = slot.lock();
        if !watch_host(&epoll, transport.host_fd(), &mut watched) {
            tracing::error!("device thread cannot watch its host descriptor");
            return;
        }
        if gate.paused() {
            continue; // doorbells stay pending; the pass after resume serves them
        }
        // Only the doorbells epoll reported: reading the others costs a
        // system call each and finds nothing (one rung since stays
        // readable, level-triggered, and brings the thread back).
        for e in &ready[..n] {
            if let Some(evt) = slot.notify.get(e.data() as usize) {
                let _ = evt.read();
            }
        }
        let mut used = false;
        let mut result = Ok(());
        for q in 0..transport.queue_count() {
            match transport.process_queue(q, mem) {
                Ok(u) => used |= u,
                Err(e) => result = Err(e),
            }
        }
        match transport.process_host(mem) {
            Ok(u) => used |= u,
            Err(e) => result = Err(e),
        }
        if let Err(e) = result {
            tracing::error!(error = %e, "device failed; marking it FAILED for the driver");
            transport.fail();
        }
        drop(transport);
        if used {
            events.signal();
        }
        run_deferred(slot);
    }
}

/// Watch `want` (edge-triggered) instead of `watched`, if they differ.
/// An unwatched TAP wakes nobody for its frames; a newly watched one that
/// has frames already reports them at once.
fn watch_host(epoll: &Epoll, want: Option<RawFd>, watched: &mut Option<RawFd>) -> bool {
    if want == *watched {
        return true;
    }
    if let Some(fd) = watched.take() {
        if epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default()).is_err() {
            return false;
        }
    }
    if let Some(fd) = want {
        if epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, TOKEN_HOST)).is_err() {
            return false;
        }
        *watched = Some(fd);
    }
    true
}

/// The device's work outside its lock (a disk's I/O): a pause taken
/// meanwhile does not wait for it. Results come back through the next
/// pass, which the doorbell makes immediate (after a pause, the pass after
/// the resume).
fn run_deferred(slot: &Slot) {
    if slot.io.as_ref().is_some_and(|io| io.run()) {
        // A doorbell already rung stays rung: nothing to do.
        let _ = slot.notify[0].write(1);
    }
}
