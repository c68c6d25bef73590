//! Histase, HBFT's write-fault predictor ("history stride based", Zhu et
//! al.; `../shared/notes/001-hbft.md`), ported from shadow page tables to
//! guest-physical pages and KVM's dirty bitmap.
//!
//! Per region of 512 pages (what one L1 shadow page table covers), the
//! mean length of the runs of consecutive written pages in an epoch
//! (`ave_stride`) feeds an exponentially weighted history
//! `his = his * 0.7 + ave * 0.3`. Each written page `i` predicts the pages
//! up to `his` after it and `his / 3` before it in its region.
//!
//! Two differences the host forces: the VMM does not see each write fault
//! as it happens, only the pages written by the freeze, so the triggers are
//! the newest writes known there (the first-write faults of the epoch just
//! ended, and the pages found written in the epoch before); and a user-space
//! VMM cannot grant write permission ahead of time, only leave it where the
//! guest already has it, so the prediction is cut down to the pages written
//! since the last re-arm.

use ftvm_vmm::PageBitmap;

use super::Predictor;

/// Pages per region: one L1 page table's worth.
const REGION: u64 = 512;
/// HBFT's default weight of the history.
const ALPHA: f32 = 0.7;

pub struct Histase {
    /// `his_stride` per region.
    his: Vec<f32>,
    /// Pages found written in the last epoch the filter finished.
    recent: PageBitmap,
    triggers: PageBitmap,
}

impl Histase {
    pub fn new(pages: u64) -> Histase {
        Histase { his: vec![0.0; pages.div_ceil(REGION) as usize], recent: PageBitmap::new(pages), triggers: PageBitmap::new(pages) }
    }
}

/// Mean length of the runs of set bits in one region's words (0 if none).
pub(super) fn mean_run(words: &[u64]) -> f32 {
    let (mut bits, mut runs, mut carry) = (0u32, 0u32, 0u64);
    for &w in words {
        bits += w.count_ones();
        // A run starts at a set bit whose lower neighbour is clear.
        runs += (w & !((w << 1) | carry)).count_ones();
        carry = w >> 63;
    }
    if runs == 0 {
        0.0
    } else {
        bits as f32 / runs as f32
    }
}

impl Predictor for Histase {
    fn choose(&mut self, _harvested: &PageBitmap, new_faults: &PageBitmap, keep: &mut PageBitmap) {
        self.triggers.copy_from(&self.recent);
        self.triggers.or_words(new_faults.words());
        // Triggers ascend, so a window reaching no further than the last one
        // adds nothing: skip to the end of what is covered.
        let mut covered: Option<u64> = None;
        for i in self.triggers.pages() {
            let region = i / REGION;
            let his = self.his[region as usize];
            let (start, end) = (region * REGION, region * REGION + REGION - 1);
            let first = i.saturating_sub((his / 3.0) as u64).max(start);
            let last = (i + his as u64).min(end);
            if covered.is_some_and(|c| last <= c) {
                continue;
            }
            keep.set_range(first, last);
            covered = Some(last);
        }
    }

    fn observe(&mut self, _left: &PageBitmap, written: &PageBitmap) {
        self.recent.copy_from(written);
        let words_per_region = (REGION / 64) as usize;
        for (his, words) in self.his.iter_mut().zip(written.words().chunks(words_per_region)) {
            *his = *his * ALPHA + mean_run(words) * (1.0 - ALPHA);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_run_lengths() {
        assert_eq!(mean_run(&[0, 0]), 0.0);
        assert_eq!(mean_run(&[0b1011, 0]), 1.5, "runs of 2 and 1");
        assert_eq!(mean_run(&[1 << 63, 1]), 2.0, "a run across a word boundary is one run");
        assert_eq!(mean_run(&[u64::MAX; 8]), 512.0);
    }

    #[test]
    fn long_runs_widen_the_window_and_history_decays() {
        let pages = 2048;
        let mut h = Histase::new(pages);
        let mut sweep = PageBitmap::new(pages);
        sweep.set_range(0, 511);
        for _ in 0..5 {
            h.observe(&PageBitmap::new(pages), &sweep);
        }
        assert!(h.his[0] > 400.0 && h.his[1] == 0.0, "{:?}", &h.his[..2]);
        // One new fault at 100 predicts the whole region after it.
        h.recent.clear();
        let mut faults = PageBitmap::new(pages);
        faults.set(100);
        faults.set(600);
        let mut keep = PageBitmap::new(pages);
        h.choose(&PageBitmap::new(pages), &faults, &mut keep);
        assert!(keep.is_set(100) && keep.is_set(511) && keep.is_set(0), "back by his/3");
        assert!(!keep.is_set(512), "windows stay inside their region");
        assert!(keep.is_set(600) && !keep.is_set(601), "no history in region 1: the page itself");
        for _ in 0..20 {
            h.observe(&PageBitmap::new(pages), &PageBitmap::new(pages));
        }
        assert!(h.his[0] < 1.0, "an idle region forgets: {}", h.his[0]);
    }
}
