//! The fake-dirty filter: a page left writable is reported dirty at every
//! freeze whether or not the guest wrote it, so before it is sent its
//! content is compared with what the backup already holds. By hash (one
//! per page), for the pages the encoder keeps no last-sent copy of: where
//! it keeps one, its diff is the comparison (`predict`'s `Step::page`).

use xxhash_rust::xxh3::xxh3_128;

use ftvm_vmm::PageBitmap;

/// What the backup holds of some pages, as content hashes.
///
/// 128-bit XXH3: a page is dropped from a checkpoint only when its hash
/// equals the hash of the copy the backup holds, and a collision between
/// two different pages has a probability of about 2^-128 per comparison.
pub struct FakeDirtyFilter {
    hashes: Vec<u128>,
    /// Pages whose entry in `hashes` is what the backup holds.
    known: PageBitmap,
}

impl FakeDirtyFilter {
    /// A filter for a VM of `pages` pages that knows nothing yet.
    pub fn new(pages: u64) -> FakeDirtyFilter {
        FakeDirtyFilter { hashes: vec![0; pages as usize], known: PageBitmap::new(pages) }
    }

    pub fn hash(data: &[u8]) -> u128 {
        xxh3_128(data)
    }

    /// Whether the backup holds exactly the content hashed to `hash` for `page`.
    pub fn holds(&self, page: u64, hash: u128) -> bool {
        self.known.is_set(page) && self.hashes.get(page as usize) == Some(&hash)
    }

    /// The backup will hold the content hashed to `hash` for `page` (it is being sent).
    pub fn remember(&mut self, page: u64, hash: u128) {
        if let Some(h) = self.hashes.get_mut(page as usize) {
            *h = hash;
            self.known.set(page);
        }
    }

    /// Stop following `page` (it is sent without being hashed from now on).
    pub fn forget(&mut self, page: u64) {
        self.known.unset(page);
    }

    /// Forget everything: the backup is a new one.
    pub fn reset(&mut self) {
        self.known.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_only_what_was_remembered_and_not_forgotten() {
        let mut f = FakeDirtyFilter::new(128);
        let (a, b) = (FakeDirtyFilter::hash(&[1u8; 4096]), FakeDirtyFilter::hash(&[2u8; 4096]));
        assert_ne!(a, b);
        assert!(!f.holds(7, a), "nothing known at first");
        f.remember(7, a);
        assert!(f.holds(7, a) && !f.holds(7, b) && !f.holds(8, a));
        f.remember(7, b);
        assert!(f.holds(7, b) && !f.holds(7, a), "the newest copy counts");
        f.forget(7);
        assert!(!f.holds(7, b));
        f.remember(9, a);
        f.reset();
        assert!(!f.holds(9, a), "a new backup holds nothing we know of");
        f.remember(500, a); // beyond RAM: ignored
        assert!(!f.holds(500, a));
    }
}
