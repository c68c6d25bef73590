//! What each host has left: memory and vCPUs, from the placements as the
//! leader read them. A VM counts on every host it is placed on (primary
//! and backup; a VSMR VM's two VM replicas, not its witness, which runs no
//! VM), so a host that takes over or catches up never runs short.

use std::collections::{BTreeMap, BTreeSet};

use crate::records::Slot;
use crate::spec::VmSpec;
use crate::view::Fleet;

/// Backup and replica ports are handed out from here up, one per process.
pub const FIRST_PORT: u16 = 7100;

pub(crate) struct Room {
    capacity_mib: BTreeMap<String, i64>,
    free_mib: BTreeMap<String, i64>,
    free_vcpus: BTreeMap<String, i64>,
    pub(crate) primaries: BTreeMap<String, u32>,
}

impl Room {
    pub(crate) fn new(fleet: &Fleet) -> Room {
        let capacity_mib: BTreeMap<String, i64> = fleet.hosts.values().map(|h| (h.name.clone(), h.memory_mib as i64)).collect();
        let mut room = Room {
            free_mib: capacity_mib.clone(),
            capacity_mib,
            free_vcpus: fleet.hosts.values().map(|h| (h.name.clone(), h.vcpus as i64)).collect(),
            primaries: fleet.hosts.keys().map(|h| (h.clone(), 0)).collect(),
        };
        for (vm, (p, _)) in &fleet.placements {
            if let Some(spec) = fleet.vms.get(vm) {
                room.take(p.primary.as_deref(), spec, true);
                room.take(p.backup.as_deref(), spec, false);
                for slot in p.replicas.iter().chain(p.replacing.as_ref().map(|r| &r.slot)) {
                    room.take_slot(slot, spec);
                }
            }
        }
        room
    }

    pub(crate) fn take(&mut self, host: Option<&str>, spec: &VmSpec, primary: bool) {
        let Some(host) = host else { return };
        if let Some(m) = self.free_mib.get_mut(host) {
            *m -= spec.memory_mib as i64;
        }
        if let Some(c) = self.free_vcpus.get_mut(host) {
            *c -= spec.vcpus as i64;
        }
        if primary {
            *self.primaries.entry(host.to_string()).or_default() += 1;
        }
    }

    /// A VSMR replica: a VM replica takes the VM's room, a witness none.
    pub(crate) fn take_slot(&mut self, slot: &Slot, spec: &VmSpec) {
        if !slot.witness {
            self.take(Some(&slot.host), spec, false);
        }
    }

    pub(crate) fn fits(&self, host: &str, spec: &VmSpec) -> bool {
        self.free_mib.get(host).is_some_and(|m| *m >= spec.memory_mib as i64)
            && self.free_vcpus.get(host).is_some_and(|c| *c >= spec.vcpus as i64)
    }

    /// `host`'s memory, in MiB (at least 1: a share of it is defined).
    pub(crate) fn capacity(&self, host: &str) -> i64 {
        self.capacity_mib.get(host).copied().unwrap_or(0).max(1)
    }

    /// `host`'s memory in use, in MiB.
    pub(crate) fn used(&self, host: &str) -> i64 {
        self.capacity(host) - self.free_mib.get(host).copied().unwrap_or(0)
    }

    /// Memory in use on `host` as a share of its own: hosts of different
    /// sizes fill alike.
    fn share(&self, host: &str) -> f64 {
        self.used(host) as f64 / self.capacity(host) as f64
    }

    /// The host for a new primary: fewest primaries, then the smallest share of memory in use, then name.
    pub(crate) fn for_primary(&self, fleet: &Fleet, spec: &VmSpec) -> Option<String> {
        let candidates = usable(fleet).filter(|h| self.fits(h, spec));
        candidates
            .min_by(|a, b| (self.primaries[*a].cmp(&self.primaries[*b])).then(self.share(a).total_cmp(&self.share(b))).then(a.cmp(b)))
            .map(str::to_string)
    }

    /// The host for a backup, not `primary`: the smallest share of memory in use, then name.
    pub(crate) fn for_backup(&self, fleet: &Fleet, spec: &VmSpec, primary: &str) -> Option<String> {
        self.for_replica(fleet, spec, &[primary], false)
    }

    /// The host for a replica (a backup, a VSMR replica) on none of the
    /// hosts `taken`: the smallest share of memory in use, then name. A
    /// witness needs no room, only a host of its own.
    pub(crate) fn for_replica(&self, fleet: &Fleet, spec: &VmSpec, taken: &[&str], witness: bool) -> Option<String> {
        let candidates = usable(fleet).filter(|h| !taken.contains(h) && (witness || self.fits(h, spec)));
        candidates.min_by(|a, b| self.share(a).total_cmp(&self.share(b)).then(a.cmp(b))).map(str::to_string)
    }
}

/// Hosts that take new VMs: alive and not draining.
pub(crate) fn usable(fleet: &Fleet) -> impl Iterator<Item = &str> {
    fleet.hosts.keys().map(String::as_str).filter(|h| !fleet.draining.contains(*h))
}

/// The first port no VM's process listens on.
pub(crate) fn free_port(ports: &BTreeSet<u16>) -> u16 {
    (FIRST_PORT..).find(|port| !ports.contains(port)).expect("a free port")
}

/// Every port the placements give a process (backups, VSMR replicas).
pub(crate) fn ports(fleet: &Fleet) -> BTreeSet<u16> {
    let mut ports = BTreeSet::new();
    for (p, _) in fleet.placements.values() {
        if p.port != 0 {
            ports.insert(p.port);
        }
        ports.extend(p.replicas.iter().chain(p.replacing.as_ref().map(|r| &r.slot)).map(|s| s.port));
    }
    ports
}

pub(crate) fn no_room(spec: &VmSpec, what: &str) -> String {
    format!("no {what} with {} MiB and {} vCPUs free", spec.memory_mib, spec.vcpus)
}
