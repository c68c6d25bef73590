//! Write-fault prediction (`--predict-writes`): at each freeze, leave the
//! pages likely to be written again writable, so the guest's next writes to
//! them take no tracked first-write fault (about 6 µs each here: shadow
//! paging, `../shared/PLATFORM.md`).
//!
//! A page left writable is reported dirty by every later harvest, written
//! or not, so it is captured every epoch; the fake-dirty filter then drops
//! the ones whose content the backup already holds before they are sent.
//! That comparison also says which predicted pages were really written,
//! which is what the predictor learns from. Where the encoder keeps a copy
//! of the page to diff against, the diff it makes anyway is that
//! comparison: such a page goes to the encoder, whose bundle leaves an
//! unchanged one out, and the predictor learns from what it found
//! (`FreezeMask::settle`). Only a page without such a copy is hashed
//! (`FakeDirtyFilter`) and, when the backup holds it, dropped.
//!
//! Only the bitmap dirty backend can leave pages writable (KVM's dirty ring
//! re-protects every page it harvested), and only pages the guest already
//! writes: the VMM cannot grant write permission ahead of time.

mod adaptive;
mod fake_dirty;
mod histase;

pub use fake_dirty::FakeDirtyFilter;

use ftvm_vmm::PageBitmap;

use super::capture::Captured;
use super::costs::Costs;
use ftvm_vmm::pages::PageEncoder;
use ftvm_vmm::switch;

switch! {
    /// `--predict-writes`: which pages to leave write-enabled at each freeze.
    pub enum Mode {
        /// None: every written page is re-protected.
        Off = "off",
        /// HBFT's Histase: stride and history per 512-page region.
        Histase = "histase",
        /// Pages written in the last 8 epochs, in regions where enough of the pages kept are written.
        Adaptive = "adaptive",
    }
}

/// Chooses the pages to leave writable at a freeze.
pub trait Predictor: Send {
    /// `harvested` holds the pages now writable (written since the last
    /// re-arm, or left writable then); `new_faults` those of them that were
    /// not left writable, so were certainly written in the epoch that just
    /// ended. Add the pages to leave writable to `keep` (it is cut down to
    /// `harvested` afterwards).
    fn choose(&mut self, harvested: &PageBitmap, new_faults: &PageBitmap, keep: &mut PageBitmap);
    /// The pages left writable through the epoch that ended at the last
    /// freeze, and the pages found really written in it (known once its
    /// checkpoint is filtered, after `choose` for the next freeze may
    /// already have run).
    fn observe(&mut self, left: &PageBitmap, written: &PageBitmap);
    /// The costs it weighs changed (they follow the stop-and-copy).
    fn weigh(&mut self, _costs: &Costs) {}
    /// Add to `out` every page of the regions it keeps writable now (a
    /// page there is kept once written; none for a predictor that does not
    /// judge by region).
    fn kept_pages(&self, _out: &mut PageBitmap) {}
    /// Which regions it keeps writable now (None: it does not judge by
    /// region).
    fn regions(&self) -> Option<Regions> {
        None
    }
}

/// The freeze mask: which pages the freeze leaves writable, and what that
/// means for the pages captured after it. One implementation per
/// `--predict-writes` value ([`mask`]): none, or a predictor.
pub trait FreezeMask: Send {
    /// Given the pages harvested at this freeze, the pages to leave writable.
    fn choose(&mut self, harvested: &PageBitmap) -> &PageBitmap;
    /// The pages left writable at the last freeze.
    fn left_writable(&self) -> &PageBitmap;
    /// The pages the in-epoch rounds must leave to the checkpoint: those
    /// left writable at the last freeze, and the other pages of the
    /// regions the predictor keeps (written, they are the predictor's to
    /// keep writable at the next freeze; a round that sent one would
    /// re-protect it, and a guest rewriting the region would fault on it
    /// again).
    fn reserved(&self) -> &PageBitmap;
    /// Pages written in the epoch that the in-epoch rounds sent ahead and
    /// the guest did not write again, so the freeze never saw them: each
    /// took a tracked first write, and the predictor learns them as written.
    fn written_ahead(&mut self, _pages: &PageBitmap) {}
    /// Drop from `pages` (the capture of the last freeze) the pages left
    /// writable whose content the backup already holds, as the filter's
    /// hashes know it; those `sent` (the encoder of what the backup gets)
    /// keeps a copy of are left to it and judged by `settle`.
    fn filter(&mut self, pages: &mut Captured, sent: &dyn PageEncoder);
    /// Once the filtered pages went through `sent`: what it found of the
    /// pages left to it; the epoch's figures.
    fn settle(&mut self, sent: &dyn PageEncoder) -> Figures;
    /// A consensus-ordered replica's `syncvm`: `hashes` of the union
    /// `pages` as both replicas now hold them tell which pages left
    /// writable were written.
    fn learn(&mut self, pages: &[u64], hashes: &[u128]) -> Figures;
    /// The content of `pages` changed by other means than the guest's writes.
    fn forget(&mut self, pages: &mut dyn Iterator<Item = u64>);
    /// Dirty tracking restarted for a new backup.
    fn reset(&mut self);
    /// The costs it weighs changed.
    fn weigh(&mut self, _costs: &Costs) {}
}

/// The freeze mask `mode` asks for.
pub fn mask(mode: Mode, pages: u64, costs: &Costs) -> Box<dyn FreezeMask> {
    match Prediction::new(mode, pages, costs) {
        Some(p) => Box::new(p),
        None => Box::new(LeaveNone::new(pages)),
    }
}

/// Re-protect everything: every dirty page took a tracked first write.
pub struct LeaveNone {
    none: PageBitmap,
    /// Pages of the last freeze.
    captured: u64,
}

impl LeaveNone {
    pub fn new(pages: u64) -> LeaveNone {
        LeaveNone { none: PageBitmap::new(pages), captured: 0 }
    }
}

impl FreezeMask for LeaveNone {
    fn choose(&mut self, _harvested: &PageBitmap) -> &PageBitmap {
        &self.none
    }

    fn left_writable(&self) -> &PageBitmap {
        &self.none
    }

    fn reserved(&self) -> &PageBitmap {
        &self.none
    }

    fn filter(&mut self, pages: &mut Captured, _sent: &dyn PageEncoder) {
        self.captured = pages.len() as u64;
    }

    fn settle(&mut self, _sent: &dyn PageEncoder) -> Figures {
        Figures { first_writes: self.captured, ..Figures::default() }
    }

    fn learn(&mut self, _pages: &[u64], _hashes: &[u128]) -> Figures {
        Figures::default()
    }

    fn forget(&mut self, _pages: &mut dyn Iterator<Item = u64>) {}

    fn reset(&mut self) {}
}

/// A predictor's verdicts by region, after its last lesson.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regions {
    /// Regions whose pages it keeps writable.
    pub kept: u32,
    /// Regions whose verdict the last lesson changed (kept or let go).
    pub flipped: u32,
}

/// Prediction figures of one checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Pages left writable through the epoch.
    pub predicted: u64,
    /// Of those, pages whose content changed (sent).
    pub predicted_written: u64,
    /// Of those, pages whose content had not changed (not sent).
    pub fake_dirty: u64,
    /// Of those, the pages the encoder judged (its bundle left them out;
    /// the others the hash filter dropped before encoding).
    pub sent_unchanged: u64,
    /// Pages dirtied that were not left writable: each took a tracked first write.
    pub first_writes: u64,
    /// Regions whose pages the predictor keeps writable, after this
    /// checkpoint's lesson (zero where it does not judge by region),
    pub regions_kept: u32,
    /// and regions whose verdict that lesson changed.
    pub regions_flipped: u32,
}

/// The predictor, the fake-dirty filter and the sets between them.
pub struct Prediction {
    predictor: Box<dyn Predictor>,
    filter: FakeDirtyFilter,
    /// Left writable through the epoch that ended at the last freeze.
    before: PageBitmap,
    /// Left writable at the last freeze.
    now: PageBitmap,
    /// Harvested at the last freeze and not in `before`.
    new_faults: PageBitmap,
    /// Scratch: what the filter finds written.
    written: PageBitmap,
    /// Pages left writable that the encoder judges (`settle`).
    to_settle: PageBitmap,
    /// The figures of the last `filter`, completed by `settle`.
    filtered: Figures,
    /// Every page of the regions the predictor keeps, after its last lesson.
    kept_regions: PageBitmap,
    /// `now` and `kept_regions`: what the in-epoch rounds leave alone.
    reserved: PageBitmap,
}

impl Prediction {
    /// `None` for `Mode::Off`.
    pub fn new(mode: Mode, pages: u64, costs: &Costs) -> Option<Prediction> {
        let predictor: Box<dyn Predictor> = match mode {
            Mode::Off => return None,
            Mode::Histase => Box::new(histase::Histase::new(pages)),
            Mode::Adaptive => Box::new(adaptive::Adaptive::new(pages, costs.keep_threshold())),
        };
        Some(Prediction::with(predictor, pages))
    }

    fn with(predictor: Box<dyn Predictor>, pages: u64) -> Prediction {
        Prediction {
            predictor,
            filter: FakeDirtyFilter::new(pages),
            before: PageBitmap::new(pages),
            now: PageBitmap::new(pages),
            new_faults: PageBitmap::new(pages),
            written: PageBitmap::new(pages),
            to_settle: PageBitmap::new(pages),
            filtered: Figures::default(),
            kept_regions: PageBitmap::new(pages),
            reserved: PageBitmap::new(pages),
        }
    }

    /// Dirty tracking restarted for a new backup: nothing is left writable
    /// and the backup holds nothing this side knows of. (What the predictor
    /// learned about the guest stays.)
    fn clear(&mut self) {
        self.now.clear();
        self.before.clear();
        self.new_faults.clear();
        self.filter.reset();
        self.reserved.copy_from(&self.kept_regions);
    }

    /// `now` or `kept_regions` changed.
    fn reserve(&mut self) {
        self.reserved.copy_from(&self.kept_regions);
        self.reserved.or_words(self.now.words());
    }

    /// Drop from `pages` (the capture of the last freeze) the predicted
    /// pages the backup already holds, follow the content of the pages left
    /// writable, and teach the predictor what was really written.
    fn filter_captured(&mut self, pages: &mut Captured, sent: &dyn PageEncoder) {
        let mut step = self.begin();
        pages.retain(|page, data| step.page(page, sent.keeps(page), || FakeDirtyFilter::hash(data)));
        self.filtered = step.figures;
    }

    /// The pages the encoder judged teach the predictor too.
    fn settle_encoded(&mut self, sent: &dyn PageEncoder) -> Figures {
        let mut figures = self.filtered;
        for page in self.to_settle.pages() {
            if sent.unchanged(page) {
                figures.fake_dirty += 1;
                figures.sent_unchanged += 1;
            } else {
                figures.predicted_written += 1;
                self.written.set(page);
            }
        }
        self.to_settle.clear();
        Step { p: self, figures }.end()
    }

    /// The same for a consensus-ordered replica, which sends nothing by
    /// this: `hashes` are those of `pages` (a `syncvm`'s union, which holds
    /// every page left writable: they are reported dirty at every harvest)
    /// as they now are on both replicas. They tell which of the pages left
    /// writable were written since the last `learn`, which teaches the
    /// predictor.
    fn learn_hashes(&mut self, pages: &[u64], hashes: &[u128]) -> Figures {
        let mut step = self.begin();
        for (&page, &hash) in pages.iter().zip(hashes) {
            step.page(page, false, || hash);
        }
        step.end()
    }

    /// The content of `pages` changed by other means than the guest's
    /// writes (a consensus-ordered secondary took the leader's): not known.
    fn forget_pages(&mut self, pages: &mut dyn Iterator<Item = u64>) {
        pages.for_each(|p| self.filter.forget(p));
    }

    fn begin(&mut self) -> Step<'_> {
        let figures = Figures { predicted: self.before.count(), first_writes: self.new_faults.count(), ..Figures::default() };
        self.written.copy_from(&self.new_faults);
        self.to_settle.clear();
        Step { p: self, figures }
    }
}

/// One filtering of the last freeze's pages.
struct Step<'a> {
    p: &'a mut Prediction,
    figures: Figures,
}

impl Step<'_> {
    /// Whether `page` of the last freeze must be sent: not when it was left
    /// writable and its `hash` says the backup holds its content already.
    /// A page the encoder `keeps` a copy of is sent, and judged by it.
    fn page(&mut self, page: u64, keeps: bool, hash: impl FnOnce() -> u128) -> bool {
        let (was_left, is_left) = (self.p.before.is_set(page), self.p.now.is_set(page));
        if !was_left && !is_left {
            return true;
        }
        if keeps {
            // The encoder's copy follows every send; a hash kept from before
            // would not, and could later match old content the backup no
            // longer holds.
            self.p.filter.forget(page);
            if was_left {
                self.p.to_settle.set(page);
            }
            return true;
        }
        let hash = hash();
        let held = self.p.filter.holds(page, hash);
        // Only pages left writable need their content followed.
        if is_left {
            self.p.filter.remember(page, hash);
        } else {
            self.p.filter.forget(page);
        }
        let send = !(was_left && held);
        if was_left {
            if send {
                self.figures.predicted_written += 1;
                self.p.written.set(page);
            } else {
                self.figures.fake_dirty += 1;
            }
        }
        send
    }

    fn end(mut self) -> Figures {
        self.p.predictor.observe(&self.p.before, &self.p.written);
        self.p.kept_regions.clear();
        self.p.predictor.kept_pages(&mut self.p.kept_regions);
        self.p.reserve();
        let regions = self.p.predictor.regions().unwrap_or_default();
        (self.figures.regions_kept, self.figures.regions_flipped) = (regions.kept, regions.flipped);
        self.figures
    }
}

impl FreezeMask for Prediction {
    fn left_writable(&self) -> &PageBitmap {
        &self.now
    }

    fn reserved(&self) -> &PageBitmap {
        &self.reserved
    }

    fn written_ahead(&mut self, pages: &PageBitmap) {
        self.new_faults.or_words(pages.words());
    }

    fn filter(&mut self, pages: &mut Captured, sent: &dyn PageEncoder) {
        self.filter_captured(pages, sent);
    }

    fn settle(&mut self, sent: &dyn PageEncoder) -> Figures {
        self.settle_encoded(sent)
    }

    fn learn(&mut self, pages: &[u64], hashes: &[u128]) -> Figures {
        self.learn_hashes(pages, hashes)
    }

    fn forget(&mut self, pages: &mut dyn Iterator<Item = u64>) {
        self.forget_pages(pages);
    }

    fn reset(&mut self) {
        self.clear();
    }

    fn weigh(&mut self, costs: &Costs) {
        self.predictor.weigh(costs);
    }

    fn choose(&mut self, harvested: &PageBitmap) -> &PageBitmap {
        std::mem::swap(&mut self.before, &mut self.now);
        self.new_faults.copy_from(harvested);
        self.new_faults.subtract(&self.before);
        self.now.clear();
        self.predictor.choose(harvested, &self.new_faults, &mut self.now);
        // Only a page still writable can be left writable.
        self.now.intersect(harvested);
        self.reserve();
        &self.now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftvm_vmm::memory::PAGE;
    use ftvm_vmm::pages::RawEncoder;

    /// Leaves every harvested page writable: the filter's cases without a
    /// predictor's judgement.
    struct KeepAll;

    impl Predictor for KeepAll {
        fn choose(&mut self, harvested: &PageBitmap, _new_faults: &PageBitmap, keep: &mut PageBitmap) {
            keep.or_words(harvested.words());
        }

        fn observe(&mut self, _left: &PageBitmap, _written: &PageBitmap) {}
    }

    /// The filter and its settling by an encoder that keeps no copies.
    fn filtered(p: &mut Prediction, pages: &mut Captured) -> Figures {
        p.filter(pages, &RawEncoder);
        p.settle(&RawEncoder)
    }

    fn keep_all() -> Prediction {
        Prediction::with(Box::new(KeepAll), 256)
    }

    fn set(pages: &[u64]) -> PageBitmap {
        set_of(256, pages)
    }

    fn set_of(capacity: u64, pages: &[u64]) -> PageBitmap {
        let mut b = PageBitmap::new(capacity);
        pages.iter().for_each(|&p| b.set(p));
        b
    }

    #[test]
    fn pages_left_writable_are_sent_only_when_changed() {
        let mut p = keep_all();
        let page = |v: u8| vec![v; PAGE];
        let (a, b, b2, c, d) = (page(1), page(2), page(9), page(3), page(4));

        // Epoch 1: three first writes, all left writable.
        assert_eq!(p.choose(&set(&[1, 2, 3])).pages().collect::<Vec<_>>(), vec![1, 2, 3]);
        let mut pages = Captured::from_pages(&[(1, &a), (2, &b), (3, &c)]);
        let f = filtered(&mut p, &mut pages);
        assert_eq!(f, Figures { first_writes: 3, ..Figures::default() });
        assert_eq!(pages.len(), 3);

        // Epoch 2: 1..3 reported again though only 2 changed; 4 is new.
        p.choose(&set(&[1, 2, 3, 4]));
        let mut pages = Captured::from_pages(&[(1, &a), (2, &b2), (3, &c), (4, &d)]);
        let f = filtered(&mut p, &mut pages);
        assert_eq!(f, Figures { predicted: 3, predicted_written: 1, fake_dirty: 2, first_writes: 1, ..Figures::default() });
        assert_eq!(pages.iter().map(|(n, data)| (n, data[0])).collect::<Vec<_>>(), vec![(2, 9), (4, 4)]);

        // A new backup holds nothing this side knows of: everything is sent.
        p.reset();
        p.choose(&set(&[1, 2]));
        let mut pages = Captured::from_pages(&[(1, &a), (2, &b2)]);
        assert_eq!(filtered(&mut p, &mut pages).fake_dirty, 0);
        assert_eq!(pages.len(), 2);
    }

    /// With an encoder that keeps what it sent, the diff it makes decides
    /// which pages left writable were written (an unchanged one goes as an
    /// empty diff); a page it stops keeping is judged by hash again, and no
    /// hash kept from before the encoder judged it can pass old content
    /// for what the backup holds.
    #[test]
    fn the_encoder_judges_the_pages_it_keeps_and_no_stale_hash_outlives_it() {
        use crate::pipeline::encode::{xor::Kernel, DiffEncoder};
        use crate::pipeline::last_sent::LastSent;
        let mut p = keep_all();
        let mut enc = DiffEncoder::new(LastSent::new(256, 256), Kernel::best(), false, Box::new(RawEncoder));
        let a = vec![1u8; PAGE];
        let mut b = a.clone();
        b[100] = 2;
        // One epoch writing `data` into page 1: figures, pages sent, bytes.
        let epoch = |p: &mut Prediction, enc: &mut DiffEncoder, data: &[u8]| {
            p.choose(&set(&[1]));
            let mut pages = Captured::from_pages(&[(1, data)]);
            p.filter(&mut pages, &*enc);
            let mut out = Vec::new();
            pages.iter().for_each(|(n, d)| {
                enc.encode(n, d, &mut out);
            });
            (p.settle(&*enc), pages.len(), out.len())
        };
        // First write: no copy yet, so hashed; sent whole, and now kept.
        let (_, sent, bytes) = epoch(&mut p, &mut enc, &a);
        assert_eq!((sent, bytes), (1, PAGE));
        assert!(enc.keeps(1));
        // Unchanged: left to the encoder, which finds nothing to send (an
        // empty diff, which the bundle leaves out).
        let (f, sent, bytes) = epoch(&mut p, &mut enc, &a);
        assert_eq!((f.fake_dirty, f.predicted_written, sent, bytes), (1, 0, 1, 1), "an empty diff");
        assert!(enc.unchanged(1));
        // Rewritten: a diff, learned as written.
        let (f, _, bytes) = epoch(&mut p, &mut enc, &b);
        assert_eq!((f.fake_dirty, f.predicted_written), (0, 1));
        assert!(bytes > 1 && bytes < PAGE);
        // The encoder no longer keeps the page (the backup read it itself),
        // and the guest writes back the first content: the hash of `a` taken
        // at the first write must not say the backup holds it.
        enc.forget(1);
        let (f, sent, bytes) = epoch(&mut p, &mut enc, &a);
        assert_eq!((f.predicted_written, sent, bytes), (1, 1, PAGE), "sent whole: the backup holds `b`");
    }

    #[test]
    fn a_replica_learns_from_the_hashes_of_a_union() {
        let mut p = keep_all();
        let (a, b, b2, c, d) = (1u128, 2, 9, 3, 4);
        p.choose(&set(&[1, 2, 3]));
        assert_eq!(p.learn(&[1, 2, 3], &[a, b, c]), Figures { first_writes: 3, ..Figures::default() });
        // 1..3 were left writable, so reported again; only 2 changed.
        assert_eq!(p.choose(&set(&[1, 2, 3, 4])).pages().collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        assert_eq!(
            p.learn(&[1, 2, 3, 4], &[a, b2, c, d]),
            Figures { predicted: 3, predicted_written: 1, fake_dirty: 2, first_writes: 1, ..Figures::default() }
        );
        // The secondary took the leader's page 3: unknown, so counted
        // written at the next `syncvm` whatever its hash.
        p.forget(&mut [3].into_iter());
        p.choose(&set(&[1, 2, 3, 4]));
        let f = p.learn(&[1, 2, 3, 4], &[a, b2, c, d]);
        assert_eq!((f.predicted, f.predicted_written, f.fake_dirty), (4, 1, 3));
    }

    /// The in-epoch rounds leave alone every page of a region the adaptive
    /// predictor keeps, not only the pages it left writable; and pages they
    /// sent ahead count as written for its lesson.
    #[test]
    fn the_rounds_leave_the_regions_prediction_keeps() {
        let mut p = Prediction::new(Mode::Adaptive, 1024, &Costs::default()).unwrap();
        let hot: Vec<u64> = (0..32).collect();
        for epoch in 0..10u8 {
            p.choose(&set_of(1024, &hot));
            // Rewritten each epoch with new content: every kept page is written.
            let data: Vec<Vec<u8>> = hot.iter().map(|_| vec![epoch + 1; PAGE]).collect();
            let pages: Vec<(u64, &[u8])> = hot.iter().zip(&data).map(|(&n, d)| (n, d.as_slice())).collect();
            filtered(&mut p, &mut Captured::from_pages(&pages));
        }
        assert!(p.left_writable().is_set(5), "a rewritten page is left writable");
        assert!(p.reserved().is_set(500), "so is the rest of its region, for the rounds");
        assert!(!p.reserved().is_set(600), "not another region");
        // A page of region 1 the rounds sent ahead is a write the predictor learns.
        p.choose(&set_of(1024, &hot));
        p.written_ahead(&set_of(1024, &[600]));
        let f = filtered(&mut p, &mut Captured::from_pages(&[]));
        assert_eq!(f.first_writes, 1, "the page sent ahead took a tracked first write");
    }

    #[test]
    fn only_harvested_pages_are_left_writable() {
        let mut p = Prediction::new(Mode::Histase, 256, &Costs::default()).unwrap();
        // Sweeps of pages 0..64 teach Histase long strides in region 0.
        let sweep: Vec<u64> = (0..64).collect();
        for e in 0..6u8 {
            p.choose(&set(&sweep));
            let data: Vec<Vec<u8>> = sweep.iter().map(|_| vec![e; PAGE]).collect();
            let pages: Vec<(u64, &[u8])> = sweep.iter().zip(&data).map(|(&n, d)| (n, d.as_slice())).collect();
            filtered(&mut p, &mut Captured::from_pages(&pages));
        }
        // Its window around the sweep reaches far beyond page 70, but only
        // what is writable now can be left writable.
        assert_eq!(p.choose(&set(&[3, 70])).pages().collect::<Vec<_>>(), vec![3, 70]);
        assert!(Prediction::new(Mode::Off, 256, &Costs::default()).is_none());
    }
}
