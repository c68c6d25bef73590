//! The undo log of the backup's disk replica: before each of a
//! checkpoint's disk writes, what it overwrites is read and kept; when a
//! write fails, everything written so far is put back, newest first, so the
//! replica is byte for byte what it was before the checkpoint.
//!
//! Putting back must not need space the failed write did not find: old
//! contents that are zero are restored by punching a hole (which frees
//! space), the rest by overwriting blocks that already hold data.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use crate::output::DiskWrite;

/// The replica's disk image, as the undo log uses it.
pub trait DiskImage: Send + Sync {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Make `len` bytes at `offset` read as zeros, freeing their space
    /// where the file system can.
    fn zero(&self, offset: u64, len: u64) -> io::Result<()>;
}

impl DiskImage for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_exact_at(buf, offset)
    }

    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_all_at(data, offset)
    }

    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: fallocate on a descriptor this File owns, with plain
        // integer arguments; the result is checked.
        let r = unsafe { libc::fallocate(self.as_raw_fd(), mode, offset as libc::off_t, len as libc::off_t) };
        if r == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(err);
        }
        // No holes on this file system: write the zeros.
        self.write_all_at(&vec![0u8; len as usize], offset)
    }
}

/// Why writing a checkpoint's disk writes failed, and whether the undo
/// succeeded.
#[derive(Debug)]
pub enum Failure {
    /// Every byte written was put back: the image is as it was.
    Undone(io::Error),
    /// Putting it back failed too: the image matches no checkpoint.
    NotUndone { err: io::Error, undo: io::Error },
}

/// Restored in pieces of this size, each either punched or written.
const PIECE: u64 = 4096;

/// The old contents of the ranges one checkpoint overwrote; reused from
/// checkpoint to checkpoint.
#[derive(Default)]
pub struct UndoLog {
    /// (offset on the disk, start in `data`, length), in write order.
    ranges: Vec<(u64, usize, usize)>,
    data: Vec<u8>,
}

impl UndoLog {
    /// Write `writes` into `disk` in order, each after saving what it
    /// overwrites. On a failure, put everything back before returning.
    pub fn write(&mut self, disk: &dyn DiskImage, writes: &[DiskWrite]) -> Result<(), Failure> {
        self.ranges.clear();
        self.data.clear();
        for w in writes {
            let start = self.data.len();
            self.data.resize(start + w.data.len(), 0);
            if let Err(err) = disk.read_at(&mut self.data[start..], w.offset) {
                self.data.truncate(start);
                return Err(self.roll_back(disk, err));
            }
            // Saved before writing: a write that fails halfway is undone too.
            self.ranges.push((w.offset, start, w.data.len()));
            if let Err(err) = disk.write_at(&w.data, w.offset) {
                return Err(self.roll_back(disk, err));
            }
        }
        Ok(())
    }

    /// Put back every saved range, newest first (writes may overlap).
    fn roll_back(&self, disk: &dyn DiskImage, err: io::Error) -> Failure {
        for &(offset, start, len) in self.ranges.iter().rev() {
            if let Err(undo) = restore(disk, offset, &self.data[start..start + len]) {
                return Failure::NotUndone { err, undo };
            }
        }
        Failure::Undone(err)
    }
}

/// Write `old` back at `offset`: zero pieces as holes, the others as data.
fn restore(disk: &dyn DiskImage, offset: u64, old: &[u8]) -> io::Result<()> {
    let mut at = 0usize;
    while at < old.len() {
        let pos = offset + at as u64;
        let len = ((PIECE - pos % PIECE) as usize).min(old.len() - at);
        let piece = &old[at..at + len];
        if ftvm_vmm::pages::is_zero(piece) {
            disk.zero(pos, len as u64)?;
        } else {
            disk.write_at(piece, pos)?;
        }
        at += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use ftvm_vmm::sync::Lock;

    use super::*;

    /// An in-memory image whose `fail_write`-th write (counting from 0)
    /// fails after writing half its bytes, and whose writes and zeroing
    /// fail after that if `undo_fails`.
    struct Flaky {
        bytes: Mutex<Vec<u8>>,
        writes: Mutex<usize>,
        fail_write: usize,
        undo_fails: bool,
    }

    impl Flaky {
        fn new(bytes: Vec<u8>, fail_write: usize, undo_fails: bool) -> Flaky {
            Flaky { bytes: Mutex::new(bytes), writes: Mutex::new(0), fail_write, undo_fails }
        }

        fn failed(&self) -> bool {
            *self.writes.locked() > self.fail_write
        }

        fn enospc() -> io::Error {
            io::Error::from_raw_os_error(libc::ENOSPC)
        }
    }

    impl DiskImage for Flaky {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            let bytes = self.bytes.locked();
            buf.copy_from_slice(&bytes[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }

        fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
            if self.failed() && self.undo_fails {
                return Err(Self::enospc());
            }
            let mut n = self.writes.locked();
            let half = *n == self.fail_write;
            *n += 1;
            let len = if half { data.len() / 2 } else { data.len() };
            self.bytes.locked()[offset as usize..offset as usize + len].copy_from_slice(&data[..len]);
            if half {
                return Err(Self::enospc());
            }
            Ok(())
        }

        fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
            if self.failed() && self.undo_fails {
                return Err(Self::enospc());
            }
            self.bytes.locked()[offset as usize..(offset + len) as usize].fill(0);
            Ok(())
        }
    }

    fn original() -> Vec<u8> {
        // Data, then zeros (a hole on a real file), then data.
        let mut v: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
        v.extend_from_slice(&[0; 8192]);
        v.extend((0..8192u32).map(|i| (i % 13) as u8 + 1));
        v
    }

    /// Overlapping writes across data and zeros, unaligned.
    fn writes() -> Vec<DiskWrite> {
        vec![
            DiskWrite { offset: 1000, data: vec![0xa1; 9000] },
            DiskWrite { offset: 512, data: vec![0xb2; 512] },
            DiskWrite { offset: 6000, data: vec![0xc3; 15000] },
            DiskWrite { offset: 0, data: vec![0xd4; 24576] },
        ]
    }

    #[test]
    fn a_failure_at_any_write_leaves_the_image_as_it_was() {
        for fail_write in 0..writes().len() {
            let disk = Flaky::new(original(), fail_write, false);
            let mut undo = UndoLog::default();
            match undo.write(&disk, &writes()) {
                Err(Failure::Undone(e)) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC)),
                other => panic!("write {fail_write} failing: {other:?}"),
            }
            assert!(*disk.bytes.locked() == original(), "write {fail_write} failing: the image changed");
        }
    }

    #[test]
    fn without_failures_every_write_lands_in_order() {
        let disk = Flaky::new(original(), usize::MAX, false);
        let mut undo = UndoLog::default();
        undo.write(&disk, &writes()).unwrap();
        let mut expected = original();
        for w in writes() {
            expected[w.offset as usize..w.offset as usize + w.data.len()].copy_from_slice(&w.data);
        }
        assert!(*disk.bytes.locked() == expected);
        // The log is reused: a second checkpoint that fails goes back to the first one's result.
        let disk = Flaky::new(expected.clone(), 1, false);
        assert!(matches!(undo.write(&disk, &writes()), Err(Failure::Undone(_))));
        assert!(*disk.bytes.locked() == expected);
    }

    #[test]
    fn a_failed_undo_is_reported_as_such() {
        let disk = Flaky::new(original(), 2, true);
        match UndoLog::default().write(&disk, &writes()) {
            Err(Failure::NotUndone { err, undo }) => {
                assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
                assert_eq!(undo.raw_os_error(), Some(libc::ENOSPC));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_real_file_is_put_back_with_its_holes() {
        let path = std::env::temp_dir().join(format!("ftvm-undo-{}", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(original().len() as u64).unwrap();
        file.write_all_at(&original()[..8192], 0).unwrap();
        file.write_all_at(&original()[16384..], 16384).unwrap();
        let mut undo = UndoLog::default();
        undo.write(&file, &writes()).unwrap();
        // Undo what landed, as a failure after the last write would.
        assert!(matches!(undo.roll_back(&file, Flaky::enospc()), Failure::Undone(_)));
        let mut back = vec![0u8; original().len()];
        file.read_exact_at(&mut back, 0).unwrap();
        assert!(back == original());
        let _ = std::fs::remove_file(&path);
    }
}
