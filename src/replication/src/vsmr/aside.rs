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

use std::io;

use xxhash_rust::xxh3::xxh3_128;

use ftvm_vmm::memory::{GuestRam, MemoryError, PAGE};

use super::disk::ReplicaDisk;

/// Copy on every core from this many pages (as `sync::hash_pages`).
const PARALLEL_FROM: usize = 256;

/// Pages and disk blocks as they were when copied.
#[derive(Default)]
pub struct Aside {
    /// (page, its slot in `data`), sorted by page.
    index: Vec<(u64, usize)>,
    data: Vec<u8>,
    /// (block, its bytes), sorted by block.
    blocks: Vec<(u64, Vec<u8>)>,
}

impl Aside {
    /// Copy `pages` of `ram` (none copied before; the guest paused).
    pub fn copy(&mut self, ram: &GuestRam, pages: &[u64]) -> Result<(), MemoryError> {
        let first = self.data.len() / PAGE;
        self.data.resize(self.data.len() + pages.len() * PAGE, 0);
        let out = &mut self.data[first * PAGE..];
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(16);
        if pages.len() < PARALLEL_FROM || threads == 1 {
            copy_into(ram, pages, out)?;
        } else {
            let chunk = pages.len().div_ceil(threads);
            std::thread::scope(|s| {
                let workers: Vec<_> =
                    pages.chunks(chunk).zip(out.chunks_mut(chunk * PAGE)).map(|(p, o)| s.spawn(move || copy_into(ram, p, o))).collect();
                workers.into_iter().try_for_each(|w| w.join().expect("a copy thread panicked"))
            })?;
        }
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
        Some(&self.data[slot * PAGE..(slot + 1) * PAGE])
    }

    /// The disk block as copied.
    pub fn block(&self, block: u64) -> Option<&[u8]> {
        let i = self.blocks.binary_search_by_key(&block, |(b, _)| *b).ok()?;
        Some(&self.blocks[i].1)
    }

    /// XXH3-128 of each page as copied (0 for one not copied, which the
    /// caller never asks for: it copied the union it hashes).
    pub fn hash_pages(&self, pages: &[u64]) -> Vec<u128> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(16);
        let hash = |pages: &[u64], out: &mut [u128]| {
            for (&p, o) in pages.iter().zip(out) {
                *o = self.page(p).map_or(0, xxh3_128);
            }
        };
        let mut out = vec![0u128; pages.len()];
        if pages.len() < PARALLEL_FROM || threads == 1 {
            hash(pages, &mut out);
            return out;
        }
        let chunk = pages.len().div_ceil(threads);
        std::thread::scope(|s| {
            for (p, o) in pages.chunks(chunk).zip(out.chunks_mut(chunk)) {
                s.spawn(move || hash(p, o));
            }
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

fn copy_into(ram: &GuestRam, pages: &[u64], out: &mut [u8]) -> Result<(), MemoryError> {
    for (&p, o) in pages.iter().zip(out.chunks_exact_mut(PAGE)) {
        ram.read_page(p, o)?;
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
        assert!(mine.len() >= PARALLEL_FROM, "the parallel copy is exercised");
        let mut aside = Aside::default();
        aside.copy(&ram, &mine).unwrap();
        aside.copy(&ram, &rest).unwrap();
        assert_eq!(aside.pages(), union.len());
        let frozen = crate::vsmr::sync::hash_pages(&ram, &union);
        // The guest runs on: it writes every page.
        for p in 0..pages {
            fill(&ram, p, 0xee);
        }
        assert_eq!(aside.hash_pages(&union), frozen);
        assert_ne!(crate::vsmr::sync::hash_pages(&ram, &union), frozen);
        assert_eq!(aside.page(7).unwrap(), vec![7u8; PAGE].as_slice());
        assert!(aside.page(2).is_none(), "a page outside the union was not copied");
        assert!(aside.copy(&ram, &[pages]).is_err(), "a page beyond RAM is refused");
    }

    #[test]
    fn disk_blocks_are_copied_as_they_were() {
        let path = std::env::temp_dir().join(format!("ftvm-vsmr-aside-{}", std::process::id()));
        std::fs::write(&path, vec![3u8; 3 * 4096]).unwrap();
        let disk = ReplicaDisk::open(&path, Default::default()).unwrap();
        let frozen = disk.hash(&[2, 0]).unwrap();
        let mut aside = Aside::default();
        aside.copy_blocks(&disk, &[2, 0]).unwrap();
        disk.write(&[crate::output::DiskWrite { offset: 0, data: vec![9; 4096] }]).unwrap();
        assert_eq!(aside.hash_blocks(&[2, 0]), frozen);
        assert_ne!(disk.hash(&[2, 0]).unwrap(), frozen);
        assert_eq!(aside.block(0).unwrap(), vec![3u8; 4096].as_slice());
        std::fs::remove_file(&path).unwrap();
    }
}
