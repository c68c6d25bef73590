//! `--early-resume on`: the leader's frozen pages and disk blocks, copied
//! aside in the pause, so that its guest resumes before the union is
//! hashed, compared and its divergent pages sent: those steps then read
//! the copy, which the running guest cannot change. The pages go through
//! the capture stage (`capture::aside`: its own dirty pages while the
//! bitmaps are swapped, then the rest of the union); the disk blocks are
//! copied here.

use std::io;

use xxhash_rust::xxh3::xxh3_128;

use ftvm_replication::pipeline::capture::{self, Capture};
use ftvm_vmm::{PageBitmap, Vm};

use crate::disk::ReplicaDisk;

/// Kept by the leader from one `syncvm` to the next: the capture's buffer
/// is then already backed, so the copy in the pause takes no page faults.
pub struct Aside {
    /// The union's pages.
    pub pages: Box<dyn Capture>,
    /// What the capture is told is left writable: nothing.
    pub none_hot: PageBitmap,
    /// The union's disk blocks.
    pub blocks: Blocks,
}

impl Aside {
    pub fn new(vm: &Vm) -> Aside {
        Aside { pages: capture::aside(vm), none_hot: PageBitmap::new(vm.ram().pages()), blocks: Blocks::default() }
    }
}

/// Disk blocks as they were when copied: (block, its bytes), sorted by block.
#[derive(Default)]
pub struct Blocks(Vec<(u64, Vec<u8>)>);

impl Blocks {
    /// Forget what was copied.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Copy `blocks` of `disk` (its I/O runs in the device's pass: none is
    /// in progress while the guest is paused).
    pub fn copy(&mut self, disk: &ReplicaDisk, blocks: &[u64]) -> io::Result<()> {
        for &b in blocks {
            self.0.push((b, disk.read(b)?));
        }
        self.0.sort_unstable_by_key(|(b, _)| *b);
        Ok(())
    }

    /// The disk block as copied.
    pub fn block(&self, block: u64) -> Option<&[u8]> {
        let i = self.0.binary_search_by_key(&block, |(b, _)| *b).ok()?;
        Some(&self.0[i].1)
    }

    /// XXH3-128 of each disk block as copied (as `ReplicaDisk::hash`).
    pub fn hash(&self, blocks: &[u64]) -> Vec<u128> {
        blocks.iter().map(|&b| self.block(b).map_or(0, xxh3_128)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_blocks_are_copied_as_they_were() {
        let path = std::env::temp_dir().join(format!("ftvm-vsmr-aside-{}", std::process::id()));
        std::fs::write(&path, vec![3u8; 3 * 4096]).unwrap();
        let disk = ReplicaDisk::open(&path, Default::default()).unwrap();
        let frozen = disk.hash(&[2, 0]).unwrap();
        let mut blocks = Blocks::default();
        blocks.copy(&disk, &[2, 0]).unwrap();
        disk.write(&[ftvm_replication::output::DiskWrite { offset: 0, data: vec![9; 4096] }]).unwrap();
        assert_eq!(blocks.hash(&[2, 0]), frozen);
        assert_ne!(disk.hash(&[2, 0]).unwrap(), frozen);
        assert_eq!(blocks.block(0).unwrap(), vec![3u8; 4096].as_slice());
        std::fs::remove_file(&path).unwrap();
    }
}
