//! `--ack-release link`: the leader's held output is released by the link
//! thread that reads the secondary's `SyncAck`, as primary-backup's
//! acknowledgement reader does, instead of by the applier once the
//! acknowledgement was handed to it. The release writes every held frame
//! to the TAP (about 20 µs each here, 0.5 ms per `syncvm` under
//! redis-benchmark): off the applier, committed input reaches the guest
//! meanwhile, and the acknowledgement's hand-off no longer delays it.
//!
//! The applier still receives the acknowledgement and does everything
//! else (status, compaction, metrics, the next `syncvm`); its own release
//! then finds nothing left of that epoch.

use std::sync::{Arc, Mutex};

use ftvm_vmm::sync::Lock;

use super::sync::SyncId;
use crate::output::OutputBuffer;

/// The one acknowledgement the leader awaits, for the link thread.
#[derive(Default)]
pub struct Awaited(Mutex<Option<Expected>>);

struct Expected {
    peer: u64,
    id: SyncId,
    /// The output epoch that `syncvm`'s freeze closed.
    epoch: u64,
    output: Arc<OutputBuffer>,
}

impl Awaited {
    /// From before the `syncvm`'s pages are sent: `peer`'s `SyncAck` of
    /// `id` releases `output` through `epoch`.
    pub fn expect(&self, peer: u64, id: SyncId, epoch: u64, output: Arc<OutputBuffer>) {
        *self.0.locked() = Some(Expected { peer, id, epoch, output });
    }

    /// The `syncvm` is over (acknowledged or failed) or this replica
    /// stepped down: release nothing more. Waits for a release in progress.
    pub fn cancel(&self) {
        *self.0.locked() = None;
    }

    /// A link thread read a `SyncAck` from `from` (its payload): release
    /// if it is the awaited one. Whether it released.
    pub fn acked(&self, from: u64, payload: &[u8]) -> bool {
        let mut awaited = self.0.locked();
        let matches = awaited.as_ref().is_some_and(|e| e.peer == from && SyncId::parse(payload) == Some(e.id));
        if !matches {
            return false;
        }
        let e = awaited.take().expect("checked above");
        // Under the lock: a `cancel` returns only once this is done.
        e.output.release_through(e.epoch);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftvm_vmm::hooks::FrameSink;

    #[derive(Default)]
    struct Wire(Mutex<Vec<Vec<u8>>>);

    impl FrameSink for Wire {
        fn send(&self, frame: &[u8]) {
            self.0.locked().push(frame.to_vec());
        }
    }

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
        assert!(!awaited.acked(3, &ack(id)), "another replica's ack");
        assert!(!awaited.acked(2, &ack(SyncId { term: 1, index: 6 })), "a stale syncvm's ack");
        assert!(!awaited.acked(2, b"short"), "a malformed ack");
        assert!(wire.0.locked().is_empty());
        assert!(awaited.acked(2, &ack(id)));
        assert_eq!(*wire.0.locked(), vec![b"before the freeze".to_vec()]);
        assert!(!awaited.acked(2, &ack(id)), "released once");
        // A cancelled wait releases nothing.
        output.close_epoch();
        awaited.expect(2, SyncId { term: 1, index: 8 }, 1, output.clone());
        awaited.cancel();
        assert!(!awaited.acked(2, &ack(SyncId { term: 1, index: 8 })));
        assert_eq!(wire.0.locked().len(), 1);
    }
}
