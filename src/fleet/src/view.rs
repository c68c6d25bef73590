//! The fleet as the leader (or any agent, or `ftvm vm list`) read it at
//! one etcd revision, and what its reports say of each VM.

use std::collections::{BTreeMap, BTreeSet};

use crate::records::{Host, Placement, Report, Role};
use crate::spec::VmSpec;

/// A VSMR VM's group: two VM replicas and a witness.
pub const REPLICAS: usize = 3;

/// The fleet as the leader read it.
#[derive(Clone, Debug, Default)]
pub struct Fleet {
    pub hosts: BTreeMap<String, Host>,
    pub draining: BTreeSet<String>,
    pub vms: BTreeMap<String, VmSpec>,
    /// Each VM's placement and the etcd revision it was last written at.
    pub placements: BTreeMap<String, (Placement, i64)>,
    /// Reports by VM, then host.
    pub reports: BTreeMap<String, BTreeMap<String, Report>>,
    /// Why VMs lack a host or a backup, as the leader last said.
    pub unplaced: BTreeMap<String, String>,
    /// The leader agent's host, if any.
    pub leader: Option<String>,
    /// The etcd revision the fleet was read at.
    pub revision: i64,
}

impl Fleet {
    /// Whether `vm`'s process on `host` reports `role` (and, with
    /// `protected`, that it is in step with its peer).
    pub fn reports(&self, vm: &str, host: &str, role: Role, protected: bool) -> bool {
        self.reports.get(vm).and_then(|r| r.get(host)).is_some_and(|r| r.role == role && (r.protected || !protected))
    }

    /// Whether `vm` is placed on two hosts, its primary reporting it
    /// protected and its backup in step; a VSMR VM: on three hosts, its
    /// group whole and its leader protected (`group_protected`).
    pub fn protected(&self, vm: &str) -> bool {
        self.placements.get(vm).is_some_and(|(p, _)| match (&p.primary, &p.backup) {
            _ if !p.replicas.is_empty() => self.group_protected(vm, p),
            (Some(primary), Some(backup)) => self.reports(vm, primary, Role::Primary, true) && self.reports(vm, backup, Role::Backup, true),
            _ => false,
        })
    }

    /// Whether `vm` is placed on `host`, as primary, backup or VSMR replica.
    pub fn placed_on(&self, vm: &str, host: &str) -> bool {
        self.placements.get(vm).is_some_and(|(p, _)| p.hosts().any(|h| h == host))
    }

    /// The report of the replica of VSMR VM `vm` that leads (of those `p`
    /// places and report leading, the one of the newest term: a replica
    /// that just lost its leadership may not have said so yet).
    pub fn vsmr_leader(&self, vm: &str, p: &Placement) -> Option<&Report> {
        let reports = self.reports.get(vm)?;
        p.replicas.iter().filter_map(|s| reports.get(&s.host)).filter(|r| r.role == Role::Leader).max_by_key(|r| r.term)
    }

    /// Whether VSMR VM `vm`'s group is whole and serving protected: its
    /// three replicas report running, none is being replaced, and its
    /// leader has a secondary in step and names exactly them as the voters.
    pub fn group_protected(&self, vm: &str, p: &Placement) -> bool {
        let Some(reports) = self.reports.get(vm) else { return false };
        let ids: BTreeSet<u64> = p.replicas.iter().map(|s| s.id).collect();
        p.replacing.is_none()
            && p.replicas.len() == REPLICAS
            && p.replicas.iter().all(|s| reports.contains_key(&s.host) && self.hosts.contains_key(&s.host))
            && self.vsmr_leader(vm, p).is_some_and(|r| r.protected && r.voters.iter().copied().collect::<BTreeSet<u64>>() == ids)
    }
}
