//! Trigger: when the next checkpoint is taken.
//!
//! `--trigger periodic` (Remus): every `--epoch-ms`. `--trigger output`
//! (PLOVER's idle-triggered sync): as soon as output is held and the guest
//! is idle (every vCPU waits: it answered and has nothing else to do), or
//! when the oldest held output has waited the hold bound, or when the epoch
//! reaches its maximum (guests that compute without output); never sooner
//! than a minimum spacing after the previous checkpoint, so a busy guest is
//! not checkpointed back to back. The spacing, hold bound and maximum
//! epoch come from measured checkpoint costs (`pacing`).
//!
//! In both modes a bounded resource of the primary may ask for the
//! checkpoint now (the disk journal when an epoch has written much), so no
//! checkpoint outgrows what the backup accepts; and a checkpoint waits for
//! room in the pipeline window (checkpoints sent and not yet acknowledged).

pub mod pacing;
pub(crate) mod reason;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use ftvm_vmm::hooks::IdleObserver;
use ftvm_vmm::sync::{self, Lock};
use ftvm_vmm::Vm;

use crate::output::{OutputBuffer, OutputListener};
use ftvm_vmm::switch;
pub use pacing::{Pacing, Sample};
pub use reason::{Reason, Started};

switch! {
    /// `--trigger`: what starts a checkpoint.
    pub enum Mode {
        /// Output held and the guest idle, output held for the hold bound,
        /// or the (adaptive) maximum epoch.
        Output = "output",
        /// Every `--epoch-ms`.
        Periodic = "periodic",
    }
}

switch! {
    /// `--group-commit`: whether an output-triggered checkpoint waits to
    /// carry more clients' requests when many wait on it.
    pub enum GroupCommit {
        /// The spacing grows with the clients the recent checkpoints' output
        /// went to, from `SPACING_PER_PAUSE` pauses (one client: waiting
        /// would only add to its latency) to `GROUP_SPACING_PER_PAUSE`
        /// (several: their next requests arrive meanwhile and share the
        /// checkpoint, which costs about the same).
        On = "on",
        /// Always `SPACING_PER_PAUSE` pauses.
        Off = "off",
    }
}

/// What the trigger needs to know of the guest.
pub trait Guest {
    /// When the open epoch's first output was held (None: nothing held).
    fn held_since(&self) -> Option<Instant>;
    /// Whether every vCPU waits right now.
    fn idle(&self) -> bool;
}

/// A running VM and its output buffer, as the trigger sees them.
pub struct GuestView<'a> {
    pub vm: &'a Vm,
    pub output: &'a OutputBuffer,
}

impl Guest for GuestView<'_> {
    fn held_since(&self) -> Option<Instant> {
        self.output.held_since()
    }

    fn idle(&self) -> bool {
        self.vm.is_idle() && self.output.may_be_idle(Instant::now())
    }
}

/// When the next checkpoint may and must start, from the previous one.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub mode: Mode,
    /// When the guest resumed from the previous checkpoint.
    pub since: Instant,
    /// Output-triggered checkpoints start no sooner than this after `since`.
    pub spacing: Duration,
    /// Held output waits at most this long for the guest to go idle.
    pub hold_bound: Duration,
    /// The epoch ends at `since + max_epoch` whatever happens.
    pub max_epoch: Duration,
}

/// What to do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Take(Reason),
    /// Nothing yet: wait until this instant at the latest; `idle` says
    /// whether the guest going idle would decide it.
    Wait {
        until: Instant,
        idle: bool,
    },
}

impl Plan {
    /// The decision at `now`, the journal having asked or not.
    pub fn decide(&self, now: Instant, journal: bool, guest: &dyn Guest) -> Decision {
        if journal {
            return Decision::Take(Reason::Journal);
        }
        let end = self.since + self.max_epoch;
        if now >= end {
            return Decision::Take(Reason::Epoch);
        }
        if self.mode == Mode::Periodic {
            return Decision::Wait { until: end, idle: false };
        }
        let Some(held) = guest.held_since() else { return Decision::Wait { until: end, idle: false } };
        let earliest = self.since + self.spacing;
        let bound = held + self.hold_bound;
        if now < earliest {
            return Decision::Wait { until: earliest.max(now).min(end), idle: false };
        }
        if now >= bound {
            return Decision::Take(Reason::Hold);
        }
        if guest.idle() {
            return Decision::Take(Reason::Idle);
        }
        Decision::Wait { until: bound.min(end), idle: true }
    }
}

#[derive(Default)]
struct State {
    /// The journal asked for a checkpoint (not yet taken).
    journal: bool,
    /// Something the replication thread waits for changed.
    poked: bool,
}

/// Shared between what starts checkpoints (the disk journal, the output
/// buffer, the idle hook, acknowledgements) and the replication thread.
#[derive(Default)]
pub struct Trigger {
    state: Mutex<State>,
    changed: Condvar,
    /// The replication thread waits for the guest to go idle: the idle hook
    /// wakes it (otherwise the hook costs one atomic load).
    watching_idle: AtomicBool,
}

/// Output held for the first time in an epoch may start a checkpoint
/// (`--trigger output`); a journal near its bound starts one.
impl OutputListener for Trigger {
    fn first_output_held(&self) {
        self.poke();
    }

    fn checkpoint_wanted(&self) {
        self.fire();
    }
}

impl Trigger {
    /// Ask for a checkpoint as soon as possible (a bound was reached).
    pub fn fire(&self) {
        let mut st = self.state.locked();
        st.journal = true;
        st.poked = true;
        drop(st);
        self.changed.notify_all();
    }

    /// Whether a checkpoint was asked for (and not yet taken).
    pub fn is_pending(&self) -> bool {
        self.state.locked().journal
    }

    /// Forget a request (the checkpoint it asked for is being taken).
    pub fn clear(&self) {
        self.state.locked().journal = false;
    }

    /// Something the replication thread may wait for happened: output was
    /// held, an acknowledgement made room in the window.
    pub fn poke(&self) {
        self.state.locked().poked = true;
        self.changed.notify_all();
    }

    /// Wait until `plan` says take a checkpoint (the reason; a journal
    /// request is consumed) with room in the window (`room`), or until
    /// `until`, whichever comes first (None: nothing to take yet).
    pub fn wait(&self, plan: &Plan, guest: &dyn Guest, room: impl Fn() -> bool, until: Instant) -> Option<Reason> {
        let mut st = self.state.locked();
        loop {
            st.poked = false;
            let now = Instant::now();
            let decision = if room() { plan.decide(now, st.journal, guest) } else { Decision::Wait { until, idle: false } };
            let (deadline, idle) = match decision {
                Decision::Take(reason) => {
                    st.journal = false;
                    self.watching_idle.store(false, Ordering::SeqCst);
                    return Some(reason);
                }
                Decision::Wait { until: d, idle } => (d.min(until), idle),
            };
            if idle {
                // Announced before looking again: a vCPU that starts waiting
                // after this look calls `all_idle`, which sees the flag.
                self.watching_idle.store(true, Ordering::SeqCst);
                if guest.idle() {
                    continue;
                }
            }
            if now >= deadline {
                self.watching_idle.store(false, Ordering::SeqCst);
                return None;
            }
            while !st.poked && Instant::now() < deadline {
                st = sync::wait_timeout(&self.changed, st, deadline - Instant::now());
            }
            self.watching_idle.store(false, Ordering::SeqCst);
        }
    }
}

impl IdleObserver for Trigger {
    fn all_idle(&self) {
        if self.watching_idle.load(Ordering::SeqCst) {
            self.poke();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    use super::*;

    /// A guest whose held output and idleness the test sets.
    #[derive(Default)]
    struct FakeGuest {
        held: Mutex<Option<Instant>>,
        idle: AtomicBool,
        looks: AtomicU64,
    }

    impl Guest for FakeGuest {
        fn held_since(&self) -> Option<Instant> {
            *self.held.locked()
        }
        fn idle(&self) -> bool {
            self.looks.fetch_add(1, Ordering::SeqCst);
            self.idle.load(Ordering::SeqCst)
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn plan(mode: Mode, since: Instant) -> Plan {
        Plan { mode, since, spacing: ms(2), hold_bound: ms(5), max_epoch: ms(20) }
    }

    #[test]
    fn periodic_waits_for_the_end_of_the_epoch_whatever_the_output() {
        let t0 = Instant::now();
        let g = FakeGuest::default();
        *g.held.locked() = Some(t0);
        g.idle.store(true, Ordering::SeqCst);
        let p = plan(Mode::Periodic, t0);
        assert_eq!(p.decide(t0 + ms(10), false, &g), Decision::Wait { until: t0 + ms(20), idle: false });
        assert_eq!(p.decide(t0 + ms(20), false, &g), Decision::Take(Reason::Epoch));
        assert_eq!(p.decide(t0 + ms(1), true, &g), Decision::Take(Reason::Journal));
    }

    #[test]
    fn output_waits_for_idle_after_the_spacing_up_to_the_hold_bound() {
        let t0 = Instant::now();
        let g = FakeGuest::default();
        let p = plan(Mode::Output, t0);
        assert_eq!(p.decide(t0 + ms(1), false, &g), Decision::Wait { until: t0 + ms(20), idle: false }, "nothing held");
        *g.held.locked() = Some(t0 + ms(1));
        g.idle.store(true, Ordering::SeqCst);
        assert_eq!(p.decide(t0 + ms(1), false, &g), Decision::Wait { until: t0 + ms(2), idle: false }, "the spacing first");
        assert_eq!(p.decide(t0 + ms(2), false, &g), Decision::Take(Reason::Idle));
        g.idle.store(false, Ordering::SeqCst);
        assert_eq!(p.decide(t0 + ms(3), false, &g), Decision::Wait { until: t0 + ms(6), idle: true }, "until the hold bound");
        assert_eq!(p.decide(t0 + ms(6), false, &g), Decision::Take(Reason::Hold));
        *g.held.locked() = Some(t0 + ms(18));
        assert_eq!(p.decide(t0 + ms(19), false, &g), Decision::Wait { until: t0 + ms(20), idle: true }, "the epoch ends first");
        assert_eq!(p.decide(t0 + ms(20), false, &g), Decision::Take(Reason::Epoch));
    }

    #[test]
    fn held_output_and_an_idle_guest_end_the_wait() {
        let t = Arc::new(Trigger::default());
        let g = Arc::new(FakeGuest::default());
        let p = Plan {
            spacing: Duration::ZERO,
            hold_bound: Duration::from_secs(60),
            max_epoch: Duration::from_secs(60),
            ..plan(Mode::Output, Instant::now())
        };
        assert_eq!(t.wait(&p, g.as_ref(), || true, Instant::now() + ms(5)), None, "nothing held: the deadline passes");
        let (t2, g2) = (t.clone(), g.clone());
        let other = std::thread::spawn(move || {
            std::thread::sleep(ms(20));
            *g2.held.locked() = Some(Instant::now());
            t2.poke(); // as the output buffer does
            std::thread::sleep(ms(20));
            g2.idle.store(true, Ordering::SeqCst);
            t2.all_idle(); // as the VMM does
        });
        let t0 = Instant::now();
        assert_eq!(t.wait(&p, g.as_ref(), || true, Instant::now() + Duration::from_secs(60)), Some(Reason::Idle));
        assert!(t0.elapsed() < Duration::from_secs(60));
        other.join().unwrap();
        assert!(!t.watching_idle.load(Ordering::SeqCst), "not watching once decided");
    }

    #[test]
    fn a_full_window_waits_for_room_and_a_journal_request_is_consumed_once() {
        let t = Arc::new(Trigger::default());
        let g = FakeGuest::default();
        let p = plan(Mode::Periodic, Instant::now());
        let room = Arc::new(AtomicBool::new(false));
        t.fire();
        let r = room.clone();
        assert_eq!(t.wait(&p, &g, move || r.load(Ordering::SeqCst), Instant::now() + ms(5)), None, "no room");
        assert!(t.is_pending(), "still asked for");
        let (t2, r2) = (t.clone(), room.clone());
        let acks = std::thread::spawn(move || {
            std::thread::sleep(ms(20));
            r2.store(true, Ordering::SeqCst);
            t2.poke(); // as an acknowledgement does
        });
        let r = room.clone();
        assert_eq!(t.wait(&p, &g, move || r.load(Ordering::SeqCst), Instant::now() + Duration::from_secs(60)), Some(Reason::Journal));
        acks.join().unwrap();
        assert!(!t.is_pending(), "consumed by the wait");
        t.fire();
        t.clear();
        assert!(!t.is_pending(), "cleared");
    }

    /// The trigger's view of a guest that is always idle, its held output
    /// read from `out`.
    struct IdleGuest(Arc<crate::output::OutputBuffer>);

    impl Guest for IdleGuest {
        fn held_since(&self) -> Option<Instant> {
            self.0.held_since()
        }
        fn idle(&self) -> bool {
            true
        }
    }

    #[test]
    fn the_first_output_of_an_epoch_wakes_the_trigger() {
        use crate::output::OutputBuffer;
        use ftvm_vmm::hooks::{ConsoleSink, FrameSink};

        let trigger = Arc::new(Trigger::default());
        let out = Arc::new(OutputBuffer::new(Arc::new(crate::test_util::Wire::default())).with_trigger(trigger.clone()));
        out.send(b"unprotected");
        assert_eq!(out.held_since(), None, "nothing held unprotected");
        out.protect(1);
        let long = Duration::from_secs(60);
        let plan = Plan { mode: Mode::Output, since: Instant::now(), spacing: Duration::ZERO, hold_bound: long, max_epoch: long };
        let sender = {
            let out = out.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                ConsoleSink::write(out.as_ref(), b"a line\n");
            })
        };
        let t0 = Instant::now();
        assert_eq!(trigger.wait(&plan, &IdleGuest(out.clone()), || true, t0 + long), Some(Reason::Idle));
        assert!(t0.elapsed() < long);
        sender.join().unwrap();
        let since = out.held_since().expect("held");
        out.send(b"f");
        assert_eq!(out.held_since(), Some(since), "from the epoch's first output");
        out.close_epoch();
        assert_eq!(out.held_since(), None, "the next epoch holds nothing yet");
    }
}
