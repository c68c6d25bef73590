//! `--early-resume on`: the leader's frozen pages and disk blocks, copied
//! aside in the pause, so that its guest resumes before the union is
//! hashed, compared and its divergent pages sent: those steps then read
//! the copy, which the running guest cannot change.
//!
//! A plain copy rather than copy-on-write: a `syncvm`'s union is small
//! (about 150 pages under redis-benchmark), and copying a page costs about
//! what write-protecting it does here (`docs/replication.md`, "Copy-on-write
//! capture"), without the 20-35 µs fault of each first write after the
//! resume.

use std::convert::Infallible;
use std::io;

use xxhash_rust::xxh3::xxh3_128;

use ftvm_vmm::memory::{GuestRam, MemoryError, PAGE};

use crate::cores::on_cores;
use crate::disk::ReplicaDisk;

/// Pages and disk blocks as they were when copied. Kept by the leader from
/// one `syncvm` to the next (`clear`): its buffer is then already mapped,
/// so the copy in the pause takes no page faults.
#[derive(Default)]
pub struct Aside {
    /// (page, its slot in `data`), sorted by page.
    index: Vec<(u64, usize)>,
    /// Slots in use: the first `used` pages of `data`.
    used: usize,
    /// Mapped at the first copy, as large as guest RAM.
    data: Option<Buffer>,
    /// (block, its bytes), sorted by block.
    blocks: Vec<(u64, Vec<u8>)>,
}

impl Aside {
    /// Forget what was copied (the buffer stays).
    pub fn clear(&mut self) {
        self.index.clear();
        self.used = 0;
        self.blocks.clear();
    }

    /// Copy `pages` of `ram` (none copied since `clear`; the guest paused).
    pub fn copy(&mut self, ram: &GuestRam, pages: &[u64]) -> Result<(), MemoryError> {
        let first = self.used;
        let end = (first + pages.len()) * PAGE;
        if self.data.as_ref().is_none_or(|d| d.len < ram.size() as usize) {
            self.data = Some(Buffer::map(ram.size() as usize)?);
        }
        let data = self.data.as_mut().expect("mapped above").as_mut_slice();
        // A union has each page once, so it never holds more than guest RAM.
        let out = data.get_mut(first * PAGE..end).ok_or(MemoryError::OutOfRange { page: (end / PAGE) as u64 })?;
        on_cores(pages, out, PAGE, |p, o| copy_into(ram, p, o))?;
        self.used += pages.len();
        self.index.extend(pages.iter().enumerate().map(|(i, &p)| (p, first + i)));
        self.index.sort_unstable();
        Ok(())
    }

    /// Copy `blocks` of `disk` (its I/O runs in the device's pass: none is
    /// in progress while the guest is paused).
    pub fn copy_blocks(&mut self, disk: &ReplicaDisk, blocks: &[u64]) -> io::Result<()> {
        for &b in blocks {
            self.blocks.push((b, disk.read(b)?));
        }
        self.blocks.sort_unstable_by_key(|(b, _)| *b);
        Ok(())
    }

    /// The page as copied.
    pub fn page(&self, page: u64) -> Option<&[u8]> {
        let i = self.index.binary_search_by_key(&page, |(p, _)| *p).ok()?;
        let slot = self.index[i].1;
        Some(&self.data.as_ref()?.as_slice()[slot * PAGE..(slot + 1) * PAGE])
    }

    /// The disk block as copied.
    pub fn block(&self, block: u64) -> Option<&[u8]> {
        let i = self.blocks.binary_search_by_key(&block, |(b, _)| *b).ok()?;
        Some(&self.blocks[i].1)
    }

    /// XXH3-128 of each page as copied (0 for one not copied, which the
    /// caller never asks for: it copied the union it hashes).
    pub fn hash_pages(&self, pages: &[u64]) -> Vec<u128> {
        let mut out = vec![0u128; pages.len()];
        let Ok(()) = on_cores(pages, &mut out, 1, |pages, out| {
            for (&p, o) in pages.iter().zip(out) {
                *o = self.page(p).map_or(0, xxh3_128);
            }
            Ok::<(), Infallible>(())
        });
        out
    }

    /// XXH3-128 of each disk block as copied (as `ReplicaDisk::hash`).
    pub fn hash_blocks(&self, blocks: &[u64]) -> Vec<u128> {
        blocks.iter().map(|&b| self.block(b).map_or(0, xxh3_128)).collect()
    }

    /// Pages copied.
    pub fn pages(&self) -> usize {
        self.index.len()
    }
}

/// Anonymous memory for the copy, on transparent huge pages where the host
/// gives them: with 4 KiB pages the copy's stores into the buffer cost a
/// TLB miss each new page, which under nested paging tripled the copy
/// (0.83 against 0.26 µs per page, cold caches, measured here).
struct Buffer {
    /// The mapping (`map_len` bytes), and in it `ptr`, 2 MiB-aligned, for `len`.
    map: *mut libc::c_void,
    map_len: usize,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by the buffer alone and reached only
// through `&self` / `&mut self`.
unsafe impl Send for Buffer {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for Buffer {}

const HUGE: usize = 2 << 20;

impl Buffer {
    /// `len` bytes reserved (backed as they are first written: a leader
    /// holds about its largest union).
    fn map(len: usize) -> Result<Buffer, MemoryError> {
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
            return Err(MemoryError::Mmap(format!("the syncvm copy buffer: {}", io::Error::last_os_error())));
        }
        let offset = (map as usize).next_multiple_of(HUGE) - map as usize;
        // SAFETY: `offset` < HUGE, and the mapping extends HUGE past `len`.
        let ptr = unsafe { (map as *mut u8).add(offset) };
        // SAFETY: advice on a range inside the mapping; a refusal (no
        // transparent huge pages) leaves ordinary pages, which work too.
        unsafe { libc::madvise(ptr.cast(), len.next_multiple_of(HUGE), libc::MADV_HUGEPAGE) };
        Ok(Buffer { map, map_len, ptr, len })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of the live mapping, readable (anonymous
        // memory reads as zero until written).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; no slice of it
        // outlives `self`.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// A plain memcpy per page: about 3x faster here than `GuestRam::read_page`'s
/// volatile copy (0.1 against 0.27 µs per page into a warm buffer), and
/// the copy is the leader's pause.
fn copy_into(ram: &GuestRam, pages: &[u64], out: &mut [u8]) -> Result<(), MemoryError> {
    for (&page, o) in pages.iter().zip(out.chunks_exact_mut(PAGE)) {
        if page >= ram.pages() {
            return Err(MemoryError::OutOfRange { page });
        }
        // SAFETY: the page lies inside guest RAM's mapping (checked above),
        // which lives as long as `ram`, and `o` is one page long. The guest
        // and the VMM's devices are paused, so nothing writes the page
        // meanwhile (were one to, the copy would only be torn, as a
        // `read_page` of a page being written is).
        unsafe { std::ptr::copy_nonoverlapping(ram.host_base().add(page as usize * PAGE), o.as_mut_ptr(), PAGE) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(ram: &GuestRam, page: u64, byte: u8) {
        ram.write_page(page, &vec![byte; PAGE]).unwrap();
    }

    /// What the guest writes after the copy changes nothing in it: the
    /// hashes and pages the leader compares and sends are those of the
    /// freeze, in two copies (its own dirty set, then the rest of the
    /// union) and on several threads.
    #[test]
    fn the_copy_keeps_the_frozen_contents() {
        let ram = GuestRam::new(4 << 20, false).unwrap();
        let pages = ram.pages();
        for p in 0..pages {
            fill(&ram, p, p as u8);
        }
        let mine: Vec<u64> = (0..pages).filter(|p| p % 3 == 0).collect();
        let rest: Vec<u64> = (0..pages).filter(|p| p % 3 == 1).collect();
        let mut union: Vec<u64> = mine.iter().chain(&rest).copied().collect();
        union.sort_unstable();
        assert!(mine.len() >= crate::cores::PARALLEL_FROM, "the parallel copy is exercised");
        let mut aside = Aside::default();
        aside.copy(&ram, &mine).unwrap();
        aside.copy(&ram, &rest).unwrap();
        assert_eq!(aside.pages(), union.len());
        let frozen = crate::page_hash::hash_pages(&ram, &union);
        // The guest runs on: it writes every page.
        for p in 0..pages {
            fill(&ram, p, 0xee);
        }
        assert_eq!(aside.hash_pages(&union), frozen);
        assert_ne!(crate::page_hash::hash_pages(&ram, &union), frozen);
        assert_eq!(aside.page(7).unwrap(), vec![7u8; PAGE].as_slice());
        assert!(aside.page(2).is_none(), "a page outside the union was not copied");
        assert!(aside.copy(&ram, &[pages]).is_err(), "a page beyond RAM is refused");
        // The next syncvm's copy reuses the buffer: nothing of the last one is left.
        aside.clear();
        aside.copy(&ram, &[2]).unwrap();
        assert_eq!(aside.pages(), 1);
        assert!(aside.page(7).is_none());
        assert_eq!(aside.page(2).unwrap(), vec![0xeeu8; PAGE].as_slice());
    }

    #[test]
    fn disk_blocks_are_copied_as_they_were() {
        let path = std::env::temp_dir().join(format!("ftvm-vsmr-aside-{}", std::process::id()));
        std::fs::write(&path, vec![3u8; 3 * 4096]).unwrap();
        let disk = ReplicaDisk::open(&path, Default::default()).unwrap();
        let frozen = disk.hash(&[2, 0]).unwrap();
        let mut aside = Aside::default();
        aside.copy_blocks(&disk, &[2, 0]).unwrap();
        disk.write(&[ftvm_replication::output::DiskWrite { offset: 0, data: vec![9; 4096] }]).unwrap();
        assert_eq!(aside.hash_blocks(&[2, 0]), frozen);
        assert_ne!(disk.hash(&[2, 0]).unwrap(), frozen);
        assert_eq!(aside.block(0).unwrap(), vec![3u8; 4096].as_slice());
        std::fs::remove_file(&path).unwrap();
    }
}
