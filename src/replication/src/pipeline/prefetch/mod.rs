//! In-epoch transfer (`--prefetch`, after Phantasy): while the guest runs,
//! send the backup the pages it dirtied earlier in the open epoch, so the
//! stop-and-copy at the end of the epoch carries only the pages written
//! again since.
//!
//! A round harvests the dirty set without pausing, re-arms tracking, and
//! only then reads the pages it sends: a page written during or after its
//! read is reported again and goes again (in a later round or in the
//! checkpoint), so a torn read is never what the backup commits. Write-cold
//! pages go first, in fact only they go: a page the last two checkpoints
//! both carried (written late in each epoch, or all through it) is hot; it
//! is left for the stop-and-copy (`carry`) and, where the dirty backend
//! can, left writable, so the guest takes no extra tracked first write for
//! it. The rounds crowd towards the planned freeze (`Schedule`), the last
//! one right before it, so little is written between it and the freeze. A
//! cold page sent and written again goes again in a round of the epoch's
//! last quarter (one before is left writable and deferred to those). The backup stages what
//! arrives and commits it only with the checkpoint of the same epoch
//! (`backup::Replica::stage_prefetch`): a primary that dies mid-epoch
//! leaves it exactly at the last checkpoint. With `adaptive` the rounds start
//! only as early in the epoch as few of their sends are wasted
//! (`adaptive::Gate`). With `--prefetch-by pull` the rounds send only
//! the pages' numbers and the backup reads them itself (`pull`).

mod adaptive;
pub mod pull;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{BundleWriter, PageEncoder};
use ftvm_vmm::{PageBitmap, Vm};

use super::costs::Costs;
use crate::error::ReplicationError;
use crate::protocol::{self, Kind};
use ftvm_vmm::switch;

switch! {
    /// `--prefetch`: send pages of the open epoch while the guest runs.
    pub enum Mode {
        /// Every dirty page goes in the stop-and-copy.
        Off = "off",
        /// Write-cold pages dirtied earlier in the epoch go ahead of the checkpoint.
        On = "on",
        /// As `on`, but the rounds start as late in the epoch as the last
        /// epoch's wasted sends (pages written again before the freeze)
        /// say, and stop for a while when even the last round alone
        /// wastes (`adaptive::Gate`).
        Adaptive = "adaptive",
    }
}

/// Prefetch rounds per epoch at most.
pub const ROUNDS: u32 = 7;

/// How long the last round of an epoch is assumed to take before one was
/// measured.
const FIRST_LEAD: Duration = Duration::from_micros(500);

/// What the last round's lead adds to the measured length of a last round:
/// the replication thread's wake-up is late by about this on a loaded host.
const SLACK: Duration = Duration::from_micros(100);

/// When an epoch's rounds run. Every page written between the last round
/// and the freeze goes in the stop-and-copy, so the last round ends right
/// before the planned freeze (its lead is the length of the previous
/// epoch's last round, plus some slack); the ones before it each halve what
/// is left of the epoch (at 1/2, 3/4, 7/8, ... of it), so the rounds grow
/// denser and smaller towards the freeze and a page is sent as late as
/// possible, when it is least likely to be written again before the
/// freeze.
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    /// Rounds before the last done (or skipped) in the open epoch.
    done: u32,
    /// The open epoch's last round ran (or was skipped).
    last_done: bool,
    /// The last round starts this long before the planned freeze.
    lead: Duration,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule { done: 0, last_done: false, lead: FIRST_LEAD + SLACK }
    }
}

impl Schedule {
    /// When the next round of the epoch that started at `since`, planned to
    /// last `max_epoch`, is due, and whether it is the epoch's last (None:
    /// the epoch had its rounds).
    pub fn next(&self, since: Instant, max_epoch: Duration) -> Option<(Instant, bool)> {
        if self.last_done {
            return None;
        }
        let last = since + max_epoch.saturating_sub(self.lead);
        let halving = since + max_epoch - max_epoch / (1u32 << (self.done + 1).min(31));
        Some(if self.done + 1 < ROUNDS && halving < last { (halving, false) } else { (last, true) })
    }

    /// A round ran from `started` to `finished`: skip the rounds before the
    /// last that are already due (they would find almost nothing new), and
    /// the last if the freeze is nearer than half its lead; learn from the
    /// epoch's last round how long before the freeze it must start.
    pub fn ran(&mut self, since: Instant, max_epoch: Duration, started: Instant, finished: Instant) {
        if let Some((_, true)) = self.next(since, max_epoch) {
            self.last_done = true;
            self.lead = (finished.saturating_duration_since(started) + SLACK).min(max_epoch / 4);
            return;
        }
        self.done += 1;
        while let Some((at, last)) = self.next(since, max_epoch) {
            if last {
                // Still worth it if it can end about when the freeze is planned.
                self.last_done = finished + self.lead / 2 >= since + max_epoch;
                break;
            }
            if at > finished {
                break;
            }
            self.done += 1;
        }
    }

    /// Whether the round due at `at` (`last`: the epoch's last) sends the
    /// pages earlier rounds deferred, and again those it sent and that
    /// were written since: the epoch's last quarter's rounds do. Sent
    /// earlier, such a page would likely be written again before the
    /// freeze: each send re-protects it, so the guest pays one more tracked
    /// first write for nothing.
    pub fn resends(since: Instant, max_epoch: Duration, at: Instant, last: bool) -> bool {
        last || at >= since + max_epoch * 3 / 4
    }

    /// How late in the epoch the round due at `at` is: `k` for the round at
    /// 1 - 1/2^k of it (1 at half-time), `ROUNDS` for the last.
    pub fn depth(since: Instant, max_epoch: Duration, at: Instant, last: bool) -> u32 {
        if last {
            return ROUNDS;
        }
        let left = max_epoch.saturating_sub(at.saturating_duration_since(since)).max(Duration::from_nanos(1));
        let k = (max_epoch.as_secs_f64() / left.as_secs_f64()).log2().round();
        (k.max(1.0) as u32).min(ROUNDS - 1)
    }

    /// A checkpoint was taken: the next epoch has all its rounds ahead.
    pub fn new_epoch(&mut self) {
        self.done = 0;
        self.last_done = false;
    }
}

/// What the prefetch rounds of one epoch sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Pages sent (a page sent twice counts twice).
    pub pages: u64,
    /// Bytes of their frames.
    pub bytes: u64,
    /// Of those pages, the ones the checkpoint does not carry again (not
    /// written since they were sent).
    pub only_ahead: u64,
    /// `adaptive`: the depth (`Schedule::depth`) the epoch's rounds
    /// started from: 0 all of them, `ROUNDS` the last alone, `ROUNDS + 1`
    /// none (always 0 with `on`).
    pub start: u32,
    /// Rounds that ran (harvested the dirty set) in the epoch.
    pub rounds: u32,
}

impl Sent {
    /// Sends of pages written again before the freeze: the checkpoint
    /// carries them anyway, and each cost the guest a tracked first write.
    pub fn wasted(&self) -> u64 {
        self.pages - self.only_ahead
    }
}

/// The open epoch, as the rounds are scheduled in it: when it started (the
/// previous checkpoint's resume) and how long it is planned to last.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub since: Instant,
    pub max_epoch: Duration,
}

/// The in-epoch transfer stage: pages sent to the backup while the guest
/// runs, in rounds the stage schedules itself. One implementation per
/// `--prefetch` value ([`in_epoch`]): no rounds, or the prefetcher (its
/// pages pushed in frames, or pulled by the backup).
pub trait InEpoch: Send {
    /// When the next round of the epoch in `window` is due (None: no round
    /// is left in it).
    fn next_round(&self, window: Window) -> Option<Instant>;
    /// Run the round that is due, for the open epoch `epoch`, its pages
    /// through `encoder` (the checkpoint's): the frame to send, if any.
    /// `reserved` holds the pages write prediction has a say on
    /// (`FreezeMask::reserved`): the round neither sends nor re-protects
    /// them, and the checkpoint carries them.
    fn round(
        &mut self,
        vm: &Vm,
        epoch: u64,
        window: Window,
        reserved: &PageBitmap,
        encoder: &mut dyn PageEncoder,
    ) -> Result<Option<&[u8]>, ReplicationError>;
    /// The round's frame was sent: what it took schedules the next ones.
    fn round_sent(&mut self);
    /// At the freeze: add to `dirty` what the checkpoint must carry, and
    /// return what the epoch's rounds sent; the next epoch has all its
    /// rounds ahead.
    fn close_epoch(&mut self, dirty: &mut PageBitmap) -> Sent;
    /// Dirty tracking restarts (a new backup): nothing carried or sent.
    fn reset(&mut self);
    /// After `close_epoch`: the pages its rounds sent ahead that the guest
    /// did not write again before the freeze (None: no rounds).
    fn written_ahead(&self) -> Option<&PageBitmap> {
        None
    }
    /// `--prefetch-by pull`: where the backup's confirmations go.
    fn pull_confirmations(&self) -> Option<Arc<AtomicU64>> {
        None
    }
    /// The costs it weighs changed.
    fn weigh(&mut self, _costs: &Costs) {}
}

/// The in-epoch transfer `mode` asks for; one epoch's rounds send at most
/// `limit` bytes of a guest of `ram_pages` pages.
pub fn in_epoch(mode: Mode, by: pull::By, ram_pages: u64, limit: u64, costs: &Costs) -> Box<dyn InEpoch> {
    match Prefetcher::for_mode(mode, by, ram_pages, limit, costs) {
        Some(p) => Box::new(p),
        None => Box::new(NoRounds),
    }
}

/// `--prefetch off`: every dirty page waits for the stop-and-copy.
struct NoRounds;

impl InEpoch for NoRounds {
    fn next_round(&self, _: Window) -> Option<Instant> {
        None
    }

    fn round(&mut self, _: &Vm, _: u64, _: Window, _: &PageBitmap, _: &mut dyn PageEncoder) -> Result<Option<&[u8]>, ReplicationError> {
        Ok(None)
    }

    fn round_sent(&mut self) {}

    fn close_epoch(&mut self, _dirty: &mut PageBitmap) -> Sent {
        Sent::default()
    }

    fn reset(&mut self) {}
}

/// A round that ran, until its frame is sent (`InEpoch::round_sent`).
#[derive(Clone, Copy, Debug)]
struct Running {
    since: Instant,
    max_epoch: Duration,
    started: Instant,
}

/// One epoch's prefetch rounds, and what the freeze must add to its dirty set.
pub struct Prefetcher {
    /// When the open epoch's rounds run.
    schedule: Schedule,
    /// The round whose frame is being sent.
    running: Option<Running>,
    /// Harvested by a round and not sent: the checkpoint carries them.
    carry: PageBitmap,
    /// Sent by a round of the open epoch.
    sent_pages: PageBitmap,
    /// Pages the last two checkpoints both carried: written late in every
    /// epoch, or all through it. (One checkpoint is weak evidence: a guest
    /// that writes a large cold set at random rewrites many of its pages
    /// in the next epoch by chance.)
    recent: PageBitmap,
    /// Scratch: `recent` and the pages write prediction reserves.
    keep: PageBitmap,
    /// The closed epoch's pages sent ahead and not written again.
    ahead: PageBitmap,
    /// The last checkpoint's dirty set.
    last: PageBitmap,
    harvested: PageBitmap,
    hot: PageBitmap,
    page: Vec<u8>,
    frame: Vec<u8>,
    sent: Sent,
    /// The most the rounds of one epoch send (the backup stages at most this).
    limit: u64,
    /// `adaptive`: whether the open epoch runs rounds (`on`: always).
    gate: Option<adaptive::Gate>,
    /// `--prefetch-by pull`: the lists the backup reads itself.
    pull: Option<pull::Lists>,
    /// What the open epoch's rounds had the backup stage, at most (it
    /// stages up to `limit`).
    staged: u64,
}

impl Prefetcher {
    /// For a guest of `ram_pages` pages; one epoch's rounds send at most
    /// `limit` bytes. None for `Mode::Off`.
    pub fn for_mode(mode: Mode, by: pull::By, ram_pages: u64, limit: u64, costs: &Costs) -> Option<Prefetcher> {
        let mut p = match mode {
            Mode::Off => return None,
            Mode::On | Mode::Adaptive => Prefetcher::new(ram_pages, limit),
        };
        p.gate = (mode == Mode::Adaptive).then(|| adaptive::Gate::new(costs.max_waste()));
        p.pull = (by == pull::By::Pull).then(pull::Lists::default);
        Some(p)
    }

    /// For a guest of `ram_pages` pages; one epoch's rounds send at most `limit` bytes.
    pub fn new(ram_pages: u64, limit: u64) -> Prefetcher {
        let empty = PageBitmap::new(ram_pages);
        Prefetcher {
            schedule: Schedule::default(),
            running: None,
            carry: empty.clone(),
            sent_pages: empty.clone(),
            recent: empty.clone(),
            keep: empty.clone(),
            ahead: empty.clone(),
            last: empty.clone(),
            harvested: empty.clone(),
            hot: empty,
            page: vec![0; PAGE],
            frame: Vec::new(),
            sent: Sent::default(),
            limit,
            gate: None,
            pull: None,
            staged: 0,
        }
    }

    /// Whether the open epoch runs rounds (with `adaptive`, not while they
    /// are found wasteful).
    fn runs(&self) -> bool {
        self.gate.as_ref().is_none_or(adaptive::Gate::open)
    }

    /// Whether the open epoch's round at `depth` (`Schedule::depth`) runs
    /// (with `adaptive`, the rounds start as late as their waste says).
    fn runs_round(&self, depth: u32) -> bool {
        self.gate.as_ref().is_none_or(|g| g.runs(depth))
    }

    /// One round for epoch `epoch`: the frame to send (None: nothing cold
    /// was dirtied). `resend` (`Schedule::resends`): send the pages earlier
    /// rounds deferred, and again those sent and written since; otherwise
    /// defer them, left writable. Pages go through `encoder`, the
    /// checkpoint's, so a diff in the checkpoint is made against what the
    /// backup will have staged. With `--prefetch-by pull` the frame only
    /// lists the pages, and `encoder` forgets its copies of them (the
    /// backup reads what they hold, which the encoder never sees).
    pub fn send_round(
        &mut self,
        vm: &Vm,
        epoch: u64,
        resend: bool,
        reserved: &PageBitmap,
        encoder: &mut dyn PageEncoder,
    ) -> Result<Option<&[u8]>, ReplicationError> {
        self.harvested.clear();
        vm.harvest_dirty(&mut self.harvested)?;
        self.sent.rounds += 1;
        let (harvested, sent_pages, sends) = (&self.harvested, &self.sent_pages, self.sent.pages);
        if self.gate.as_mut().is_some_and(|g| g.wasting(sends, harvested.count_common(sent_pages))) {
            // Standing down: every page harvested stays writable where the
            // backend can (no tracked first write for a page the guest
            // keeps rewriting), and the checkpoint carries it.
            vm.rearm_dirty(&self.harvested)?;
            self.carry.or_words(self.harvested.words());
            return Ok(None);
        }
        // Hot: written late in the last two epochs, or write prediction's
        // (left writable, or in a region it keeps: the checkpoint carries
        // those, and re-protecting one would cost the guest the tracked
        // first write prediction saves it).
        self.keep.copy_from(&self.recent);
        self.keep.or_words(reserved.words());
        if resend {
            // Every page the freeze would take but a hot one. (A deferred
            // page was harvested and is tracked since, so what is read now
            // is reported again if written after this.)
            self.hot.copy_from(&self.carry);
            self.hot.subtract(&self.keep);
            self.harvested.or_words(self.hot.words());
            self.carry.intersect(&self.keep);
        }
        self.hot.copy_from(&self.keep);
        if !resend {
            self.hot.or_words(self.sent_pages.words());
            self.hot.or_words(self.carry.words());
        }
        self.hot.intersect(&self.harvested);
        // Before any page is read: a write after this is reported again.
        vm.rearm_dirty(&self.hot)?;
        self.carry.or_words(self.hot.words());
        self.harvested.subtract(&self.hot);
        let cold = self.harvested.count();
        tracing::debug!(hot = self.hot.count(), cold, "prefetch round harvested");
        let most = 8 + ftvm_vmm::pages::max_bundle_len(0, cold);
        if cold == 0 || self.staged + most > self.limit {
            // Over the epoch's budget: the checkpoint takes them.
            self.carry.or_words(self.harvested.words());
            return Ok(None);
        }
        self.sent_pages.or_words(self.harvested.words());
        if let Some(lists) = &mut self.pull {
            lists.list(&mut self.frame, epoch, &self.harvested);
            self.harvested.pages().for_each(|p| encoder.forget(p));
            self.sent.pages += cold;
            self.sent.bytes += self.frame.len() as u64;
            self.staged += most;
            return Ok(Some(&self.frame));
        }
        protocol::begin_frame(&mut self.frame, Kind::Prefetch);
        self.frame.extend_from_slice(&epoch.to_le_bytes());
        let mut bundle = BundleWriter::begin(&mut self.frame, &[], encoder, false);
        for p in self.harvested.pages() {
            vm.ram().read_page(p, &mut self.page).map_err(ftvm_vmm::VmError::from)?;
            bundle.page(p, &self.page);
        }
        bundle.finish();
        protocol::finish_frame(&mut self.frame);
        // Every page the round took on, the ones the encoder found the
        // backup holding already too: as `sent_pages` counts them, so that
        // what was sent and not written again never exceeds what was sent.
        self.sent.pages += cold;
        self.sent.bytes += self.frame.len() as u64;
        self.staged += self.frame.len() as u64;
        Ok(Some(&self.frame))
    }

    /// At the freeze of the epoch: add the pages harvested and not sent to
    /// its dirty set, remember which pages are hot, and return what
    /// the epoch's rounds sent (the next epoch starts from nothing).
    /// With `--prefetch-by pull` it must run with the guest paused: the
    /// pages of lists the backup has not confirmed go in the checkpoint.
    fn close_rounds(&mut self, dirty: &mut PageBitmap) -> Sent {
        self.hot.clear();
        if let Some(lists) = &mut self.pull {
            let unread = lists.close(&mut self.hot);
            tracing::debug!(unread, "pages listed and not confirmed at the freeze go in the checkpoint");
        }
        self.staged = 0;
        dirty.or_words(self.carry.words());
        self.recent.copy_from(dirty);
        self.recent.intersect(&self.last);
        self.last.copy_from(dirty);
        // Listed, not confirmed yet: the checkpoint carries them, but they
        // were written before the round that listed them, which says
        // nothing of how late in the epoch they are written.
        dirty.or_words(self.hot.words());
        self.carry.clear();
        self.sent_pages.subtract(dirty);
        self.sent.only_ahead = self.sent_pages.count();
        std::mem::swap(&mut self.ahead, &mut self.sent_pages);
        self.sent_pages.clear();
        if let Some(g) = &mut self.gate {
            self.sent.start = g.start();
            g.observe(&self.sent);
        }
        std::mem::take(&mut self.sent)
    }

    fn forget_rounds(&mut self) {
        for b in [&mut self.carry, &mut self.sent_pages, &mut self.recent, &mut self.last, &mut self.ahead] {
            b.clear();
        }
        self.sent = Sent::default();
        self.staged = 0;
        if let Some(g) = &mut self.gate {
            g.reset();
        }
        if let Some(l) = &mut self.pull {
            l.reset();
        }
    }
}

impl InEpoch for Prefetcher {
    fn next_round(&self, window: Window) -> Option<Instant> {
        if !self.runs() {
            return None;
        }
        self.schedule.next(window.since, window.max_epoch).map(|(at, _)| at)
    }

    fn round(
        &mut self,
        vm: &Vm,
        epoch: u64,
        window: Window,
        reserved: &PageBitmap,
        encoder: &mut dyn PageEncoder,
    ) -> Result<Option<&[u8]>, ReplicationError> {
        let Window { since, max_epoch } = window;
        let Some((at, last)) = self.schedule.next(since, max_epoch) else { return Ok(None) };
        let started = Instant::now();
        self.running = Some(Running { since, max_epoch, started });
        // With `adaptive`, an early round may be skipped: its pages stay
        // writable for a later one.
        if !self.runs_round(Schedule::depth(since, max_epoch, at, last)) {
            return Ok(None);
        }
        let resend = Schedule::resends(since, max_epoch, at, last);
        self.send_round(vm, epoch, resend, reserved, encoder)
    }

    fn round_sent(&mut self) {
        if let Some(r) = self.running.take() {
            let finished = Instant::now();
            tracing::debug!(
                at_us = r.started.duration_since(r.since).as_micros() as u64,
                took_us = (finished - r.started).as_micros() as u64,
                "prefetch round"
            );
            self.schedule.ran(r.since, r.max_epoch, r.started, finished);
        }
    }

    fn close_epoch(&mut self, dirty: &mut PageBitmap) -> Sent {
        self.schedule.new_epoch();
        self.running = None;
        self.close_rounds(dirty)
    }

    fn reset(&mut self) {
        self.forget_rounds();
    }

    fn written_ahead(&self) -> Option<&PageBitmap> {
        Some(&self.ahead)
    }

    fn pull_confirmations(&self) -> Option<Arc<AtomicU64>> {
        self.pull.as_ref().map(pull::Lists::confirmations)
    }

    fn weigh(&mut self, costs: &Costs) {
        if let Some(g) = &mut self.gate {
            g.weigh(costs.max_waste());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPOCH: Duration = Duration::from_millis(16);

    /// The rounds of one epoch as the primary runs them, each taking `took`.
    fn rounds(schedule: &mut Schedule, since: Instant, took: Duration) -> Vec<(Duration, bool)> {
        let mut at = Vec::new();
        let mut free = since;
        while let Some((due, last)) = schedule.next(since, EPOCH) {
            at.push((due - since, last));
            let started = due.max(free);
            free = started + took;
            schedule.ran(since, EPOCH, started, free);
        }
        at
    }

    #[test]
    fn rounds_halve_what_is_left_and_the_last_starts_its_lead_before_the_freeze() {
        let mut s = Schedule::default();
        let since = Instant::now();
        let ms = |f: f64| Duration::from_secs_f64(f / 1e3);
        let first = rounds(&mut s, since, ms(0.1));
        let lead = FIRST_LEAD + SLACK;
        assert_eq!(first, vec![(ms(8.0), false), (ms(12.0), false), (ms(14.0), false), (ms(15.0), false), (EPOCH - lead, true)]);
        // The next epoch's last round starts as long before the freeze as
        // the last one took, plus the slack.
        s.new_epoch();
        let second = rounds(&mut s, since, ms(0.1));
        assert_eq!(second.last(), Some(&(EPOCH - ms(0.1) - SLACK, true)));
        assert_eq!(second.len() as u32, ROUNDS, "{second:?}");
        // The rounds of the last quarter send again what was written since
        // it was sent; the one at half-time defers it.
        let resends: Vec<bool> = second.iter().map(|&(at, last)| Schedule::resends(since, EPOCH, since + at, last)).collect();
        assert_eq!(resends, [false, true, true, true, true, true, true]);
        let depths: Vec<u32> = second.iter().map(|&(at, last)| Schedule::depth(since, EPOCH, since + at, last)).collect();
        assert_eq!(depths, [1, 2, 3, 4, 5, 6, ROUNDS]);
    }

    #[test]
    fn a_slow_round_skips_the_rounds_it_overran_but_not_the_last() {
        let mut s = Schedule::default();
        let since = Instant::now();
        let (first, _) = s.next(since, EPOCH).unwrap();
        // The first round ends past the second and third ones' times.
        s.ran(since, EPOCH, first, since + Duration::from_millis(14) + Duration::from_micros(1));
        assert_eq!(s.next(since, EPOCH), Some((since + Duration::from_millis(15), false)));
        // One that ends right before the freeze leaves no time for the last.
        s.ran(since, EPOCH, since + Duration::from_millis(15), since + EPOCH - Duration::from_micros(100));
        assert_eq!(s.next(since, EPOCH), None);
    }
}
