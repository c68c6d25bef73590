//! Guest RAM: one memfd mapped shared, so that a second process (a backup's
//! page reader, a checkpoint collector) can map the same pages later.
//!
//! The mapping carries a vm-memory `AtomicBitmap`: every write the VMM makes
//! through the `GuestMemory` API marks the page, because KVM's dirty log only
//! sees writes made by the guest.

use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, FromRawFd};

use vm_memory::bitmap::AtomicBitmap;
use std::sync::Arc;

use vm_memory::mmap::{MmapRegion, MmapRegionBuilder};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use ftvm_abi::PAGE_SIZE;

pub type GuestMemory = GuestMemoryMmap<AtomicBitmap>;

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
}

/// Guest RAM starting at guest-physical address 0.
pub struct GuestRam {
    memfd: File,
    mem: GuestMemory,
    mapping: Arc<MmapRegion<AtomicBitmap>>,
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
    /// (and userfaultfd write-protection later covers every page).
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
        let page = NonZeroUsize::new(PAGE_SIZE as usize).expect("page size is non-zero");
        let bitmap = AtomicBitmap::new(size as usize, page);
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

    pub fn memfd_raw(&self) -> i32 {
        self.memfd.as_raw_fd()
    }

    /// Host address of guest-physical 0, for KVM memory slots.
    pub fn host_base(&self) -> *mut u8 {
        self.host_base
    }

    /// The whole of guest RAM, for bulk copies into a snapshot.
    ///
    /// # Safety
    /// The caller must make sure no vCPU or device writes guest memory while
    /// the slice is alive (the VM is paused), or accept torn reads.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `size` bytes long and lives as long as self.
        unsafe { std::slice::from_raw_parts(self.host_base, self.size as usize) }
    }

    /// Mutable view for bulk restore.
    ///
    /// # Safety
    /// No vCPU may run and no other reference into guest memory may be in use.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as for `as_slice`, plus the caller's exclusivity promise.
        unsafe { std::slice::from_raw_parts_mut(self.host_base, self.size as usize) }
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

    /// Pages the VMM wrote since the last call (one bit per page), cleared.
    pub fn take_vmm_dirty(&self) -> Vec<u64> {
        self.mapping.bitmap().get_and_reset()
    }

    /// Mark a range written by the VMM through a raw pointer (bulk restore).
    pub fn mark_vmm_dirty(&self, addr: u64, len: u64) {
        self.mapping.bitmap().set_addr_range(addr as usize, len as usize);
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
        let bits = ram.take_vmm_dirty();
        assert_eq!(bits[0], (1 << 3) | (1 << 5) | (1 << 6));
        assert!(ram.take_vmm_dirty().iter().all(|&w| w == 0), "taking clears");
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
    fn memfd_sees_guest_writes() {
        use std::os::unix::fs::FileExt;
        let ram = GuestRam::new(1 << 20, true).unwrap();
        ram.memory().write_obj(0xabcdu32, GuestAddress(0x1000)).unwrap();
        let mut buf = [0u8; 4];
        ram.memfd().read_exact_at(&mut buf, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(buf), 0xabcd);
    }
}
