//! The program's memory: `brk` and anonymous `mmap` in one region of guest
//! RAM that the runtime sets aside at start.
//!
//! Memory is identity-mapped and readable, writable and executable
//! everywhere (2 MiB pages set up by the VMM), so a mapping is only a claim
//! on addresses: `mprotect` has nothing to change. The heap (`brk`) grows up
//! from the bottom of the region and mappings are placed top-down, as on
//! Linux. Every page that is not mapped is zero (pages are zeroed when they
//! are unmapped, never when mapped), so fresh mappings cost nothing and
//! untouched memory is never dirtied (which a checkpoint would copy).
//!
//! Process 1's region is the guest-physical memory itself, so its free
//! 2 MiB chunks are also what forked processes' frames are made of
//! (`aspace`): such a chunk is lent (neither free nor the program's) until
//! the frame is dropped and the chunk comes back zeroed. The program never
//! sees a lent chunk: `fork` does not share it, the calls that release or
//! zero memory leave it alone, and MAP_FIXED over it fails with ENOMEM.
//! Its claimed chunks, which `fork` shares copy-on-write, stay its own
//! memory at their own addresses (`aspace`: process 1 keeps them when it
//! writes one, its children move to a copy).

use alloc::collections::BTreeMap;

use crate::errno::{Errno, EINVAL, ENOMEM};

pub const PAGE: u64 = 4096;

pub fn page_up(v: u64) -> u64 {
    v.div_ceil(PAGE) * PAGE
}

#[derive(Clone)]
pub struct Memory {
    base: u64,
    end: u64,
    brk_start: u64,
    brk: u64,
    /// Free ranges, start -> end, disjoint and not adjacent.
    free: BTreeMap<u64, u64>,
    /// Chunks lent as other processes' frames, start -> end.
    lent: BTreeMap<u64, u64>,
}

impl Memory {
    /// Manage `[base, end)` (page-aligned), all of it zero and unused.
    pub fn new(base: u64, end: u64) -> Memory {
        let mut free = BTreeMap::new();
        free.insert(base, end);
        Memory { base, end, brk_start: base, brk: base, free, lent: BTreeMap::new() }
    }

    /// execve: everything the old program had is released (zeroed).
    pub fn reset(&mut self) {
        self.release(self.base, self.end);
        self.brk = self.brk_start;
    }

    pub fn size(&self) -> u64 {
        self.end - self.base
    }

    /// The region it manages, `[base, end)`.
    pub fn bounds(&self) -> (u64, u64) {
        (self.base, self.end)
    }

    /// The program's claimed ranges (neither free nor lent), in order.
    pub fn used(&self) -> alloc::vec::Vec<(u64, u64)> {
        self.claimed(self.base, self.end)
    }

    /// The program's claimed parts of `[start, end)`, in order.
    fn claimed(&self, start: u64, end: u64) -> alloc::vec::Vec<(u64, u64)> {
        let mut out = alloc::vec::Vec::new();
        let mut at = start;
        while at < end {
            let unclaimed = self.free_at(at).or_else(|| self.lent_at(at));
            if let Some((_, e)) = unclaimed {
                at = e.min(end);
                continue;
            }
            let next = |m: &BTreeMap<u64, u64>| m.range(at..).next().map_or(end, |(&s, _)| s.min(end));
            let upto = next(&self.free).min(next(&self.lent));
            out.push((at, upto));
            at = upto;
        }
        out
    }

    /// The lent chunk containing `addr`, if any.
    fn lent_at(&self, addr: u64) -> Option<(u64, u64)> {
        self.lent.range(..=addr).next_back().map(|(&s, &e)| (s, e)).filter(|&(_, e)| addr < e)
    }

    fn overlaps_lent(&self, start: u64, end: u64) -> bool {
        self.lent.range(..end).next_back().is_some_and(|(_, &e)| e > start)
    }

    /// A free, zero, `size`-aligned block of `size` bytes lent out of the
    /// program's reach, or None. Taken top-down like mappings and above
    /// the heap, which keeps room to grow.
    pub fn lend(&mut self, size: u64) -> Option<u64> {
        let brk_top = page_up(self.brk);
        let start = self.free.iter().rev().find_map(|(&s, &e)| {
            let start = e.checked_sub(size)? & !(size - 1);
            (start >= s.max(brk_top)).then_some(start)
        })?;
        self.take(start, start + size);
        self.lent.insert(start, start + size);
        Some(start)
    }

    /// A lent block comes back, zeroed by the borrower: free again.
    pub fn give_back(&mut self, start: u64) {
        if let Some(end) = self.lent.remove(&start) {
            self.merge_free(start, end);
        }
    }

    /// The allocator a forked child starts with: this one's claims, and
    /// what this one lent free (the child's addresses there are its own).
    pub fn for_child(&self) -> Memory {
        let mut child = self.clone();
        for (s, e) in core::mem::take(&mut child.lent) {
            child.merge_free(s, e);
        }
        child
    }

    /// The free range containing `addr`, if any.
    fn free_at(&self, addr: u64) -> Option<(u64, u64)> {
        self.free.range(..=addr).next_back().map(|(&s, &e)| (s, e)).filter(|&(_, e)| addr < e)
    }

    fn is_free(&self, start: u64, end: u64) -> bool {
        start == end || self.free_at(start).is_some_and(|(_, e)| end <= e)
    }

    /// Claim `[start, end)`, which must be free.
    fn take(&mut self, start: u64, end: u64) {
        let (s, e) = self.free_at(start).expect("take: range is free");
        debug_assert!(end <= e);
        self.free.remove(&s);
        if s < start {
            self.free.insert(s, start);
        }
        if end < e {
            self.free.insert(end, e);
        }
    }

    /// Give back `[start, end)`, claimed a moment ago and never touched
    /// (still zero), without writing to it: in a forked process part of it
    /// may have no memory behind it (`aspace`).
    pub fn unclaim(&mut self, start: u64, len: u64) {
        self.merge_free(start, start + page_up(len));
    }

    /// Release `[start, end)`: zero the parts the program claimed and make
    /// them free (lent chunks stay lent).
    fn release(&mut self, start: u64, end: u64) {
        for (a, b) in self.claimed(start, end) {
            // SAFETY: [a, b) is inside the program region, mapped by the
            // VMM and claimed by the program, which gave it up.
            unsafe { core::ptr::write_bytes(a as *mut u8, 0, (b - a) as usize) };
            self.merge_free(a, b);
        }
    }

    /// Merge [start, end) with every free range it touches.
    fn merge_free(&mut self, start: u64, end: u64) {
        let (mut s, mut e) = (start, end);
        let touching: alloc::vec::Vec<(u64, u64)> =
            self.free.range(..=end).rev().take_while(|&(_, &fe)| fe >= start).map(|(&a, &b)| (a, b)).collect();
        for (a, b) in touching {
            self.free.remove(&a);
            s = s.min(a);
            e = e.max(b);
        }
        self.free.insert(s, e);
    }

    fn in_region(&self, start: u64, len: u64) -> bool {
        start >= self.base && start.checked_add(len).is_some_and(|e| e <= self.end)
    }

    pub fn brk(&mut self, new: u64) -> u64 {
        if new < self.brk_start {
            return self.brk;
        }
        let (old_top, new_top) = (page_up(self.brk), page_up(new));
        if new_top > old_top {
            if new_top > self.end || !self.is_free(old_top, new_top) {
                return self.brk;
            }
            self.take(old_top, new_top);
        } else if new_top < old_top {
            self.release(new_top, old_top);
        }
        self.brk = new;
        new
    }

    /// An anonymous mapping of `len` bytes; at `addr` exactly if `fixed`
    /// (replacing what is there), else wherever it fits.
    pub fn map(&mut self, addr: u64, len: u64, fixed: bool) -> Result<u64, Errno> {
        if len == 0 {
            return Err(EINVAL);
        }
        let len = page_up(len);
        if fixed {
            if !addr.is_multiple_of(PAGE) || !self.in_region(addr, len) || self.overlaps_lent(addr, addr + len) {
                return Err(if !addr.is_multiple_of(PAGE) { EINVAL } else { ENOMEM });
            }
            // MAP_FIXED discards what was there: zero it and claim it again.
            self.release(addr, addr + len);
            self.take(addr, addr + len);
            return Ok(addr);
        }
        // Top-down, leaving the heap room to grow.
        let brk_top = page_up(self.brk);
        let (_, &e) = self.free.iter().rev().find(|&(&s, &e)| e - s >= len && s >= brk_top).ok_or(ENOMEM)?;
        let start = e - len;
        self.take(start, e);
        Ok(start)
    }

    pub fn unmap(&mut self, addr: u64, len: u64) -> Result<(), Errno> {
        if !addr.is_multiple_of(PAGE) || len == 0 {
            return Err(EINVAL);
        }
        let len = page_up(len);
        if !self.in_region(addr, len) {
            // Not ours (the program image, say): nothing to release.
            return Ok(());
        }
        self.release(addr, addr + len);
        Ok(())
    }

    /// `madvise(MADV_DONTNEED)`: the range reads as zero afterwards.
    pub fn discard(&mut self, addr: u64, len: u64) -> Result<(), Errno> {
        if !addr.is_multiple_of(PAGE) {
            return Err(EINVAL);
        }
        let len = page_up(len);
        if self.in_region(addr, len) {
            self.release(addr, addr + len);
            // Still mapped: claim the now-zero pages again (not lent ones).
            let mut at = addr;
            while at < addr + len {
                match self.free_at(at) {
                    Some((_, e)) => {
                        let e = e.min(addr + len);
                        self.take(at, e);
                        at = e;
                    }
                    None => at = self.lent_at(at).map_or(addr + len, |(_, e)| e),
                }
            }
        }
        Ok(())
    }

    /// `mremap`: grow or shrink in place when possible, else move if allowed.
    pub fn remap(&mut self, old: u64, old_len: u64, new_len: u64, may_move: bool) -> Result<u64, Errno> {
        if !old.is_multiple_of(PAGE) || new_len == 0 {
            return Err(EINVAL);
        }
        let (old_len, new_len) = (page_up(old_len), page_up(new_len));
        if !self.in_region(old, old_len) {
            return Err(EINVAL);
        }
        if new_len <= old_len {
            self.release(old + new_len, old + old_len);
            return Ok(old);
        }
        let (tail, end) = (old + old_len, old + new_len);
        if end <= self.end && self.is_free(tail, end) {
            self.take(tail, end);
            return Ok(old);
        }
        if !may_move {
            return Err(ENOMEM);
        }
        let new = self.map(0, new_len, false)?;
        // SAFETY: both ranges are claimed by the program and do not overlap
        // (the new one was free).
        unsafe { core::ptr::copy_nonoverlapping(old as *const u8, new as *mut u8, old_len as usize) };
        self.release(old, old + old_len);
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    const CHUNK: u64 = 2 << 20;

    /// A region of `chunks` 2 MiB chunks of real (zero) memory, aligned.
    fn region(chunks: u64) -> (Vec<u8>, Memory) {
        let buf = std::vec![0u8; ((chunks + 1) * CHUNK) as usize];
        let base = (buf.as_ptr() as u64).div_ceil(CHUNK) * CHUNK;
        (buf, Memory::new(base, base + chunks * CHUNK))
    }

    #[test]
    fn a_lent_chunk_is_neither_free_nor_the_programs() {
        let (_buf, mut m) = region(8);
        let (base, end) = m.bounds();
        let mapped = m.map(0, 3 * CHUNK, false).unwrap();
        assert_eq!(mapped, end - 3 * CHUNK);
        // Top-down below the mapping, aligned.
        let lent = m.lend(CHUNK).unwrap();
        assert_eq!(lent, mapped - CHUNK);
        // Not the program's: fork copies only the mapping.
        assert_eq!(m.used(), std::vec![(mapped, end)]);
        // Not free: a mapping goes below it, MAP_FIXED over it is refused.
        assert_eq!(m.map(0, CHUNK, false).unwrap(), lent - CHUNK);
        assert_eq!(m.map(lent + PAGE, PAGE, true), Err(ENOMEM));
        // A child sees its addresses free.
        let child = m.for_child();
        assert_eq!(child.used(), std::vec![(lent - CHUNK, lent), (mapped, end)]);
        assert!(child.is_free(lent, lent + CHUNK));
        // munmap and madvise over it leave it alone (it is not zeroed).
        // SAFETY: inside the test's buffer.
        unsafe { (lent as *mut u8).write(7) };
        m.unmap(lent - CHUNK, 2 * CHUNK).unwrap();
        m.discard(lent, CHUNK).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { (lent as *const u8).read() }, 7);
        assert_eq!(m.used(), std::vec![(mapped, end)]);
        // Back (zeroed by the borrower): free, merged with its neighbours.
        // SAFETY: as above.
        unsafe { (lent as *mut u8).write(0) };
        m.give_back(lent);
        assert!(m.is_free(base, mapped));
        assert_eq!(m.lent.len(), 0);
    }

    #[test]
    fn lending_keeps_above_the_heap_and_stops_when_full() {
        let (_buf, mut m) = region(4);
        let (base, _) = m.bounds();
        assert_eq!(m.brk(base + CHUNK + 1), base + CHUNK + 1);
        let a = m.lend(CHUNK).unwrap();
        let b = m.lend(CHUNK).unwrap();
        assert_eq!((a - base, b - base), (3 * CHUNK, 2 * CHUNK));
        // The heap's last chunk is partly claimed: nothing left to lend.
        assert_eq!(m.lend(CHUNK), None);
        // The heap cannot grow into a lent chunk.
        assert_eq!(m.brk(base + 3 * CHUNK), base + CHUNK + 1);
        m.give_back(b);
        assert_eq!(m.brk(base + 3 * CHUNK), base + 3 * CHUNK);
    }
}
