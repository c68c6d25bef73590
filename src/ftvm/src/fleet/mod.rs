//! The fleet on the command line: `ftvm agent` (`agent`, running what the
//! fleet places on its host through `local`), and the operator's `ftvm vm`
//! and `ftvm host` commands, which only read and write the fleet's keys in
//! etcd (`ftvm_fleet::Store`).

pub mod agent;
mod local;
mod metrics;

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Subcommand;
use ftvm_fleet::placement::Fleet;
use ftvm_fleet::{Protection, Role, Store, VmSpec};

use crate::error::RunError;
use crate::output::outln;

#[derive(clap::Args)]
pub struct EtcdArgs {
    /// The fleet's etcd (http://HOST:PORT).
    #[arg(long, value_name = "URL", value_parser = crate::cli::values::arbiter_url)]
    pub etcd: String,
}

#[derive(Subcommand)]
pub enum VmCommand {
    /// Add a VM to the fleet from a spec file (TOML, docs/fleet.md): the
    /// leader agent places its primary and backup on two hosts (a VSMR
    /// VM: its three replicas on three).
    Create {
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long, value_name = "FILE")]
        spec: PathBuf,
    },
    /// The fleet's VMs: where each runs, and whether it is protected.
    List {
        #[command(flatten)]
        etcd: EtcdArgs,
    },
    /// One VM: its spec, placement and what its hosts report.
    Show {
        #[command(flatten)]
        etcd: EtcdArgs,
        name: String,
    },
    /// Remove a VM: its hosts stop its processes.
    Delete {
        #[command(flatten)]
        etcd: EtcdArgs,
        name: String,
    },
}

#[derive(Subcommand)]
pub enum HostCommand {
    /// The fleet's hosts: capacity, use, and which leads.
    List {
        #[command(flatten)]
        etcd: EtcdArgs,
    },
    /// Empty a host: its primaries are handed over, its backups rebuilt elsewhere.
    Drain {
        #[command(flatten)]
        etcd: EtcdArgs,
        name: String,
    },
    /// Let a drained host take VMs again.
    Undrain {
        #[command(flatten)]
        etcd: EtcdArgs,
        name: String,
    },
}

fn fleet_error(e: impl std::fmt::Display) -> RunError {
    RunError::Usage(format!("fleet: {e}"))
}

fn ago(since_ms: u64) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    format!("{:.1}s ago", now.saturating_sub(since_ms) as f64 / 1000.0)
}

pub fn vm(command: VmCommand) -> Result<i32, RunError> {
    match command {
        VmCommand::Create { etcd, spec } => {
            let text = std::fs::read_to_string(&spec).map_err(|e| RunError::Usage(format!("cannot read {}: {e}", spec.display())))?;
            let spec = VmSpec::from_toml(&text).map_err(|e| RunError::Usage(format!("{}: {e}", spec.display())))?;
            Store::new(&etcd.etcd).create_vm(&spec).map_err(fleet_error)?;
            outln!("created {}", spec.name);
        }
        VmCommand::List { etcd } => {
            let fleet = Store::new(&etcd.etcd).read().map_err(fleet_error)?;
            outln!("{:<16} {:<5} {:<10} {:<16} {:<10} {:<12} NOTE", "NAME", "KIND", "PRIMARY", "BACKUP", "PROTECTED", "SINCE");
            for name in fleet.vms.keys() {
                let row = Row::of(&fleet, name);
                outln!(
                    "{:<16} {:<5} {:<10} {:<16} {:<10} {:<12} {}",
                    name,
                    row.kind,
                    row.primary,
                    row.backup,
                    row.protected,
                    row.since.map_or_else(|| "-".to_string(), ago),
                    fleet.unplaced.get(name).map_or(row.note, String::clone)
                );
            }
        }
        VmCommand::Show { etcd, name } => {
            let fleet = Store::new(&etcd.etcd).read().map_err(fleet_error)?;
            let spec = fleet.vms.get(&name).ok_or_else(|| fleet_error(format!("no VM named {name}")))?;
            let out = serde_json::json!({
                "spec": spec,
                "placement": fleet.placements.get(&name).map(|(p, _)| p),
                "reports": fleet.reports.get(&name),
                "unplaced": fleet.unplaced.get(&name),
            });
            outln!("{}", serde_json::to_string_pretty(&out).expect("JSON"));
        }
        VmCommand::Delete { etcd, name } => {
            Store::new(&etcd.etcd).delete_vm(&name).map_err(fleet_error)?;
            outln!("deleted {name}");
        }
    }
    Ok(0)
}

/// One VM as `ftvm vm list` shows it. A VSMR VM's primary is the host of
/// the replica that leads, its backups the other replicas' hosts (`w`:
/// the witness), and it is protected when its three replicas run, the
/// leader with a secondary in step and the three of them as its voters.
struct Row {
    kind: &'static str,
    primary: String,
    backup: String,
    protected: &'static str,
    since: Option<u64>,
    note: String,
}

impl Row {
    fn of(fleet: &Fleet, name: &str) -> Row {
        let placement = fleet.placements.get(name).map(|(p, _)| p.clone()).unwrap_or_default();
        let reports = fleet.reports.get(name);
        let report = |host: &str| reports.and_then(|r| r.get(host));
        let yes_no = |yes: bool| if yes { "yes" } else { "no" };
        if fleet.vms.get(name).is_some_and(|s| s.protection == Protection::Vsmr) {
            let leader = fleet.vsmr_leader(name, &placement).map(|r| r.host.clone());
            let leader = placement.replicas.iter().find(|s| Some(&s.host) == leader.as_ref());
            let others: Vec<String> = placement
                .replicas
                .iter()
                .filter(|s| Some(*s) != leader)
                .map(|s| format!("{}{}", s.host, if s.witness { "w" } else { "" }))
                .collect();
            let note = placement
                .replacing
                .as_ref()
                .map_or(String::new(), |r| format!("replica {} on {} replaces replica {}", r.slot.id, r.slot.host, r.replaces));
            return Row {
                kind: "vsmr",
                primary: leader.map_or("-".into(), |s| s.host.clone()),
                backup: if others.is_empty() { "-".into() } else { others.join(",") },
                protected: if placement.replicas.is_empty() { "-" } else { yes_no(fleet.protected(name)) },
                since: leader.and_then(|s| report(&s.host)).map(|r| r.since_ms),
                note,
            };
        }
        let primary = placement.primary.as_deref().and_then(report).filter(|r| r.role == Role::Primary);
        Row {
            kind: "pb",
            primary: placement.primary.clone().unwrap_or_else(|| "-".into()),
            backup: placement.backup.clone().unwrap_or_else(|| "-".into()),
            protected: primary.map_or("-", |r| yes_no(r.protected)),
            since: primary.map(|r| r.since_ms),
            note: String::new(),
        }
    }
}

pub fn host(command: HostCommand) -> Result<i32, RunError> {
    match command {
        HostCommand::List { etcd } => {
            let fleet = Store::new(&etcd.etcd).read().map_err(fleet_error)?;
            outln!(
                "{:<10} {:<16} {:>10} {:>6} {:>9} {:>7} {:>8}  STATE",
                "NAME",
                "REPL ADDR",
                "MEMORY MiB",
                "vCPUs",
                "PRIMARIES",
                "BACKUPS",
                "REPLICAS"
            );
            for (name, h) in &fleet.hosts {
                let count = |primary: bool| {
                    fleet
                        .placements
                        .values()
                        .filter(|(p, _)| if primary { p.primary.as_ref() } else { p.backup.as_ref() } == Some(name))
                        .count()
                };
                let replicas = fleet.placements.values().filter(|(p, _)| p.slot_on(name).is_some()).count();
                let mut state = vec![];
                if fleet.leader.as_ref() == Some(name) {
                    state.push("leader");
                }
                if fleet.draining.contains(name) {
                    state.push("draining");
                }
                outln!(
                    "{:<10} {:<16} {:>10} {:>6} {:>9} {:>7} {:>8}  {}",
                    name,
                    h.repl_addr,
                    h.memory_mib,
                    h.vcpus,
                    count(true),
                    count(false),
                    replicas,
                    state.join(",")
                );
            }
        }
        HostCommand::Drain { etcd, name } => {
            Store::new(&etcd.etcd).drain(&name).map_err(fleet_error)?;
            outln!("draining {name}");
        }
        HostCommand::Undrain { etcd, name } => {
            let was = Store::new(&etcd.etcd).undrain(&name).map_err(fleet_error)?;
            outln!("{name} {}", if was { "takes VMs again" } else { "was not draining" });
        }
    }
    Ok(0)
}
