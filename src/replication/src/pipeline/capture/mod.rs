//! Capture: the dirty pages as they were at the freeze.

mod cow;

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::{PageBitmap, Vm};

use crate::error::ReplicationError;
use ftvm_vmm::switch;

switch! {
    /// `--capture`: how pages are captured.
    pub enum Mode {
        /// Copy every dirty page while the VM is paused.
        Pause = "pause",
        /// Resume at once; copy each dirty page before the guest writes it again (userfaultfd write protection).
        Cow = "cow",
    }
}

pub fn new(mode: Mode, vm: &Vm) -> Result<Box<dyn Capture>, ReplicationError> {
    Ok(match mode {
        Mode::Pause => Box::<CopyInPause>::default(),
        Mode::Cow => Box::new(cow::CopyOnWrite::new(vm)?),
    })
}

/// Copies of pages, in ascending page order, some of them perhaps dropped
/// (not to be sent).
#[derive(Default)]
pub struct Captured {
    numbers: Vec<u64>,
    data: Vec<u8>,
    /// Per entry of `numbers`: dropped by `retain`.
    dropped: Vec<bool>,
    kept: usize,
}

impl Captured {
    /// Pages to send.
    pub fn len(&self) -> usize {
        self.kept
    }

    pub fn is_empty(&self) -> bool {
        self.kept == 0
    }

    /// The pages to send.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &[u8])> {
        self.numbers.iter().copied().zip(self.data.chunks_exact(PAGE)).zip(&self.dropped).filter(|(_, &d)| !d).map(|(e, _)| e)
    }

    /// Drop the pages for which `keep` says false.
    pub fn retain(&mut self, mut keep: impl FnMut(u64, &[u8]) -> bool) {
        for ((&p, data), dropped) in self.numbers.iter().zip(self.data.chunks_exact(PAGE)).zip(self.dropped.iter_mut()) {
            if !*dropped && !keep(p, data) {
                *dropped = true;
                self.kept -= 1;
            }
        }
    }

    /// Copies of the given pages (ascending), for tests of later stages.
    #[cfg(test)]
    pub fn from_pages(pages: &[(u64, &[u8])]) -> Captured {
        Captured {
            numbers: pages.iter().map(|(p, _)| *p).collect(),
            data: pages.iter().flat_map(|(_, d)| d.iter().copied()).collect(),
            dropped: vec![false; pages.len()],
            kept: pages.len(),
        }
    }

    /// Make room for copies of `pages` (contents unspecified until filled).
    fn prepare(&mut self, pages: &PageBitmap) {
        self.numbers.clear();
        self.numbers.extend(pages.pages());
        self.dropped.clear();
        self.dropped.resize(self.numbers.len(), false);
        self.kept = self.numbers.len();
        // Grows once to the largest epoch and is reused: no zeroing per epoch.
        let len = self.numbers.len() * PAGE;
        if self.data.len() < len {
            self.data.resize(len, 0);
        }
    }

    fn numbers(&self) -> &[u64] {
        &self.numbers
    }

    /// Where slot `i` (page `numbers()[i]`) starts, for threads filling the
    /// slots concurrently.
    fn slots_mut(&mut self) -> *mut u8 {
        self.data.as_mut_ptr()
    }

    /// Replace the contents with copies of `pages` read from `vm` now.
    fn copy_from(&mut self, vm: &Vm, pages: &PageBitmap) -> Result<(), ReplicationError> {
        self.prepare(pages);
        for (&p, buf) in self.numbers.iter().zip(self.data.chunks_exact_mut(PAGE)) {
            vm.ram().read_page(p, buf).map_err(ftvm_vmm::VmError::from)?;
        }
        Ok(())
    }
}

pub trait Capture: Send {
    /// The VM is paused and `dirty` is the checkpoint's dirty set; `hot`
    /// are those of its pages left writable (the guest is likely to write
    /// them again at once).
    fn in_pause(&mut self, vm: &Vm, dirty: &PageBitmap, hot: &PageBitmap) -> Result<(), ReplicationError>;
    /// The VM runs again; hand over the pages as they were at the freeze.
    fn finish(&mut self, vm: &Vm) -> Result<&mut Captured, ReplicationError>;
}

/// Today's capture: every page copied inside the pause.
#[derive(Default)]
pub struct CopyInPause {
    pages: Captured,
}

impl Capture for CopyInPause {
    fn in_pause(&mut self, vm: &Vm, dirty: &PageBitmap, _hot: &PageBitmap) -> Result<(), ReplicationError> {
        self.pages.copy_from(vm, dirty)
    }

    fn finish(&mut self, _vm: &Vm) -> Result<&mut Captured, ReplicationError> {
        Ok(&mut self.pages)
    }
}
