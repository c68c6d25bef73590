//! The bytes of a file in memory.
//!
//! A small file is a vector on the runtime's heap. A file that grows past
//! [`SMALL`] moves into 2 MiB frames, which come from the free part of the
//! program region like a forked process's memory (`aspace`): the runtime's
//! own share stays small and fixed, and a program writing hundreds of MiB
//! of files (an append-only log and its rewrite) is bounded by the VM's
//! memory rather than by that share. Growing never copies what is there
//! (no reallocation), and a file takes what it holds rounded up to 2 MiB.

use alloc::vec::Vec;

use crate::aspace::{Frame, CHUNK};
use crate::errno::{Errno, ENOSPC};

/// Bytes a file keeps on the heap before it moves into frames.
const SMALL: usize = 1 << 20;
const CHUNK_BYTES: usize = CHUNK as usize;

#[derive(Default)]
pub struct FileData {
    len: usize,
    /// The bytes while `chunks` is empty.
    small: Vec<u8>,
    /// The bytes, 2 MiB a frame; past `len` they are zero.
    chunks: Vec<Frame>,
}

impl FileData {
    pub fn from_slice(bytes: &[u8]) -> Result<FileData, Errno> {
        let mut d = FileData::default();
        d.write(0, bytes)?;
        Ok(d)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Copy out what lies at `offset`; the bytes copied.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> usize {
        let start = offset.min(self.len);
        let n = out.len().min(self.len - start);
        if self.chunks.is_empty() {
            out[..n].copy_from_slice(&self.small[start..start + n]);
        } else {
            self.each(start, n, |frame, at, range| {
                // SAFETY: `at..at + range.len()` lies inside the frame.
                let src = unsafe { core::slice::from_raw_parts(frame.ptr().add(at), range.len()) };
                out[range].copy_from_slice(src);
            });
        }
        n
    }

    /// Write `bytes` at `offset`, growing the file (zeros in any gap);
    /// ENOSPC, and nothing written, if memory runs out.
    pub fn write(&mut self, offset: usize, bytes: &[u8]) -> Result<(), Errno> {
        let end = offset.checked_add(bytes.len()).ok_or(ENOSPC)?;
        if self.chunks.is_empty() && end <= SMALL {
            if self.small.len() < end {
                self.small.try_reserve(end - self.small.len()).map_err(|_| ENOSPC)?;
                self.small.resize(end, 0);
            }
            self.small[offset..end].copy_from_slice(bytes);
            self.len = self.len.max(end);
            return Ok(());
        }
        self.grow_to(end)?;
        self.each(offset, bytes.len(), |frame, at, range| {
            // SAFETY: `at..at + range.len()` lies inside the frame.
            let dst = unsafe { core::slice::from_raw_parts_mut(frame.ptr().add(at), range.len()) };
            dst.copy_from_slice(&bytes[range]);
        });
        self.len = self.len.max(end);
        Ok(())
    }

    /// Cut or extend (with zeros) to `len` bytes.
    pub fn truncate(&mut self, len: usize) -> Result<(), Errno> {
        if len > self.len {
            // Past the end everything is zero already: only claim room.
            if self.chunks.is_empty() && len <= SMALL {
                self.small.try_reserve(len - self.small.len()).map_err(|_| ENOSPC)?;
                self.small.resize(len, 0);
            } else {
                self.grow_to(len)?;
            }
        } else if self.chunks.is_empty() {
            self.small.truncate(len);
        } else {
            // What is cut reads as zero if the file grows again: zeroed in
            // the frame kept (the others are zeroed as they go back).
            let kept_end = self.len.min(len.div_ceil(CHUNK_BYTES) * CHUNK_BYTES);
            self.each(len, kept_end.saturating_sub(len), |frame, at, range| {
                // SAFETY: `at..at + range.len()` lies inside the frame.
                unsafe { core::ptr::write_bytes(frame.ptr().add(at), 0, range.len()) };
            });
            self.chunks.truncate(len.div_ceil(CHUNK_BYTES));
        }
        self.len = len;
        Ok(())
    }

    /// Frames enough for `end` bytes, moving a small file into them; all
    /// or, with ENOSPC, none.
    fn grow_to(&mut self, end: usize) -> Result<(), Errno> {
        let need = end.div_ceil(CHUNK_BYTES);
        let mut new = Vec::new();
        new.try_reserve(need.saturating_sub(self.chunks.len())).map_err(|_| ENOSPC)?;
        for _ in self.chunks.len()..need {
            new.push(Frame::chunk().map_err(|_| ENOSPC)?);
        }
        self.chunks.try_reserve(new.len()).map_err(|_| ENOSPC)?;
        let was_small = self.chunks.is_empty();
        self.chunks.extend(new);
        if was_small && !self.small.is_empty() {
            let small = core::mem::take(&mut self.small);
            self.each(0, small.len(), |frame, at, range| {
                // SAFETY: `at..at + range.len()` lies inside the frame.
                let dst = unsafe { core::slice::from_raw_parts_mut(frame.ptr().add(at), range.len()) };
                dst.copy_from_slice(&small[range]);
            });
        }
        Ok(())
    }

    /// `f(frame, offset in it, range of the caller's bytes)` for each
    /// frame piece of `[offset, offset + n)`, which the frames cover.
    fn each(&self, offset: usize, n: usize, mut f: impl FnMut(&Frame, usize, core::ops::Range<usize>)) {
        let mut done = 0;
        while done < n {
            let pos = offset + done;
            let at = pos % CHUNK_BYTES;
            let take = (CHUNK_BYTES - at).min(n - done);
            f(&self.chunks[pos / CHUNK_BYTES], at, done..done + take);
            done += take;
        }
    }
}
