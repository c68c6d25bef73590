//! `--predict-writes` on a VM replica: HBFT's write-fault prediction
//! (`pipeline::predict`), which leaves the pages the guest is likely to
//! write again writable when a `syncvm` re-arms dirty tracking, so their
//! next writes take no tracked first-write fault (about 6 µs each here).
//! Both VM replicas run the guest, so both pay those faults, and both
//! predict, each for its own guest.
//!
//! Nothing else changes: a page left writable is reported dirty at every
//! later harvest, so it is in every `syncvm`'s union, hashed on both sides
//! and sent only when the two differ, as any dirty page. Those hashes also
//! say which of the pages left writable were really written (the hash
//! changed since the last `syncvm`), which is what the predictor learns
//! from; primary-backup's fake-dirty filter is not needed.

use ftvm_vmm::PageBitmap;

use ftvm_replication::pipeline::costs::Costs;
use ftvm_replication::pipeline::predict::{self, FreezeMask};

/// This replica's prediction (none with `off`).
pub struct Writes {
    mask: Box<dyn FreezeMask>,
    /// Scratch: the pages only a device wrote at the last harvest.
    device_written: PageBitmap,
}

impl Writes {
    pub fn new(mode: predict::Mode, pages: u64, costs: &Costs) -> Writes {
        Writes { mask: predict::mask(mode, pages, costs), device_written: PageBitmap::new(pages) }
    }

    /// Harvest `vm`'s dirty pages into `out` and re-arm tracking for those
    /// the predictor does not keep writable. It chooses from the guest's
    /// own writes: a page only a device wrote cost no tracked first write.
    pub fn collect(&mut self, vm: &ftvm_vmm::Vm, out: &mut PageBitmap) -> Result<(), ftvm_vmm::VmError> {
        self.device_written.clear();
        vm.harvest_dirty_by(out, &mut self.device_written)?;
        let leave = self.mask.choose(out);
        vm.rearm_dirty(leave)?;
        out.or_words(self.device_written.words());
        Ok(())
    }

    /// What a freeze asks which pages to leave writable.
    pub fn leave(&mut self) -> &mut dyn FreezeMask {
        self.mask.as_mut()
    }

    /// A `syncvm`'s union and the hashes of its pages as both replicas
    /// hold them now: learn which pages left writable were written.
    pub fn learn(&mut self, pages: &[u64], hashes: &[u128]) -> predict::Figures {
        self.mask.learn(pages, hashes)
    }

    /// The secondary took the leader's content for `pages`.
    pub fn forget(&mut self, mut pages: impl Iterator<Item = u64>) {
        self.mask.forget(&mut pages);
    }
}
