//! A set of guest pages: what was dirtied in an epoch, what a snapshot holds,
//! what to leave write-enabled.

/// One bit per page of guest RAM, 64 pages per word, page 0 in bit 0 of word 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageBitmap {
    words: Vec<u64>,
}

impl PageBitmap {
    pub fn new(pages: u64) -> PageBitmap {
        PageBitmap { words: vec![0; pages.div_ceil(64) as usize] }
    }

    /// Pages that fit (a multiple of 64).
    pub fn capacity(&self) -> u64 {
        self.words.len() as u64 * 64
    }

    /// Add `page`; pages beyond the bitmap are ignored.
    pub fn set(&mut self, page: u64) {
        if let Some(w) = self.words.get_mut((page / 64) as usize) {
            *w |= 1 << (page % 64);
        }
    }

    /// Add pages `first..=last` (clipped to the bitmap).
    pub fn set_range(&mut self, first: u64, last: u64) {
        let last = last.min(self.capacity().saturating_sub(1));
        let mut p = first;
        while p <= last {
            let (word, bit) = ((p / 64) as usize, p % 64);
            let n = (64 - bit).min(last - p + 1);
            let mask = if n == 64 { u64::MAX } else { ((1u64 << n) - 1) << bit };
            self.words[word] |= mask;
            p += n;
        }
    }

    /// Remove `page`; pages beyond the bitmap are ignored.
    pub fn unset(&mut self, page: u64) {
        if let Some(w) = self.words.get_mut((page / 64) as usize) {
            *w &= !(1 << (page % 64));
        }
    }

    pub fn is_set(&self, page: u64) -> bool {
        self.words.get((page / 64) as usize).is_some_and(|w| w & (1 << (page % 64)) != 0)
    }

    /// Add every page set in `other` (KVM's and vm-memory's bitmap layout).
    pub fn or_words(&mut self, other: &[u64]) {
        for (w, o) in self.words.iter_mut().zip(other) {
            *w |= o;
        }
    }

    /// OR `bits` into word `index` (pages `64 * index ..`); beyond the
    /// bitmap, nothing.
    pub fn or_word(&mut self, index: usize, bits: u64) {
        if let Some(w) = self.words.get_mut(index) {
            *w |= bits;
        }
    }

    /// Keep only the pages also set in `other`.
    pub fn intersect(&mut self, other: &PageBitmap) {
        for (i, w) in self.words.iter_mut().enumerate() {
            *w &= other.words.get(i).copied().unwrap_or(0);
        }
    }

    /// Make this set equal to `other` (same capacity), without allocating.
    pub fn copy_from(&mut self, other: &PageBitmap) {
        self.words.clone_from(&other.words);
    }

    /// Remove every page set in `other`.
    pub fn subtract(&mut self, other: &PageBitmap) {
        for (w, o) in self.words.iter_mut().zip(&other.words) {
            *w &= !o;
        }
    }

    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// How many pages are set both here and in `other`.
    pub fn count_common(&self, other: &PageBitmap) -> u64 {
        self.words.iter().zip(&other.words).map(|(a, b)| (a & b).count_ones() as u64).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Indices of set pages, ascending.
    pub fn pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut bits = w;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                Some(i as u64 * 64 + b)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iterates_set_pages_in_order() {
        let mut b = PageBitmap::new(200);
        for p in [0, 63, 64, 199] {
            b.set(p);
        }
        b.set(500); // beyond the bitmap: ignored
        assert_eq!(b.pages().collect::<Vec<_>>(), vec![0, 63, 64, 199]);
        assert_eq!(b.count(), 4);
        assert!(b.is_set(63) && !b.is_set(62));
    }

    #[test]
    fn set_operations() {
        let mut a = PageBitmap::new(128);
        a.or_words(&[0b1011, 1]);
        let mut b = PageBitmap::new(128);
        b.set(1);
        b.set(64);
        a.subtract(&b);
        assert_eq!(a.pages().collect::<Vec<_>>(), vec![0, 3]);
        let mut c = PageBitmap::new(128);
        c.copy_from(&a);
        c.unset(0);
        c.set(100);
        assert_eq!(a.count_common(&c), 1);
        a.intersect(&c);
        assert_eq!(a.pages().collect::<Vec<_>>(), vec![3]);
        let mut r = PageBitmap::new(200);
        r.set_range(60, 130);
        r.set_range(190, 500);
        assert_eq!(r.count(), 71 + 66, "60..=130, and 190 to the end of the last word");
        assert!(r.is_set(60) && r.is_set(130) && !r.is_set(131) && !r.is_set(59) && r.is_set(255));
        a.clear();
        assert!(a.is_empty());
    }
}
