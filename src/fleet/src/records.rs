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
    /// A VSMR VM's replicas (the members of its raft group), each on a
    /// host of its own; none for a primary-backup VM.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<Slot>,
    /// A VSMR VM's new replica on its way to replacing a lost one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacing: Option<Replacement>,
    /// The raft id a VSMR VM's next new replica gets: ids are never used
    /// twice in a group (a new replica with a lost one's id and an empty
    /// log could vote twice in a term or lose committed entries).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub next_id: u64,
}

impl Placement {
    /// The hosts this placement gives a process: primary, backup, VSMR
    /// replicas (the replacement under way included).
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        let replicas = self.replicas.iter().chain(self.replacing.as_ref().map(|r| &r.slot)).map(|s| s.host.as_str());
        self.primary.as_deref().into_iter().chain(self.backup.as_deref()).chain(replicas)
    }

    /// The VSMR replica this placement gives `host`, if any (the
    /// replacement under way included), and whether it joins the group
    /// (the replacement) rather than being one of its members.
    pub fn slot_on(&self, host: &str) -> Option<(&Slot, bool)> {
        let member = self.replicas.iter().find(|s| s.host == host).map(|s| (s, false));
        member.or_else(|| self.replacing.as_ref().filter(|r| r.slot.host == host).map(|r| (&r.slot, true)))
    }

    /// The members as `ftvm replica --peers` takes them (`1=HOST:PORT,...`),
    /// but `but`.
    pub fn peers(&self, but: Option<u64>) -> String {
        let each: Vec<String> = self.replicas.iter().filter(|s| Some(s.id) != but).map(|s| format!("{}={}", s.id, s.addr())).collect();
        each.join(",")
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One replica of a VSMR VM (`ftvm replica --id ID`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    /// Its raft id in the VM's group.
    pub id: u64,
    pub host: String,
    /// Its host's `repl_addr` when it was placed: the group reaches it at
    /// `repl_addr:port`, also once the host is gone.
    pub repl_addr: String,
    /// The port it listens on for the other replicas.
    pub port: u16,
    /// Votes and keeps the log, runs no VM.
    #[serde(default)]
    pub witness: bool,
}

impl Slot {
    /// Where the other replicas reach it (`HOST:PORT` of `--peers`).
    pub fn addr(&self) -> String {
        format!("{}:{}", self.repl_addr, self.port)
    }
}

/// A new replica (`ftvm replica --join`) that takes the place of replica
/// `replaces` once the group's leader made it a voter instead
/// (`ftvm replica-replace`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replacement {
    pub slot: Slot,
    pub replaces: u64,
}

/// What an agent runs for a VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The process runs the VM.
    Primary,
    /// The process follows a primary, or waits for one.
    Backup,
    /// A VSMR replica that serves the VM.
    Leader,
    /// A VSMR replica that runs the VM in step with the leader (or is
    /// being brought up to date).
    Secondary,
    /// A VSMR replica without a VM.
    Witness,
}

/// An agent's account of one VM process on its host (its key lives as long
/// as the agent's lease).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub host: String,
    pub role: Role,
    /// A primary: a backup holds its checkpoints. A backup: a primary is
    /// checkpointing to it. A VSMR leader: a secondary is in step with it.
    pub protected: bool,
    pub pid: u32,
    /// When `role` and `protected` took their values (ms since the UNIX epoch).
    pub since_ms: u64,
    /// A VSMR replica: the voting members of its group, as it applied them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub voters: Vec<u64>,
    /// A VSMR replica: its raft term. Reports are a look apart, so a
    /// replica that just lost its leadership may still be reported leading
    /// beside the new leader; raft has one leader per term, the newest.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub term: u64,
}
