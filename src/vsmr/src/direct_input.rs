//! `--direct-input on`: the consensus thread puts committed input into the
//! guest's network card itself instead of handing it to the applier
//! thread, one thread wake-up fewer per batch on a host with few cores.
//! Log order is kept: it does so only when nothing it handed to the
//! applier earlier is still waiting there or being run (a `syncvm`, or
//! input not yet delivered); otherwise the input follows through the
//! applier as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ftvm_vmm::sync::Lock;
use ftvm_vmm::Vm;

pub struct InputGate {
    vm: Arc<Vm>,
    /// The VM is held for a pre-copy or as a standby: its input is dropped
    /// (the `syncvm` that releases it replaces it whole).
    held: Arc<AtomicBool>,
    /// Entries handed to the applier and not yet done with.
    queued: Mutex<u64>,
}

impl InputGate {
    pub fn new(vm: Arc<Vm>, held: Arc<AtomicBool>) -> InputGate {
        InputGate { vm, held, queued: Mutex::new(0) }
    }

    /// The consensus thread: deliver `frames` now, or give them back when
    /// the applier has something earlier (then hand them to it, after
    /// `handing`).
    pub fn deliver(&self, frames: Vec<Vec<u8>>) -> Option<Vec<Vec<u8>>> {
        let queued = self.queued.locked();
        if *queued > 0 {
            return Some(frames);
        }
        if !self.held.load(Ordering::SeqCst) {
            // Under the lock: the applier cannot deliver anything between.
            self.vm.devices().inject_host_input(frames);
        }
        None
    }

    /// The consensus thread is about to hand the applier one more entry.
    pub fn handing(&self) {
        *self.queued.locked() += 1;
    }

    /// The applier is done with `n` entries it took (their input delivered).
    pub fn done(&self, n: u64) {
        if n > 0 {
            let mut q = self.queued.locked();
            *q = q.saturating_sub(n);
        }
    }
}
