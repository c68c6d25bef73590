//! KVM dirty ring: each vCPU pushes the GFNs it dirties into its own ring,
//! which the VMM harvests without stopping the guest; KVM_RESET_DIRTY_RINGS
//! then re-protects the harvested pages.

use std::sync::atomic::Ordering;

use kvm_bindings::kvm_dirty_gfn;
use kvm_ioctls::{VcpuFd, VmFd};

use super::ioctls::{self, RingMapping};
use super::{DirtyError, DirtyLog};
use crate::memory::PageBitmap;

const GFN_DIRTY: u32 = 1;
const GFN_RESET: u32 = 2;

/// Entries per vCPU ring (16 bytes each). KVM exits with "ring full" 64
/// entries before the end, and the VMM harvests then.
pub const RING_ENTRIES: u32 = 16384;

/// Enable the ring on `vm`; must happen before any vCPU is created.
pub fn enable(vm: &VmFd) -> Result<(), DirtyError> {
    let bytes = RING_ENTRIES as u64 * std::mem::size_of::<kvm_dirty_gfn>() as u64;
    for cap in [kvm_bindings::KVM_CAP_DIRTY_LOG_RING_ACQ_REL, kvm_bindings::KVM_CAP_DIRTY_LOG_RING] {
        let arg = kvm_bindings::kvm_enable_cap { cap, args: [bytes, 0, 0, 0], ..Default::default() };
        if vm.enable_cap(&arg).is_ok() {
            return Ok(());
        }
    }
    Err(DirtyError::Unsupported("KVM_CAP_DIRTY_LOG_RING"))
}

pub struct RingLog {
    rings: Vec<RingMapping>,
    next: Vec<u32>,
    /// Pages harvested early (ring-full exits) since the last collect.
    pending: PageBitmap,
}

impl RingLog {
    pub fn new(vcpus: &[&VcpuFd], pages: u64) -> Result<RingLog, DirtyError> {
        let rings = vcpus
            .iter()
            .map(|v| RingMapping::new(*v, RING_ENTRIES as usize))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| DirtyError::Ioctl { op: "mmap dirty ring", err })?;
        Ok(RingLog { next: vec![0; rings.len()], rings, pending: PageBitmap::new(pages) })
    }

    fn harvest_vcpu(&mut self, vcpu: usize) {
        let ring = &self.rings[vcpu];
        let next = &mut self.next[vcpu];
        loop {
            let flags = ring.flags(*next);
            if flags.load(Ordering::Acquire) & GFN_DIRTY == 0 {
                break;
            }
            // One memory slot (0) covers all RAM, so the offset is the page.
            self.pending.set(ring.entry(*next).offset);
            flags.store(GFN_RESET, Ordering::Release);
            *next = next.wrapping_add(1);
        }
    }

    fn reset(&self, vm: &VmFd) -> Result<(), DirtyError> {
        ioctls::reset_dirty_rings(vm).map(|_| ()).map_err(|err| DirtyError::Ioctl { op: "KVM_RESET_DIRTY_RINGS", err })
    }
}

impl DirtyLog for RingLog {
    fn start(&mut self, vm: &VmFd) -> Result<(), DirtyError> {
        for vcpu in 0..self.rings.len() {
            self.harvest_vcpu(vcpu);
        }
        self.reset(vm)?;
        self.pending.clear();
        Ok(())
    }

    fn harvest(&mut self, _vm: &VmFd, out: &mut PageBitmap) -> Result<(), DirtyError> {
        for vcpu in 0..self.rings.len() {
            self.harvest_vcpu(vcpu);
        }
        out.or_words(self.pending.words());
        Ok(())
    }

    /// The reset re-protects every harvested entry, in ring order: KVM
    /// offers no way to skip one, so nothing is left writable.
    fn rearm(&mut self, vm: &VmFd, _leave_writable: &PageBitmap) -> Result<(), DirtyError> {
        self.reset(vm)?;
        self.pending.clear();
        Ok(())
    }

    fn ring_full(&mut self, vm: &VmFd, vcpu: usize) -> Result<(), DirtyError> {
        self.harvest_vcpu(vcpu);
        self.reset(vm)
    }
}
