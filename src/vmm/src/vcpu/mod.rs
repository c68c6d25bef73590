//! vCPUs: their KVM descriptors, their threads, their state.

mod state;
mod thread;

pub use state::{saveable_msrs, StateError, StateReads, VcpuState, MSR_IA32_TSC};
pub use thread::thread_main;

use std::sync::{Arc, Mutex};

use kvm_ioctls::VcpuFd;

use crate::sync::Lock;
use state::Fixed;

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
    /// What a save reads from KVM.
    reads: StateReads,
    /// With [`StateReads::Changing`], the state only ring 0 or the VMM
    /// changes, as the last whole read found it.
    fixed: Mutex<FixedCache>,
}

/// Every this many saves of a vCPU with [`StateReads::Changing`] one reads
/// it whole and checks the part read once against it: a host or guest that
/// breaks the rule is found and read whole from then on.
const AUDIT_EVERY: u32 = 256;

#[derive(Default)]
struct FixedCache {
    /// None until the first save, and again after the VMM writes the vCPU
    /// (its setup, a restore).
    fixed: Option<Fixed>,
    /// Saves since the last whole read.
    saves: u32,
    /// An audit found the fixed part changed: every save reads it all.
    distrusted: bool,
}

impl Vcpu {
    pub fn new(fd: VcpuFd, msrs: Arc<[u32]>, reads: StateReads) -> Vcpu {
        Vcpu { fd, msrs, restores: 0, reads, fixed: Mutex::default() }
    }

    /// The VMM wrote this vCPU's registers through `fd` (its setup): the
    /// next save reads everything again.
    pub fn forget_fixed(&mut self) {
        crate::sync::get_mut(&mut self.fixed).fixed = None;
    }

    /// Read this (paused) vCPU whole and check the part a save with
    /// [`StateReads::Changing`] takes as read once: what differs, if
    /// anything (nothing when nothing was read once yet).
    pub fn audit(&self) -> Result<Option<&'static str>, StateError> {
        let state = VcpuState::read(&self.fd, &self.msrs)?;
        Ok(self.fixed.locked().fixed.as_ref().and_then(|f| f.differs_from(&state)))
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
        if self.reads == StateReads::All {
            return VcpuState::read(&self.fd, &self.msrs);
        }
        let mut cache = self.fixed.locked();
        if cache.distrusted {
            return VcpuState::read(&self.fd, &self.msrs);
        }
        let cache = &mut *cache;
        match &cache.fixed {
            Some(fixed) if cache.saves < AUDIT_EVERY => {
                cache.saves += 1;
                VcpuState::read_changing(&self.fd, fixed)
            }
            known => {
                let state = VcpuState::read(&self.fd, &self.msrs)?;
                if let Some(what) = known.as_ref().and_then(|f| f.differs_from(&state)) {
                    tracing::error!(
                        what,
                        "vCPU state that only ring 0 or the VMM writes changed between saves; reading all of it at every save from now on"
                    );
                    cache.distrusted = true;
                }
                cache.fixed = Some(Fixed::of(&state));
                cache.saves = 0;
                Ok(state)
            }
        }
    }

    fn restore(&mut self, state: &VcpuState) -> Result<(), StateError> {
        self.restores += 1;
        self.forget_fixed();
        state.load(&self.fd)
    }
}
