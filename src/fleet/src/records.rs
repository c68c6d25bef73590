//! What the fleet keeps in etcd besides the specs: hosts, placements and
//! the agents' reports of what runs. All JSON.

use serde::{Deserialize, Serialize};

/// A host whose agent is alive (its key lives as long as the agent's lease).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    pub name: String,
    /// Guest memory the host offers, in MiB.
    pub memory_mib: u64,
    /// vCPUs the host offers.
    pub vcpus: u32,
    /// The address the host's backups listen on and its primaries replicate from.
    pub repl_addr: String,
}

/// Where one VM's primary and backup belong. Written by the leader only.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The host running (or to run) the VM. `None`: the VM is not running
    /// anywhere and starts afresh from its image where it is placed next.
    pub primary: Option<String>,
    /// The host keeping (or to keep) its backup.
    pub backup: Option<String>,
    /// The port the backup listens on, on the backup host's `repl_addr`.
    pub port: u16,
    /// The primary hands the VM over to its backup (its host drains).
    #[serde(default)]
    pub handover: bool,
    /// Bumped at every change.
    pub generation: u64,
}

/// What an agent runs for a VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The process runs the VM.
    Primary,
    /// The process follows a primary, or waits for one.
    Backup,
}

/// An agent's account of one VM process on its host (its key lives as long
/// as the agent's lease).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub host: String,
    pub role: Role,
    /// A primary: a backup holds its checkpoints. A backup: a primary is
    /// checkpointing to it.
    pub protected: bool,
    pub pid: u32,
    /// When `role` and `protected` took their values (ms since the UNIX epoch).
    pub since_ms: u64,
}
