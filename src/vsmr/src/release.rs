//! The acknowledgements of `syncvm`s the leader awaits, and the release of
//! their held output.
//!
//! Every `SyncAck` a link thread reads passes through here (`take`)
//! before the `syncvm` exchange sees it. Two uses:
//!
//! - `--ack-release link`: the link thread that reads the acknowledgement
//!   releases the held output itself, as primary-backup's acknowledgement
//!   reader does, instead of the thread that waits for it. The release
//!   writes every held frame to the TAP (about 20 µs each here, 0.5 ms per
//!   `syncvm` under redis-benchmark): off the applier, committed input
//!   reaches the guest meanwhile. The link thread hands the
//!   acknowledgement on first, then releases: the waiting thread does
//!   everything else (status, compaction, metrics, the next `syncvm`)
//!   meanwhile, and leaves the release to it.
//! - `--sync-pipeline on`: a second `syncvm` runs its exchange (on the
//!   applier, reading the `syncvm` messages) while the first one's
//!   acknowledgement is awaited (by the acknowledgement thread, `wait`),
//!   so that acknowledgement must reach its waiter without going through
//!   the exchange's inbox.
//!
//! Output leaves in order: an acknowledgement releases its epoch only once
//! every `syncvm` awaited before it was released, and a `syncvm` that
//! failed (`finish`) abandons every one awaited after it, whose
//! acknowledgements then release nothing.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use ftvm_vmm::sync::{self as vsync, Lock};

use crate::sync_id::SyncId;
use ftvm_replication::output::OutputBuffer;

/// The acknowledgements the leader awaits, oldest first.
#[derive(Default)]
pub struct Awaited {
    queue: Mutex<VecDeque<Expected>>,
    /// An acknowledgement came, a link closed, or an entry was abandoned.
    changed: Condvar,
}

/// Where one awaited acknowledgement stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ack {
    Waiting,
    /// It came; its output is not released yet (by the waiter, or by a
    /// link thread once every earlier one was).
    Acked,
    /// It came and a link thread released its output.
    Released,
    /// The peer's link closed before it came.
    Lost,
    /// An earlier `syncvm` failed: its acknowledgement releases nothing.
    Abandoned,
}

struct Expected {
    peer: u64,
    id: SyncId,
    /// The output epoch that `syncvm`'s freeze closed.
    epoch: u64,
    output: Arc<OutputBuffer>,
    /// `--ack-release link`: the link thread releases it.
    link: bool,
    state: Ack,
}

/// How a wait for an acknowledgement ended (`Awaited::wait`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    Acked,
    /// The peer's link closed.
    Lost,
    /// An earlier `syncvm` failed, or this replica stepped down.
    Abandoned,
    Timeout,
}

/// A release a link thread is to make (`Awaited::take`), once it handed
/// the acknowledgement on.
pub struct Release {
    epoch: u64,
    output: Arc<OutputBuffer>,
}

impl Release {
    pub fn run(self) {
        self.output.release_through(self.epoch);
    }
}

impl Awaited {
    /// From before the `syncvm`'s pages are sent (the acknowledgement
    /// cannot come first): `peer`'s `SyncAck` of `id` acknowledges `output`
    /// through `epoch`; with `link`, the link thread that reads it releases
    /// that output. `abandoned`: a `syncvm` failed since this one was
    /// proposed, so its acknowledgement releases nothing.
    pub fn expect(&self, peer: u64, id: SyncId, epoch: u64, output: Arc<OutputBuffer>, link: bool, abandoned: bool) {
        let state = if abandoned { Ack::Abandoned } else { Ack::Waiting };
        self.queue.locked().push_back(Expected { peer, id, epoch, output, link, state });
    }

    /// A link thread read a `SyncAck` from `from` (its payload): the
    /// release to make, if it is an awaited one whose output the link
    /// thread releases and every earlier one was released (then it
    /// releases those acknowledged after it too, in one go). The
    /// acknowledgement is then true whatever happens next (the secondary
    /// staged the leader's state and commits it), so the release stands
    /// even if the waiting thread gave up meanwhile or this replica
    /// stepped down: the `Sync` entry was committed, and every later
    /// leader applied it.
    pub fn take(&self, from: u64, payload: &[u8]) -> Option<Release> {
        let id = SyncId::parse(payload)?;
        let mut queue = self.queue.locked();
        let e = queue.iter_mut().find(|e| e.peer == from && e.id == id && e.state == Ack::Waiting)?;
        e.state = Ack::Acked;
        self.changed.notify_all();
        // The acknowledged run at the head of the queue, in order.
        let mut release: Option<Release> = None;
        for e in queue.iter_mut().skip_while(|e| e.state == Ack::Released) {
            if e.state != Ack::Acked || !e.link {
                break;
            }
            e.state = Ack::Released;
            release = Some(Release { epoch: e.epoch, output: e.output.clone() });
        }
        release
    }

    /// The link from `peer` closed: the acknowledgements awaited from it
    /// will not come.
    pub fn lost(&self, peer: u64) {
        let mut queue = self.queue.locked();
        for e in queue.iter_mut().filter(|e| e.peer == peer && e.state == Ack::Waiting) {
            e.state = Ack::Lost;
        }
        self.changed.notify_all();
    }

    /// Wait until `id`'s acknowledgement came, or it cannot come, or
    /// `deadline`; `lost` says whether the peer's link is down now (it may
    /// have closed before this `syncvm` was awaited).
    pub fn wait(&self, id: SyncId, deadline: Instant, lost: impl Fn() -> bool) -> Waited {
        let mut queue = self.queue.locked();
        loop {
            match queue.iter().find(|e| e.id == id).map(|e| e.state) {
                Some(Ack::Acked | Ack::Released) => return Waited::Acked,
                Some(Ack::Lost) => return Waited::Lost,
                Some(Ack::Abandoned) | None => return Waited::Abandoned,
                Some(Ack::Waiting) => {}
            }
            if lost() {
                return Waited::Lost;
            }
            let now = Instant::now();
            if now >= deadline {
                return Waited::Timeout;
            }
            // Woken by any change; the link's state is looked at again at
            // least every 20 ms.
            let step = (deadline - now).min(std::time::Duration::from_millis(20));
            queue = vsync::wait_timeout(&self.changed, queue, step);
        }
    }

    /// The `syncvm` `id` is over (acknowledged, `ok`, or failed): no link
    /// thread takes its acknowledgement from now on, and if it failed,
    /// every `syncvm` awaited after it is abandoned. Whether a link thread
    /// released its output (then the caller need not).
    pub fn finish(&self, id: SyncId, ok: bool) -> bool {
        let mut queue = self.queue.locked();
        let Some(at) = queue.iter().position(|e| e.id == id) else { return false };
        let e = queue.remove(at).expect("found above");
        if !ok {
            for later in queue.iter_mut().skip(at).filter(|l| matches!(l.state, Ack::Waiting | Ack::Acked)) {
                later.state = Ack::Abandoned;
            }
            self.changed.notify_all();
        }
        e.state == Ack::Released
    }

    /// This replica stepped down: no link thread takes any of them from
    /// now on, and every wait ends.
    pub fn clear(&self) {
        self.queue.locked().clear();
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftvm_replication::test_util::Wire;
    use ftvm_vmm::hooks::FrameSink;
    use std::time::Duration;

    fn ack(id: SyncId) -> Vec<u8> {
        id.header().to_vec()
    }

    fn sync(index: u64) -> SyncId {
        SyncId { term: 1, index }
    }

    /// A protected buffer with `epochs` closed epochs, each holding one
    /// frame named after it, and one frame in the open epoch.
    fn held(epochs: u64) -> (Arc<Wire>, Arc<OutputBuffer>) {
        let wire = Arc::new(Wire::default());
        let output = Arc::new(OutputBuffer::new(wire.clone()));
        output.protect(0);
        for e in 0..epochs {
            output.send(format!("epoch {e}").as_bytes());
            output.close_epoch();
        }
        output.send(b"open");
        (wire, output)
    }

    fn sent(wire: &Wire) -> Vec<String> {
        wire.0.locked().iter().map(|f| String::from_utf8_lossy(f).into_owned()).collect()
    }

    /// `held(epochs)` with two `syncvm`s awaited from peer 2: 7 closing
    /// epoch 0 and 9 closing epoch 1, released by the link thread (`link`)
    /// or by their waiters.
    fn awaiting_7_and_9(epochs: u64, link: bool) -> (Arc<Wire>, Arc<OutputBuffer>, Arc<Awaited>) {
        let (wire, output) = held(epochs);
        let awaited = Arc::new(Awaited::default());
        awaited.expect(2, sync(7), 0, output.clone(), link, false);
        awaited.expect(2, sync(9), 1, output.clone(), link, false);
        (wire, output, awaited)
    }

    /// Only the awaited peer's acknowledgement of the awaited `syncvm`
    /// releases, only the epoch its freeze closed, once; output of the
    /// epoch after it (the guest's since its resume) stays held.
    #[test]
    fn only_the_awaited_ack_releases_and_only_its_epoch() {
        let (wire, output) = held(1);
        let awaited = Awaited::default();
        let id = sync(7);
        awaited.expect(2, id, 0, output.clone(), true, false);
        assert!(awaited.take(3, &ack(id)).is_none(), "another replica's ack");
        assert!(awaited.take(2, &ack(sync(6))).is_none(), "a stale syncvm's ack");
        assert!(awaited.take(2, b"short").is_none(), "a malformed ack");
        assert!(sent(&wire).is_empty());
        let release = awaited.take(2, &ack(id)).expect("the awaited ack");
        assert!(awaited.take(2, &ack(id)).is_none(), "taken once");
        assert!(sent(&wire).is_empty(), "released only when run");
        release.run();
        assert_eq!(sent(&wire), ["epoch 0"]);
        assert!(awaited.finish(id, true), "the waiting thread learns that the link thread released");
        // A finished wait: nothing taken, the waiting thread releases.
        output.close_epoch();
        awaited.expect(2, sync(8), 1, output.clone(), true, false);
        assert!(!awaited.finish(sync(8), true));
        assert!(awaited.take(2, &ack(sync(8))).is_none());
        assert_eq!(sent(&wire).len(), 1);
    }

    /// `--sync-pipeline on` with `--ack-release link`: two `syncvm`s
    /// awaited at once. Acknowledged out of order (from one secondary
    /// over one link they cannot be: it sends the second's only after it
    /// applied the first; from two, or after a lost one, they could), the
    /// second releases nothing until the first is acknowledged, and then
    /// both epochs leave, in order.
    #[test]
    fn two_epochs_acknowledged_out_of_order_leave_in_order() {
        let (wire, _, awaited) = awaiting_7_and_9(2, true);
        assert!(awaited.take(2, &ack(sync(9))).is_none(), "the second first: held until the first is released");
        assert_eq!(awaited.wait(sync(9), Instant::now(), || false), Waited::Acked, "its waiter learns it came");
        assert_eq!(awaited.wait(sync(7), Instant::now(), || false), Waited::Timeout);
        assert!(sent(&wire).is_empty());
        awaited.take(2, &ack(sync(7))).expect("the first releases both").run();
        assert_eq!(sent(&wire), ["epoch 0", "epoch 1"], "in order, and not the open epoch");
        assert!(awaited.finish(sync(7), true));
        assert!(awaited.finish(sync(9), true));
    }

    /// In order, each acknowledgement releases its own epoch only.
    #[test]
    fn two_epochs_acknowledged_in_order_leave_one_by_one() {
        let (wire, _, awaited) = awaiting_7_and_9(2, true);
        awaited.take(2, &ack(sync(7))).expect("the first").run();
        assert_eq!(sent(&wire), ["epoch 0"]);
        assert!(awaited.finish(sync(7), true));
        awaited.take(2, &ack(sync(9))).expect("the second").run();
        assert_eq!(sent(&wire), ["epoch 0", "epoch 1"]);
    }

    /// A failed `syncvm` abandons the one awaited after it: that one's
    /// acknowledgement releases nothing (its epoch would carry the failed
    /// one's with it), and its waiter learns at once; so is one registered
    /// as abandoned (proposed before the failure, run after it).
    #[test]
    fn a_failed_syncvm_abandons_the_next() {
        let (wire, output, awaited) = awaiting_7_and_9(3, true);
        assert_eq!(awaited.wait(sync(7), Instant::now() + Duration::from_millis(5), || false), Waited::Timeout);
        assert!(!awaited.finish(sync(7), false));
        assert_eq!(awaited.wait(sync(9), Instant::now() + Duration::from_secs(60), || false), Waited::Abandoned);
        assert!(awaited.take(2, &ack(sync(9))).is_none(), "abandoned: releases nothing");
        assert!(!awaited.finish(sync(9), false));
        awaited.expect(2, sync(11), 2, output.clone(), true, true);
        assert!(awaited.take(2, &ack(sync(11))).is_none());
        assert_eq!(awaited.wait(sync(11), Instant::now(), || false), Waited::Abandoned);
        assert!(sent(&wire).is_empty(), "nothing left unacknowledged epochs");
    }

    /// With the waiter releasing (`--ack-release waiter`), an
    /// acknowledgement wakes the waiter and releases nothing itself; a
    /// closed link ends the wait; stepping down ends every wait.
    #[test]
    fn waiters_learn_of_acks_lost_links_and_step_downs() {
        let (wire, output, awaited) = awaiting_7_and_9(3, false);
        let a = awaited.clone();
        let acker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            assert!(a.take(2, &ack(sync(7))).is_none(), "the waiter releases");
        });
        assert_eq!(awaited.wait(sync(7), Instant::now() + Duration::from_secs(60), || false), Waited::Acked);
        acker.join().unwrap();
        assert!(!awaited.finish(sync(7), true));
        awaited.lost(2);
        assert_eq!(awaited.wait(sync(9), Instant::now() + Duration::from_secs(60), || false), Waited::Lost);
        assert!(awaited.take(2, &ack(sync(9))).is_none(), "lost: a late ack changes nothing");
        assert!(!awaited.finish(sync(9), false));
        awaited.expect(2, sync(11), 2, output.clone(), false, false);
        assert_eq!(awaited.wait(sync(11), Instant::now() + Duration::from_secs(60), || true), Waited::Lost, "the link is down now");
        awaited.clear();
        assert_eq!(awaited.wait(sync(11), Instant::now() + Duration::from_secs(60), || false), Waited::Abandoned);
        assert!(sent(&wire).is_empty());
    }
}
