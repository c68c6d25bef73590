//! Polling the receive ring a little before sleeping in WAIT.
//!
//! Every WAIT is a VM exit to the VMM's vCPU thread (16-19 µs here), and
//! the frame that ends it must then wake that thread (a futex wake and a
//! reschedule by the device thread). A server whose clients answer within
//! tens of microseconds (pipelined redis-benchmark: the next batch follows
//! the replies at once) goes idle for only that long, so watching the used
//! ring for a short while, which costs no exit, often finds the next frame
//! first. The price is CPU spent spinning when nothing comes; hence a
//! budget, and off (0) unless asked for.

use core::sync::atomic::{AtomicU64, Ordering};

use super::device::VirtioNet;
use crate::time;

/// Nanoseconds to watch the receive ring before a WAIT (0: never).
static IDLE_POLL_NS: AtomicU64 = AtomicU64::new(0);
/// WAITs avoided because a frame came while polling, for diagnostics.
static HITS: AtomicU64 = AtomicU64::new(0);

/// Watch the receive ring for up to `ns` nanoseconds before each idle WAIT
/// from now on (0: wait at once).
pub fn set_idle_poll(ns: u64) {
    IDLE_POLL_NS.store(ns, Ordering::Relaxed);
}

/// How many idle waits a frame arriving during the poll made unnecessary.
pub fn idle_poll_hits() -> u64 {
    HITS.load(Ordering::Relaxed)
}

/// Watch `device`'s receive ring until a frame is there (true), the budget
/// is spent or guest time reaches `deadline` (false). `now` is the time
/// the caller read last.
pub(super) fn poll_for_frame(device: &mut VirtioNet, now: u64, deadline: u64) -> bool {
    let budget = IDLE_POLL_NS.load(Ordering::Relaxed);
    if budget == 0 {
        return false;
    }
    let end = now.saturating_add(budget).min(deadline);
    loop {
        if device.rx_pending() {
            HITS.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        if time::now_ns() >= end {
            return false;
        }
        core::hint::spin_loop();
    }
}
