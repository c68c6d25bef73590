//! Guest RAM: one memfd mapped shared, so that a second process (a backup's
//! page reader, a checkpoint collector) can map the same pages later.
//!
//! The mapping carries a vm-memory bitmap (`vmm_dirty::VmmDirty`): every
//! write the VMM makes through the `GuestMemory` API marks the page, because
//! KVM's dirty log only sees writes made by the guest. The VMM reaches guest RAM only through
//! vm-memory's volatile accessors: vCPUs may be writing it at any time, so a
//! Rust reference into it would be a data race.

mod page_bitmap;
mod vmm_dirty;
mod write_protect;

pub use page_bitmap::PageBitmap;
use vmm_dirty::VmmDirty;
pub use write_protect::{WriteProtect, WriteProtectError};

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_memory::mmap::{MmapRegion, MmapRegionBuilder};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use ftvm_abi::PAGE_SIZE;

use crate::components::{ComponentError, ComponentId, Components};
use crate::persist::Persist;

/// Bytes per guest page.
pub const PAGE: usize = PAGE_SIZE as usize;

mod aligned;
pub use aligned::AlignedPage;

pub type GuestMemory = GuestMemoryMmap<VmmDirty>;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create guest memory file: {0}")]
    Memfd(std::io::Error),
    #[error("cannot size guest memory to {size} bytes: {err}")]
    Truncate { size: u64, err: std::io::Error },
    #[error("cannot map guest memory: {0}")]
    Mmap(String),
    #[error("cannot pre-fault guest memory: {0}")]
    Prefault(std::io::Error),
    #[error("page {page} is beyond guest RAM")]
    OutOfRange { page: u64 },
    #[error("the saved VM has {saved} bytes of RAM, this VM has {present}")]
    SizeMismatch { saved: u64, present: u64 },
}

/// What guest memory contributes to a VM's saved state besides its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryState {
    pub size: u64,
}

/// Guest memory's component (its pages travel apart from it).
pub fn component_id() -> ComponentId {
    ComponentId::new("memory")
}

/// The size of the guest memory `saved` describes.
pub fn saved_size(saved: &Components) -> Result<u64, ComponentError> {
    saved.state::<MemoryState>(&component_id()).map(|m| m.size)
}

/// Guest RAM starting at guest-physical address 0.
pub struct GuestRam {
    memfd: File,
    mem: GuestMemory,
    mapping: Arc<MmapRegion<VmmDirty>>,
    host_base: *mut u8,
    size: u64,
}

// SAFETY: `host_base` points into the mapping owned by `mem`, which lives as
// long as `self`; all access to guest memory is by design shared between the
// vCPUs (guest code) and VMM threads, exactly as with `GuestMemoryMmap` itself.
unsafe impl Send for GuestRam {}
// SAFETY: see `Send`; the raw pointer is only used to hand out ranges whose
// concurrent use the callers account for.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// Create `size` bytes of zeroed guest RAM. With `prefault`, every page is
    /// populated up front so first guest touches do not take host page faults
    /// (tracking and write protection then see every page as present).
    pub fn new(size: u64, prefault: bool) -> Result<GuestRam, MemoryError> {
        // SAFETY: memfd_create with a valid NUL-terminated name; the result is
        // checked before use.
        let fd = unsafe { libc::memfd_create(c"ftvm-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(size).map_err(|err| MemoryError::Truncate { size, err })?;
        Self::map(memfd, size, prefault)
    }

    fn map(memfd: File, size: u64, prefault: bool) -> Result<GuestRam, MemoryError> {
        let bitmap = VmmDirty::new(size as usize);
        let mut flags = libc::MAP_SHARED | libc::MAP_NORESERVE;
        if prefault {
            flags |= libc::MAP_POPULATE;
        }
        let offset = FileOffset::new(memfd.try_clone().map_err(MemoryError::Memfd)?, 0);
        let region = MmapRegionBuilder::new_with_bitmap(size as usize, bitmap)
            .with_file_offset(offset)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(flags)
            .build()
            .map_err(|e| MemoryError::Mmap(e.to_string()))?;
        let host_base = region.as_ptr();
        let region = GuestRegionMmap::new(region, GuestAddress(0))
            .ok_or_else(|| MemoryError::Mmap("region does not fit the address space".into()))?;
        let mapping = region.get_mmap();
        let mem = GuestMemory::from_regions(vec![region]).map_err(|e| MemoryError::Mmap(e.to_string()))?;
        Ok(GuestRam { memfd, mem, mapping, host_base, size })
    }

    pub fn memory(&self) -> &GuestMemory {
        &self.mem
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn pages(&self) -> u64 {
        self.size / PAGE_SIZE
    }

    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    /// Host address of guest-physical 0, for KVM memory slots.
    pub fn host_base(&self) -> *mut u8 {
        self.host_base
    }

    fn page_addr(&self, page: u64) -> Result<GuestAddress, MemoryError> {
        if page >= self.pages() {
            return Err(MemoryError::OutOfRange { page });
        }
        Ok(GuestAddress(page * PAGE_SIZE))
    }

    /// Copy page `page` into `buf` (one page long). The guest may be
    /// writing it meanwhile: the copy may then mix old and new bytes, which
    /// callers accept only where dirty tracking will send the page again.
    ///
    /// A plain copy from the mapping, not through `vm-memory`'s slices:
    /// the same bytes, about 100 ns a page less here, and a checkpoint
    /// copies every dirty page in its pause.
    pub fn read_page(&self, page: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.page_addr(page)?;
        let buf = &mut buf[..PAGE];
        // SAFETY: `page` is below `self.pages()` (checked above), so its
        // bytes lie inside the mapping of `self.size` bytes at `host_base`,
        // which lives as long as `self`; `buf` is one page of memory the
        // caller owns, never part of that mapping. A guest writing the page
        // meanwhile can only tear the copy, as the doc says (`vm-memory`'s
        // own copy is the same `copy_nonoverlapping`).
        unsafe { std::ptr::copy_nonoverlapping(self.host_base.add(page as usize * PAGE), buf.as_mut_ptr(), PAGE) };
        Ok(())
    }

    /// Overwrite page `page` with `data` (one page long); the VMM dirty
    /// bitmap records it.
    pub fn write_page(&self, page: u64, data: &[u8]) -> Result<(), MemoryError> {
        let addr = self.page_addr(page)?;
        self.mem.write_slice(&data[..PAGE], addr).map_err(|_| MemoryError::OutOfRange { page })
    }

    /// Byte ranges of guest RAM that have ever been populated; the rest
    /// reads as zero. Found with SEEK_DATA/SEEK_HOLE on the memfd, so
    /// scanning for content never faults in untouched memory.
    pub fn populated_ranges(&self) -> Vec<(u64, u64)> {
        let fd = self.memfd.as_raw_fd();
        let mut ranges = Vec::new();
        let mut pos: i64 = 0;
        let size = self.size as i64;
        while pos < size {
            // SAFETY: lseek on a descriptor we own; errors are checked.
            let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
            if data < 0 {
                break; // ENXIO: no data after `pos`
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let end = if hole < 0 { size } else { hole.min(size) };
            ranges.push((data as u64, end as u64));
            pos = end;
        }
        ranges
    }

    /// OR into `out` the pages the VMM wrote since the last call, and clear them.
    pub fn take_vmm_dirty(&self, out: &mut PageBitmap) {
        self.mapping.bitmap().take_into(out)
    }
}

impl Persist for GuestRam {
    type State = MemoryState;
    type Error = MemoryError;

    fn save(&self) -> Result<MemoryState, MemoryError> {
        Ok(MemoryState { size: self.size })
    }

    fn restore(&mut self, state: &MemoryState) -> Result<(), MemoryError> {
        self.fits(state)
    }
}

impl GuestRam {
    /// Guest RAM keeps its size for life (its contents travel as pages):
    /// restoring its state only checks that it fits.
    pub fn fits(&self, state: &MemoryState) -> Result<(), MemoryError> {
        if state.size != self.size {
            return Err(MemoryError::SizeMismatch { saved: state.size, present: self.size });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn vmm_writes_are_tracked_per_page() {
        let ram = GuestRam::new(1 << 20, false).unwrap();
        ram.memory().write_obj(7u64, GuestAddress(0x3000)).unwrap();
        ram.memory().write_slice(&[1u8; 2], GuestAddress(0x5fff)).unwrap();
        let mut bits = PageBitmap::new(ram.pages());
        ram.take_vmm_dirty(&mut bits);
        assert_eq!(bits.pages().collect::<Vec<_>>(), vec![3, 5, 6]);
        let mut again = PageBitmap::new(ram.pages());
        ram.take_vmm_dirty(&mut again);
        assert!(again.is_empty(), "taking clears");
    }

    #[test]
    fn populated_ranges_skip_holes() {
        let ram = GuestRam::new(8 << 20, false).unwrap();
        ram.memory().write_obj(1u8, GuestAddress(0x5000)).unwrap();
        ram.memory().write_obj(1u8, GuestAddress(6 << 20)).unwrap();
        let ranges = ram.populated_ranges();
        assert!(!ranges.is_empty());
        let covered = |a: u64| ranges.iter().any(|&(s, e)| (s..e).contains(&a));
        assert!(covered(0x5000) && covered(6 << 20));
        assert!(!covered(3 << 20), "untouched memory is a hole: {ranges:x?}");
    }

    #[test]
    fn pages_round_trip_and_are_bounds_checked() {
        let mut ram = GuestRam::new(1 << 20, false).unwrap();
        let page = vec![0x5au8; PAGE];
        ram.write_page(3, &page).unwrap();
        let mut back = vec![0u8; PAGE];
        ram.read_page(3, &mut back).unwrap();
        assert_eq!(back, page);
        assert!(matches!(ram.read_page(256, &mut back), Err(MemoryError::OutOfRange { page: 256 })));
        assert!(ram.write_page(u64::MAX, &page).is_err());
        let mut written = PageBitmap::new(ram.pages());
        ram.take_vmm_dirty(&mut written);
        assert_eq!(written.pages().collect::<Vec<_>>(), vec![3], "VMM writes are tracked");
        assert!(ram.restore(&MemoryState { size: 2 << 20 }).is_err());
        ram.restore(&ram.save().unwrap()).unwrap();
    }

    #[test]
    fn memfd_sees_guest_writes() {
        use std::os::unix::fs::FileExt;
        let ram = GuestRam::new(1 << 20, true).unwrap();
        ram.memory().write_obj(0xabcdu32, GuestAddress(0x1000)).unwrap();
        let mut buf = [0u8; 4];
        ram.memfd().read_exact_at(&mut buf, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(buf), 0xabcd);
    }
}
