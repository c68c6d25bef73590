//! What the replicated log holds (raft entries' data, postcard-encoded):
//! the leader's network input and its `syncvm` points, in one order.

use serde::{Deserialize, Serialize};

use crate::protocol::ProtocolError;

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
}

impl Entry {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("log entries serialize")
    }

    pub fn decode(data: &[u8]) -> Result<Entry, ProtocolError> {
        crate::protocol::decode(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_garbage_is_refused() {
        for e in [Entry::Input(vec![1, 2, 3]), Entry::Sync { leader: 1, secondary: 2, full: true }] {
            assert_eq!(Entry::decode(&e.encode()).unwrap(), e);
        }
        assert!(Entry::decode(&[9, 9, 9]).is_err());
    }
}
