//! What arrives at a replica: a peer's messages, routed by kind, and the
//! events that drive its consensus thread (messages for raft, a lost
//! link, proposals, compaction, an operator's membership change). Below both the links (`mesh`) that
//! produce them and the consensus thread (`node`) that consumes them.

use std::sync::mpsc::Sender;
use std::time::Instant;

use ftvm_replication::protocol::Kind;

/// A message from a peer.
pub struct Inbound {
    pub from: u64,
    pub kind: Kind,
    pub payload: Vec<u8>,
    /// Not a message: the link from `from` closed at this instant (sent to
    /// the `syncvm` route, so that an exchange with a dead peer ends at
    /// once instead of at its step timeout, its guest paused meanwhile).
    pub lost: Option<Instant>,
}

/// What drives the consensus thread.
pub enum Event {
    Peer(Inbound),
    /// The link this peer dialled here closed (`Mesh`).
    PeerLost(u64),
    /// Append this entry to the log (only a leader does; others drop it).
    Propose(Vec<u8>),
    /// `--input-batch on`: frames the leader's TAP gave in one read pass.
    /// Those queued in one round of this thread become one `Inputs` entry,
    /// proposed before any later proposal (only a leader; others drop them).
    Inputs(Vec<Vec<u8>>),
    /// A `syncvm` completed at this index: the log before it is not needed
    /// any more (a replica that lacks it gets raft's snapshot and then a
    /// full `syncvm`).
    Compact(u64),
    /// An operator asks this replica (the leader) to replace a member
    /// (`membership`).
    Replace(Replace),
}

/// `ftvm replica-replace`: replace member `remove` by a new replica `add`
/// listening at `addr`; the answer says whether the change was proposed.
pub struct Replace {
    pub remove: u64,
    pub add: u64,
    pub addr: String,
    pub reply: Sender<Result<String, String>>,
}
