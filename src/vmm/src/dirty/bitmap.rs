//! KVM dirty bitmap with manual re-protection: GET returns the pages written,
//! CLEAR re-protects exactly those pages (so the cost scales with the dirty
//! set, not with RAM).

use kvm_ioctls::VmFd;

use super::{ioctls, DirtyError, DirtyLog};
use crate::memory::PageBitmap;

pub struct BitmapLog {
    slot: u32,
    mem_size: u64,
    /// What the last `harvest` got from KVM: the pages `rearm` re-protects.
    harvested: Vec<u64>,
}

impl BitmapLog {
    /// Must be created (it enables the capability) before any memory slot.
    pub fn new(vm: &VmFd, slot: u32, mem_size: u64) -> Result<BitmapLog, DirtyError> {
        let cap = kvm_bindings::kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            args: [(kvm_bindings::KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | kvm_bindings::KVM_DIRTY_LOG_INITIALLY_SET) as u64, 0, 0, 0],
            ..Default::default()
        };
        vm.enable_cap(&cap).map_err(|_| DirtyError::Unsupported("KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2"))?;
        Ok(BitmapLog { slot, mem_size, harvested: Vec::new() })
    }

    fn get(&self, vm: &VmFd) -> Result<Vec<u64>, DirtyError> {
        vm.get_dirty_log(self.slot, self.mem_size as usize).map_err(|e| DirtyError::Ioctl { op: "KVM_GET_DIRTY_LOG", err: e.into() })
    }

    fn clear(&self, vm: &VmFd, bits: &mut [u64]) -> Result<(), DirtyError> {
        ioctls::clear_dirty_log(vm, self.slot, bits).map_err(|err| DirtyError::Ioctl { op: "KVM_CLEAR_DIRTY_LOG", err })
    }
}

impl DirtyLog for BitmapLog {
    fn start(&mut self, vm: &VmFd) -> Result<(), DirtyError> {
        // INITIALLY_SET leaves every page reported dirty and writable; one
        // CLEAR of all pages write-protects them.
        let mut all = self.get(vm)?;
        all.fill(u64::MAX);
        self.clear(vm, &mut all)
    }

    fn harvest(&mut self, vm: &VmFd, out: &mut PageBitmap) -> Result<(), DirtyError> {
        // KVM keeps reporting a page until it is cleared, so the latest GET
        // holds everything not yet re-armed.
        self.harvested = self.get(vm)?;
        out.or_words(&self.harvested);
        Ok(())
    }

    fn rearm(&mut self, vm: &VmFd, leave_writable: &PageBitmap) -> Result<(), DirtyError> {
        let mut bits = std::mem::take(&mut self.harvested);
        // A page left writable is not cleared, so KVM keeps reporting it.
        for (w, keep) in bits.iter_mut().zip(leave_writable.words()) {
            *w &= !keep;
        }
        if bits.iter().any(|&w| w != 0) {
            self.clear(vm, &mut bits)?;
        }
        Ok(())
    }
}
