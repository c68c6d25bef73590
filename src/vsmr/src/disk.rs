//! A VM replica's disk in `syncvm`: which blocks either replica wrote
//! since the last `syncvm`, their hashes, and the atomic write of the
//! leader's divergent blocks on the secondary.
//!
//! Each VM replica has its own image (same size; the contents of a
//! restarted replica's are repaired by its full `syncvm`). The writes are
//! recorded by the primary-backup disk journal (`output::DiskJournal`,
//! installed as the VM's disk-write observer): only their offsets are used
//! here, as a dirty set of 4 KiB blocks. The secondary writes the divergent
//! blocks with the primary-backup backup's undo log (`pipeline::apply::
//! UndoLog`): a failed write puts back what it overwrote.
//!
//! The disk's I/O runs in the device's pass (`--disk-io sync`, forced for
//! replicas): once the VM is paused no write is in progress, so a block
//! read for its hash is the one the guest sees, and a secondary's own write
//! cannot land after the leader's blocks replaced its disk's.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_128;

use ftvm_replication::output::{DiskJournal, DiskWrite};
use ftvm_replication::pipeline::apply::UndoLog;

/// The unit of comparison: a 4 KiB block (the last one may be shorter).
pub const BLOCK: u64 = 4096;

/// One replica's disk image and the journal of its guest's writes.
pub struct ReplicaDisk {
    file: File,
    size: u64,
    /// While this replica does not lead: the writes since its last
    /// `syncvm` (a leader's own freeze takes its leadership's journal).
    pub journal: Arc<DiskJournal>,
}

impl ReplicaDisk {
    pub fn open(path: &Path, journal: Arc<DiskJournal>) -> io::Result<ReplicaDisk> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let size = file.metadata()?.len();
        Ok(ReplicaDisk { file, size, journal })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn blocks(&self) -> u64 {
        self.size.div_ceil(BLOCK)
    }

    /// Every block of the disk (a full `syncvm`).
    pub fn all(&self) -> Vec<u64> {
        (0..self.blocks()).collect()
    }

    /// The block's bytes (shorter for a last partial block).
    pub fn read(&self, block: u64) -> io::Result<Vec<u8>> {
        let offset = block * BLOCK;
        let len = BLOCK.min(self.size.saturating_sub(offset)) as usize;
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }

    /// XXH3-128 of each block, in order.
    pub fn hash(&self, blocks: &[u64]) -> io::Result<Vec<u128>> {
        blocks.iter().map(|&b| self.read(b).map(|d| xxh3_128(&d))).collect()
    }

    /// Write the leader's blocks, each checked to lie on the disk; on a
    /// failure everything written is put back.
    pub fn write(&self, blocks: &[DiskWrite]) -> Result<(), String> {
        UndoLog::default().write(&self.file, blocks).map_err(|f| format!("cannot write the leader's disk blocks: {f:?}"))
    }

    /// Whether `w` is one whole block of this disk, as the leader sends them.
    pub fn fits(&self, w: &DiskWrite) -> bool {
        w.offset.is_multiple_of(BLOCK) && w.offset < self.size && w.data.len() as u64 == BLOCK.min(self.size - w.offset)
    }
}

/// The blocks a set of writes touched, sorted, each once; writes beyond
/// `size` (none should be) are clipped.
pub fn dirty_blocks(writes: &[DiskWrite], size: u64) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    for w in writes {
        if w.data.is_empty() || w.offset >= size {
            continue;
        }
        let end = (w.offset + w.data.len() as u64).min(size);
        out.extend(w.offset / BLOCK..end.div_ceil(BLOCK));
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The sorted union of two sorted block lists.
pub fn union(a: &[u64], b: &[u64]) -> Vec<u64> {
    let mut out: Vec<u64> = a.iter().chain(b).copied().collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_map_to_the_blocks_they_touch() {
        let w = |offset: u64, len: usize| DiskWrite { offset, data: vec![1; len] };
        let size = 3 * BLOCK + 512;
        assert_eq!(dirty_blocks(&[w(512, 512), w(BLOCK - 512, 1024), w(3 * BLOCK, 512)], size), vec![0, 1, 3]);
        assert_eq!(dirty_blocks(&[w(size, 512), w(0, 0)], size), Vec::<u64>::new());
        assert_eq!(union(&[0, 3], &[1, 3, 7]), vec![0, 1, 3, 7]);
    }

    #[test]
    fn blocks_are_hashed_read_and_written_whole() {
        let dir = std::env::temp_dir().join(format!("ftvm-vsmr-disk-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; (BLOCK + 512) as usize]).unwrap();
        let disk = ReplicaDisk::open(&dir, Arc::default()).unwrap();
        assert_eq!(disk.blocks(), 2);
        let before = disk.hash(&disk.all()).unwrap();
        let last = DiskWrite { offset: BLOCK, data: vec![7; 512] };
        assert!(disk.fits(&last));
        assert!(!disk.fits(&DiskWrite { offset: BLOCK, data: vec![7; BLOCK as usize] }));
        assert!(!disk.fits(&DiskWrite { offset: 512, data: vec![7; BLOCK as usize] }));
        disk.write(&[last]).unwrap();
        let after = disk.hash(&disk.all()).unwrap();
        assert_eq!(before[0], after[0]);
        assert_ne!(before[1], after[1]);
        assert_eq!(disk.read(1).unwrap(), vec![7; 512]);
        std::fs::remove_file(&dir).unwrap();
    }
}
