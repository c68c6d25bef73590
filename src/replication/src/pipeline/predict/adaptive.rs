//! The adaptive predictor: leave a page writable when it is likely enough
//! to be written again in the next epoch to pay for being kept.
//!
//! Keeping a page that is not written costs a copy and a hash (about 1 µs
//! here); not keeping one that is written costs a tracked first write (about
//! 6 µs). So keeping pays from a rewrite probability of about 1/6. It is
//! estimated per region of 512 pages as the share of the pages written in
//! one epoch that were written again in the next (an exponentially weighted
//! mean), and a page written in each of the last two epochs known is kept
//! whatever its region says. Unlike Histase, a region where writes scatter
//! (random access over a large set) stops being predicted, so it costs no
//! copies of pages that are not written.

use ftvm_vmm::PageBitmap;

use super::Predictor;

const REGION: u64 = 512;
const WORDS_PER_REGION: usize = (REGION / 64) as usize;
/// Weight of the history in the rewrite rate.
const ALPHA: f32 = 0.7;
/// Keep a region's recent writes from this rewrite rate up.
const THRESHOLD: f32 = 1.0 / 6.0;
/// A region's rate before anything is known: worth trying.
const INITIAL_RATE: f32 = 0.5;

pub struct Adaptive {
    /// Estimated probability that a page written in one epoch is written in the next, per region.
    rate: Vec<f32>,
    /// Pages found written in the last two epochs the filter finished.
    recent: PageBitmap,
    older: PageBitmap,
}

impl Adaptive {
    pub fn new(pages: u64) -> Adaptive {
        Adaptive {
            rate: vec![INITIAL_RATE; pages.div_ceil(REGION) as usize],
            recent: PageBitmap::new(pages),
            older: PageBitmap::new(pages),
        }
    }
}

impl Predictor for Adaptive {
    fn choose(&mut self, _harvested: &PageBitmap, new_faults: &PageBitmap, keep: &mut PageBitmap) {
        let mut out = vec![0u64; keep.words().len()];
        for (r, rate) in self.rate.iter().enumerate() {
            let words = r * WORDS_PER_REGION..((r + 1) * WORDS_PER_REGION).min(out.len());
            for i in words {
                let (fresh, recent, older) = (new_faults.words()[i], self.recent.words()[i], self.older.words()[i]);
                out[i] = recent & older;
                if *rate >= THRESHOLD {
                    out[i] |= fresh | recent;
                }
            }
        }
        keep.or_words(&out);
    }

    fn observe(&mut self, written: &PageBitmap) {
        for (r, rate) in self.rate.iter_mut().enumerate() {
            let words = r * WORDS_PER_REGION..((r + 1) * WORDS_PER_REGION).min(written.words().len());
            let (mut before, mut again) = (0u32, 0u32);
            for i in words {
                let prev = self.recent.words()[i];
                before += prev.count_ones();
                again += (prev & written.words()[i]).count_ones();
            }
            if before > 0 {
                *rate = *rate * ALPHA + (again as f32 / before as f32) * (1.0 - ALPHA);
            }
        }
        std::mem::swap(&mut self.older, &mut self.recent);
        self.recent.copy_from(written);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(a: &mut Adaptive, faults: &PageBitmap) -> Vec<u64> {
        let mut keep = PageBitmap::new(1024);
        a.choose(&PageBitmap::new(1024), faults, &mut keep);
        keep.pages().collect()
    }

    #[test]
    fn rewritten_regions_are_kept_scattered_ones_are_not() {
        let mut a = Adaptive::new(1024);
        // Region 0: the same 8 pages every epoch. Region 1: new pages every epoch.
        for e in 0..10u64 {
            let mut w = PageBitmap::new(1024);
            w.set_range(0, 7);
            w.set(512 + e * 8);
            a.observe(&w);
        }
        assert!(a.rate[0] > 0.9 && a.rate[1] < THRESHOLD, "{:?}", a.rate);
        let mut faults = PageBitmap::new(1024);
        faults.set(100);
        faults.set(900);
        let k = kept(&mut a, &faults);
        assert!(k.contains(&0) && k.contains(&7) && k.contains(&100), "{k:?}");
        assert!(!k.contains(&900) && !k.contains(&(512 + 72)), "scattered writes are not kept: {k:?}");
    }

    #[test]
    fn a_page_written_twice_running_is_kept_anywhere() {
        let mut a = Adaptive::new(1024);
        a.rate[1] = 0.0;
        let mut w = PageBitmap::new(1024);
        w.set(700);
        a.observe(&w);
        a.observe(&w);
        assert_eq!(kept(&mut a, &PageBitmap::new(1024)), vec![700]);
    }
}
