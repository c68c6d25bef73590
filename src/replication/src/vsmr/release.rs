//! `--ack-release link`: the leader's held output is released by the link
//! thread that reads the secondary's `SyncAck`, as primary-backup's
//! acknowledgement reader does, instead of by the applier once the
//! acknowledgement was handed to it. The release writes every held frame
//! to the TAP (about 20 µs each here, 0.5 ms per `syncvm` under
//! redis-benchmark): off the applier, committed input reaches the guest
//! meanwhile, and the acknowledgement's hand-off no longer delays it.
//!
//! The link thread hands the acknowledgement on first, then releases: the
//! waiting thread does everything else (status, compaction, metrics, the
//! next `syncvm`) meanwhile, and leaves the release to it.

use std::sync::{Arc, Mutex};

use ftvm_vmm::sync::Lock;

use super::sync::SyncId;
use crate::output::OutputBuffer;

/// The one acknowledgement the leader awaits, for the link thread.
#[derive(Default)]
pub struct Awaited(Mutex<State>);

#[derive(Default)]
enum State {
    #[default]
    Idle,
    Expected(Expected),
    /// A link thread took it: that thread releases the output.
    Taken,
}

struct Expected {
    peer: u64,
    id: SyncId,
    /// The output epoch that `syncvm`'s freeze closed.
    epoch: u64,
    output: Arc<OutputBuffer>,
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
    /// From before the `syncvm`'s pages are sent: `peer`'s `SyncAck` of
    /// `id` releases `output` through `epoch`.
    pub fn expect(&self, peer: u64, id: SyncId, epoch: u64, output: Arc<OutputBuffer>) {
        *self.0.locked() = State::Expected(Expected { peer, id, epoch, output });
    }

    /// The `syncvm` is over (acknowledged or failed) or this replica
    /// stepped down: no link thread takes it from now on. Whether one took
    /// it (then that thread releases the output: the caller need not).
    pub fn cancel(&self) -> bool {
        matches!(std::mem::take(&mut *self.0.locked()), State::Taken)
    }

    /// A link thread read a `SyncAck` from `from` (its payload): the
    /// release to make if it is the awaited one. The acknowledgement is
    /// then true whatever happens next (the secondary staged the leader's
    /// state and commits it), so the release stands even if the waiting
    /// thread gave up meanwhile or this replica stepped down: the `Sync`
    /// entry was committed, and every later leader applied it.
    pub fn take(&self, from: u64, payload: &[u8]) -> Option<Release> {
        let mut state = self.0.locked();
        let State::Expected(e) = &*state else { return None };
        if e.peer != from || SyncId::parse(payload) != Some(e.id) {
            return None;
        }
        let State::Expected(e) = std::mem::replace(&mut *state, State::Taken) else { unreachable!("matched above") };
        Some(Release { epoch: e.epoch, output: e.output })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::Wire;
    use ftvm_vmm::hooks::FrameSink;

    fn ack(id: SyncId) -> Vec<u8> {
        id.header().to_vec()
    }

    /// Only the awaited peer's acknowledgement of the awaited `syncvm`
    /// releases, only the epoch its freeze closed, once; output of the
    /// epoch after it (the guest's since its resume) stays held.
    #[test]
    fn only_the_awaited_ack_releases_and_only_its_epoch() {
        let wire = Arc::new(Wire::default());
        let output = Arc::new(OutputBuffer::new(wire.clone()));
        output.protect(0);
        output.send(b"before the freeze");
        output.close_epoch(); // the freeze of syncvm (1, 7): epoch 0 closed
        output.send(b"after the resume");
        let awaited = Awaited::default();
        let id = SyncId { term: 1, index: 7 };
        awaited.expect(2, id, 0, output.clone());
        assert!(awaited.take(3, &ack(id)).is_none(), "another replica's ack");
        assert!(awaited.take(2, &ack(SyncId { term: 1, index: 6 })).is_none(), "a stale syncvm's ack");
        assert!(awaited.take(2, b"short").is_none(), "a malformed ack");
        assert!(wire.0.locked().is_empty());
        let release = awaited.take(2, &ack(id)).expect("the awaited ack");
        assert!(awaited.take(2, &ack(id)).is_none(), "taken once");
        assert!(wire.0.locked().is_empty(), "released only when run");
        release.run();
        assert_eq!(*wire.0.locked(), vec![b"before the freeze".to_vec()]);
        assert!(awaited.cancel(), "the waiting thread learns that the link thread released");
        // A cancelled wait: nothing taken, the waiting thread releases.
        output.close_epoch();
        awaited.expect(2, SyncId { term: 1, index: 8 }, 1, output.clone());
        assert!(!awaited.cancel());
        assert!(awaited.take(2, &ack(SyncId { term: 1, index: 8 })).is_none());
        assert_eq!(wire.0.locked().len(), 1);
    }
}
