//! KVM dirty bitmap with manual re-protection: GET returns the pages written,
//! CLEAR re-protects exactly those pages (so the cost scales with the dirty
//! set, not with RAM).

use kvm_ioctls::VmFd;

use super::{ioctls, DirtyError, DirtyLog};
use crate::memory::PageBitmap;

pub struct BitmapLog {
    slot: u32,
    /// What the last `harvest` got from KVM (one bit per page of the slot):
    /// the pages `rearm` re-protects. Kept, so that a harvest allocates
    /// nothing.
    harvested: Vec<u64>,
    /// `harvested` holds a harvest not re-armed yet.
    pending: bool,
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
        let pages = mem_size.div_ceil(crate::memory::PAGE as u64);
        Ok(BitmapLog { slot, harvested: vec![0; pages.div_ceil(64) as usize], pending: false })
    }
}

fn get(vm: &VmFd, slot: u32, bits: &mut [u64]) -> Result<(), DirtyError> {
    ioctls::get_dirty_log(vm, slot, bits).map_err(|err| DirtyError::Ioctl { op: "KVM_GET_DIRTY_LOG", err })
}

fn clear(vm: &VmFd, slot: u32, bits: &mut [u64]) -> Result<(), DirtyError> {
    ioctls::clear_dirty_log(vm, slot, bits).map_err(|err| DirtyError::Ioctl { op: "KVM_CLEAR_DIRTY_LOG", err })
}

impl DirtyLog for BitmapLog {
    fn start(&mut self, vm: &VmFd) -> Result<(), DirtyError> {
        // INITIALLY_SET leaves every page reported dirty and writable; one
        // CLEAR of all pages write-protects them.
        let mut all = vec![0; self.harvested.len()];
        get(vm, self.slot, &mut all)?;
        all.fill(u64::MAX);
        self.pending = false;
        clear(vm, self.slot, &mut all)
    }

    fn harvest(&mut self, vm: &VmFd, out: &mut PageBitmap) -> Result<(), DirtyError> {
        // KVM keeps reporting a page until it is cleared, so the latest GET
        // holds everything not yet re-armed.
        get(vm, self.slot, &mut self.harvested)?;
        self.pending = true;
        out.or_words(&self.harvested);
        Ok(())
    }

    fn rearm(&mut self, vm: &VmFd, leave_writable: &PageBitmap) -> Result<(), DirtyError> {
        if !std::mem::take(&mut self.pending) {
            return Ok(());
        }
        // A page left writable is not cleared, so KVM keeps reporting it.
        for (w, keep) in self.harvested.iter_mut().zip(leave_writable.words()) {
            *w &= !keep;
        }
        if self.harvested.iter().any(|&w| w != 0) {
            clear(vm, self.slot, &mut self.harvested)?;
        }
        Ok(())
    }
}
