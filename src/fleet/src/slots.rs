//! Where a VSMR VM's replicas belong (`protection = "vsmr"`): three
//! replicas of one raft group, two running the VM and a witness, each on
//! a host of its own. The fleet does not fail a VSMR VM over (its group
//! elects a new leader by itself); it only replaces replicas whose host
//! is gone or drains, one at a time, by new ones with ids the group never
//! had, through the group's own configuration change:
//!
//! - A placement's `replicas` are the group's members. One whose host is
//!   gone gets a replacement: a new replica on another host (a VM replica
//!   for a VM replica, a witness for a witness), with the next id, which
//!   joins the group (`ftvm replica --join`); the agent of the replica
//!   that leads asks it to replace the lost one (`replica-replace`).
//! - Once a replica reports the new one a voter in place of the lost one,
//!   the replacement is a member (`replicas`) and the next may start. A
//!   replacement whose own host is gone before that is replaced by another
//!   new replica (the group's leader drops the lost learner when asked).
//! - A replica on a draining host is replaced the same way, once the
//!   group is whole and in step; if it leads, asked to replace itself it
//!   hands leadership over first (the agent of the new leader asks again).
//! - With two of three replicas gone the group has lost its quorum: it
//!   cannot elect a leader or change its members, so nothing is replaced;
//!   the VM waits for a lost host to come back (its agent starts that
//!   replica again, under its old id and its kept raft vote), and says so.
//! - With all three gone the VM starts afresh from its image on three new
//!   replicas (new ids): its state is lost, as a primary-backup VM's is
//!   when both its hosts die.

use std::collections::BTreeSet;

use crate::records::{Placement, Replacement, Slot};
use crate::room::{free_port, no_room, Room};
use crate::spec::VmSpec;
use crate::view::{Fleet, REPLICAS};

/// Whether a replica of `vm` reports `r`'s new replica a voter in place of
/// the lost one: the group committed the change.
fn replaced(fleet: &Fleet, vm: &str, p: &Placement, r: &Replacement) -> bool {
    let hosts: Vec<&str> = p.replicas.iter().map(|s| s.host.as_str()).chain([r.slot.host.as_str()]).collect();
    fleet
        .reports
        .get(vm)
        .into_iter()
        .flatten()
        .any(|(host, report)| hosts.contains(&host.as_str()) && report.voters.contains(&r.slot.id) && !report.voters.contains(&r.replaces))
}

/// `vm`'s placement `p` as the rules want it, changed in place, with the
/// reasons in `why`; what it lacks, if anything.
pub(crate) fn plan(
    fleet: &Fleet,
    vm: &str,
    spec: &VmSpec,
    p: &mut Placement,
    room: &mut Room,
    ports: &mut BTreeSet<u16>,
    why: &mut Vec<String>,
) -> Option<String> {
    let alive = |h: &str| fleet.hosts.contains_key(h);
    if let Some(r) = p.replacing.clone() {
        if replaced(fleet, vm, p, &r) {
            why.push(format!("replica {} on {} replaced replica {}", r.slot.id, r.slot.host, r.replaces));
            p.replicas.retain(|s| s.id != r.replaces);
            p.replicas.push(r.slot);
            p.replicas.sort_by_key(|s| s.id);
            p.replacing = None;
        }
    }
    let lost: Vec<Slot> = p.replicas.iter().filter(|s| !alive(&s.host)).cloned().collect();
    if !p.replicas.is_empty() && lost.len() == p.replicas.len() {
        why.push("the hosts of all its replicas are gone: the VM starts afresh from its image (its state is lost)".into());
        p.replicas.clear();
        p.replacing = None;
    }
    if p.replicas.is_empty() {
        return match three(fleet, spec, room) {
            Ok(hosts) => {
                let first = p.next_id.max(1);
                for (i, host) in hosts.into_iter().enumerate() {
                    let repl_addr = fleet.hosts[&host].repl_addr.clone();
                    let slot = Slot { id: first + i as u64, host, repl_addr, port: free_port(ports), witness: i == REPLICAS - 1 };
                    ports.insert(slot.port);
                    room.take_slot(&slot, spec);
                    p.replicas.push(slot);
                }
                p.next_id = first + REPLICAS as u64;
                let each: Vec<String> = p.replicas.iter().map(|s| format!("{} on {}", s.id, s.host)).collect();
                why.push(format!("placed: replicas {} (the last a witness)", each.join(", ")));
                None
            }
            Err(lacks) => Some(lacks),
        };
    }
    if lost.len() * 2 > p.replicas.len() {
        let left: Vec<String> = p.replicas.iter().filter(|s| alive(&s.host)).map(|s| format!("replica {} on {}", s.id, s.host)).collect();
        return Some(format!(
            "quorum lost: only {} of {} survives; the VM waits for a lost host to come back",
            left.join(", "),
            p.replicas.len()
        ));
    }
    if let Some(r) = &p.replacing {
        if alive(&r.slot.host) {
            return None;
        }
        // Its learner goes when the group's leader is asked for the next one.
        why.push(format!("host {} of replica {}, which was to replace replica {}, is gone too", r.slot.host, r.slot.id, r.replaces));
        p.replacing = None;
    }
    // A lost replica first; else one on a draining host, once the group
    // is whole and in step (its replacement then costs no protection).
    let (old, gone) = match lost.first() {
        Some(old) => (old.clone(), true),
        None => match p.replicas.iter().find(|s| fleet.draining.contains(&s.host)) {
            Some(old) if fleet.group_protected(vm, p) => (old.clone(), false),
            _ => return None,
        },
    };
    let taken: Vec<&str> = p.replicas.iter().map(|s| s.host.as_str()).collect();
    let Some(host) = room.for_replica(fleet, spec, &taken, old.witness) else {
        let other = no_room(spec, "other host");
        return Some(match gone {
            true => format!("unprotected: replica {} is lost and there is {other}", old.id),
            false => format!("replica {} stays on draining host {}: there is {other}", old.id, old.host),
        });
    };
    let repl_addr = fleet.hosts[&host].repl_addr.clone();
    let slot = Slot { id: p.next_id.max(1), host, repl_addr, port: free_port(ports), witness: old.witness };
    ports.insert(slot.port);
    room.take_slot(&slot, spec);
    p.next_id = slot.id + 1;
    let why_old = if gone { "is gone" } else { "drains" };
    why.push(format!("host {} {why_old}: replica {} on {} replaces replica {}", old.host, slot.id, slot.host, old.id));
    p.replacing = Some(Replacement { slot, replaces: old.id });
    None
}

/// Three hosts for a new group: two with room for the VM, a third for
/// the witness.
fn three(fleet: &Fleet, spec: &VmSpec, room: &Room) -> Result<Vec<String>, String> {
    let mut hosts: Vec<String> = Vec::new();
    for i in 0..REPLICAS {
        let witness = i == REPLICAS - 1;
        let taken: Vec<&str> = hosts.iter().map(String::as_str).collect();
        match room.for_replica(fleet, spec, &taken, witness) {
            Some(host) => hosts.push(host),
            None if witness => return Err(format!("no third host for its witness: its {REPLICAS} replicas need {REPLICAS} hosts")),
            None if i == 0 => return Err(no_room(spec, "host")),
            None => return Err(format!("{} for its second VM replica", no_room(spec, "second host"))),
        }
    }
    Ok(hosts)
}
