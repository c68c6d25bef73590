//! Where each VM belongs: a pure function of the fleet as read at one
//! revision, so the leader's decisions are testable without etcd and
//! every agent that leads would decide the same.
//!
//! The rules, per VM in name order:
//! - A primary's host is gone: the backup took over (or is about to; it
//!   does so on its own through the arbiter), so the primary is where the
//!   backup was and the VM has no backup. With both hosts gone the VM
//!   starts afresh from its image.
//! - A backup's host is gone or draining: the VM has no backup.
//! - A VM without a backup gets one on another host with room.
//! - A primary on a draining host whose backup is in step hands the VM
//!   over to it; once the backup reports running it, that host is the
//!   primary's.
//! - A VM placed nowhere gets a primary on the host with fewest primaries
//!   (then the smallest share of its memory in use) and a backup on
//!   another (the smallest share): both or neither.
//! - A fleet at rest (`at_rest`: every VM placed on two hosts protected,
//!   no host draining, no hand-over under way) with nothing to change is
//!   evened out, one move at a time (`rebalance`): a host that joined gets
//!   backups, then primaries.
//!
//! Room is memory and vCPUs (`room`): a VM counts on both hosts it is
//! placed on. A VSMR VM's replicas follow rules of their own (`slots`).

use std::collections::BTreeSet;

use crate::records::{Placement, Role};
pub use crate::room::FIRST_PORT;
use crate::room::{free_port, no_room, usable, Room};
use crate::slots;
use crate::spec::Protection;
pub use crate::view::Fleet;

/// A placement to write, over the one at `seen` (0: none yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub vm: String,
    pub placement: Placement,
    pub seen: i64,
    pub why: String,
}

/// A VM that could not be given what it needs, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unplaced {
    pub vm: String,
    pub why: String,
}

/// The placements to write for `fleet` to be as the rules want, and the
/// VMs that cannot be (not) placed as they should, with why.
pub fn plan(fleet: &Fleet) -> (Vec<Change>, Vec<Unplaced>) {
    let mut room = Room::new(fleet);
    let mut changes = Vec::new();
    let mut unplaced = Vec::new();
    let mut ports = crate::room::ports(fleet);
    let alive = |h: &Option<String>| h.as_ref().is_some_and(|h| fleet.hosts.contains_key(h));
    for (vm, spec) in &fleet.vms {
        let (before, seen) = fleet.placements.get(vm).cloned().unwrap_or_default();
        let mut p = before.clone();
        let mut why = Vec::new();
        if spec.protection == Protection::Vsmr {
            if let Some(lacks) = slots::plan(fleet, vm, spec, &mut p, &mut room, &mut ports, &mut why) {
                unplaced.push(Unplaced { vm: vm.clone(), why: lacks });
            }
            if p != before {
                p.generation = before.generation + 1;
                changes.push(Change { vm: vm.clone(), placement: p, seen, why: why.join("; ") });
            }
            continue;
        }
        if p.primary.is_some() && !alive(&p.primary) {
            let gone = p.primary.take().unwrap_or_default();
            if alive(&p.backup) {
                p.primary = p.backup.take();
                why.push(format!("host {gone} is gone: the backup on {} runs the VM", p.primary.as_deref().unwrap_or("")));
            } else {
                p.backup = None;
                why.push(format!("host {gone} is gone and no backup survived: the VM starts afresh"));
            }
            p.handover = false;
        }
        if p.backup.is_some() && (!alive(&p.backup) || p.backup.as_ref().is_some_and(|b| fleet.draining.contains(b))) {
            why.push(format!("the backup's host {} is gone or draining", p.backup.as_deref().unwrap_or("")));
            p.backup = None;
            p.handover = false;
        }
        if let (Some(primary), Some(backup)) = (&p.primary, &p.backup) {
            if p.handover && fleet.reports(vm, backup, Role::Primary, false) {
                why.push(format!("handed over from {primary} to {backup}"));
                p.primary = p.backup.take();
                p.handover = false;
            } else if !p.handover && fleet.draining.contains(primary) && fleet.reports(vm, primary, Role::Primary, true) {
                why.push(format!("host {primary} drains: hand the VM over to {backup}"));
                p.handover = true;
            }
        }
        match (&p.primary, &p.backup) {
            (None, _) => match room.for_primary(fleet, spec) {
                Some(primary) => match room.for_backup(fleet, spec, &primary) {
                    Some(backup) => {
                        room.take(Some(&primary), spec, true);
                        room.take(Some(&backup), spec, false);
                        why.push(format!("placed: primary on {primary}, backup on {backup}"));
                        p.primary = Some(primary);
                        p.backup = Some(backup);
                    }
                    None => unplaced.push(Unplaced { vm: vm.clone(), why: format!("{} for its backup", no_room(spec, "second host")) }),
                },
                None => unplaced.push(Unplaced { vm: vm.clone(), why: no_room(spec, "host") }),
            },
            (Some(primary), None) => match room.for_backup(fleet, spec, primary) {
                Some(backup) => {
                    room.take(Some(&backup), spec, false);
                    why.push(format!("protected again: backup on {backup}"));
                    p.backup = Some(backup);
                }
                None => unplaced.push(Unplaced { vm: vm.clone(), why: format!("unprotected: {}", no_room(spec, "other host")) }),
            },
            (Some(_), Some(_)) => {}
        }
        if p.backup.is_some() && p.backup != before.backup {
            // A new backup gets a port no other VM's backup uses.
            p.port = free_port(&ports);
            ports.insert(p.port);
        }
        if p != before {
            p.generation = before.generation + 1;
            changes.push(Change { vm: vm.clone(), placement: p, seen, why: why.join("; ") });
        }
    }
    if changes.is_empty() && at_rest(fleet) {
        changes.extend(rebalance(fleet, &room, &ports));
    }
    (changes, unplaced)
}

/// Whether nothing is under way: every VM placed on two hosts protected
/// (a VM no host has room for does not hold the others back), every VSMR
/// VM whole and protected or lacking what cannot be had now, no hand-over
/// or replacement under way, no host draining. Only then is the fleet
/// evened out.
pub fn at_rest(fleet: &Fleet) -> bool {
    let lacking = |p: &Placement| {
        if p.replicas.is_empty() {
            p.primary.is_none() || p.backup.is_none()
        } else {
            p.replacing.is_none() && p.replicas.iter().any(|s| !fleet.hosts.contains_key(&s.host))
        }
    };
    fleet.draining.is_empty()
        && fleet
            .placements
            .iter()
            .filter(|(vm, _)| fleet.vms.contains_key(*vm))
            .all(|(vm, (p, _))| !p.handover && p.replacing.is_none() && (lacking(p) || fleet.protected(vm)))
}

/// Whether the fleet is at rest and evened out: the leader has nothing to do.
pub fn settled(fleet: &Fleet) -> bool {
    at_rest(fleet) && plan(fleet).0.is_empty()
}

/// One move that evens out a fleet at rest, or none.
///
/// Moves cost protection for a while: a moved backup is rebuilt by a live
/// pre-copy, a hand-over pauses the guest for a last checkpoint. So the
/// fleet moves one VM at a time (the next move waits until every VM is
/// protected again), and only where the move strictly lowers what it
/// evens out; the two measures are taken in order (primaries, then memory)
/// and neither move raises the first, so a fleet cannot move in circles.
/// - Primaries: a VM whose backup's host runs at least two primaries fewer
///   than its primary's host is handed over to its backup (its new backup
///   is then placed by the rules above).
/// - Memory: the backup of a VM on the host with the largest share of its
///   memory in use moves to the host with the smallest, if that brings the
///   shares closer (it lowers the sum of use^2 / capacity) and that host is
///   not its primary's.
fn rebalance(fleet: &Fleet, room: &Room, ports: &BTreeSet<u16>) -> Option<Change> {
    let placed = |vm: &String| fleet.placements.get(vm).map(|(p, seen)| (p, *seen));
    let hosts: Vec<&str> = usable(fleet).collect();
    let primaries = |h: &str| room.primaries.get(h).copied().unwrap_or(0);
    let handover = fleet
        .vms
        .keys()
        .filter_map(|vm| {
            let (p, seen) = placed(vm)?;
            let (from, to) = (p.primary.as_deref()?, p.backup.as_deref()?);
            let gap = primaries(from).checked_sub(primaries(to)).filter(|gap| *gap >= 2)?;
            Some((gap, vm, p, seen, from, to))
        })
        .min_by_key(|(gap, vm, ..)| (std::cmp::Reverse(*gap), (*vm).clone()));
    if let Some((_, vm, p, seen, from, to)) = handover {
        let why = format!("rebalance: hand the VM over from {from} ({} primaries) to {to} ({})", primaries(from), primaries(to));
        let placement = Placement { handover: true, generation: p.generation + 1, ..p.clone() };
        return Some(Change { vm: vm.clone(), placement, seen, why });
    }
    // Memory in use as a share of each host's, compared without rounding:
    // hosts of different sizes fill alike.
    let capacity = |h: &str| i128::from(room.capacity(h));
    let used = |h: &str| i128::from(room.used(h));
    let fuller = |a: &str, b: &str| (used(a) * capacity(b)).cmp(&(used(b) * capacity(a))).then_with(|| b.cmp(a));
    let fullest = hosts.iter().copied().max_by(|a, b| fuller(a, b))?;
    let emptiest = hosts.iter().copied().min_by(|a, b| fuller(a, b))?;
    // Moving m MiB from the fullest (a of A in use) to the emptiest (b of
    // B) must lower the sum over hosts of use^2 / capacity, which is least
    // when every host has the same share in use:
    // (a-m)^2/A + (b+m)^2/B < a^2/A + b^2/B.
    let (a, big_a, b, big_b) = (used(fullest), capacity(fullest), used(emptiest), capacity(emptiest));
    let evens = |m: i128| (m * m - 2 * a * m) * big_b + (m * m + 2 * b * m) * big_a < 0;
    let (vm, p, seen) = fleet
        .vms
        .iter()
        .filter_map(|(vm, spec)| {
            let (p, seen) = placed(vm)?;
            let moves = p.backup.as_deref() == Some(fullest)
                && p.primary.as_deref() != Some(emptiest)
                && evens(spec.memory_mib as i128)
                && room.fits(emptiest, spec);
            moves.then_some((vm, p, seen, spec.memory_mib))
        })
        .max_by_key(|(vm, .., mib)| (*mib, std::cmp::Reverse((*vm).clone())))
        .map(|(vm, p, seen, _)| (vm, p, seen))?;
    let port = free_port(ports);
    let why = format!("rebalance: backup moves from {fullest} ({a} of {big_a} MiB in use) to {emptiest} ({b} of {big_b} MiB)");
    let placement = Placement { backup: Some(emptiest.to_string()), port, generation: p.generation + 1, ..p.clone() };
    Some(Change { vm: vm.clone(), placement, seen, why })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{Host, Report};
    use crate::spec::VmSpec;

    fn spec(name: &str, memory_mib: u64) -> VmSpec {
        VmSpec::from_toml(&format!("name = \"{name}\"\nimage = \"/kv.elf\"\nmemory_mib = {memory_mib}\nmac = \"52:54:00:00:00:01\""))
            .unwrap()
    }

    /// A host of 1 GiB and 8 vCPUs, the `n`th.
    fn host(name: &str, n: usize) -> Host {
        Host { name: name.to_string(), memory_mib: 1024, vcpus: 8, repl_addr: format!("10.9.0.{n}") }
    }

    fn fleet(hosts: &[&str], vms: &[(&str, u64)]) -> Fleet {
        let mut f = Fleet::default();
        for h in hosts {
            f.hosts.insert(h.to_string(), host(h, f.hosts.len() + 1));
        }
        for (vm, mem) in vms {
            f.vms.insert(vm.to_string(), spec(vm, *mem));
        }
        f
    }

    /// Write the plan's changes into the fleet, as the leader would.
    fn apply(f: &mut Fleet) -> Vec<Unplaced> {
        let (changes, unplaced) = plan(f);
        for c in changes {
            f.placements.insert(c.vm, (c.placement, f.revision + 1));
            f.revision += 1;
        }
        unplaced
    }

    fn placed(f: &Fleet, vm: &str) -> (Option<String>, Option<String>) {
        let p = &f.placements[vm].0;
        (p.primary.clone(), p.backup.clone())
    }

    #[test]
    fn replicas_go_to_different_hosts_and_primaries_spread() {
        let mut f = fleet(&["h1", "h2", "h3"], &[("a", 256), ("b", 256), ("c", 256)]);
        assert!(apply(&mut f).is_empty());
        let mut primaries = BTreeSet::new();
        for vm in ["a", "b", "c"] {
            let (p, b) = placed(&f, vm);
            assert_ne!(p, b);
            primaries.insert(p.unwrap());
        }
        assert_eq!(primaries.len(), 3, "one primary per host");
        let ports: BTreeSet<u16> = f.placements.values().map(|(p, _)| p.port).collect();
        assert_eq!(ports.len(), 3, "each backup has its own port");
        let (again, _) = plan(&f);
        assert!(again.is_empty(), "a placed fleet stays as it is: {again:?}");
    }

    #[test]
    fn a_dead_hosts_vms_run_where_their_backups_were_and_are_protected_again() {
        let mut f = fleet(&["h1", "h2", "h3"], &[("a", 256)]);
        apply(&mut f);
        let (primary, backup) = placed(&f, "a");
        f.hosts.remove(primary.as_deref().unwrap());
        assert!(apply(&mut f).is_empty());
        let (p, b) = placed(&f, "a");
        assert_eq!(p, backup, "the backup runs the VM");
        assert!(b.is_some() && b != p && b != primary, "a new backup on the third host: {b:?}");
    }

    #[test]
    fn a_vm_whose_hosts_both_died_starts_afresh() {
        let mut f = fleet(&["h1", "h2", "h3"], &[("a", 256)]);
        apply(&mut f);
        let (p, b) = placed(&f, "a");
        f.hosts.remove(p.as_deref().unwrap());
        f.hosts.remove(b.as_deref().unwrap());
        let unplaced = apply(&mut f);
        assert_eq!(placed(&f, "a"), (None, None));
        assert!(unplaced[0].why.contains("second host"), "one host left, no room for both: {unplaced:?}");
        f.hosts.insert("h4".into(), host("h4", 4));
        assert!(apply(&mut f).is_empty());
        let (p, b) = placed(&f, "a");
        assert!(p.is_some() && b.is_some());
    }

    #[test]
    fn capacity_is_respected_and_the_reason_given() {
        let mut f = fleet(&["h1", "h2"], &[("a", 600), ("b", 600)]);
        let unplaced = apply(&mut f);
        assert_eq!(unplaced.len(), 1, "two 600 MiB VMs with backups do not fit in 2 x 1024 MiB");
        assert_eq!(unplaced[0].why, "no host with 600 MiB and 1 vCPUs free");
    }

    #[test]
    fn a_draining_host_hands_its_primaries_over_and_loses_its_backups() {
        let mut f = fleet(&["h1", "h2", "h3"], &[("a", 256)]);
        apply(&mut f);
        let (primary, backup) = placed(&f, "a");
        let (primary, backup) = (primary.unwrap(), backup.unwrap());
        let report =
            |host: &str, role| Report { host: host.into(), role, protected: true, pid: 1, since_ms: 0, voters: Vec::new(), term: 0 };
        f.reports.entry("a".into()).or_default().insert(primary.clone(), report(&primary, Role::Primary));
        f.draining.insert(primary.clone());
        apply(&mut f);
        assert!(f.placements["a"].0.handover, "the primary is told to hand over");
        // The backup took over and says so.
        f.reports.get_mut("a").unwrap().insert(backup.clone(), report(&backup, Role::Primary));
        apply(&mut f);
        let (p, b) = placed(&f, "a");
        assert_eq!(p.as_deref(), Some(backup.as_str()));
        assert!(b.is_some_and(|b| b != primary && b != backup), "the new backup is on neither the drained host nor the primary's");
        assert!(!f.placements["a"].0.handover);
    }

    /// Run the fleet until it is at rest: every process reports what its
    /// placement says, in step, and a primary told to hand over has done
    /// so. Returns how many moves the rebalance made.
    fn settle(f: &mut Fleet) -> usize {
        let mut moves = 0;
        for _ in 0..100 {
            let (changes, _) = plan(f);
            if changes.is_empty() {
                return moves;
            }
            moves += changes.iter().filter(|c| c.why.starts_with("rebalance")).count();
            for c in changes {
                f.placements.insert(c.vm, (c.placement, f.revision + 1));
                f.revision += 1;
            }
            f.reports.clear();
            for (vm, (p, _)) in &f.placements {
                let report = |host: &str, role| Report {
                    host: host.into(),
                    role,
                    protected: true,
                    pid: 1,
                    since_ms: 0,
                    voters: Vec::new(),
                    term: 0,
                };
                let reports = f.reports.entry(vm.clone()).or_default();
                if let Some(primary) = &p.primary {
                    reports.insert(primary.clone(), report(primary, Role::Primary));
                }
                if let Some(backup) = &p.backup {
                    let role = if p.handover { Role::Primary } else { Role::Backup };
                    reports.insert(backup.clone(), report(backup, role));
                }
            }
        }
        panic!("the fleet never came to rest: {:?}", plan(f).0);
    }

    fn in_use(f: &Fleet, host: &str) -> (u64, usize) {
        let mut mib = 0;
        let mut primaries = 0;
        for (vm, (p, _)) in &f.placements {
            if p.primary.as_deref() == Some(host) {
                primaries += 1;
            }
            if f.placed_on(vm, host) {
                mib += f.vms[vm].memory_mib;
            }
        }
        (mib, primaries)
    }

    #[test]
    fn a_host_that_joins_gets_backups_then_primaries_one_move_at_a_time() {
        let vms: Vec<(String, u64)> = (0..6).map(|i| (format!("vm{i}"), 64)).collect();
        let names: Vec<(&str, u64)> = vms.iter().map(|(n, m)| (n.as_str(), *m)).collect();
        let mut f = fleet(&["h1", "h2"], &names);
        settle(&mut f);
        assert_eq!(in_use(&f, "h1").0, 384);
        f.hosts.insert("h3".into(), host("h3", 3));
        let (first, _) = plan(&f);
        assert_eq!(first.len(), 1, "one move at a time: {first:?}");
        assert_eq!(first[0].placement.backup.as_deref(), Some("h3"), "the new host gets a backup first: {first:?}");
        let moves = settle(&mut f);
        assert!(moves >= 2, "{moves} moves");
        assert!(settled(&f));
        let spread: Vec<(u64, usize)> = ["h1", "h2", "h3"].iter().map(|h| in_use(&f, h)).collect();
        let mib: Vec<u64> = spread.iter().map(|s| s.0).collect();
        let primaries: Vec<usize> = spread.iter().map(|s| s.1).collect();
        assert!(mib.iter().max().unwrap() - mib.iter().min().unwrap() <= 64, "memory in use {mib:?}");
        assert!(primaries.iter().max().unwrap() - primaries.iter().min().unwrap() <= 1, "primaries {primaries:?}");
        for (vm, (p, _)) in &f.placements {
            assert!(p.primary.is_some() && p.backup.is_some() && p.primary != p.backup, "{vm}: {p:?}");
        }
    }

    #[test]
    fn a_fleet_not_at_rest_is_not_rebalanced() {
        let mut f = fleet(&["h1", "h2"], &[("a", 64), ("b", 64)]);
        settle(&mut f);
        f.hosts.insert("h3".into(), host("h3", 3));
        // b's backup is still catching up: nothing moves.
        let backup = f.placements["b"].0.backup.clone().unwrap();
        f.reports.get_mut("b").unwrap().get_mut(&backup).unwrap().protected = false;
        assert!(plan(&f).0.is_empty(), "{:?}", plan(&f).0);
        // Nor while a host drains (its VMs move by the drain's rules).
        f.reports.get_mut("b").unwrap().get_mut(&backup).unwrap().protected = true;
        f.draining.insert("h3".into());
        assert!(plan(&f).0.is_empty(), "{:?}", plan(&f).0);
        f.draining.clear();
        assert_eq!(plan(&f).0.len(), 1);
        // A VM no host has room for does not hold the others back.
        f.vms.insert("huge".into(), spec("huge", 4096));
        let (changes, unplaced) = plan(&f);
        assert_eq!(unplaced.len(), 1, "{unplaced:?}");
        assert!(changes.len() == 1 && changes[0].why.starts_with("rebalance"), "{changes:?}");
    }

    #[test]
    fn a_balanced_fleet_stays_put() {
        let mut f = fleet(&["h1", "h2", "h3"], &[("a", 256), ("b", 256), ("c", 256), ("d", 100)]);
        let moves = settle(&mut f);
        assert_eq!(moves, 0, "placement already spread what it placed: {:?}", f.placements);
    }

    fn vsmr(name: &str, memory_mib: u64) -> VmSpec {
        VmSpec { protection: Protection::Vsmr, ..spec(name, memory_mib) }
    }

    /// `f` with VSMR VM `vm` of `memory_mib`.
    fn with_vsmr(mut f: Fleet, vm: &str, memory_mib: u64) -> Fleet {
        f.vms.insert(vm.to_string(), vsmr(vm, memory_mib));
        f
    }

    fn slots(f: &Fleet, vm: &str) -> Vec<(u64, String, bool)> {
        f.placements[vm].0.replicas.iter().map(|s| (s.id, s.host.clone(), s.witness)).collect()
    }

    /// Every replica of `vm` reports; the one on `leader` leads with the
    /// placement's members as its voters, protected.
    fn report_group(f: &mut Fleet, vm: &str, leader: &str) {
        let p = f.placements[vm].0.clone();
        let voters: Vec<u64> = p.replicas.iter().map(|s| s.id).collect();
        let reports = f.reports.entry(vm.to_string()).or_default();
        reports.clear();
        for s in &p.replicas {
            let role = if s.host == leader {
                Role::Leader
            } else if s.witness {
                Role::Witness
            } else {
                Role::Secondary
            };
            let report = Report { host: s.host.clone(), role, protected: true, pid: 1, since_ms: 0, voters: voters.clone(), term: 1 };
            reports.insert(s.host.clone(), report);
        }
    }

    #[test]
    fn a_vsmr_vm_gets_three_replicas_on_three_hosts() {
        let mut f = with_vsmr(fleet(&["h1", "h2", "h3", "h4"], &[("pb", 256)]), "v", 256);
        assert!(apply(&mut f).is_empty());
        let placed = slots(&f, "v");
        assert_eq!(placed.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(placed.iter().map(|s| s.2).collect::<Vec<_>>(), [false, false, true], "the third is the witness");
        let hosts: BTreeSet<&String> = placed.iter().map(|s| &s.1).collect();
        assert_eq!(hosts.len(), 3, "one replica per host: {placed:?}");
        let p = &f.placements["v"].0;
        assert_eq!((p.next_id, &p.primary, &p.backup), (4, &None, &None));
        let mut ports: Vec<u16> = p.replicas.iter().map(|s| s.port).collect();
        ports.push(f.placements["pb"].0.port);
        assert_eq!(ports.iter().collect::<BTreeSet<_>>().len(), 4, "every process has a port of its own: {ports:?}");
        // The VM replicas take room, the witness none: the witness's host
        // is the emptiest one left.
        let leader = placed[0].1.clone();
        report_group(&mut f, "v", &leader);
        assert!(f.protected("v"));
        assert!(plan(&f).0.is_empty(), "a placed group stays as it is: {:?}", plan(&f).0);
    }

    #[test]
    fn a_lost_replica_is_replaced_by_one_with_a_new_id_on_another_host() {
        let mut f = with_vsmr(fleet(&["h1", "h2", "h3", "h4"], &[]), "v", 256);
        apply(&mut f);
        let before = slots(&f, "v");
        report_group(&mut f, "v", &before[1].1);
        // The leader's host dies.
        let dead = before[1].1.clone();
        f.hosts.remove(&dead);
        assert!(!f.protected("v"));
        assert!(apply(&mut f).is_empty());
        let p = f.placements["v"].0.clone();
        let r = p.replacing.clone().expect("a replacement");
        assert_eq!((r.slot.id, r.replaces, r.slot.witness), (4, 2, false), "a new id for a VM replica: {r:?}");
        assert!(!before.iter().any(|s| s.1 == r.slot.host), "the replacement is on a host of its own: {r:?}");
        assert_eq!(p.next_id, 5);
        assert_eq!(slots(&f, "v"), before, "the members stay until the group changed");
        // Nothing more while the group changes; then a replica reports
        // the new one a voter in place of the lost one.
        assert!(plan(&f).0.is_empty());
        assert!(!at_rest(&f));
        let reports = f.reports.get_mut("v").unwrap();
        reports.remove(&dead);
        reports.get_mut(&before[0].1).unwrap().voters = vec![1, 3, 4];
        assert!(apply(&mut f).is_empty());
        let now: Vec<u64> = slots(&f, "v").iter().map(|s| s.0).collect();
        assert_eq!(now, [1, 3, 4]);
        assert!(f.placements["v"].0.replacing.is_none());
        // The witness's host dies next: a new witness, id 5.
        let witness = before[2].1.clone();
        f.hosts.remove(&witness);
        f.hosts.insert("h5".into(), host("h5", 5));
        apply(&mut f);
        let r = f.placements["v"].0.replacing.clone().unwrap();
        assert_eq!((r.slot.id, r.replaces, r.slot.witness), (5, 3, true));
        assert_eq!(r.slot.host, "h5", "the only host without a replica of v");
        // The new witness's host dies before it joined: another, id 6.
        f.hosts.remove("h5");
        f.hosts.insert("h6".into(), host("h6", 6));
        apply(&mut f);
        let r = f.placements["v"].0.replacing.clone().unwrap();
        assert_eq!((r.slot.id, r.replaces, r.slot.host.as_str()), (6, 3, "h6"));
        assert_eq!(f.placements["v"].0.next_id, 7);
    }

    #[test]
    fn a_replica_on_a_draining_host_is_replaced_once_the_group_is_in_step() {
        let mut f = with_vsmr(fleet(&["h1", "h2", "h3", "h4"], &[]), "v", 256);
        apply(&mut f);
        let placed = slots(&f, "v");
        let drained = placed[0].1.clone();
        f.draining.insert(drained.clone());
        // Not in step (no reports): nothing moves.
        assert!(plan(&f).0.is_empty(), "{:?}", plan(&f).0);
        report_group(&mut f, "v", &drained);
        assert!(apply(&mut f).is_empty());
        let r = f.placements["v"].0.replacing.clone().expect("a replacement");
        assert_eq!((r.slot.id, r.replaces), (4, 1));
        assert!(r.slot.host != drained && !placed.iter().any(|s| s.1 == r.slot.host), "{r:?}");
        let p = plan(&f).0;
        assert!(p.is_empty(), "one replacement at a time: {p:?}");
        // Nowhere else to go: it stays, and the list says why.
        let mut f = with_vsmr(fleet(&["h1", "h2", "h3"], &[]), "v", 256);
        apply(&mut f);
        let drained = slots(&f, "v")[0].1.clone();
        report_group(&mut f, "v", &drained);
        f.draining.insert(drained.clone());
        let unplaced = apply(&mut f);
        assert_eq!(
            unplaced[0].why,
            format!("replica 1 stays on draining host {drained}: there is no other host with 256 MiB and 1 vCPUs free")
        );
    }

    #[test]
    fn a_vsmr_vm_needs_three_hosts_and_room_on_two() {
        let mut f = with_vsmr(fleet(&["h1", "h2"], &[]), "v", 256);
        let unplaced = apply(&mut f);
        assert_eq!(unplaced.len(), 1);
        assert_eq!(unplaced[0].why, "no third host for its witness: its 3 replicas need 3 hosts");
        assert!(!f.placements.contains_key("v"));
        // Three hosts, one with room for the VM: no second VM replica.
        let mut f = with_vsmr(fleet(&["h1", "h2", "h3"], &[]), "v", 600);
        f.hosts.get_mut("h2").unwrap().memory_mib = 512;
        f.hosts.get_mut("h3").unwrap().memory_mib = 512;
        let unplaced = apply(&mut f);
        assert_eq!(unplaced[0].why, "no second host with 600 MiB and 1 vCPUs free for its second VM replica");
        // Two with room and a small third: the witness goes there.
        f.hosts.get_mut("h2").unwrap().memory_mib = 1024;
        assert!(apply(&mut f).is_empty());
        let placed = slots(&f, "v");
        assert_eq!(placed[2], (3, "h3".to_string(), true), "{placed:?}");
    }

    #[test]
    fn no_two_replicas_share_a_host_even_when_none_is_free() {
        let mut f = with_vsmr(fleet(&["h1", "h2", "h3"], &[]), "v", 256);
        apply(&mut f);
        let lost = slots(&f, "v")[0].1.clone();
        f.hosts.remove(&lost);
        let unplaced = apply(&mut f);
        assert!(f.placements["v"].0.replacing.is_none(), "{:?}", f.placements["v"]);
        assert_eq!(unplaced[0].why, "unprotected: replica 1 is lost and there is no other host with 256 MiB and 1 vCPUs free");
        f.hosts.insert("h4".into(), host("h4", 4));
        assert!(apply(&mut f).is_empty());
        let p = &f.placements["v"].0;
        let mut hosts: Vec<&str> = p.hosts().collect();
        hosts.retain(|h| *h != lost);
        assert_eq!(hosts.iter().collect::<BTreeSet<_>>().len(), 3, "{p:?}");
        assert_eq!(p.replacing.as_ref().unwrap().slot.host, "h4");
    }

    #[test]
    fn a_group_without_quorum_says_so_and_one_without_replicas_starts_afresh() {
        let mut f = with_vsmr(fleet(&["h1", "h2", "h3", "h4", "h5", "h6"], &[]), "v", 256);
        apply(&mut f);
        let placed = slots(&f, "v");
        f.hosts.remove(&placed[0].1);
        f.hosts.remove(&placed[2].1);
        let unplaced = apply(&mut f);
        let survivor = &placed[1];
        assert_eq!(
            unplaced[0].why,
            format!("quorum lost: only replica 2 on {} of 3 survives; the VM waits for a lost host to come back", survivor.1)
        );
        assert_eq!(slots(&f, "v"), placed, "nothing is replaced without a quorum");
        assert!(f.placements["v"].0.replacing.is_none());
        f.hosts.remove(&survivor.1);
        assert!(apply(&mut f).is_empty());
        let afresh = slots(&f, "v");
        assert_eq!(afresh.iter().map(|s| s.0).collect::<Vec<_>>(), [4, 5, 6], "a new group, new ids: {afresh:?}");
        assert!(afresh.iter().all(|s| f.hosts.contains_key(&s.1)));
    }

    #[test]
    fn hosts_of_different_sizes_fill_alike() {
        let vms: Vec<(String, u64)> = (0..8).map(|i| (format!("vm{i}"), 256)).collect();
        let names: Vec<(&str, u64)> = vms.iter().map(|(n, m)| (n.as_str(), *m)).collect();
        let mut f = fleet(&["h1", "h2"], &names);
        for h in f.hosts.values_mut() {
            (h.memory_mib, h.vcpus) = (4096, 32);
        }
        settle(&mut f);
        f.hosts.insert("h3".into(), host("h3", 3));
        settle(&mut f);
        let share = |h: &str| in_use(&f, h).0 as f64 / f.hosts[h].memory_mib as f64;
        let shares = [share("h1"), share("h2"), share("h3")];
        // 4096 MiB of replicas over 9216: about 44% each; by MiB alone the
        // small host would be filled to the brim.
        assert!(shares.iter().all(|s| (0.3..=0.6).contains(s)), "shares in use {shares:?}");
        assert!(in_use(&f, "h3").0 > 0, "the new host got nothing");
    }
}
