//! Which `syncvm` a message belongs to, as every `syncvm` message and
//! acknowledgement carries it.

use serde::{Deserialize, Serialize};

/// Which `syncvm` a message belongs to: its `Sync` entry's term and log
/// index, the first 16 bytes of every `syncvm` message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncId {
    pub term: u64,
    pub index: u64,
}

pub(crate) const ID_LEN: usize = 16;

impl SyncId {
    pub(crate) fn header(&self) -> [u8; ID_LEN] {
        let mut h = [0; ID_LEN];
        h[..8].copy_from_slice(&self.term.to_le_bytes());
        h[8..].copy_from_slice(&self.index.to_le_bytes());
        h
    }

    /// The id at the head of a message's payload.
    pub(crate) fn parse(payload: &[u8]) -> Option<SyncId> {
        let term = u64::from_le_bytes(payload.get(..8)?.try_into().ok()?);
        let index = u64::from_le_bytes(payload.get(8..ID_LEN)?.try_into().ok()?);
        Some(SyncId { term, index })
    }
}
