//! Anonymous memory on transparent huge pages, for copies of pages: with
//! 4 KiB pages each store into a new page of the buffer costs a TLB miss,
//! which under nested paging tripled a copy in the pause (0.83 against
//! 0.26 µs per page, cold caches, measured here).

use std::io;

use ftvm_vmm::memory::MemoryError;

/// A private anonymous mapping, 2 MiB-aligned, backed as it is first
/// written.
pub struct HugeBuffer {
    /// The mapping (`map_len` bytes), and in it `ptr`, 2 MiB-aligned, for `len`.
    map: *mut libc::c_void,
    map_len: usize,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by the buffer alone and reached only
// through `&self` / `&mut self`.
unsafe impl Send for HugeBuffer {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for HugeBuffer {}

const HUGE: usize = 2 << 20;

impl HugeBuffer {
    /// `len` bytes reserved (backed as they are first written: a user
    /// holds about the most it copied at once).
    pub fn map(len: usize) -> Result<HugeBuffer, MemoryError> {
        let map_len = len.next_multiple_of(HUGE) + HUGE;
        // SAFETY: a fresh private anonymous mapping; the result is checked,
        // and unmapped only in Drop.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(MemoryError::Mmap(format!("a buffer for page copies: {}", io::Error::last_os_error())));
        }
        let offset = (map as usize).next_multiple_of(HUGE) - map as usize;
        // SAFETY: `offset` < HUGE, and the mapping extends HUGE past `len`.
        let ptr = unsafe { (map as *mut u8).add(offset) };
        // SAFETY: advice on a range inside the mapping; a refusal (no
        // transparent huge pages) leaves ordinary pages, which work too.
        unsafe { libc::madvise(ptr.cast(), len.next_multiple_of(HUGE), libc::MADV_HUGEPAGE) };
        Ok(HugeBuffer { map, map_len, ptr, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of the live mapping, readable (anonymous
        // memory reads as zero until written).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HugeBuffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; no slice of it
        // outlives `self`.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}
