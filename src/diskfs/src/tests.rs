//! The file system against a disk in memory that can "crash": after a
//! budget of written blocks it applies nothing more (a request cut by the
//! budget is applied in part, a torn write), as when the VMM is SIGKILLed.

use super::*;

extern crate std;
use std::vec::Vec;

#[derive(Clone)]
struct MemDisk {
    data: Vec<u8>,
    /// Blocks that may still be written; None: unlimited.
    budget: Option<u64>,
    writes: u64,
    flushes: u64,
}

impl MemDisk {
    fn new(blocks: u64) -> MemDisk {
        MemDisk { data: vec![0; blocks as usize * BLOCK], budget: None, writes: 0, flushes: 0 }
    }
}

impl BlockDevice for MemDisk {
    fn blocks(&self) -> u64 {
        (self.data.len() / BLOCK) as u64
    }
    fn read(&mut self, block: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let at = block as usize * BLOCK;
        buf.copy_from_slice(self.data.get(at..at + buf.len()).ok_or(IoError)?);
        Ok(())
    }
    fn write(&mut self, block: u64, buf: &[u8]) -> Result<(), IoError> {
        assert_eq!(buf.len() % BLOCK, 0);
        self.writes += 1;
        for (i, b) in buf.chunks(BLOCK).enumerate() {
            if let Some(left) = &mut self.budget {
                if *left == 0 {
                    return Err(IoError);
                }
                *left -= 1;
            }
            let at = (block as usize + i) * BLOCK;
            self.data.get_mut(at..at + BLOCK).ok_or(IoError)?.copy_from_slice(b);
        }
        Ok(())
    }
    fn flush(&mut self) -> Result<(), IoError> {
        self.flushes += 1;
        if self.budget == Some(0) {
            return Err(IoError);
        }
        Ok(())
    }
}

fn fresh(blocks: u64) -> DiskFs<MemDisk> {
    let (fs, formatted) = DiskFs::mount_or_format(MemDisk::new(blocks), 1).unwrap();
    assert!(formatted);
    fs
}

/// The disk as it is now, mounted again (what a restart sees).
fn remount(fs: &mut DiskFs<MemDisk>) -> DiskFs<MemDisk> {
    let mut disk = fs.device().clone();
    disk.budget = None;
    let (fs, formatted) = DiskFs::mount_or_format(disk, 2).unwrap();
    assert!(!formatted);
    fs
}

fn content(fs: &mut DiskFs<MemDisk>, dir: NodeId, name: &str) -> Option<Vec<u8>> {
    let id = fs.lookup(dir, name).ok()?;
    let size = fs.stat(id)?.size as usize;
    let mut buf = vec![0u8; size + 10];
    let n = fs.read(id, 0, &mut buf).unwrap();
    assert_eq!(n, size);
    buf.truncate(n);
    Some(buf)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8).collect()
}

#[test]
fn synced_files_survive_a_remount_and_unsynced_data_does_not() {
    let mut fs = fresh(1024);
    let a = fs.create(ROOT, "appendonly.aof", Kind::File, 5).unwrap();
    let data = pattern(1, 10_000);
    fs.write(a, 0, &data, 6).unwrap();
    fs.sync(a).unwrap();
    fs.write(a, 10_000, b"not synced", 7).unwrap();
    assert_eq!(content(&mut fs, ROOT, "appendonly.aof").unwrap().len(), 10_010);
    let mut again = remount(&mut fs);
    assert_eq!(content(&mut again, ROOT, "appendonly.aof").unwrap(), data);
    // Created but never written: the name was committed at once.
    fs.create(ROOT, "empty", Kind::File, 8).unwrap();
    let mut again = remount(&mut fs);
    assert_eq!(content(&mut again, ROOT, "empty").unwrap(), b"");
}

#[test]
fn a_disk_with_other_content_is_refused_and_never_formatted() {
    let mut disk = MemDisk::new(1024);
    disk.data[100] = 1;
    let before = disk.data.clone();
    assert!(matches!(DiskFs::mount_or_format(disk.clone(), 0), Err(Error::Foreign)));
    assert_eq!(disk.data, before);
    assert!(matches!(DiskFs::mount_or_format(MemDisk::new(8), 0), Err(Error::TooSmall)));
}

#[test]
fn appends_with_fsync_keep_extents_few_and_read_back_across_blocks() {
    let mut fs = fresh(8192);
    let a = fs.create(ROOT, "log", Kind::File, 0).unwrap();
    let mut all = Vec::new();
    for i in 0..3000u64 {
        let rec = pattern(i, 37 + (i as usize % 300));
        fs.write(a, all.len() as u64, &rec, i).unwrap();
        all.extend_from_slice(&rec);
        fs.sync(a).unwrap();
    }
    assert!(fs.nodes[&a].extents.len() <= 4, "{:?}", fs.nodes[&a].extents);
    let mut again = remount(&mut fs);
    assert_eq!(content(&mut again, ROOT, "log").unwrap(), all);
    // Reads at odd offsets and lengths.
    let id = again.lookup(ROOT, "log").unwrap();
    let mut buf = vec![0u8; 9000];
    assert_eq!(again.read(id, 4000, &mut buf).unwrap(), 9000);
    assert_eq!(buf, all[4000..13000]);
}

#[test]
fn writes_past_the_end_leave_zeros_even_over_reused_blocks() {
    let mut fs = fresh(256);
    // Fill blocks with non-zero data, then free them.
    let junk = fs.create(ROOT, "junk", Kind::File, 0).unwrap();
    fs.write(junk, 0, &[0xee; 200 * BLOCK], 0).unwrap();
    fs.sync(junk).unwrap();
    fs.remove(ROOT, "junk", false, 0).unwrap();
    let f = fs.create(ROOT, "sparse", Kind::File, 0).unwrap();
    fs.write(f, 0, b"head", 0).unwrap();
    fs.sync(f).unwrap();
    fs.write(f, 3 * BLOCK as u64 + 5, b"tail", 0).unwrap();
    fs.truncate(f, 5 * BLOCK as u64, 0).unwrap();
    fs.sync(f).unwrap();
    let mut again = remount(&mut fs);
    let got = content(&mut again, ROOT, "sparse").unwrap();
    let mut want = vec![0u8; 5 * BLOCK];
    want[..4].copy_from_slice(b"head");
    want[3 * BLOCK + 5..3 * BLOCK + 9].copy_from_slice(b"tail");
    assert!(got == want, "holes must read as zeros");
    // Shrink, then grow again: the cut part is zero.
    let f = again.lookup(ROOT, "sparse").unwrap();
    again.truncate(f, 2, 0).unwrap();
    again.truncate(f, 10, 0).unwrap();
    assert_eq!(content(&mut again, ROOT, "sparse").unwrap(), b"he\0\0\0\0\0\0\0\0");
}

#[test]
fn names_behave_as_on_linux() {
    let mut fs = fresh(1024);
    let d = fs.create(ROOT, "dir", Kind::Dir, 0).unwrap();
    let f = fs.create(d, "f", Kind::File, 0).unwrap();
    assert_eq!(fs.create(d, "f", Kind::File, 0), Err(Error::Exists));
    assert_eq!(fs.create(f, "x", Kind::File, 0), Err(Error::NotDir));
    assert_eq!(fs.create(ROOT, "a/b", Kind::File, 0), Err(Error::Invalid));
    assert_eq!(fs.create(ROOT, &"n".repeat(256), Kind::File, 0), Err(Error::NameTooLong));
    assert_eq!(fs.remove(ROOT, "dir", true, 0), Err(Error::NotEmpty));
    assert_eq!(fs.remove(ROOT, "dir", false, 0), Err(Error::IsDir));
    assert_eq!(fs.remove(d, "f", true, 0), Err(Error::NotDir));
    assert_eq!(fs.rename(ROOT, "dir", d, "inside", 0), Err(Error::Invalid));
    fs.write(f, 0, b"one", 0).unwrap();
    fs.sync(f).unwrap();
    let g = fs.create(ROOT, "g", Kind::File, 0).unwrap();
    fs.write(g, 0, b"two", 0).unwrap();
    fs.sync(g).unwrap();
    // The rewrite-then-rename pattern: g replaces dir/f.
    fs.rename(ROOT, "g", d, "f", 0).unwrap();
    assert_eq!(fs.lookup(ROOT, "g"), Err(Error::NotFound));
    let mut again = remount(&mut fs);
    let d2 = again.lookup(ROOT, "dir").unwrap();
    assert_eq!(content(&mut again, d2, "f").unwrap(), b"two");
    let names: Vec<String> = again.list(ROOT).unwrap().into_iter().map(|(n, _, _)| n).collect();
    assert_eq!(names, ["dir"]);
}

#[test]
fn a_removed_open_file_keeps_its_data_until_released() {
    let mut fs = fresh(64);
    let free0 = fs.free_blocks();
    let f = fs.create(ROOT, "f", Kind::File, 0).unwrap();
    fs.open(f);
    fs.write(f, 0, &pattern(3, 20 * BLOCK), 0).unwrap();
    fs.sync(f).unwrap();
    fs.remove(ROOT, "f", false, 0).unwrap();
    let mut buf = vec![0u8; 20 * BLOCK];
    assert_eq!(fs.read(f, 0, &mut buf).unwrap(), 20 * BLOCK);
    assert_eq!(buf, pattern(3, 20 * BLOCK));
    fs.release(f);
    // Freed, and reusable once a commit no longer names them.
    let g = fs.create(ROOT, "g", Kind::File, 0).unwrap();
    assert_eq!(fs.free_blocks(), free0);
    fs.write(g, 0, &vec![1u8; free0 as usize * BLOCK], 0).unwrap();
    fs.sync(g).unwrap();
    assert_eq!(fs.write(g, free0 * BLOCK as u64, b"x", 0), Err(Error::NoSpace));
}

#[test]
fn a_full_disk_says_no_space_before_accepting_the_write() {
    let mut fs = fresh(64);
    let free = fs.free_blocks();
    let a = fs.create(ROOT, "a", Kind::File, 0).unwrap();
    let b = fs.create(ROOT, "b", Kind::File, 0).unwrap();
    fs.write(a, 0, &vec![1u8; (free as usize - 2) * BLOCK], 0).unwrap();
    // b's unwritten blocks are reserved too: 3 blocks do not fit.
    assert_eq!(fs.write(b, 0, &vec![2u8; 3 * BLOCK], 0), Err(Error::NoSpace));
    fs.write(b, 0, &vec![2u8; 2 * BLOCK], 0).unwrap();
    fs.sync_all().unwrap();
    let mut again = remount(&mut fs);
    assert_eq!(content(&mut again, ROOT, "b").unwrap(), vec![2u8; 2 * BLOCK]);
    assert_eq!(again.free_blocks(), 0);
}

/// The workload of the crash test: appends with fsync (an append-only
/// file), a rewrite into a new file renamed over the old one, a
/// truncation, removals.
/// Returns, after each call that returned, the content "log" must have at
/// least (a prefix of the final content).
fn workload(fs: &mut DiskFs<MemDisk>) -> Result<(), Error> {
    let log = fs.create(ROOT, "log", Kind::File, 0)?;
    let mut len = 0u64;
    for i in 0..40u64 {
        let rec = pattern(i, 100 + (i as usize * 97) % 5000);
        fs.write(log, len, &rec, i)?;
        len += rec.len() as u64;
        fs.sync(log)?;
    }
    let tmp = fs.create(ROOT, "temp-rewrite", Kind::File, 0)?;
    fs.write(tmp, 0, &pattern(99, 3 * BLOCK + 17), 0)?;
    fs.sync(tmp)?;
    fs.rename(ROOT, "temp-rewrite", ROOT, "log", 0)?;
    // Blocks a truncation frees are not reused before it is committed.
    let log = fs.lookup(ROOT, "log")?;
    fs.truncate(log, 10, 0)?;
    let other = fs.create(ROOT, "other", Kind::File, 0)?;
    fs.write(other, 0, &[0xee; 9 * BLOCK], 0)?;
    fs.sync(other)?;
    let junk = fs.create(ROOT, "junk", Kind::File, 0)?;
    fs.write(junk, 0, &pattern(5, 9 * BLOCK), 0)?;
    fs.sync(junk)?;
    fs.remove(ROOT, "junk", false, 0)?;
    Ok(())
}

#[test]
fn a_crash_at_any_block_write_leaves_a_mountable_consistent_file_system() {
    // How many blocks the whole workload writes.
    let mut full = fresh(512);
    workload(&mut full).unwrap();
    let total = full.device().writes;
    let log_states: Vec<Vec<u8>> = {
        // Every content "log" may legally have: each synced prefix of the
        // appends, and the rewrite.
        let mut states = vec![Vec::new()];
        let mut all = Vec::new();
        for i in 0..40u64 {
            all.extend_from_slice(&pattern(i, 100 + (i as usize * 97) % 5000));
            states.push(all.clone());
        }
        states.push(pattern(99, 3 * BLOCK + 17));
        states.push(pattern(99, 10));
        states
    };
    let blocks_written = {
        let mut probe = MemDisk::new(512);
        probe.budget = Some(u64::MAX);
        let (mut fs, _) = DiskFs::mount_or_format(probe, 0).unwrap();
        workload(&mut fs).unwrap();
        u64::MAX - fs.device().budget.unwrap()
    };
    assert!(total > 40 && blocks_written > total);
    for budget in 0..=blocks_written {
        let mut disk = MemDisk::new(512);
        disk.budget = Some(budget);
        let Ok((mut fs, _)) = DiskFs::mount_or_format(disk, 0) else { continue };
        let result = workload(&mut fs);
        let mut disk = fs.device().clone();
        disk.budget = None;
        let (mut fs, _) = match DiskFs::mount_or_format(disk, 0) {
            Ok(x) => x,
            Err(e) => panic!("budget {budget}: remount failed: {e}"),
        };
        if let Some(log) = content(&mut fs, ROOT, "log") {
            assert!(log_states.contains(&log), "budget {budget}: log of {} bytes is no state it ever had", log.len());
        }
        if result.is_ok() {
            assert_eq!(content(&mut fs, ROOT, "log").as_ref(), log_states.last());
            assert_eq!(fs.lookup(ROOT, "junk"), Err(Error::NotFound));
        }
    }
}

#[test]
fn damaged_metadata_never_panics_and_falls_back_or_refuses() {
    let mut fs = fresh(256);
    let f = fs.create(ROOT, "f", Kind::File, 0).unwrap();
    fs.write(f, 0, b"data", 0).unwrap();
    fs.sync(f).unwrap();
    let image = fs.device().clone();
    let sb = Super::for_device(256).unwrap();
    for slot in 0..2 {
        for byte in 0..200 {
            let mut disk = image.clone();
            disk.data[sb.slot_start(slot) as usize * BLOCK + byte] ^= 0x5a;
            // Either the other slot (an older state) or a clean refusal.
            if let Ok((mut fs, _)) = DiskFs::mount_or_format(disk, 0) {
                let c = content(&mut fs, ROOT, "f");
                assert!(c.is_none() || c.as_deref() == Some(&b""[..]) || c.as_deref() == Some(&b"data"[..]));
            }
        }
    }
}

#[test]
fn blocks_freed_by_a_truncation_wait_for_its_commit() {
    let mut fs = fresh(64);
    let f = fs.create(ROOT, "f", Kind::File, 0).unwrap();
    fs.write(f, 0, &pattern(1, 4 * BLOCK), 0).unwrap();
    fs.sync(f).unwrap();
    let g = fs.create(ROOT, "g", Kind::File, 0).unwrap();
    let filler = fs.create(ROOT, "filler", Kind::File, 0).unwrap();
    fs.write(filler, 0, &vec![7u8; fs.free_blocks() as usize * BLOCK], 0).unwrap();
    fs.sync(filler).unwrap();
    // f's blocks are the only ones left, still named by the last commit.
    fs.truncate(f, 0, 0).unwrap();
    fs.write(g, 0, &[9u8; BLOCK], 0).unwrap();
    // The disk dies after one more block: g's data must not be it.
    fs.device().budget = Some(1);
    assert_eq!(fs.sync(g), Err(Error::Io));
    let mut crashed = remount(&mut fs);
    let f_now = content(&mut crashed, ROOT, "f").unwrap();
    assert!(f_now.is_empty() || f_now == pattern(1, 4 * BLOCK), "f holds another file's data");
    // Without the crash: the truncation is committed, then g gets the blocks.
    fs.device().budget = None;
    fs.sync(g).unwrap();
    assert!(content(&mut remount(&mut fs), ROOT, "g").unwrap() == vec![9u8; BLOCK]);
}
