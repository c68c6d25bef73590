//! Complete architectural state of one vCPU, for snapshots and checkpoints.

use kvm_bindings::{kvm_debugregs, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs};
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
#[error("vCPU state {op} failed: {err}")]
pub struct StateError {
    pub op: &'static str,
    pub err: kvm_ioctls::Error,
}

fn ctx<T>(op: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, StateError> {
    r.map_err(|err| StateError { op, err })
}

#[derive(Default, Serialize, Deserialize)]
pub struct VcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
    pub debugregs: kvm_debugregs,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VcpuState {{ rip: {:#x}, rsp: {:#x}, msrs: {} }}", self.regs.rip, self.regs.rsp, self.msrs.len())
    }
}

/// The MSRs of `msr_index_list` that this vCPU can both read and write back.
/// KVM lists some that a given host refuses, and GET/SET_MSRS stop at the
/// first refusal, so a snapshot must only carry MSRs that round-trip.
pub fn saveable_msrs(vcpu: &VcpuFd, msr_index_list: &[u32]) -> Vec<u32> {
    msr_index_list
        .iter()
        .copied()
        .filter(|&index| {
            let mut one = Msrs::from_entries(&[kvm_msr_entry { index, ..Default::default() }]).expect("one entry fits");
            matches!(vcpu.get_msrs(&mut one), Ok(1)) && matches!(vcpu.set_msrs(&one), Ok(1))
        })
        .collect()
}

/// The time-stamp counter MSR.
pub const MSR_IA32_TSC: u32 = 0x10;

crate::switch! {
    /// What a save reads from KVM (`--vcpu-state-reads`).
    pub enum StateReads {
        /// What a guest at CPL3 can change: registers, segments, FPU/vector
        /// state, pending events and the time-stamp counter (five ioctls).
        /// The rest (the MSRs but the counter, XCR0, debug registers, MP
        /// state) only ring 0 or the VMM writes, and ring 0 here runs only
        /// the VMM's own stubs (`arch::tables`), which write none of them and
        /// never halt: it is read once and again after state is loaded.
        Changing = "changing",
        /// Every register set at every save (eight ioctls).
        All = "all",
    }
}

/// The part of a vCPU's state that [`StateReads::Changing`] reads once: as
/// the VMM set it up or loaded it, unchanged by the guest since.
#[derive(Clone)]
pub struct Fixed {
    xcrs: kvm_xcrs,
    /// Every saved MSR, the counter's entry included (refreshed per save).
    msrs: Vec<kvm_msr_entry>,
    mp_state: kvm_mp_state,
    debugregs: kvm_debugregs,
}

impl Fixed {
    /// The fixed part of `state`, read whole.
    pub fn of(state: &VcpuState) -> Fixed {
        Fixed { xcrs: state.xcrs, msrs: state.msrs.clone(), mp_state: state.mp_state, debugregs: state.debugregs }
    }

    /// What of `state` (read whole) differs from this: None when it all
    /// matches (the time-stamp counter aside).
    pub fn differs_from(&self, state: &VcpuState) -> Option<&'static str> {
        let msrs =
            |m: &[kvm_msr_entry]| -> Vec<(u32, u64)> { m.iter().filter(|e| e.index != MSR_IA32_TSC).map(|e| (e.index, e.data)).collect() };
        if bytes(&self.xcrs) != bytes(&state.xcrs) {
            Some("XCRs")
        } else if msrs(&self.msrs) != msrs(&state.msrs) {
            Some("MSRs")
        } else if self.mp_state.mp_state != state.mp_state.mp_state {
            Some("MP state")
        } else if bytes(&self.debugregs) != bytes(&state.debugregs) {
            Some("debug registers")
        } else {
            None
        }
    }
}

/// What postcard makes of `v`: KVM's structures here have no comparison of
/// their own (the unions in some), their serialized forms do.
fn bytes<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_allocvec(v).expect("KVM state serializes")
}

impl VcpuState {
    /// Zero the time-stamp counter in the saved MSRs and return it (0 if
    /// this host does not save it).
    pub fn take_tsc(&mut self) -> u64 {
        self.msrs.iter_mut().find(|m| m.index == MSR_IA32_TSC).map_or(0, |m| std::mem::take(&mut m.data))
    }

    /// Put back a counter `take_tsc` took.
    pub fn set_tsc(&mut self, tsc: u64) {
        if let Some(m) = self.msrs.iter_mut().find(|m| m.index == MSR_IA32_TSC) {
            m.data = tsc;
        }
    }

    /// Read the state of a vCPU that is not running (its I/O completed).
    pub fn read(vcpu: &VcpuFd, msr_indices: &[u32]) -> Result<VcpuState, StateError> {
        let entries: Vec<_> = msr_indices.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
        let mut msrs =
            Msrs::from_entries(&entries).map_err(|_| StateError { op: "KVM_GET_MSRS", err: kvm_ioctls::Error::new(libc::E2BIG) })?;
        let read = ctx("KVM_GET_MSRS", vcpu.get_msrs(&mut msrs))?;
        if read != entries.len() {
            return Err(StateError { op: "KVM_GET_MSRS (partial)", err: kvm_ioctls::Error::new(libc::EIO) });
        }
        Ok(VcpuState {
            regs: ctx("KVM_GET_REGS", vcpu.get_regs())?,
            sregs: ctx("KVM_GET_SREGS", vcpu.get_sregs())?,
            xsave: ctx("KVM_GET_XSAVE", vcpu.get_xsave())?,
            xcrs: ctx("KVM_GET_XCRS", vcpu.get_xcrs())?,
            msrs: msrs.as_slice().to_vec(),
            events: ctx("KVM_GET_VCPU_EVENTS", vcpu.get_vcpu_events())?,
            mp_state: ctx("KVM_GET_MP_STATE", vcpu.get_mp_state())?,
            debugregs: ctx("KVM_GET_DEBUGREGS", vcpu.get_debug_regs())?,
        })
    }

    /// Read the state of a vCPU that is not running, taking the part only
    /// ring 0 or the VMM changes from `fixed` ([`StateReads::Changing`]).
    pub fn read_changing(vcpu: &VcpuFd, fixed: &Fixed) -> Result<VcpuState, StateError> {
        let mut msrs = fixed.msrs.clone();
        if let Some(tsc) = msrs.iter_mut().find(|m| m.index == MSR_IA32_TSC) {
            let mut one = Msrs::from_entries(&[*tsc]).expect("one entry fits");
            if ctx("KVM_GET_MSRS", vcpu.get_msrs(&mut one))? != 1 {
                return Err(StateError { op: "KVM_GET_MSRS (time-stamp counter)", err: kvm_ioctls::Error::new(libc::EIO) });
            }
            tsc.data = one.as_slice()[0].data;
        }
        Ok(VcpuState {
            regs: ctx("KVM_GET_REGS", vcpu.get_regs())?,
            sregs: ctx("KVM_GET_SREGS", vcpu.get_sregs())?,
            xsave: ctx("KVM_GET_XSAVE", vcpu.get_xsave())?,
            xcrs: fixed.xcrs,
            msrs,
            events: ctx("KVM_GET_VCPU_EVENTS", vcpu.get_vcpu_events())?,
            mp_state: fixed.mp_state,
            debugregs: fixed.debugregs,
        })
    }

    /// Load this state into a vCPU that is not running. The order follows
    /// the dependencies: control registers before the registers and
    /// extended state that depend on them, events last.
    pub fn load(&self, vcpu: &VcpuFd) -> Result<(), StateError> {
        ctx("KVM_SET_SREGS", vcpu.set_sregs(&self.sregs))?;
        ctx("KVM_SET_REGS", vcpu.set_regs(&self.regs))?;
        // SAFETY: the buffer came from KVM_GET_XSAVE on a vCPU of the same
        // kind (the snapshot header pins the shape) and is the legacy
        // 4 KiB layout that KVM_SET_XSAVE expects.
        ctx("KVM_SET_XSAVE", unsafe { vcpu.set_xsave(&self.xsave) })?;
        ctx("KVM_SET_XCRS", vcpu.set_xcrs(&self.xcrs))?;
        let msrs =
            Msrs::from_entries(&self.msrs).map_err(|_| StateError { op: "KVM_SET_MSRS", err: kvm_ioctls::Error::new(libc::E2BIG) })?;
        let written = ctx("KVM_SET_MSRS", vcpu.set_msrs(&msrs))?;
        if written != self.msrs.len() {
            return Err(StateError { op: "KVM_SET_MSRS (partial)", err: kvm_ioctls::Error::new(libc::EIO) });
        }
        ctx("KVM_SET_VCPU_EVENTS", vcpu.set_vcpu_events(&self.events))?;
        ctx("KVM_SET_MP_STATE", vcpu.set_mp_state(self.mp_state))?;
        ctx("KVM_SET_DEBUGREGS", vcpu.set_debug_regs(&self.debugregs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_msrs(msrs: &[(u32, u64)]) -> VcpuState {
        let msrs = msrs.iter().map(|&(index, data)| kvm_msr_entry { index, data, ..Default::default() }).collect();
        VcpuState { msrs, ..Default::default() }
    }

    #[test]
    fn the_fixed_part_ignores_the_counter_and_nothing_else() {
        const LSTAR: u32 = 0xc000_0082;
        let fixed = Fixed::of(&with_msrs(&[(MSR_IA32_TSC, 100), (LSTAR, 0x1000)]));
        assert_eq!(fixed.differs_from(&with_msrs(&[(MSR_IA32_TSC, 900), (LSTAR, 0x1000)])), None, "the counter moves on");
        assert_eq!(fixed.differs_from(&with_msrs(&[(MSR_IA32_TSC, 100), (LSTAR, 0x2000)])), Some("MSRs"));
        let mut halted = with_msrs(&[(MSR_IA32_TSC, 100), (LSTAR, 0x1000)]);
        halted.mp_state.mp_state = 3;
        assert_eq!(fixed.differs_from(&halted), Some("MP state"));
        let mut dr7 = with_msrs(&[(MSR_IA32_TSC, 100), (LSTAR, 0x1000)]);
        dr7.debugregs.dr7 = 0x400 | 1;
        assert_eq!(fixed.differs_from(&dr7), Some("debug registers"));
    }
}
