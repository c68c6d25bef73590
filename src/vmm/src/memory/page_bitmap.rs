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

    pub fn is_set(&self, page: u64) -> bool {
        self.words.get((page / 64) as usize).is_some_and(|w| w & (1 << (page % 64)) != 0)
    }

    /// Add every page set in `other` (KVM's and vm-memory's bitmap layout).
    pub fn or_words(&mut self, other: &[u64]) {
        for (w, o) in self.words.iter_mut().zip(other) {
            *w |= o;
        }
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
        a.clear();
        assert!(a.is_empty());
    }
}
