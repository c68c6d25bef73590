//! Capture: the dirty pages as they were at the freeze: copied in the
//! pause (`CopyInPause`), copy-on-write after the resume (`cow`), or
//! copied aside onto huge pages, on every core, the pause able to add
//! pages (`aside`).

mod aside;
mod captured;
mod cow;
mod huge;

use ftvm_vmm::{PageBitmap, Vm};

use crate::error::ReplicationError;
pub use aside::CopyAside;
pub use captured::Captured;
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

/// The copy aside (`CopyAside`), not a `--capture` value: a hash compare
/// (`encode::hash_compare`) chooses it, to add the reader's dirty pages in
/// the pause.
pub fn aside(vm: &Vm) -> Box<dyn Capture> {
    Box::new(CopyAside::new(vm))
}

pub trait Capture: Send {
    /// The VM is paused and `dirty` is the checkpoint's dirty set; `hot`
    /// are those of its pages left writable (the guest is likely to write
    /// them again at once).
    fn in_pause(&mut self, vm: &Vm, dirty: &PageBitmap, hot: &PageBitmap) -> Result<(), ReplicationError>;
    /// Still in the same pause, after `in_pause`: capture `more` pages too,
    /// none of them in its dirty set (pages the reader wrote, which a hash
    /// compare reads as this side froze them). Captures that copy in the
    /// pause can; the default refuses.
    fn also(&mut self, _vm: &Vm, _more: &PageBitmap) -> Result<(), ReplicationError> {
        Err(ReplicationError::Unsupported("this capture takes no pages after the dirty set"))
    }
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
        self.pages.clear();
        self.pages.copy_more(vm, dirty)
    }

    fn also(&mut self, vm: &Vm, more: &PageBitmap) -> Result<(), ReplicationError> {
        self.pages.copy_more(vm, more)
    }

    fn finish(&mut self, _vm: &Vm) -> Result<&mut Captured, ReplicationError> {
        Ok(&mut self.pages)
    }
}
