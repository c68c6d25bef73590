//! vCPUs: their KVM descriptors, their threads, their state.

mod state;
mod thread;

pub use state::{saveable_msrs, StateError, VcpuState};
pub use thread::thread_main;

use std::sync::Arc;

use kvm_ioctls::VcpuFd;

use crate::persist::Persist;

/// One vCPU: its KVM descriptor and what saving its state needs.
pub struct Vcpu {
    pub fd: VcpuFd,
    /// The MSRs that round-trip on this host (`state::saveable_msrs`).
    msrs: Arc<[u32]>,
    /// How many times state was loaded into it: its thread, back from a
    /// wait parked in place, must not finish that wait into new state.
    restores: u64,
}

impl Vcpu {
    pub fn new(fd: VcpuFd, msrs: Arc<[u32]>) -> Vcpu {
        Vcpu { fd, msrs, restores: 0 }
    }

    pub fn restores(&self) -> u64 {
        self.restores
    }
}

impl Persist for Vcpu {
    type State = VcpuState;
    type Error = StateError;

    fn save(&self) -> Result<VcpuState, StateError> {
        VcpuState::read(&self.fd, &self.msrs)
    }

    fn restore(&mut self, state: &VcpuState) -> Result<(), StateError> {
        self.restores += 1;
        state.load(&self.fd)
    }
}
