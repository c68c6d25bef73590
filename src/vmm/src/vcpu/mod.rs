//! vCPUs: their KVM descriptors, their threads, their state.

mod state;
mod thread;

pub use state::{saveable_msrs, StateError, VcpuState, MSR_IA32_TSC};
pub use thread::thread_main;

use std::sync::Arc;

use kvm_ioctls::VcpuFd;

use crate::components::{ComponentError, ComponentId, Components};
use crate::persist::Persist;

/// vCPU `index`'s components: its state, and apart from it its time-stamp
/// counter, which moves on even while the vCPU is halted (and must stay in
/// step with the other vCPUs'): a vCPU that did not run changes only its
/// counter's component, so a checkpoint of changed components sends only
/// that.
pub fn component_ids(index: usize) -> [ComponentId; 2] {
    [ComponentId::new(format!("vcpu/{index}")), ComponentId::new(format!("vcpu/{index}/tsc"))]
}

/// How many vCPUs `saved` holds the state of.
pub fn count(saved: &Components) -> usize {
    (0..).take_while(|&i| saved.contains(&component_ids(i)[0])).count()
}

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

    /// Save this vCPU, number `index`, into `out` (`component_ids`).
    pub fn save_into(&self, index: usize, out: &mut Components) -> Result<(), StateError> {
        let mut state = self.save()?;
        let tsc = state.take_tsc();
        let [whole, counter] = component_ids(index);
        out.put(whole, &state);
        out.put(counter, &tsc);
        Ok(())
    }

    /// vCPU `index`'s state in `saved`, put back together.
    pub fn state_in(saved: &Components, index: usize) -> Result<VcpuState, ComponentError> {
        let [whole, counter] = component_ids(index);
        let mut state: VcpuState = saved.state(&whole)?;
        state.set_tsc(saved.state(&counter)?);
        Ok(state)
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
