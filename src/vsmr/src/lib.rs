//! Consensus-ordered replicas (PLOVER's VSMR, `ftvm replica`): three
//! replicas agree, through raft, on one order of the leader's network
//! input and of `syncvm` points; the two VM replicas run the same input,
//! and at each `syncvm` the leader sends the secondary only the pages
//! that diverged, then releases the output held since the previous one.
//! The witness votes and keeps the log but runs no VM, and never leads.
//! See docs/replicas.md.

pub mod aside;
pub mod direct_input;
pub mod disk;
mod diverge_dump;
pub mod failover;
pub mod inbound;
pub mod log;
pub mod loss;
pub mod membership;
pub mod mesh;
pub mod node;
pub mod outbox;
pub mod recent;
pub mod rejoin;
pub mod release;
pub mod repair;
mod replica;
pub mod settle;
pub mod squeeze;
pub mod sync;
mod sync_id;
pub mod tuning;
pub mod vote;
pub mod writes;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ftvm_vmm::Vm;

pub use ftvm_replication::consensus_status::{SyncMetrics, SyncRole};
use ftvm_replication::metrics::{MetricsLog, Role, StatusCell};
use ftvm_replication::output::DiskJournal;
use ftvm_replication::pipeline::transport::Auth;
use ftvm_replication::ReplicationError;
use membership::{Book, Control, Membership};
use mesh::{LinkOptions, Mesh, PeerHello, Routes};
use node::{Committed, NodeConfig, View};

/// `ftvm replica`'s replication options.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    pub id: u64,
    /// Every replica (this one included): id and address.
    pub peers: Vec<(u64, String)>,
    /// `--join`: this replica joins a running group (`peers` lists where
    /// its members are): it starts with no configuration, learns the
    /// group's from raft's snapshot, and votes or leads only once the
    /// group made it a voter (`ftvm replica-replace`, `membership`).
    pub join: bool,
    /// Vote, keep the log, stand late in elections and never lead while
    /// not in step; with a VM (a standby), keep it held until a leader
    /// brings it up to date to replace a lost VM replica.
    pub witness: bool,
    pub auth: Option<Auth>,
    pub metrics: Option<PathBuf>,
    /// Longest interval between two `syncvm`s.
    pub max_interval: Duration,
    /// How divergent pages travel.
    pub pages: sync::PageMode,
    /// How a replica this leader has not synchronized is brought up to date.
    pub rejoin: rejoin::RejoinMode,
    /// How a dead leader is found: at once, or by raft's election timeout.
    pub failover: failover::Options,
    /// `--takeover-replay`: a new leader sends its guest's output since its
    /// last `syncvm`.
    pub replay: recent::Mode,
    /// `--on-secondary-loss`: whether a leader with no synchronized
    /// secondary runs on (releasing output after consensus barriers) or
    /// pauses its guest with its output held.
    pub on_secondary_loss: loss::OnSecondaryLoss,
    /// The throughput switches (`tuning`).
    pub tuning: tuning::Tuning,
    /// `--raft-state`: keep the term and vote in this file.
    pub raft_state: Option<PathBuf>,
}

impl ReplicaConfig {
    /// `--sync-ms` unless given.
    pub const DEFAULT_MAX_INTERVAL: Duration = Duration::from_millis(100);
}

/// `--peers 1=HOST:PORT,2=HOST:PORT,3=HOST:PORT`, checked against `--id`.
pub fn parse_peers(s: &str, me: u64) -> Result<Vec<(u64, String)>, String> {
    let peers = parse_list(s)?;
    if peers.len() < 3 {
        return Err(format!("{} replicas listed; at least three are needed so that a majority survives a failure", peers.len()));
    }
    if !peers.iter().any(|(i, _)| *i == me) {
        return Err(format!("--id {me} is not one of the replicas in --peers"));
    }
    Ok(peers)
}

/// `ID=HOST:PORT,...`: ids from 1, each once, each at an address of its own.
fn parse_list(s: &str) -> Result<Vec<(u64, String)>, String> {
    let mut peers: Vec<(u64, String)> = Vec::new();
    for item in s.split(',') {
        let (id, addr) = item.split_once('=').ok_or_else(|| format!("`{item}` is not ID=HOST:PORT"))?;
        let id: u64 = id.trim().parse().map_err(|_| format!("`{id}` is not a replica id (a number from 1)"))?;
        if id == 0 {
            return Err("replica ids start at 1".into());
        }
        if !addr.contains(':') {
            return Err(format!("`{addr}` is not HOST:PORT"));
        }
        if peers.iter().any(|(i, _)| *i == id) {
            return Err(format!("replica {id} is listed twice"));
        }
        let addr = addr.trim();
        if let Some((other, _)) = peers.iter().find(|(_, a)| a == addr) {
            return Err(format!("replicas {other} and {id} are both at {addr}: each needs an address of its own"));
        }
        peers.push((id, addr.to_string()));
    }
    Ok(peers)
}

/// `--join 1=HOST:PORT,...,4=HOST:PORT`: where the group's members are,
/// and this replica's own address, checked against `--id`.
pub fn parse_join(s: &str, me: u64) -> Result<Vec<(u64, String)>, String> {
    let peers = parse_list(s)?;
    if !peers.iter().any(|(i, _)| *i == me) {
        return Err(format!("--id {me} is not in --join: give this replica's own address there too"));
    }
    if peers.len() < 2 {
        return Err("--join names no member of the group to join".into());
    }
    Ok(peers)
}

/// Start this replica: its links, its consensus thread and, with a VM
/// (`vm`; none for the witness), the VM's side. The VM must be started.
/// A witness with a VM is a standby: its VM stays held until a leader
/// brings it up to date (docs/replicas.md, "Replacing a replica").
pub fn start(config: ReplicaConfig, vm: Option<Arc<Vm>>) -> Result<(StatusCell, Control), ReplicationError> {
    // A replica that fails to start leaves no `--raft-state` file it
    // created (an empty one would only look like a replica that never
    // voted); one that existed, or that holds a vote by now, stays.
    let created = config.raft_state.clone().filter(|path| std::fs::symlink_metadata(path).is_err());
    let started = start_replica(config, vm);
    if let (Err(_), Some(path)) = (&started, created) {
        if std::fs::metadata(&path).is_ok_and(|m| m.len() == 0) {
            let _ = std::fs::remove_file(&path);
        }
    }
    started
}

fn start_replica(config: ReplicaConfig, vm: Option<Arc<Vm>>) -> Result<(StatusCell, Control), ReplicationError> {
    let witness = config.witness;
    // A joining VM replica is held as a standby is until a leader brings
    // it up to date; unlike a standby it is picked as any VM replica.
    let held_at_start = witness || (config.join && vm.is_some());
    let ring = vm.as_ref().is_some_and(|v| v.config().dirty_backend != ftvm_vmm::DirtyBackend::Bitmap);
    if config.tuning.predict_writes != ftvm_replication::pipeline::predict::Mode::Off && ring {
        // The ring re-protects every page it harvested.
        return Err(ReplicationError::Unsupported("--predict-writes needs --dirty-backend bitmap"));
    }
    // Read before any link opens: a replica that cannot keep its vote stays out.
    let votes = match &config.raft_state {
        Some(path) => Some(vote::VoteFile::open(path, config.id)?),
        None => None,
    };
    let status = StatusCell::new(if vm.is_none() { Role::Witness } else { Role::Secondary });
    status.lock().detail = match (&vm, witness) {
        (None, _) => "witness".into(),
        (Some(_), true) => "standby witness: VM held until a leader needs it".into(),
        (_, false) if config.join => "joining: waiting for the group to add it".into(),
        (Some(_), false) => "secondary: waiting for a leader".into(),
    };
    let disk = match (&vm, vm.as_ref().and_then(|v| v.config().devices.disk.clone())) {
        (Some(vm), Some(path)) => Some(
            disk::ReplicaDisk::open(
                &path,
                Arc::new(DiskJournal::new(Arc::new(ftvm_replication::pipeline::trigger::Trigger::default()), vm.devices().waker())),
            )
            .map_err(|e| ReplicationError::Disk(format!("cannot open the disk {}: {e}", path.display())))?,
        ),
        _ => None,
    };
    let disk_size = disk.as_ref().map_or(0, disk::ReplicaDisk::size);
    let listen = config.peers.iter().find(|(i, _)| *i == config.id).map(|(_, a)| a.clone()).expect("parse_peers checked --id");
    let others: Vec<(u64, String)> = config.peers.iter().filter(|(i, _)| *i != config.id).cloned().collect();
    let (events_tx, events_rx) = mpsc::channel();
    let (sync_tx, sync_rx) = mpsc::channel();
    let (join_tx, join_rx) = mpsc::channel();
    let (precopy_tx, precopy_rx) = mpsc::channel();
    let acks = Arc::new(release::Awaited::default());
    let routes = Routes { raft: events_tx.clone(), sync: sync_tx, join: join_tx, precopy: precopy_tx, acks: acks.clone() };
    // Peers pick secondaries among replicas with a VM: a standby says it has one.
    let mesh = Mesh::start(
        PeerHello { id: config.id, witness: vm.is_none(), standby: witness && vm.is_some(), disk: disk_size },
        &listen,
        &others,
        config.auth.clone(),
        routes,
        LinkOptions {
            batch: config.tuning.link_batch,
            direct: config.tuning.link_direct,
            compress: config.tuning.link_compress,
            linger: config.tuning.witness_linger,
        },
    )?;
    let (committed_tx, committed_rx) = mpsc::channel();
    let view = Arc::new(Mutex::new(View::default()));
    // Every VM replica of a new group may lead; the witness (a standby
    // too) not before it was brought up to date, nor a replica restarted
    // (its kept vote says it was a member): its VM started afresh, and
    // only a full `syncvm` from a replica that holds the state makes it
    // the group's again. Were both VM replicas lost, neither may lead, and
    // the group waits rather than serve a VM without its released state.
    let restarted = votes.as_ref().is_some_and(|(_, kept)| kept.as_ref().is_some_and(|v| v.term > 0));
    let eligible = Arc::new(AtomicBool::new(!held_at_start && !restarted));
    // Whether the VM is held (`replica`), shared with the input gate.
    let held = Arc::new(AtomicBool::new(false));
    let gate = match (&vm, config.tuning.direct_input) {
        (Some(vm), tuning::DirectInput::On) => Some(Arc::new(direct_input::InputGate::new(vm.clone(), held.clone()))),
        _ => None,
    };
    let inputs = Arc::new(log::InputCounts::default());
    let book: Book = config.peers.iter().cloned().collect();
    let shown = Arc::new(Mutex::new(Membership::default()));
    let control = Control::new(events_tx.clone(), shown.clone());
    let node_config = NodeConfig {
        id: config.id,
        voters: if config.join { Vec::new() } else { config.peers.iter().map(|(i, _)| *i).collect() },
        book: Arc::new(Mutex::new(book)),
        shown,
        witness,
        vm: vm.is_some(),
        eligible: eligible.clone(),
        failover: config.failover,
        status: status.clone(),
        tuning: config.tuning,
        gate: gate.clone(),
        inputs: inputs.clone(),
        votes,
    };
    node::start(node_config, mesh.clone(), events_rx, committed_tx, view.clone())?;
    let metrics = MetricsLog::open(config.metrics.clone().map(ftvm_replication::metrics::MetricsFile::every_epoch).as_ref())
        .map_err(ReplicationError::Metrics)?;
    match vm {
        Some(vm) => {
            let shared = Arc::new(replica::Shared::new(
                config.id,
                vm,
                mesh,
                view,
                events_tx,
                eligible,
                status.clone(),
                metrics,
                replica::Options {
                    max_interval: config.max_interval,
                    pages: config.pages,
                    rejoin: config.rejoin,
                    standby: held_at_start,
                    replay: config.replay,
                    spacing: config.tuning.sync_spacing,
                    ack_wait: config.tuning.ack_wait,
                    early_resume: config.tuning.early_resume,
                    sync_settle: config.tuning.sync_settle,
                    sync_clock: config.tuning.sync_clock,
                    ack_release: config.tuning.ack_release,
                    input_batch: config.tuning.input_batch,
                    sync_pipeline: config.tuning.sync_pipeline,
                    on_secondary_loss: config.on_secondary_loss,
                    predict_writes: config.tuning.predict_writes,
                    costs: config.tuning.costs,
                    sync_output: config.tuning.sync_output,
                },
                disk,
                held,
                gate,
                acks,
                inputs,
            ));
            replica::start(shared, committed_rx, replica::Inboxes { sync: sync_rx, join: join_rx, precopy: precopy_rx })
                .map_err(ReplicationError::Thread)?;
        }
        None => {
            let status = status.clone();
            std::thread::Builder::new()
                .name("witness".into())
                .spawn(move || {
                    // The witness agrees on entries and treats syncvm as a
                    // no-op: the consensus thread hands on only who leads.
                    for c in committed_rx {
                        if let Committed::LeaderStart { term, leader, .. } = c {
                            let mut st = status.lock();
                            st.term = term;
                            st.detail = format!("witness; leader {leader}");
                        }
                    }
                })
                .map_err(ReplicationError::Thread)?;
        }
    }
    Ok((status, control))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_and_bad_lists_are_refused() {
        let p = parse_peers("1=10.0.0.1:7000,2=10.0.0.2:7000,3=h:1", 2).unwrap();
        assert_eq!(p, vec![(1, "10.0.0.1:7000".into()), (2, "10.0.0.2:7000".into()), (3, "h:1".into())]);
        assert!(parse_peers("1=a:1,2=b:2", 1).unwrap_err().contains("at least three"));
        assert!(parse_peers("1=a:1,1=b:2,3=c:3", 1).unwrap_err().contains("twice"));
        assert!(parse_peers("1=a:1,2=a:1,3=c:3", 1).unwrap_err().contains("replicas 1 and 2 are both at a:1"));
        assert!(parse_peers("1=a:1,2=b:2,3=c:3", 4).unwrap_err().contains("--id 4"));
        assert!(parse_peers("0=a:1,2=b:2,3=c:3", 2).unwrap_err().contains("start at 1"));
        assert!(parse_peers("1=a,2=b:2,3=c:3", 2).unwrap_err().contains("HOST:PORT"));
        assert!(parse_peers("x=a:1,2=b:2,3=c:3", 2).unwrap_err().contains("not a replica id"));
    }

    #[test]
    fn a_join_list_names_this_replica_and_a_member() {
        assert_eq!(parse_join("1=a:1,4=d:4", 4).unwrap(), vec![(1, "a:1".into()), (4, "d:4".into())]);
        assert!(parse_join("1=a:1,3=c:3", 4).unwrap_err().contains("--id 4 is not in --join"));
        assert!(parse_join("4=d:4", 4).unwrap_err().contains("no member"));
        assert!(parse_join("1=a:1,4=a:1", 4).unwrap_err().contains("both at a:1"));
    }
}
