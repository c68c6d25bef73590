//! What the replicated log holds (raft entries' data, postcard-encoded):
//! the leader's network input and its `syncvm` points, in one order.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use ftvm_replication::protocol::ProtocolError;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Entry {
    /// A frame that reached the leader's TAP (with its virtio-net header),
    /// delivered to every VM replica's guest in log order.
    Input(Vec<u8>),
    /// `syncvm`: the VM replicas pause here (after every earlier input) and
    /// the leader brings `secondary` to its state; `full` compares every
    /// page (a secondary it has not synchronized before). `secondary` 0:
    /// no secondary, only a barrier (the leader still leads when it commits).
    Sync { leader: u64, secondary: u64, full: bool },
    /// Frames that reached the leader's TAP together (one read pass of its
    /// network card, or queued for the consensus thread in one round;
    /// `--input-batch on`), delivered in this order: one entry, one raft
    /// bookkeeping and one delivery for all of them.
    Inputs(Vec<Vec<u8>>),
}

/// Most frames one `Inputs` entry holds: a long read pass (a flood) still
/// goes into the log in bounded entries.
pub const MAX_INPUT_FRAMES: usize = 64;

impl Entry {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("log entries serialize")
    }

    pub fn decode(data: &[u8]) -> Result<Entry, ProtocolError> {
        ftvm_replication::protocol::decode(data)
    }

    /// Whether encoded `data` is an `Input` or `Inputs` entry, without
    /// decoding (copying) its frames: postcard writes the variant's index
    /// first, as a varint (one byte here).
    pub fn is_input(data: &[u8]) -> bool {
        matches!(data.first(), Some(0 | 2))
    }
}

/// Input entries and their frames handed on by the consensus thread since
/// the last `take` (the `syncvm` metrics' `input_entries`, `input_frames`).
#[derive(Debug, Default)]
pub struct InputCounts {
    entries: AtomicU64,
    frames: AtomicU64,
}

impl InputCounts {
    pub fn add(&self, frames: usize) {
        self.entries.fetch_add(1, Ordering::Relaxed);
        self.frames.fetch_add(frames as u64, Ordering::Relaxed);
    }

    /// (entries, frames) since the previous call.
    pub fn take(&self) -> (u64, u64) {
        (self.entries.swap(0, Ordering::Relaxed), self.frames.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_garbage_is_refused() {
        for e in [
            Entry::Input(vec![1, 2, 3]),
            Entry::Sync { leader: 1, secondary: 2, full: true },
            Entry::Inputs(vec![vec![4, 5], vec![], vec![6]]),
        ] {
            assert_eq!(Entry::decode(&e.encode()).unwrap(), e);
        }
        assert!(Entry::decode(&[9, 9, 9]).is_err());
    }

    #[test]
    fn input_is_told_without_decoding() {
        assert!(Entry::is_input(&Entry::Input(vec![7; 100]).encode()));
        assert!(Entry::is_input(&Entry::Inputs(vec![vec![7; 100]]).encode()));
        assert!(!Entry::is_input(&Entry::Sync { leader: 1, secondary: 2, full: false }.encode()));
        assert!(!Entry::is_input(&[]));
    }
}
