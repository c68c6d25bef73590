//! Failure detection for consensus-ordered replicas (`--fast-election`):
//! a replica that finds its leader dead starts an election at once rather
//! than after raft's randomized election timeout (200-400 ms of silence,
//! long so that a loaded host does not depose leaders for nothing).
//!
//! The leader counts as dead when the link it dialled to this replica
//! closes (a killed VMM's sockets close at once), or, with
//! `--failure-timeout-ms`, when nothing arrived from it for that long.
//! Safety stays raft's: the election is a pre-vote first, which a replica
//! that still hears the leader ignores (its lease, from check-quorum), so
//! a replica that alone lost its link to a live leader disrupts nothing.
//! A replica that detected the loss gives up its own lease so that it
//! grants its vote at once, and campaigns only when it may lead (a VM
//! replica in step): the witness never stands first. Should a candidate's
//! log be behind this replica's (the dead leader sent this one more), it
//! campaigns itself, and if it may not lead, hands over (`node`).

use std::time::{Duration, Instant};

use ftvm_vmm::switch;

switch! {
    /// `--fast-election`: start an election as soon as the leader is found dead.
    pub enum FastElection {
        /// On a closed link to the leader (or its silence past
        /// `--failure-timeout-ms`).
        On = "on",
        /// Only raft's randomized election timeout.
        Off = "off",
    }
}

/// How a replica finds its leader dead.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    pub fast: FastElection,
    /// The leader is dead after this long without a message from it
    /// (heartbeats come every 20 ms); none: only a closed link tells.
    pub failure_timeout: Option<Duration>,
}

pub use ftvm_replication::consensus_status::{Cause, Detection, Election};

/// A leader found dead, while the election it calls for runs.
#[derive(Clone, Copy, Debug)]
pub struct Lost {
    pub leader: u64,
    pub how: Detection,
    /// The term it led.
    pub term: u64,
    pub at: Instant,
}

impl Lost {
    pub fn cause(&self) -> Cause {
        Cause::Detected { leader: self.leader, how: self.how }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_election_says_what_started_it() {
        let e = Election { term: 4, cause: Cause::Detected { leader: 1, how: Detection::LinkClosed }, after_us: 2500 };
        assert_eq!(e.to_string(), "term 4, started when leader 1's link closed, leading 2500 us later");
        let json = serde_json::to_value(e).unwrap();
        assert_eq!(json["cause"], "detected");
        assert_eq!(json["how"], "link-closed");
        assert_eq!(serde_json::from_value::<Election>(json).unwrap(), e);
        assert!("maybe".parse::<FastElection>().unwrap_err().contains("on or off"));
    }
}
