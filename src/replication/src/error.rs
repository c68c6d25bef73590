//! How replication fails, as one error every stage and role returns.

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
    Protocol(#[from] crate::protocol::ProtocolError),
    #[error("replication send failed: {0}")]
    Send(std::io::Error),
    #[error("cannot read the primary's disk: {0}")]
    PrimaryDisk(std::io::Error),
    #[error("{0}")]
    Disk(String),
    #[error("this backup cannot apply the primary's stream ({0}); it told the primary and stops without taking over")]
    CannotApply(#[from] crate::pipeline::apply::ApplyError),
    #[error("checkpoint {epoch} would be {bytes} bytes, over the {limit}-byte limit of this VM's shape")]
    CheckpointTooLarge { epoch: u64, bytes: u64, limit: u64 },
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("--prefetch-by pull: {0}")]
    Pull(#[from] crate::pipeline::prefetch::pull::PullError),
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
    Arbiter(#[from] crate::arbiter::ArbiterError),
    #[error("this side lost ownership of the VM to {owner} (arbiter generation {generation}); it stops without emitting anything")]
    Fenced { owner: String, generation: u64 },
    #[error("consensus: {0}")]
    Consensus(String),
    /// A replica's raft state file (`ftvm_vsmr`'s vote file).
    #[error(transparent)]
    RaftState(Box<dyn std::error::Error + Send + Sync>),
    #[error("the primary was lost before this backup had read the VM's ownership from the arbiter; not taking over")]
    NoOwnershipView,
}
