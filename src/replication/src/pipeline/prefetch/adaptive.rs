//! `--prefetch adaptive`: run an epoch's rounds only as early as they pay.
//!
//! A page a round sends and the guest writes again before the freeze is a
//! wasted send: the checkpoint carries it anyway, and the round's re-arm
//! cost the guest one more tracked first write for it (about 6 µs here, no
//! PML). A send that holds saves a page of the stop-and-copy, about 1 µs of
//! pause (measured: hotcold's pause shrinks 1.2 ms for 1400 pages fewer).
//! So rounds pay while at most about one send in seven is wasted
//! (`Costs::max_waste`, from the costs measured at start; `MAX_WASTE`
//! where none were). A page sent earlier in the epoch has longer to be written
//! again: the early rounds waste the most.
//!
//! So the gate moves where the rounds start: after each epoch that ran
//! rounds it looks at the share of their sends that were wasted; above
//! `MAX_WASTE` the next epoch's rounds start one step later (the round at
//! 1/2 of the epoch first, then 3/4, 7/8, ..., finally the last round
//! alone); below half of it they start one step earlier again. The pages
//! a skipped round would have sent stay writable and go with the next round
//! that runs. When even the last round alone wastes too much, the rounds
//! stop for a number of epochs (`FIRST_BACKOFF`, doubling at every failed
//! try up to `MAX_BACKOFF`), then run once more (a probe): a guest that
//! changed its ways is followed, one that did not pays for one epoch in
//! `MAX_BACKOFF`. Rounds that find next to nothing to send (fewer than
//! `MIN_SENDS` pages: every dirty page is write prediction's, or the guest
//! barely writes) rest for `FIRST_BACKOFF` epochs too, then look again:
//! their harvests cost the replication thread and saved nothing. Like
//! `--predict-writes adaptive`, it decides on what the guest did, one
//! epoch late.

use super::{Sent, ROUNDS};

/// The largest share of an epoch's sends that may be wasted where no costs
/// were measured: a wasted send costs the guest about 6 µs, a useful one
/// saves about 1 µs of pause.
#[cfg(test)]
const MAX_WASTE: f64 = 1.0 / 7.0;
/// Fewer sends than this in an epoch say nothing either way.
const MIN_SENDS: u64 = 32;
/// Sends of the open epoch from which its own waste stands its remaining
/// rounds down (`Gate::wasting`): a sweep over a working set sends
/// thousands; a few dozen say too little within one epoch (a hot/cold
/// writer's rounds send about a hundred pages an epoch, some written again
/// by chance, and the epoch-by-epoch gate weighs those better).
const STAND_DOWN_SENDS: u64 = 256;
/// Epochs without rounds after the last round alone was found wasteful.
const FIRST_BACKOFF: u32 = 4;
/// The longest pause between two tries.
const MAX_BACKOFF: u32 = 64;

/// Which of the next epoch's rounds run.
#[derive(Clone, Copy, Debug)]
pub struct Gate {
    /// The largest share of an epoch's sends that may be wasted.
    max_waste: f64,
    /// Epochs left without rounds.
    off_for: u32,
    /// How many epochs the next stop lasts.
    backoff: u32,
    /// Rounds run from this depth on (`super::Schedule::depth`: 1 is the
    /// round at half the epoch, `ROUNDS` the last).
    from: u32,
    /// The open epoch's rounds stood down (`Gate::wasting`).
    stood_down: bool,
}

impl Gate {
    /// A gate that lets at most `max_waste` of an epoch's sends be wasted.
    pub fn new(max_waste: f64) -> Gate {
        Gate { max_waste, off_for: 0, backoff: FIRST_BACKOFF, from: 0, stood_down: false }
    }

    /// Whether the open epoch runs rounds at all.
    pub fn open(&self) -> bool {
        self.off_for == 0 && !self.stood_down
    }

    /// A round of the open epoch found `rewritten` of the pages its rounds
    /// sent so far (`sent` sends) written again: the checkpoint carries
    /// those anyway. Past the waste allowed, the epoch's remaining rounds
    /// stand down at once: the guest is rewriting what it wrote earlier
    /// in the epoch (a sweep over its whole working set), and every later
    /// round would send those pages again for the same fate. Without this
    /// the gate learns it one epoch late, after rounds that re-sent a
    /// whole working set several times (10000 pages swept six times an
    /// epoch: 20 000 sends, four in five wasted).
    pub fn wasting(&mut self, sent: u64, rewritten: u64) -> bool {
        if sent >= STAND_DOWN_SENDS && rewritten as f64 > self.max_waste * sent as f64 {
            tracing::debug!(sent, rewritten, "prefetch rounds written again within the epoch; the rest stand down");
            self.stood_down = true;
        }
        self.stood_down
    }

    /// The depth the open epoch's rounds start from: 0 all run, `ROUNDS`
    /// the last alone, `ROUNDS + 1` none.
    pub fn start(&self) -> u32 {
        if self.off_for == 0 {
            self.from
        } else {
            ROUNDS + 1
        }
    }

    /// Whether the open epoch's round at `depth` runs.
    pub fn runs(&self, depth: u32) -> bool {
        self.open() && depth >= self.from
    }

    /// The open epoch closed; its rounds (if it ran any) sent `sent`.
    pub fn observe(&mut self, sent: &Sent) {
        self.stood_down = false;
        if self.off_for > 0 {
            self.off_for -= 1;
            return;
        }
        if sent.pages < MIN_SENDS {
            // Next to nothing to send (every dirty page is write
            // prediction's, or the guest barely writes): the rounds' harvests
            // cost the replication thread for nothing. Rest, and look again.
            // (Rounds that never ran, the epoch over before their time on
            // a loaded host, say nothing.)
            if sent.rounds > 0 {
                self.off_for = FIRST_BACKOFF;
            }
            return;
        }
        let share = sent.wasted() as f64 / sent.pages as f64;
        if share > self.max_waste {
            if self.from < ROUNDS {
                self.from += 1;
                tracing::debug!(sent = sent.pages, wasted = sent.wasted(), from = self.from, "prefetch rounds wasted; start later");
            } else {
                tracing::debug!(sent = sent.pages, wasted = sent.wasted(), epochs = self.backoff, "prefetch rounds wasted; stopped");
                self.off_for = self.backoff;
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        } else {
            self.backoff = FIRST_BACKOFF;
            if share < self.max_waste / 2.0 {
                self.from = self.from.saturating_sub(1);
            }
        }
    }

    /// Let at most `max_waste` of an epoch's sends be wasted from now on.
    pub fn weigh(&mut self, max_waste: f64) {
        self.max_waste = max_waste;
    }

    /// Dirty tracking restarts (a new backup): start trusting the rounds again.
    pub fn reset(&mut self) {
        *self = Gate::new(self.max_waste);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(pages: u64, wasted: u64) -> Sent {
        Sent { pages, bytes: pages * 4096, only_ahead: pages - wasted, start: 0, rounds: 3 }
    }

    /// Epochs the gate stays closed.
    fn closed_run(g: &mut Gate) -> u32 {
        let mut n = 0;
        while !g.open() {
            g.observe(&Sent::default());
            n += 1;
        }
        n
    }

    #[test]
    fn wasteful_rounds_start_later_then_stop_for_longer_each_time() {
        let mut g = Gate::new(MAX_WASTE);
        assert!(g.runs(1));
        g.observe(&sent(1000, 100));
        assert!(g.runs(1), "10% wasted pays");
        for from in 1..=ROUNDS {
            g.observe(&sent(1000, 500));
            assert!(!g.runs(from - 1) && g.runs(from), "rounds start at depth {from}");
        }
        // Even the last round alone wastes: no rounds for a while.
        g.observe(&sent(1000, 500));
        assert_eq!(closed_run(&mut g), FIRST_BACKOFF);
        assert!(g.runs(ROUNDS) && !g.runs(ROUNDS - 1), "the probe runs the last round");
        g.observe(&sent(1000, 500));
        assert_eq!(closed_run(&mut g), 2 * FIRST_BACKOFF);
        for _ in 0..10 {
            g.observe(&sent(1000, 500));
            closed_run(&mut g);
        }
        g.observe(&sent(1000, 500));
        assert_eq!(closed_run(&mut g), MAX_BACKOFF, "the pause between tries is bounded");
        // A probe that pays keeps the rounds and moves them earlier.
        g.observe(&sent(1000, 10));
        assert!(g.runs(ROUNDS - 1) && !g.runs(ROUNDS - 2));
        g.observe(&sent(1000, 100));
        assert!(!g.runs(ROUNDS - 2), "between half and all of MAX_WASTE: stay");
        g.observe(&sent(1000, 500));
        g.observe(&sent(1000, 500));
        assert_eq!(closed_run(&mut g), FIRST_BACKOFF, "the backoff restarted");
    }

    /// A round that finds the epoch's earlier sends written again past
    /// the waste allowed stands the epoch's other rounds down at once;
    /// the next epoch's rounds run (from where the epoch's waste says).
    #[test]
    fn rounds_written_again_within_the_epoch_stand_down_until_it_ends() {
        let mut g = Gate::new(MAX_WASTE);
        assert!(!g.wasting(STAND_DOWN_SENDS - 1, STAND_DOWN_SENDS - 1), "too few sends to say within an epoch");
        assert!(!g.wasting(1000, 100), "a tenth written again pays");
        assert!(g.runs(1));
        assert!(g.wasting(1000, 800));
        assert!(!g.open() && !g.runs(ROUNDS), "the rest of the epoch runs no round");
        assert_eq!(g.start(), 0, "the epoch ran rounds from where it started");
        g.observe(&sent(1000, 800));
        assert!(g.open() && g.runs(1) && !g.runs(0), "the next epoch's rounds start one step later");
    }

    /// Rounds that find next to nothing to send rest for a few epochs,
    /// then look again; where they start stays, and so does the backoff.
    #[test]
    fn rounds_with_next_to_nothing_to_send_rest() {
        let mut g = Gate::new(MAX_WASTE);
        g.observe(&sent(1000, 500));
        g.observe(&sent(MIN_SENDS - 1, MIN_SENDS - 1));
        assert_eq!(closed_run(&mut g), FIRST_BACKOFF);
        assert!(g.runs(1) && !g.runs(0), "they start where they did");
        g.observe(&Sent::default());
        assert!(g.runs(1), "rounds that never ran say nothing");
        g.observe(&Sent { rounds: 2, ..Sent::default() });
        assert_eq!(closed_run(&mut g), FIRST_BACKOFF, "idle rests do not grow");
        g.observe(&sent(1000, 10));
        assert!(g.runs(0));
    }
}
