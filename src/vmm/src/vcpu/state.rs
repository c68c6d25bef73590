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
