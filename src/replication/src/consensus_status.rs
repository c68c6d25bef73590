//! What a consensus-ordered replica adds to its status (`ftvm status`,
//! `--metrics`): its last `syncvm` and the election that made it leader.
//! Plain data, kept here beside the other roles' figures so that the
//! status every role reports is one type the control API and the metrics
//! files know, without the core knowing how replicas work.

use serde::{Deserialize, Serialize};

/// One `syncvm` as a replica records it (`--metrics`, `ftvm status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncMetrics {
    pub term: u64,
    /// The `Sync` entry's log index.
    pub index: u64,
    /// `leader` or `secondary`: this replica's part.
    pub role: SyncRole,
    /// The other VM replica (0: none, a consensus barrier).
    pub peer: u64,
    /// Every page compared (a secondary not synchronized before).
    pub full: bool,
    /// Completed (acknowledged and applied).
    pub ok: bool,
    /// Every byte this replica sent on its replication links since the
    /// previous `syncvm`: consensus messages and `syncvm` messages.
    pub bytes: u64,
    /// Pages written on either VM replica since the previous `syncvm` (the union).
    pub dirty_pages: u64,
    /// Of those, pages whose contents differed: sent.
    pub divergent_pages: u64,
    /// Of those, pages sent as their changed 64-byte blocks
    /// (`--sync-pages blocks`, or `adaptive` while it sends blocks).
    #[serde(default)]
    pub patched_pages: u64,
    /// The secondary: of those, pages that did not hash to the leader's
    /// page hash once patched (a block-hash collision) and came whole in
    /// one more round trip.
    #[serde(default)]
    pub repaired_pages: u64,
    /// Bytes of the divergent pages and state message.
    pub page_bytes: u64,
    /// Disk blocks (4 KiB) written on either VM replica since the previous
    /// `syncvm` (the union; every block in a full one).
    pub dirty_blocks: u64,
    /// Of those, blocks whose contents differed: sent.
    pub divergent_blocks: u64,
    /// How long this replica's guest was paused.
    pub pause_us: u64,
    /// From the previous `syncvm`'s end to this one's start.
    pub interval_us: u64,
    /// From the start of the pause until the exchange ended.
    pub sync_us: u64,
    /// Frames this replica sent on its replication links since the
    /// previous `syncvm` (as `bytes`).
    #[serde(default)]
    pub messages: u64,
    /// What compression kept off those links (`--link-compress lz4`): the
    /// bytes `bytes` would have been more without it.
    #[serde(default)]
    pub saved_bytes: u64,
    /// The steps (docs/replicas.md, "Metrics"). The leader: from its
    /// proposal of the `Sync` entry until its applier reached it (the
    /// consensus round); 0 on the secondary.
    #[serde(default)]
    pub propose_us: u64,
    /// The leader with `--sync-pipeline on`: proposed while the previous
    /// `syncvm` still awaited its acknowledgement.
    #[serde(default)]
    pub overlapped: bool,
    /// The leader: its freeze (vCPUs paused, dirty set and VM state
    /// taken); the secondary: taking its dirty set once paused.
    #[serde(default)]
    pub freeze_us: u64,
    /// From sending this side's dirty bitmap until the peer's arrived
    /// (the leader's copy of its own dirty pages meanwhile not counted).
    #[serde(default)]
    pub bitmap_us: u64,
    /// The leader with `--early-resume on`: copying the union's pages and
    /// disk blocks aside, in its pause (0 otherwise).
    #[serde(default)]
    pub copy_us: u64,
    /// Hashing the union's pages and disk blocks, this side (the leader
    /// with `--early-resume on`: its copy, after the resume).
    #[serde(default)]
    pub hash_us: u64,
    /// The leader: waiting for the secondary's hashes once its own were
    /// done (and the block hashes of `--sync-pages blocks`); the
    /// secondary: from sending its hashes until the leader's pages came.
    #[serde(default)]
    pub wait_us: u64,
    /// The leader: from sending the pages until the secondary's
    /// acknowledgement (which releases the output); 0 on the secondary.
    #[serde(default)]
    pub ack_us: u64,
    /// Input log entries this replica was handed since the previous
    /// `syncvm`, and the frames in them (more frames than entries:
    /// `--input-batch on` put several in one).
    #[serde(default)]
    pub input_entries: u64,
    #[serde(default)]
    pub input_frames: u64,
    /// `--predict-writes`: this replica's pages left writable through the
    /// interval (in the union whether written or not), and of those the
    /// pages that were written.
    #[serde(default)]
    pub predicted: u64,
    #[serde(default)]
    pub predicted_written: u64,
    /// Tests only (`FTVM_TEST_FAULT=syncvm-digest:1`): a digest of all
    /// guest memory, the leader's at its freeze, the secondary's once the
    /// pages are applied: equal when the divergence was repaired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_digest: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncRole {
    #[default]
    Leader,
    Secondary,
}

/// How this replica found its leader dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Detection {
    /// The link the leader dialled to this replica closed.
    LinkClosed,
    /// Nothing from the leader for `--failure-timeout-ms`.
    Silent,
}

/// What started the election that made a replica leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cause", rename_all = "kebab-case")]
pub enum Cause {
    /// This replica found the leader `leader` dead.
    Detected { leader: u64, how: Detection },
    /// raft's randomized election timeout (no failure detected first).
    Timeout,
    /// A leader that may not lead (the witness, a replica not in step)
    /// handed leadership over.
    Handover { from: u64 },
}

/// The election that made this replica leader (`ftvm status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Election {
    pub term: u64,
    #[serde(flatten)]
    pub cause: Cause,
    /// From the detection (or the campaign) to leading, in microseconds.
    pub after_us: u64,
}

impl std::fmt::Display for Election {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "term {}, ", self.term)?;
        match self.cause {
            Cause::Detected { leader, how: Detection::LinkClosed } => write!(f, "started when leader {leader}'s link closed")?,
            Cause::Detected { leader, how: Detection::Silent } => {
                write!(f, "started when leader {leader} was silent past the failure timeout")?
            }
            Cause::Timeout => write!(f, "started by the election timeout")?,
            Cause::Handover { from } => write!(f, "handed over by {from}")?,
        }
        write!(f, ", leading {} us later", self.after_us)
    }
}
