//! `--prefetch adaptive`: run an epoch's rounds only while they pay.
//!
//! A page a round sends and the guest writes again before the freeze is a
//! wasted send: the checkpoint carries it anyway, and the round's re-arm
//! cost the guest one more tracked first write for it (about 6 µs here, no
//! PML). A send that holds saves a page of the stop-and-copy, about 1 µs of
//! pause and of the wait for the acknowledgement. So rounds pay while few
//! of their sends are wasted; on a guest that rewrites most of what it
//! wrote within the epoch (a sequential sweep, random writes over a set
//! the epoch covers) nearly all are, and the guest runs several times
//! slower with them.
//!
//! After each epoch that ran rounds the gate looks at its share of wasted
//! sends; above `MAX_WASTE` it stops the rounds for a number of epochs
//! (`FIRST_BACKOFF`, doubling at every failed try up to `MAX_BACKOFF`),
//! then runs them for one epoch again (a probe): a guest that changed its
//! ways is followed, and one that did not pays for one epoch in
//! `MAX_BACKOFF`. Like `--predict-writes adaptive`, it decides on what the
//! guest did, one epoch late.

use super::Sent;

/// Rounds stop when more than this share of an epoch's sends were wasted.
/// At 6 µs a wasted send and about 1 µs saved by a useful one, the guest's
/// time breaks even near 1/7; a little above, the pause and the wait for
/// the acknowledgement still shrink while the guest loses little.
pub const MAX_WASTE: f64 = 0.25;
/// Fewer sends than this in an epoch say nothing either way.
const MIN_SENDS: u64 = 32;
/// Epochs without rounds after the first epoch found wasteful.
const FIRST_BACKOFF: u32 = 4;
/// The longest pause between two tries.
const MAX_BACKOFF: u32 = 64;

/// Whether the next epoch runs prefetch rounds.
#[derive(Clone, Copy, Debug)]
pub struct Gate {
    /// Epochs left without rounds.
    off_for: u32,
    /// How many epochs the next wasteful epoch stops the rounds for.
    backoff: u32,
}

impl Default for Gate {
    fn default() -> Gate {
        Gate { off_for: 0, backoff: FIRST_BACKOFF }
    }
}

impl Gate {
    /// Whether the open epoch runs rounds.
    pub fn open(&self) -> bool {
        self.off_for == 0
    }

    /// The open epoch closed; its rounds (if it ran any) sent `sent`.
    pub fn observe(&mut self, sent: &Sent) {
        if self.off_for > 0 {
            self.off_for -= 1;
            return;
        }
        if sent.pages < MIN_SENDS {
            return;
        }
        let wasted = sent.pages - sent.only_ahead;
        if wasted as f64 > sent.pages as f64 * MAX_WASTE {
            tracing::debug!(sent = sent.pages, wasted, epochs = self.backoff, "prefetch rounds wasted; stopped");
            self.off_for = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        } else {
            self.backoff = FIRST_BACKOFF;
        }
    }

    /// Dirty tracking restarts (a new backup): start trusting the rounds again.
    pub fn reset(&mut self) {
        *self = Gate::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(pages: u64, wasted: u64) -> Sent {
        Sent { pages, bytes: pages * 4096, only_ahead: pages - wasted }
    }

    /// Epochs the gate keeps closed after `epochs` more observations.
    fn closed_run(g: &mut Gate) -> u32 {
        let mut n = 0;
        while !g.open() {
            g.observe(&Sent::default());
            n += 1;
        }
        n
    }

    #[test]
    fn wasteful_rounds_stop_for_longer_each_time_and_a_good_probe_resets() {
        let mut g = Gate::default();
        assert!(g.open());
        g.observe(&sent(1000, 100));
        assert!(g.open(), "10% wasted pays");
        g.observe(&sent(1000, 900));
        assert_eq!(closed_run(&mut g), FIRST_BACKOFF);
        // The probe is wasteful again: twice as long.
        g.observe(&sent(1000, 900));
        assert_eq!(closed_run(&mut g), 2 * FIRST_BACKOFF);
        for _ in 0..10 {
            g.observe(&sent(1000, 900));
            closed_run(&mut g);
        }
        g.observe(&sent(1000, 900));
        assert_eq!(closed_run(&mut g), MAX_BACKOFF, "the pause between tries is bounded");
        // A probe that pays keeps the rounds, and a later wasteful epoch
        // stops them only briefly.
        g.observe(&sent(1000, 10));
        assert!(g.open());
        g.observe(&sent(1000, 900));
        assert_eq!(closed_run(&mut g), FIRST_BACKOFF);
    }

    #[test]
    fn a_few_sends_decide_nothing() {
        let mut g = Gate::default();
        g.observe(&sent(MIN_SENDS - 1, MIN_SENDS - 1));
        assert!(g.open());
        g.observe(&Sent::default());
        assert!(g.open());
    }
}
