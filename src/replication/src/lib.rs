//! Fault tolerance for ftvm VMs: a primary checkpoints its VM to a backup
//! every epoch and holds each epoch's network output until the backup has
//! acknowledged it; the backup applies checkpoints atomically and takes the
//! VM over when the primary disappears.

pub mod arbiter;
pub mod backup;
pub mod bounds;
pub mod checkpoint;
pub mod fakeack;
pub mod fault;
pub mod handshakes;
pub mod liveness;
pub mod metrics;
pub mod mirror;

pub mod output;
pub mod pipeline;
pub mod primary;
pub mod protocol;
pub mod refusals;
mod sockopt;
pub mod telemetry;
#[cfg(test)]
mod test_util;
pub mod vsmr;

pub use backup::{Backup, BackupConfig, Outcome};
pub use metrics::{EpochMetrics, MetricsFile, Role, Status, StatusCell};
pub use pipeline::Switches;
pub use primary::{BackupLoss, Finished, OnBackupLoss, Primary, PrimaryConfig, DEFAULT_PIPELINE_DEPTH};
pub use protocol::{ProtocolError, PROTOCOL_VERSION};

#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("cannot reach the backup at {addr}: {err}")]
    Unreachable { addr: String, err: String },
    #[error("cannot listen on {addr}: {err}")]
    Listen { addr: String, err: std::io::Error },
    #[error("the backup refused this primary: {0}")]
    Refused(String),
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("the primary failed before the backup had a complete checkpoint; nothing to take over")]
    NotSynchronized,
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("replication send failed: {0}")]
    Send(std::io::Error),
    #[error("cannot read the primary's disk: {0}")]
    PrimaryDisk(std::io::Error),
    #[error("{0}")]
    Disk(String),
    #[error("this backup cannot apply the primary's stream ({0}); it told the primary and stops without taking over")]
    CannotApply(#[from] pipeline::apply::ApplyError),
    #[error("checkpoint {epoch} would be {bytes} bytes, over the {limit}-byte limit of this VM's shape")]
    CheckpointTooLarge { epoch: u64, bytes: u64, limit: u64 },
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("--prefetch-by pull: {0}")]
    Pull(#[from] pipeline::prefetch::pull::PullError),
    #[error("copy-on-write capture: {0}")]
    WriteProtect(ftvm_vmm::memory::WriteProtectError),
    #[error("cannot write metrics: {0}")]
    Metrics(std::io::Error),
    #[error("cannot start a replication thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot set up heartbeats: {0}")]
    Heartbeat(std::io::Error),
    #[error("stopped while bringing the backup up to date")]
    Stopped,
    #[error("the backup was lost while being brought up to date: {0}")]
    LostDuringSync(String),
    #[error(transparent)]
    Vm(#[from] ftvm_vmm::VmError),
    #[error(transparent)]
    Arbiter(#[from] arbiter::ArbiterError),
    #[error("this side lost ownership of the VM to {owner} (arbiter generation {generation}); it stops without emitting anything")]
    Fenced { owner: String, generation: u64 },
    #[error("consensus: {0}")]
    Consensus(String),
    #[error(transparent)]
    RaftState(#[from] vsmr::vote::VoteFileError),
    #[error("the primary was lost before this backup had read the VM's ownership from the arbiter; not taking over")]
    NoOwnershipView,
}

/// How this process names itself to the arbiter: unique to it (a random
/// tag besides host and pid), so a claim it retries is recognised as its own.
pub fn identity(role: Role) -> String {
    let read = |path| std::fs::read_to_string(path).unwrap_or_default();
    let tag: String = read("/proc/sys/kernel/random/uuid").chars().filter(char::is_ascii_hexdigit).take(8).collect();
    format!("{role} pid {} on {} ({tag})", std::process::id(), read("/proc/sys/kernel/hostname").trim())
}
