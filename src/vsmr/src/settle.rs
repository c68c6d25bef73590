//! `--sync-settle`: before a `syncvm` freezes the leader's guest or pauses
//! the secondary's, let it take and answer the input delivered to it.
//!
//! Both replicas deliver the same input before the `Sync` entry, but the
//! applier pauses its guest as soon as it reaches the entry: a guest still
//! busy with the last requests (or that had not polled them yet) is frozen
//! mid-way, and the two replicas are caught at different points of the
//! same input. The TCP sockets of the requests one of them had not
//! answered then differ (sequence numbers, windows, timers), and so do the
//! buffers and stack of the work in progress: most of the pages a
//! `syncvm` sends (docs/replicas.md, "What diverges"). A guest that has
//! consumed everything and waits has answered every request it was given,
//! on both replicas alike.

use std::time::{Duration, Instant};

use ftvm_vmm::Vm;

/// The longest wait: a guest that keeps computing (or a host too busy to
/// run it) is frozen where it is, as without the switch.
pub const MAX: Duration = Duration::from_millis(1);

/// How long to sleep between two looks (the vCPU needs the core more than
/// this thread on a small host).
const POLL: Duration = Duration::from_micros(20);

/// Wait until every frame injected into `vm`'s network device is in the
/// guest's receive buffers and every vCPU waits in the wait hypercall, at
/// most `max`. Returns how long it waited and whether the guest settled.
pub fn settle(vm: &Vm, max: Duration) -> (Duration, bool) {
    let t = Instant::now();
    loop {
        // The device first: a frame it places wakes the guest, which then
        // is not idle until it has taken it.
        if !vm.devices().injected_host_input_pending() && vm.is_idle() {
            return (t.elapsed(), true);
        }
        if t.elapsed() >= max {
            return (t.elapsed(), false);
        }
        std::thread::sleep(POLL);
    }
}
