//! The primary's copy of what the backup has: the last version of pages
//! it sent, so the next version can go as a diff against it (`encode`), or
//! a page marked dirty whose bytes did not change can be recognised.
//!
//! Bounded: at most `capacity` pages are kept; the bound comes from
//! `bounds::last_sent_pages`. When full, the page to forget is chosen by
//! CLOCK (second chance): each send of a page marks it; the hand sweeps
//! the slots, clearing marks, and takes the first unmarked one. Pages sent
//! epoch after epoch stay; pages sent once and not again go first. A page
//! not kept is simply sent whole, which is always correct.
//!
//! What it holds must be exactly what the backup holds: every page the
//! backup receives goes through `put` (or `forget`), and a new backup
//! starts with `clear`.

use ftvm_vmm::memory::{AlignedPage, PAGE};

/// Pages per allocation: memory is taken as slots are first used.
const CHUNK_PAGES: usize = 256;
const NONE: u32 = u32::MAX;

pub struct LastSent {
    /// Per guest page: its slot, or `NONE`.
    slot_of: Vec<u32>,
    /// Per slot in use: its guest page, or `u64::MAX` for a free slot.
    page_of: Vec<u64>,
    /// Per slot: sent since the hand last passed (CLOCK).
    marked: Vec<bool>,
    free: Vec<u32>,
    chunks: Vec<Box<[AlignedPage]>>,
    capacity: usize,
    hand: usize,
}

impl LastSent {
    /// A store for a guest of `ram_pages` pages that keeps at most
    /// `capacity` of them (at least one).
    pub fn new(ram_pages: u64, capacity: usize) -> LastSent {
        let capacity = capacity.clamp(1, ram_pages.min(u64::from(NONE - 1)) as usize);
        LastSent {
            slot_of: vec![NONE; ram_pages as usize],
            page_of: Vec::new(),
            marked: Vec::new(),
            free: Vec::new(),
            chunks: Vec::new(),
            capacity,
            hand: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The guest's size in pages.
    pub fn ram_pages(&self) -> u64 {
        self.slot_of.len() as u64
    }

    /// Pages kept now.
    pub fn len(&self) -> usize {
        self.page_of.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn data(&self, slot: u32) -> &[u8; PAGE] {
        &self.chunks[slot as usize / CHUNK_PAGES][slot as usize % CHUNK_PAGES].0
    }

    fn data_mut(&mut self, slot: u32) -> &mut [u8; PAGE] {
        &mut self.chunks[slot as usize / CHUNK_PAGES][slot as usize % CHUNK_PAGES].0
    }

    /// The version of `page` the backup has, if kept.
    pub fn get(&self, page: u64) -> Option<&[u8; PAGE]> {
        let slot = *self.slot_of.get(page as usize)?;
        (slot != NONE).then(|| self.data(slot))
    }

    /// The kept version of `page`, to be brought up to the version being
    /// sent now (which counts as a send for eviction).
    pub fn get_mut(&mut self, page: u64) -> Option<&mut [u8; PAGE]> {
        let slot = *self.slot_of.get(page as usize)?;
        if slot == NONE {
            return None;
        }
        self.marked[slot as usize] = true;
        Some(self.data_mut(slot))
    }

    /// The slot for `page`'s new version, which the caller fills with what
    /// it sends now; another page is forgotten if the store is full.
    pub fn put(&mut self, page: u64) -> &mut [u8; PAGE] {
        let slot = match self.slot_of[page as usize] {
            NONE => self.take_slot(page),
            slot => slot,
        };
        self.marked[slot as usize] = true;
        self.data_mut(slot)
    }

    /// The backup's version of `page` is no longer known here.
    pub fn forget(&mut self, page: u64) {
        let Some(&slot) = self.slot_of.get(page as usize) else { return };
        if slot != NONE {
            self.slot_of[page as usize] = NONE;
            self.page_of[slot as usize] = u64::MAX;
            self.free.push(slot);
        }
    }

    /// A new backup: it has none of these versions. Memory is kept for reuse.
    pub fn clear(&mut self) {
        for &p in self.page_of.iter().filter(|&&p| p != u64::MAX) {
            self.slot_of[p as usize] = NONE;
        }
        self.page_of.clear();
        self.marked.clear();
        self.free.clear();
        self.hand = 0;
    }

    fn take_slot(&mut self, page: u64) -> u32 {
        let slot = if let Some(slot) = self.free.pop() {
            slot
        } else if self.page_of.len() < self.capacity {
            let slot = self.page_of.len();
            if slot / CHUNK_PAGES == self.chunks.len() {
                // Page-aligned as the guest's pages (copies between them
                // stay in whole cache lines), zeroed on first touch.
                self.chunks.push(AlignedPage::zeroed(CHUNK_PAGES));
            }
            self.page_of.push(u64::MAX);
            self.marked.push(false);
            slot as u32
        } else {
            let slot = self.evict();
            self.slot_of[self.page_of[slot as usize] as usize] = NONE;
            slot
        };
        self.page_of[slot as usize] = page;
        self.slot_of[page as usize] = slot;
        slot
    }

    /// CLOCK: the first slot in use whose mark is clear, clearing marks on
    /// the way. Ends within two sweeps (the first clears every mark).
    fn evict(&mut self) -> u32 {
        loop {
            let slot = self.hand;
            self.hand = (self.hand + 1) % self.page_of.len();
            if self.page_of[slot] == u64::MAX {
                continue;
            }
            if !std::mem::take(&mut self.marked[slot]) {
                return slot as u32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(fill: u8) -> [u8; PAGE] {
        [fill; PAGE]
    }

    #[test]
    fn keeps_what_was_put_and_forgets_on_request() {
        let mut s = LastSent::new(100, 10);
        assert!(s.get(3).is_none() && s.is_empty());
        *s.put(3) = page(3);
        *s.put(99) = page(9);
        assert_eq!(s.get(3), Some(&page(3)));
        assert_eq!(s.get(99), Some(&page(9)));
        s.get_mut(3).unwrap()[0] = 7;
        assert_eq!(s.get(3).unwrap()[0], 7);
        s.forget(3);
        assert!(s.get(3).is_none());
        assert_eq!(s.len(), 1);
        // The freed slot is reused.
        *s.put(4) = page(4);
        assert_eq!((s.len(), s.page_of.len()), (2, 2));
        assert!(s.get(1000).is_none(), "a page beyond RAM is simply not kept");
        s.clear();
        assert!(s.is_empty() && s.get(4).is_none() && s.get(99).is_none());
    }

    #[test]
    fn never_holds_more_than_its_capacity_and_evicts_by_second_chance() {
        let mut s = LastSent::new(1000, 4);
        for p in 0..4 {
            *s.put(p) = page(p as u8);
        }
        // Full: every page is marked, so the first sweep clears them all
        // and takes slot 0 (page 0).
        *s.put(10) = page(10);
        assert!(s.get(0).is_none());
        // Page 1 is sent again (marked); the hand is at slot 1 (page 1):
        // it survives, page 2 goes.
        s.get_mut(1).unwrap();
        *s.put(11) = page(11);
        assert!(s.get(1).is_some() && s.get(2).is_none());
        assert_eq!(s.len(), 4);
        for p in 100..1000 {
            *s.put(p) = page(p as u8);
            assert!(s.len() <= 4);
        }
        // Whatever is kept is exactly what was put for it.
        let kept: Vec<u64> = (0..1000).filter(|&p| s.get(p).is_some()).collect();
        assert_eq!(kept.len(), 4);
        for p in kept {
            assert_eq!(s.get(p), Some(&page(p as u8)));
        }
    }

    #[test]
    fn the_capacity_is_at_least_one_and_at_most_ram() {
        assert_eq!(LastSent::new(8, 0).capacity(), 1);
        assert_eq!(LastSent::new(8, 100).capacity(), 8);
    }
}
