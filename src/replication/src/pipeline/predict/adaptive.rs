//! The adaptive predictor: leave a page writable while it is likely enough
//! to be written again soon to pay for being kept.
//!
//! Keeping a page that is not written costs a copy and a hash per epoch
//! (about 1 µs here); not keeping one that is written costs a tracked first
//! write (about 6 µs). So keeping pays while at least about one kept page in
//! six is written in the epoch: the threshold follows from the costs
//! measured at start (`Costs::keep_threshold`). Candidates are the pages written in the
//! last `WINDOW` epochs (so a sweep that comes back every few epochs is
//! caught, which Histase, which looks one epoch back, misses: and once kept
//! the guest sweeps faster, so it comes back sooner). They are kept per
//! region of 512 pages while the region's measured precision (kept pages
//! written / kept pages, exponentially weighted) stays above that break-even
//! point; a region whose writes scatter stops being kept. A region not kept
//! goes on being judged: every write there is a tracked first write, so what
//! keeping its candidates would have hit is known exactly, and it is kept
//! once that would pay. So nothing is kept on trust (a guest filling its
//! memory once would have every page it wrote copied at every pause until
//! the misses showed), a guest that changes its ways is followed, and one
//! whose writes go on scattering is not tried again and again.

use std::collections::VecDeque;

use ftvm_vmm::PageBitmap;

use super::{Predictor, Regions};
use crate::pipeline::costs::Costs;

const REGION: u64 = 512;
const WORDS_PER_REGION: usize = (REGION / 64) as usize;
/// Epochs a written page stays a candidate.
const WINDOW: usize = 8;
/// Weight of the history in the precision.
const ALPHA: f32 = 0.7;
/// A region's precision before anything is known: not kept until what
/// keeping it would have hit shows it pays.
const INITIAL: f32 = 0.0;

pub struct Adaptive {
    /// Keep a region's candidates from this precision up (the break-even point).
    threshold: f32,
    /// Estimated share of a region's kept pages written per epoch.
    precision: Vec<f32>,
    /// The pages found written in each of the last `WINDOW` epochs, newest first.
    history: VecDeque<PageBitmap>,
    /// The union of `history`, made once per epoch in `observe` (after the
    /// resume), not in the pause.
    recent: PageBitmap,
    /// Scratch for `choose`: `recent` and the newest faults.
    candidates: PageBitmap,
    /// Each region's verdict after the last lesson.
    kept: Vec<bool>,
    regions: Regions,
}

impl Adaptive {
    pub fn new(pages: u64, threshold: f32) -> Adaptive {
        Adaptive {
            threshold,
            precision: vec![INITIAL; pages.div_ceil(REGION) as usize],
            history: VecDeque::with_capacity(WINDOW),
            recent: PageBitmap::new(pages),
            candidates: PageBitmap::new(pages),
            kept: vec![false; pages.div_ceil(REGION) as usize],
            regions: Regions::default(),
        }
    }
}

fn region_words(r: usize, len: usize) -> std::ops::Range<usize> {
    r * WORDS_PER_REGION..((r + 1) * WORDS_PER_REGION).min(len)
}

impl Predictor for Adaptive {
    fn choose(&mut self, _harvested: &PageBitmap, new_faults: &PageBitmap, keep: &mut PageBitmap) {
        self.candidates.copy_from(new_faults);
        self.candidates.or_words(self.recent.words());
        let mut out = vec![0u64; keep.words().len()];
        for (r, precision) in self.precision.iter().enumerate() {
            if *precision >= self.threshold {
                let words = region_words(r, out.len());
                out[words.clone()].copy_from_slice(&self.candidates.words()[words]);
            }
        }
        keep.or_words(&out);
    }

    fn observe(&mut self, left: &PageBitmap, written: &PageBitmap) {
        // What a region not kept would have kept: the pages written in the
        // epochs before this one.
        let would = self.recent.words();
        for (r, precision) in self.precision.iter_mut().enumerate() {
            let (mut kept, mut hit, mut cand, mut cand_hit) = (0u32, 0u32, 0u32, 0u32);
            for i in region_words(r, written.words().len()) {
                kept += left.words()[i].count_ones();
                hit += (left.words()[i] & written.words()[i]).count_ones();
                cand += would[i].count_ones();
                cand_hit += (would[i] & written.words()[i]).count_ones();
            }
            let (tried, hits) = if kept > 0 { (kept, hit) } else { (cand, cand_hit) };
            // A region without candidates keeps its verdict until it is written again.
            if tried > 0 {
                *precision = *precision * ALPHA + (hits as f32 / tried as f32) * (1.0 - ALPHA);
            }
        }
        self.regions = Regions::default();
        for (kept, precision) in self.kept.iter_mut().zip(&self.precision) {
            let now = *precision >= self.threshold;
            self.regions.kept += u32::from(now);
            self.regions.flipped += u32::from(now != *kept);
            *kept = now;
        }
        let mut newest =
            if self.history.len() == WINDOW { self.history.pop_back().expect("full") } else { PageBitmap::new(written.capacity()) };
        newest.copy_from(written);
        self.history.push_front(newest);
        self.recent.clear();
        for h in &self.history {
            self.recent.or_words(h.words());
        }
    }

    fn weigh(&mut self, costs: &Costs) {
        self.threshold = costs.keep_threshold();
    }

    fn kept_pages(&self, out: &mut PageBitmap) {
        let end = out.capacity();
        for (r, kept) in self.kept.iter().enumerate() {
            let first = r as u64 * REGION;
            if *kept && first < end {
                out.set_range(first, (first + REGION).min(end) - 1);
            }
        }
    }

    fn regions(&self) -> Option<Regions> {
        Some(self.regions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The break-even point with the costs assumed where none were measured.
    const THRESHOLD: f32 = 1.0 / 6.0;

    fn kept(a: &mut Adaptive, faults: &PageBitmap) -> PageBitmap {
        let mut keep = PageBitmap::new(1024);
        a.choose(&PageBitmap::new(1024), faults, &mut keep);
        keep
    }

    fn pages(range: std::ops::RangeInclusive<u64>) -> PageBitmap {
        let mut b = PageBitmap::new(1024);
        b.set_range(*range.start(), *range.end());
        b
    }

    #[test]
    fn a_sweep_that_comes_back_every_few_epochs_is_kept() {
        let mut a = Adaptive::new(1024, THRESHOLD);
        // Region 0 swept a quarter at a time: each page every 4th epoch.
        for e in 0..20u64 {
            let written = pages(e % 4 * 128..=e % 4 * 128 + 127);
            let left = kept(&mut a, &written);
            a.observe(&left, &written);
        }
        assert!(a.precision[0] > THRESHOLD, "{}", a.precision[0]);
        assert_eq!(kept(&mut a, &PageBitmap::new(1024)).count(), 512, "the whole region stays writable");
    }

    /// Region 1 written 4 new pages an epoch, never the same twice in 128
    /// epochs, for `epochs` epochs; asserts nothing was kept.
    fn scatter(a: &mut Adaptive, epochs: u64) {
        for e in 0..epochs {
            let written = pages(512 + e * 4 % 512..=512 + e * 4 % 512 + 3);
            let left = kept(a, &written);
            assert!(left.is_empty(), "epoch {e}: scattered writes kept");
            a.observe(&left, &written);
        }
        assert!(a.precision[1] < THRESHOLD, "{}", a.precision[1]);
    }

    /// Writes that never come back (a guest filling its memory once, or
    /// writing at random into much more than an epoch covers) are never
    /// kept: not even at first, on trust.
    #[test]
    fn scattered_writes_are_not_kept() {
        scatter(&mut Adaptive::new(1024, THRESHOLD), 100);
    }

    /// A region not kept whose writes start coming back to the same pages
    /// is kept again, from what keeping it would have hit.
    #[test]
    fn a_region_not_kept_is_kept_again_once_its_writes_return() {
        let mut a = Adaptive::new(1024, THRESHOLD);
        scatter(&mut a, 40);
        // Now the same 16 pages every epoch: tracked first writes all.
        let hot = pages(700..=715);
        let mut epochs = 0;
        while kept(&mut a, &hot).is_empty() {
            a.observe(&PageBitmap::new(1024), &hot);
            epochs += 1;
            assert!(epochs < 10, "still not kept after {epochs} epochs: {}", a.precision[1]);
        }
        let k = kept(&mut a, &hot);
        assert!(hot.pages().all(|p| k.is_set(p)), "every rewritten page is kept");
        assert_eq!(a.regions(), Some(Regions { kept: 1, flipped: 1 }), "the lesson that kept it says so");
    }
}
