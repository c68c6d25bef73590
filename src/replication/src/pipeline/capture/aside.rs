//! Copy aside: every page copied in the pause, as `CopyInPause`, but onto
//! huge pages (`huge`), on every core, and the pause may add pages
//! (`also`): a hash compare copies its own dirty pages while the reader's
//! dirty set is on its way, then the reader's. The guest
//! resumes once the copy is made; what reads it after (hashing, comparing,
//! sending) reads what the running guest cannot change.
//!
//! A plain copy rather than copy-on-write: a compared union is small
//! (about 150 pages under redis-benchmark), and copying a page costs about
//! what write-protecting it does here (`docs/replication.md`, "Copy-on-write
//! capture"), without the 20-35 µs fault of each first write after the
//! resume.

use ftvm_vmm::memory::{GuestRam, PAGE};
use ftvm_vmm::{PageBitmap, Vm};

use super::captured::copy_into;
use super::{Capture, Captured};
use crate::error::ReplicationError;
use crate::pipeline::cores::on_cores;

/// Kept from one pause to the next: its buffer, as large as guest RAM (a
/// set of pages has each page once), is then already backed, so the copy
/// in the pause takes no page faults.
pub struct CopyAside {
    pages: Captured,
}

impl CopyAside {
    pub fn new(vm: &Vm) -> CopyAside {
        CopyAside::for_ram(vm.ram())
    }

    fn for_ram(ram: &GuestRam) -> CopyAside {
        CopyAside { pages: Captured::on_huge_pages(ram.size() as usize) }
    }

    /// Copy `pages` of `ram` after those held (the guest paused).
    fn copy(&mut self, ram: &GuestRam, pages: &PageBitmap) -> Result<(), ReplicationError> {
        let (numbers, slots) = self.pages.append(pages)?;
        on_cores(numbers, slots, PAGE, |p, o| copy_into(ram, p, o)).map_err(ftvm_vmm::VmError::from)?;
        Ok(())
    }
}

impl Capture for CopyAside {
    fn in_pause(&mut self, vm: &Vm, dirty: &PageBitmap, _hot: &PageBitmap) -> Result<(), ReplicationError> {
        self.pages.clear();
        self.copy(vm.ram(), dirty)
    }

    fn also(&mut self, vm: &Vm, more: &PageBitmap) -> Result<(), ReplicationError> {
        self.copy(vm.ram(), more)
    }

    fn finish(&mut self, _vm: &Vm) -> Result<&mut Captured, ReplicationError> {
        Ok(&mut self.pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::cores::PARALLEL_FROM;

    fn fill(ram: &GuestRam, page: u64, byte: u8) {
        ram.write_page(page, &vec![byte; PAGE]).unwrap();
    }

    fn bitmap(ram: &GuestRam, pages: impl Iterator<Item = u64>) -> PageBitmap {
        let mut b = PageBitmap::new(ram.pages());
        pages.for_each(|p| b.set(p));
        b
    }

    /// What the guest writes after the copy changes nothing in it: the
    /// pages read after the resume are those of the freeze, in two copies
    /// (its own dirty set, then the reader's) and on several threads.
    #[test]
    fn the_copy_keeps_the_frozen_contents() {
        let ram = GuestRam::new(4 << 20, false).unwrap();
        let pages = ram.pages();
        for p in 0..pages {
            fill(&ram, p, p as u8);
        }
        let mine = bitmap(&ram, (0..pages).filter(|p| p % 3 == 0));
        let rest = bitmap(&ram, (0..pages).filter(|p| p % 3 == 1));
        assert!(mine.count() as usize >= PARALLEL_FROM, "the parallel copy is exercised");
        let mut aside = CopyAside::for_ram(&ram);
        aside.copy(&ram, &mine).unwrap();
        aside.copy(&ram, &rest).unwrap();
        assert_eq!(aside.pages.len() as u64, mine.count() + rest.count());
        // The guest runs on: it writes every page.
        for p in 0..pages {
            fill(&ram, p, 0xee);
        }
        let mut last = None;
        for (p, data) in aside.pages.iter() {
            assert!(p % 3 != 2 && last < Some(p), "the union, in page order");
            assert_eq!(data, vec![p as u8; PAGE].as_slice());
            last = Some(p);
        }
        assert_eq!(aside.pages.page(7).unwrap(), vec![7u8; PAGE].as_slice());
        assert!(aside.pages.page(2).is_none(), "a page outside the union was not copied");
        let mut beyond = PageBitmap::new(pages + 1);
        beyond.set(pages);
        assert!(aside.copy(&ram, &beyond).is_err(), "a page beyond RAM is refused");
        // The next pause's copy reuses the buffer: nothing of the last one is left.
        aside.pages.clear();
        aside.copy(&ram, &bitmap(&ram, [2].into_iter())).unwrap();
        assert_eq!(aside.pages.len(), 1);
        assert!(aside.pages.page(7).is_none());
        assert_eq!(aside.pages.page(2).unwrap(), vec![0xeeu8; PAGE].as_slice());
    }
}
