//! `ftvm agent`: one per host. It enters the host in the fleet under a
//! lease it keeps renewing, leads the fleet's placement when no other
//! agent does, runs the VM processes the placements give its host (a
//! primary, a backup, a VSMR replica), and reports what they are
//! (`local`). Where its VSMR replica leads a group that is to replace a
//! lost member, it asks that replica to (`replica_replace`).
//!
//! Restarting the agent restarts nothing: the VM processes run in their
//! own sessions, and the new agent adopts them and takes over the lease
//! the old one held (its id is kept in the state directory; a lock on the
//! directory shows the old agent is gone). An agent whose lease expired
//! (it could not reach etcd for the lease's time to live, or etcd stalled)
//! joins again under a new lease and keeps what runs here, but for the VMs
//! the fleet placed elsewhere meanwhile: their processes are stopped, so
//! no VM has two hosts. An agent that cannot reach etcd leaves its VMs
//! running: a lost etcd stops placement, not the VMs.

use std::fs;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ftvm_fleet::placement::{plan, Fleet};
use ftvm_fleet::{Host, Role, Store, StoreError};
use serde_json::json;

use super::local::{Group, Local, Setup};
use super::metrics::FleetMetrics;
use crate::api::Request;
use crate::error::{os, RunError};
use crate::output::outln;
use crate::signals;

/// How often a request that did not take (a protection, a hand-over) is made again.
const ASK_AGAIN: Duration = Duration::from_secs(5);

#[derive(clap::Args)]
pub struct AgentArgs {
    /// The fleet's etcd (http://HOST:PORT); also the VMs' arbiter.
    #[arg(long, value_name = "URL", value_parser = crate::cli::values::arbiter_url)]
    pub etcd: String,
    /// This host's name in the fleet (1 to 32 of A-Z, a-z, 0-9, '-', '_').
    #[arg(long, value_name = "NAME", value_parser = host_name)]
    pub host: String,
    /// The address this host's backups listen on (an address of this host
    /// that the other hosts reach).
    #[arg(long, value_name = "IP")]
    pub repl_addr: std::net::IpAddr,
    /// Guest memory this host offers the fleet, in MiB.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(16..))]
    pub memory_mib: u64,
    /// vCPUs this host offers the fleet.
    #[arg(long, value_name = "N", value_parser = crate::cli::values::at_least_one)]
    pub vcpus: u32,
    /// The bridge the VMs' TAPs join (it carries the guests' network).
    #[arg(long, value_name = "NAME", default_value = "br0")]
    pub bridge: String,
    /// The replication channel's secret, the same file on every host.
    #[arg(long, value_name = "PATH")]
    pub secret_file: PathBuf,
    /// The agent's state: its lease, its VM processes' pids, sockets and logs.
    #[arg(long, value_name = "DIR")]
    pub state_dir: PathBuf,
    /// The host counts as dead this long after its agent was last heard.
    #[arg(long, value_name = "SECONDS", default_value_t = 2)]
    pub lease_seconds: u64,
    /// Serve the fleet's Prometheus metrics (as this agent reads it) on
    /// http://ADDR/metrics (host:port).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// How often the agent looks at the fleet.
    #[arg(long, value_name = "MS", default_value_t = 200)]
    pub interval_ms: u64,
}

fn host_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty() && s.len() <= 32 && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    ok.then(|| s.to_string()).ok_or_else(|| "1 to 32 of A-Z, a-z, 0-9, '-', '_'".to_string())
}

/// One JSON line on stdout: what the fleet or this agent did.
fn event(kind: &str, fields: serde_json::Value) {
    let mut line = json!({ "event": kind, "at_ms": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64) });
    if let (Some(line), Some(fields)) = (line.as_object_mut(), fields.as_object()) {
        line.extend(fields.clone());
    }
    outln!("{line}");
}

struct Agent {
    args: AgentArgs,
    me: Host,
    store: Store,
    lease: i64,
    local: Local,
    metrics: FleetMetrics,
    /// The hosts seen, so a host whose key is gone for a moment is not dead yet.
    hosts: Grace,
    /// When each VM's process was last asked something, for which generation.
    asked: std::collections::BTreeMap<String, (u64, Instant)>,
}

/// The hosts every agent has seen, and since when each has been missing.
///
/// A host's key goes when its lease expires: its agent died, or was cut
/// off from etcd that long, or etcd itself stalled (a stalled etcd expires
/// every lease at once when it resumes, and every agent then joins again
/// within a look or two). So a host counts as gone only once it has been
/// missing for `grace` (the lease's time to live): placement waits that
/// much longer after a death, and a stalled etcd moves no VM.
#[derive(Default)]
struct Grace {
    seen: std::collections::BTreeMap<String, (Host, Option<Instant>)>,
}

impl Grace {
    /// `fleet` as read at `now`, with the hosts missing for less than `grace` put back.
    fn view(&mut self, fleet: &Fleet, grace: Duration, now: Instant) -> Fleet {
        for (name, host) in &fleet.hosts {
            self.seen.insert(name.clone(), (host.clone(), None));
        }
        let mut view = fleet.clone();
        self.seen.retain(|name, (host, missing)| {
            if fleet.hosts.contains_key(name) {
                return true;
            }
            let since = *missing.get_or_insert(now);
            let keep = now.duration_since(since) < grace;
            if keep {
                view.hosts.insert(name.clone(), host.clone());
            }
            keep
        });
        view
    }
}

/// Hold the state directory's lock for as long as this process lives.
fn lock(dir: &std::path::Path) -> Result<(), RunError> {
    fs::create_dir_all(dir).map_err(os("create the agent's state directory"))?;
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("agent.lock"))
        .map_err(os("open the agent's lock"))?;
    // SAFETY: flock on a descriptor this function owns; it is leaked below so the lock lasts.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(RunError::Usage(format!("an agent is running already with state directory {}", dir.display())));
    }
    std::mem::forget(file);
    Ok(())
}

impl Agent {
    fn join(args: AgentArgs) -> Result<Agent, RunError> {
        // Every VM process reads it: a bad one is said once, here.
        ftvm_replication::pipeline::transport::Secret::from_file(&args.secret_file)?;
        lock(&args.state_dir)?;
        let me = Host { name: args.host.clone(), memory_mib: args.memory_mib, vcpus: args.vcpus, repl_addr: args.repl_addr.to_string() };
        let store = Store::new(&args.etcd);
        let setup = Setup {
            etcd: args.etcd.clone(),
            bridge: args.bridge.clone(),
            secret_file: args.secret_file.clone(),
            state_dir: args.state_dir.clone(),
            exe: std::env::current_exe().map_err(os("find the ftvm executable"))?,
        };
        let local = Local::adopt(setup).map_err(os("read the agent's state directory"))?;
        let mut agent = Agent {
            args,
            me,
            store,
            lease: 0,
            local,
            metrics: FleetMetrics::default(),
            hosts: Grace::default(),
            asked: Default::default(),
        };
        agent.enter()?;
        Ok(agent)
    }

    fn lease_file(&self) -> PathBuf {
        self.args.state_dir.join("lease")
    }

    /// Enter the fleet: under the lease of the agent before this one if it
    /// is still alive, else under a new one (and then whatever still runs
    /// here was moved elsewhere meanwhile: it is stopped).
    fn enter(&mut self) -> Result<(), RunError> {
        let fleet = |e: StoreError| RunError::Usage(format!("fleet: {e}"));
        let kept = fs::read_to_string(self.lease_file()).ok().and_then(|l| l.trim().parse::<i64>().ok());
        let alive = match kept {
            Some(lease) => match self.store.renew(lease) {
                Ok(()) => Some(lease),
                Err(StoreError::LeaseExpired) => None,
                // etcd unreachable says nothing of the lease: nothing is stopped on it.
                Err(e) => return Err(fleet(e)),
            },
            None => None,
        };
        self.lease = match alive {
            Some(lease) => lease,
            None => {
                // What still runs here stays until the placements say
                // otherwise (`run_placed` stops what was moved away): an etcd
                // that stalled expires every lease at once when it resumes,
                // and that must not stop a single VM.
                let lease = self.store.lease(Duration::from_secs(self.args.lease_seconds)).map_err(fleet)?;
                fs::write(self.lease_file(), lease.to_string()).map_err(os("write the agent's lease"))?;
                lease
            }
        };
        self.store.register(&self.me, self.lease).map_err(fleet)?;
        event("joined", json!({ "host": self.me.name, "memory_mib": self.me.memory_mib, "vcpus": self.me.vcpus }));
        Ok(())
    }

    /// One look at the fleet.
    fn tick(&mut self) -> Result<(), StoreError> {
        self.store.renew(self.lease)?;
        let fleet = self.store.read()?;
        let view = self.hosts.view(&fleet, Duration::from_secs(self.args.lease_seconds), Instant::now());
        let wrote = self.store.lead(&self.me.name, self.lease)? && self.lead(&view)?;
        // A leader that changed the fleet acts on what it wrote; every
        // other look needs one read only.
        let fleet = if wrote { self.store.read()? } else { fleet };
        self.metrics.update(&fleet, &self.me.name);
        self.run_placed(&fleet);
        self.report(&fleet)
    }

    /// Place what the plan says; whether anything in etcd changed.
    fn lead(&mut self, fleet: &Fleet) -> Result<bool, StoreError> {
        let mut wrote = false;
        let (changes, unplaced) = plan(fleet);
        for c in changes {
            if self.store.place(&c)? {
                wrote = true;
                let p = &c.placement;
                let replicas: Vec<String> = p.replicas.iter().map(|s| format!("{}@{}", s.id, s.host)).collect();
                let replacing = p.replacing.as_ref().map(|r| format!("{}@{} replaces {}", r.slot.id, r.slot.host, r.replaces));
                event(
                    "placed",
                    json!({ "vm": c.vm, "primary": p.primary, "backup": p.backup, "replicas": replicas, "replacing": replacing, "why": c.why }),
                );
            }
        }
        for vm in fleet.unplaced.keys().filter(|vm| !unplaced.iter().any(|u| &u.vm == *vm)) {
            self.store.set_unplaced(vm, None)?;
            wrote = true;
        }
        for u in unplaced {
            if fleet.unplaced.get(&u.vm) != Some(&u.why) {
                event("unplaced", json!({ "vm": u.vm, "why": u.why }));
                self.store.set_unplaced(&u.vm, Some(&u.why))?;
                wrote = true;
            }
        }
        Ok(wrote)
    }

    /// Ask `vm`'s process `request` once per placement generation, and
    /// again every `ASK_AGAIN` while it has not taken.
    fn ask(&mut self, vm: &str, generation: u64, request: Request) {
        if self.asked.get(vm).is_some_and(|(g, at)| *g == generation && at.elapsed() < ASK_AGAIN) {
            return;
        }
        self.asked.insert(vm.to_string(), (generation, Instant::now()));
        event("asked", json!({ "vm": vm, "host": self.me.name, "request": format!("{request:?}") }));
        self.local.ask(vm, request);
    }

    /// Run what the placements give this host; stop what they no longer do.
    fn run_placed(&mut self, fleet: &Fleet) {
        let me = self.me.name.clone();
        for ended in self.local.reap() {
            event("ended", json!({ "vm": ended, "host": me }));
        }
        // A process is stale where its VM is gone or placed elsewhere, and
        // a VSMR replica also where this host's replica has another id now
        // (the group started afresh).
        let stale: Vec<String> = self
            .local
            .procs
            .iter()
            .filter(|(vm, proc)| {
                let Some((p, _)) = fleet.placements.get(*vm).filter(|_| fleet.vms.contains_key(*vm)) else { return true };
                !p.hosts().any(|h| h == me) || proc.replica.is_some_and(|id| p.slot_on(&me).is_none_or(|(slot, _)| slot.id != id))
            })
            .map(|(vm, _)| vm.clone())
            .collect();
        for vm in stale {
            event("stopped", json!({ "vm": vm, "host": me, "why": "no longer placed here" }));
            self.local.remove(&vm);
        }
        for (vm, (p, _)) in &fleet.placements {
            let Some(spec) = fleet.vms.get(vm) else { continue };
            if !p.replicas.is_empty() {
                self.run_replica(vm, spec, p);
                continue;
            }
            let running = self.local.procs.get(vm).and_then(|proc| proc.seen);
            let backup_addr = p.backup.as_ref().and_then(|b| fleet.hosts.get(b)).map(|b| format!("{}:{}", b.repl_addr, p.port));
            let backup_waits =
                p.backup.as_ref().is_some_and(|b| fleet.reports(vm, b, Role::Backup, false) && !fleet.reports(vm, b, Role::Backup, true));
            if p.backup.as_deref() == Some(me.as_str()) && !self.local.procs.contains_key(vm) {
                let result = self.local.start_backup(vm, spec, &self.me, p.port);
                event("started", json!({ "vm": vm, "host": me, "role": "backup", "error": result.err().map(|e| e.to_string()) }));
            } else if p.primary.as_deref() == Some(me.as_str()) {
                match (running, backup_addr) {
                    (None, Some(addr)) if !self.local.procs.contains_key(vm) && backup_waits => {
                        let result = self.local.start_primary(vm, spec, &addr);
                        event("started", json!({ "vm": vm, "host": me, "role": "primary", "error": result.err().map(|e| e.to_string()) }));
                    }
                    (Some((Role::Primary, false, _)), Some(addr)) if backup_waits => {
                        self.ask(vm, p.generation, Request::Protect { backup: addr })
                    }
                    (Some((Role::Primary, true, _)), Some(_)) if p.handover => self.ask(vm, p.generation, Request::Switchover),
                    _ => {}
                }
            }
        }
    }

    /// Run this host's replica of VSMR VM `vm`, if it has one; where that
    /// replica leads and the placement replaces a lost one, ask it to
    /// change the group, until it says the change is made.
    fn run_replica(&mut self, vm: &str, spec: &ftvm_fleet::VmSpec, p: &ftvm_fleet::Placement) {
        let me = self.me.name.clone();
        let Some((slot, joins)) = p.slot_on(&me) else { return };
        let Some(proc) = self.local.procs.get(vm) else {
            let group = match &p.replacing {
                Some(r) if joins => Group::Joins(format!("{},{}={}", p.peers(Some(r.replaces)), slot.id, slot.addr())),
                _ => Group::Member(p.peers(None)),
            };
            let result = self.local.start_replica(vm, spec, slot, group);
            let role = if slot.witness { "witness" } else { "replica" };
            let error = result.err().map(|e| e.to_string());
            event("started", json!({ "vm": vm, "host": me, "role": role, "id": slot.id, "joins": joins, "error": error }));
            return;
        };
        let Some(r) = &p.replacing else { return };
        let leads = proc.seen.is_some_and(|(role, _, _)| role == Role::Leader);
        let done = proc.voters.contains(&r.slot.id) && !proc.voters.contains(&r.replaces);
        if leads && !done {
            self.ask(vm, p.generation, Request::ReplicaReplace { remove: r.replaces, add: r.slot.id, addr: r.slot.addr() });
        }
    }

    /// Tell the fleet what each VM process here is, where that changed.
    fn report(&mut self, fleet: &Fleet) -> Result<(), StoreError> {
        let me = self.me.name.clone();
        let vms: Vec<String> = self.local.procs.keys().cloned().collect();
        for vm in &vms {
            if let Some(report) = self.local.report(vm, &me) {
                if fleet.reports.get(vm).and_then(|r| r.get(&me)) != Some(&report) {
                    self.store.report(vm, &report, self.lease)?;
                }
            }
        }
        for (vm, reports) in &fleet.reports {
            if reports.contains_key(&me) && self.local.procs.get(vm).is_none_or(|p| p.leaving) {
                self.store.unreport(vm, &me)?;
            }
        }
        Ok(())
    }
}

/// `ftvm agent`: runs until SIGINT or SIGTERM, leaving the VMs running.
pub fn run(args: AgentArgs) -> Result<i32, RunError> {
    signals::install().map_err(os("install signal handlers"))?;
    let interval = Duration::from_millis(args.interval_ms.max(10));
    let metrics_listen = args.metrics_listen.clone();
    let mut agent = Agent::join(args)?;
    if let Some(addr) = metrics_listen {
        crate::exporter::serve_registry(&addr, agent.metrics.registry(), || {})?;
    }
    while !signals::stop_requested().load(Ordering::SeqCst) {
        match agent.tick() {
            Ok(()) => {}
            // Only etcd saying so ends the lease: an agent that cannot reach
            // etcd (or an etcd that is down) leaves its VMs running, since
            // nobody can move them meanwhile without it counting as dead.
            Err(StoreError::LeaseExpired) => {
                tracing::warn!("agent: the fleet counted this host dead (its lease expired)");
                if let Err(e) = agent.enter() {
                    tracing::warn!("agent: {e}");
                }
            }
            Err(e) => tracing::warn!("agent: {e}"),
        }
        std::thread::sleep(interval);
    }
    event("left", json!({ "host": agent.me.name, "why": "stopped; its VMs go on running" }));
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(hosts: &[&str]) -> Fleet {
        let mut f = Fleet::default();
        for h in hosts {
            f.hosts.insert(h.to_string(), Host { name: h.to_string(), memory_mib: 1, vcpus: 1, repl_addr: String::new() });
        }
        f
    }

    #[test]
    fn a_host_missing_for_less_than_the_grace_still_counts() {
        let mut grace = Grace::default();
        let t0 = Instant::now();
        let g = Duration::from_secs(2);
        assert_eq!(grace.view(&fleet(&["h1", "h2"]), g, t0).hosts.len(), 2);
        // h2's key is gone (an expired lease): still there for 2 s.
        assert!(grace.view(&fleet(&["h1"]), g, t0 + Duration::from_millis(100)).hosts.contains_key("h2"));
        assert!(grace.view(&fleet(&["h1"]), g, t0 + Duration::from_millis(2000)).hosts.contains_key("h2"));
        assert!(!grace.view(&fleet(&["h1"]), g, t0 + Duration::from_millis(2200)).hosts.contains_key("h2"));
        // Back again, and missing again later: the grace starts anew.
        grace.view(&fleet(&["h1", "h2"]), g, t0 + Duration::from_secs(3));
        assert!(grace.view(&fleet(&["h1"]), g, t0 + Duration::from_secs(4)).hosts.contains_key("h2"));
    }
}
