//! Which part a process plays in replicating a VM: named in its status,
//! its metrics, its heartbeats and its identity at the arbiter.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What this side of a replicated VM is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs the VM (and replicates it while it has a backup).
    #[default]
    Primary,
    /// Follows a primary, ready to take over.
    Backup,
    /// A consensus-ordered replica that serves the VM (`ftvm replica`).
    Leader,
    /// A consensus-ordered replica that runs the VM in step with the leader.
    Secondary,
    /// A consensus-ordered replica without a VM: votes and keeps the log.
    Witness,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Primary => "primary",
            Role::Backup => "backup",
            Role::Leader => "leader",
            Role::Secondary => "secondary",
            Role::Witness => "witness",
        })
    }
}

/// How this process names itself to the arbiter: unique to it (a random
/// tag besides host and pid), so a claim it retries is recognised as its own.
pub fn identity(role: Role) -> String {
    let read = |path| std::fs::read_to_string(path).unwrap_or_default();
    let tag: String = read("/proc/sys/kernel/random/uuid").chars().filter(char::is_ascii_hexdigit).take(8).collect();
    format!("{role} pid {} on {} ({tag})", std::process::id(), read("/proc/sys/kernel/hostname").trim())
}
