//! Free data blocks: a map of free runs, start to length, rebuilt from the
//! committed metadata at mount.
//!
//! Blocks a change frees are *pending* until the next commit is durable:
//! the last durable commit may still name them, and reusing them earlier
//! would let a crash bring back a file whose blocks hold another's data.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use crate::format::Extent;

#[derive(Default)]
pub struct Space {
    /// Free runs, start to length, never adjacent.
    free: BTreeMap<u64, u64>,
    free_blocks: u64,
    pending: Vec<Extent>,
}

impl Space {
    /// All of `start..end` free but `used` (checked not to overlap by the
    /// caller).
    pub fn new(start: u64, end: u64, used: &mut [Extent]) -> Space {
        used.sort_by_key(|e| e.start);
        let mut s = Space::default();
        let mut at = start;
        for e in used.iter() {
            if e.start > at {
                s.insert(at, e.start - at);
            }
            at = at.max(e.start + e.len);
        }
        if end > at {
            s.insert(at, end - at);
        }
        s
    }

    pub fn free_blocks(&self) -> u64 {
        self.free_blocks
    }

    fn insert(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.free_blocks += len;
        let (mut start, mut len) = (start, len);
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(nl) = self.free.remove(&(start + len)) {
            len += nl;
        }
        self.free.insert(start, len);
    }

    /// Take up to `want` blocks starting exactly at `at` (to grow a file's
    /// last extent in place); how many were taken.
    pub fn take_at(&mut self, at: u64, want: u64) -> u64 {
        let Some((&s, &l)) = self.free.range(..=at).next_back() else { return 0 };
        if s + l <= at {
            return 0;
        }
        let n = want.min(s + l - at);
        self.free.remove(&s);
        if at > s {
            self.free.insert(s, at - s);
        }
        if s + l > at + n {
            self.free.insert(at + n, s + l - at - n);
        }
        self.free_blocks -= n;
        n
    }

    /// One run of at least `min` and at most `want` blocks: the first run
    /// that holds `want`, else the largest; `None` when even `min` blocks
    /// are not free in one run.
    pub fn take(&mut self, min: u64, want: u64) -> Option<Extent> {
        let start = match self.free.iter().find(|(_, &l)| l >= want) {
            Some((&s, _)) => s,
            None => {
                let (&s, &l) = self.free.iter().max_by_key(|(_, &l)| l)?;
                if l < min {
                    return None;
                }
                s
            }
        };
        let len = self.take_at(start, want);
        Some(Extent { start, len })
    }

    /// Blocks no longer used, reusable after the next durable commit.
    pub fn release(&mut self, e: Extent) {
        if e.len > 0 {
            self.pending.push(e);
        }
    }

    pub fn pending_blocks(&self) -> u64 {
        self.pending.iter().map(|e| e.len).sum()
    }

    /// A commit is durable: what was pending is free.
    pub fn committed(&mut self) {
        for e in core::mem::take(&mut self.pending) {
            self.insert(e.start, e.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_split() {
        let mut s = Space::new(10, 100, &mut [Extent { start: 20, len: 10 }]);
        assert_eq!(s.free_blocks(), 80);
        assert_eq!(s.take(1, 5), Some(Extent { start: 10, len: 5 }));
        assert_eq!(s.take_at(15, 100), 5);
        assert_eq!(s.take_at(15, 1), 0);
        // First fit for 50: the run after the used extent.
        assert_eq!(s.take(1, 50), Some(Extent { start: 30, len: 50 }));
        assert_eq!(s.free_blocks(), 20);
        // Nothing holds 30: the largest run, if at least `min`.
        assert_eq!(s.take(21, 30), None);
        assert_eq!(s.take(1, 30), Some(Extent { start: 80, len: 20 }));
        s.release(Extent { start: 10, len: 10 });
        s.release(Extent { start: 30, len: 50 });
        assert_eq!(s.free_blocks(), 0);
        assert_eq!(s.pending_blocks(), 60);
        s.committed();
        assert_eq!(s.free_blocks(), 60);
        s.release(Extent { start: 20, len: 10 });
        s.committed();
        // 10..80 is one run again.
        assert_eq!(s.take(70, 70), Some(Extent { start: 10, len: 70 }));
    }
}
