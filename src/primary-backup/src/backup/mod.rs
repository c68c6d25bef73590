//! The backup: takes the VM's shape from the primary, applies its pre-copy
//! and then one checkpoint per epoch (whole or not at all), acknowledges
//! each, and takes the VM over when the primary falls silent.

mod admission;
mod replica;

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ftvm_vmm::arch::compat::CpuProfile;
use ftvm_vmm::devices::DeviceConfig;
use ftvm_vmm::hooks::GuestProxy;
use ftvm_vmm::sync::Lock;
use ftvm_vmm::{Console, DirtyBackend, IdlePause, Persist, StateReads, Vm};

use crate::mirror::{self, Mirror};
use ftvm_replication::arbiter::{Arbiter, Claim};
use ftvm_replication::bounds;
use ftvm_replication::fakeack::FakeAck;
use ftvm_replication::liveness::Priority;
use ftvm_replication::liveness::{self, Heartbeats, Observer, Pulse, SessionHalf, Timing};
use ftvm_replication::metrics::{AppliedEpoch, MetricsLog, Role, StatusCell};
pub use ftvm_replication::pipeline::apply::Replica;
use ftvm_replication::pipeline::apply::{Apply, ApplyError, InPlace};
use ftvm_replication::pipeline::prefetch::pull::PrimaryRam;
use ftvm_replication::pipeline::transport::{self, Auth, Transport};
use ftvm_replication::protocol::{self, Heartbeat, Hello, Kind, ProtocolError, PullList, Welcome};
use ftvm_replication::ReplicationError;
pub use replica::for_primary;

#[derive(Clone, Debug)]
pub struct BackupConfig {
    pub listen: String,
    pub devices: DeviceConfig,
    /// The shape this backup was explicitly given, if any; a primary of
    /// another shape is refused.
    pub mem_size: Option<u64>,
    pub vcpus: Option<u32>,
    /// Nothing heard from the primary (no heartbeat, no byte of the stream)
    /// for this long means it is dead (default: [`liveness::DEFAULT_FAILURE_TIMEOUT`]).
    pub failure_timeout: Option<Duration>,
    /// How often to send the primary a heartbeat.
    pub heartbeat: Duration,
    pub prefault: bool,
    pub dirty_backend: DirtyBackend,
    pub idle_pause: IdlePause,
    pub vcpu_state_reads: StateReads,
    /// How the thread receiving and applying checkpoints runs.
    pub priority: Priority,
    pub console: Console,
    /// Log every applied checkpoint as a JSON line here.
    pub metrics: Option<ftvm_replication::metrics::MetricsFile>,
    /// Decides who owns the VM when primary and backup lose each other;
    /// without one, the backup takes over on silence alone.
    pub arbiter: Option<Arbiter>,
    /// Accept only a primary that proves it holds this secret (and, with
    /// `encrypt`, only an encrypted channel).
    pub auth: Option<Auth>,
    /// A connection that has not completed its handshake (authentication
    /// and Hello) within this long is dropped.
    pub handshake_timeout: Duration,
}

/// Default of `BackupConfig::handshake_timeout`.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the backup retries an arbiter it cannot reach.
const ARBITER_RETRY: Duration = Duration::from_millis(200);

/// How following a primary ended.
pub enum Outcome {
    /// The primary failed; this VM, resumed from the last committed
    /// checkpoint, is the VM now.
    TookOver(Arc<Vm>),
    /// The primary's guest stopped for good with this status; nothing to take over.
    PrimaryFinished(i32),
}

enum Ended {
    Lost(String),
    /// The primary stopped its guest and handed the VM over (`Kind::Handover`).
    HandedOver,
    Finished(i32),
    /// This backup cannot apply what the primary sent; the primary was told.
    CannotApply(ApplyError),
}

/// How long a backup that cannot apply keeps the stream open for its reason
/// to reach the primary (less if the primary hangs up first).
const LINGER: Duration = Duration::from_secs(1);

/// A backup waiting for, or following, its primary.
pub struct Backup {
    config: BackupConfig,
    listener: TcpListener,
    /// Where the primary's heartbeats arrive: the listening address, over UDP.
    heartbeats: UdpSocket,
    /// Where its mirrored frames arrive (`mirror`).
    mirror: UdpSocket,
    /// What this host offers a vCPU (`ftvm_vmm::arch::compat`): a primary
    /// whose vCPUs need more is refused at the handshake.
    host: CpuProfile,
    status: StatusCell,
}

/// Why the heartbeat thread found the primary lost, once it did.
type Verdict = Arc<Mutex<Option<String>>>;

/// The backup's side of the heartbeat thread: a silent primary is lost; the
/// stream is cut so that following it ends.
struct Silence {
    verdict: Verdict,
    link: Box<dyn Transport>,
}

impl Observer for Silence {
    fn silent(&mut self, silence: Duration, timeout: Duration) {
        *self.verdict.locked() = Some(format!(
            "nothing heard from the primary for {} ms, no heartbeat and no stream (failure timeout {} ms)",
            silence.as_millis(),
            timeout.as_millis()
        ));
        self.link.shutdown();
    }
}

impl Backup {
    pub fn bind(config: BackupConfig) -> Result<Backup, ReplicationError> {
        let listen_err = |err| ReplicationError::Listen { addr: config.listen.clone(), err };
        let listener = TcpListener::bind(&config.listen).map_err(listen_err)?;
        let heartbeats = listener.local_addr().and_then(liveness::bind_backup).map_err(listen_err)?;
        let mirror = listener.local_addr().and_then(|a| mirror::bind_backup(a.ip())).map_err(listen_err)?;
        let host = ftvm_replication::fault::host_profile(ftvm_vmm::vm::host_cpu_profile()?);
        let status = StatusCell::new(Role::Backup);
        status.lock().detail = format!("waiting for a primary on {}", config.listen);
        tracing::info!(listen = %config.listen, "waiting for a primary");
        Ok(Backup { config, listener, heartbeats, mirror, host, status })
    }

    pub fn status(&self) -> StatusCell {
        self.status.clone()
    }

    /// Follow a primary until it fails, then return the VM, resumed from the
    /// last committed checkpoint and announced on the network.
    pub fn run(self) -> Result<Outcome, ReplicationError> {
        let Backup { config, listener, heartbeats: socket, mirror: mirror_socket, host, status } = self;
        let Admitted { mut link, mut replica, peer, beats, verdict, mirror } = admit(&config, &host, listener, &socket, &mirror_socket)?;
        tracing::info!(%peer, "primary connected");
        {
            let mut st = status.lock();
            st.detail = format!("synchronizing from primary {peer}");
            st.peer = peer.clone();
        }
        let log = MetricsLog::open(config.metrics.as_ref()).map_err(ReplicationError::Metrics)?;
        // This thread receives and applies the checkpoints (`--priority`),
        // then is back to normal for a takeover, whose threads inherit it.
        let ended = config.priority.during(|| follow(link.as_mut(), &mut replica, config.arbiter.as_ref(), &status, &log, &mirror.frames));
        // Following ended: no more heartbeats to this primary.
        drop(beats);
        let lost_unix_us = unix_ns() / 1000;
        let handed_over = matches!(ended, Ended::HandedOver);
        let reason = match ended {
            // The heartbeat thread's finding, if it cut the stream.
            Ended::Lost(reason) => verdict.locked().take().unwrap_or(reason),
            Ended::HandedOver => "the primary handed the VM over (switch-over)".to_string(),
            Ended::Finished(status) => {
                tracing::info!(status, "the primary's guest stopped; the backup stops too");
                return Ok(Outcome::PrimaryFinished(status));
            }
            Ended::CannotApply(e) => {
                // Never a takeover: the primary is alive and runs on as it
                // does after losing a backup (it may have released output
                // of the epoch this replica lacks).
                let mut st = status.lock();
                st.protected = false;
                st.detail = format!("stopped: cannot apply the primary's stream: {e}");
                return Err(ReplicationError::CannotApply(e));
            }
        };
        if !replica.usable {
            return Err(ReplicationError::NotSynchronized);
        }
        let Some((epoch, state)) = replica.committed.take() else {
            tracing::error!("primary lost ({reason}) before the first checkpoint");
            return Err(ReplicationError::NotSynchronized);
        };
        if let Some(arbiter) = &config.arbiter {
            win_ownership(arbiter, &replica, &reason, &status)?;
        }
        let t0 = Instant::now();
        let mut vm = replica.vm;
        vm.restore(&state)?;
        let restore_us = t0.elapsed().as_micros() as u64;
        ftvm_replication::announce::announce(&vm);
        // What the primary may not have released of this epoch goes out
        // first (in the order the guest sent it); then the guest runs, and
        // the input the primary got after this checkpoint reaches it first.
        let mut replay = mirror.frames.take(epoch, std::mem::take(&mut replica.output));
        if handed_over {
            // The primary released all of it once this checkpoint was acknowledged.
            replay.output.clear();
        }
        let (replayed_out, replayed_in) = (replay.output.len(), replay.input.len());
        if let Some(tap) = vm.devices().tap_sink() {
            for frame in &replay.output {
                tap.send(frame);
            }
            // --fake-ack: the guest was told acknowledged what the proxy
            // stored (it is in this checkpoint, so it may go out); the
            // peer may have none of it. The proxy then runs on here.
            if let Some(state) = replica.fake_ack.take() {
                let flows = state.flows();
                let (proxy, resent) = FakeAck::took_over(state, tap);
                tracing::warn!(flows, resent, "fake ACK: took over the proxy's flows; resent what the peer had not acknowledged");
                // The input the primary got after the checkpoint went
                // through its proxy; it goes through this one for the
                // restored guest.
                replay.input.retain_mut(|frame| proxy.rewrite(frame));
                vm.hooks().set_tx(Some(proxy.clone()));
                vm.hooks().set_guest_proxy(Some(proxy));
            }
        }
        vm.devices().inject_host_input(replay.input);
        let replay_us = t0.elapsed().as_micros() as u64 - restore_us;
        let vm = Arc::new(vm);
        vm.start().map_err(ReplicationError::Thread)?;
        let resume_us = t0.elapsed().as_micros() as u64;
        if handed_over {
            tracing::warn!(epoch, resume_us, replayed_in, "HANDED OVER: runs the VM from the primary's last checkpoint");
        } else {
            tracing::warn!(
                epoch,
                reason,
                lost_unix_us,
                resume_us,
                restore_us,
                replay_us,
                replayed_out,
                replayed_in,
                "PRIMARY LOST: took over from the last committed checkpoint"
            );
        }
        ftvm_replication::telemetry::telemetry().took_over();
        {
            let mut st = status.lock();
            st.role = Role::Primary;
            st.protected = false;
            st.epoch = epoch;
            st.peer.clear();
            st.detail = if handed_over {
                format!("took over at epoch {epoch}: {reason}; UNPROTECTED")
            } else {
                format!("took over at epoch {epoch} after the primary was lost: {reason}; UNPROTECTED")
            };
        }
        Ok(Outcome::TookOver(vm))
    }
}

/// Take the VM over only as its owner: the primary may be alive and
/// have claimed it first (then this backup stops). An unreachable
/// arbiter means waiting, never a takeover.
fn win_ownership(arbiter: &Arbiter, replica: &Replica, reason: &str, status: &StatusCell) -> Result<(), ReplicationError> {
    let Some(seen) = &replica.owner_seen else {
        tracing::error!("primary lost ({reason}); {}", ReplicationError::NoOwnershipView);
        return Err(ReplicationError::NoOwnershipView);
    };
    let me = ftvm_replication::identity(Role::Backup);
    let mut logged = false;
    loop {
        match arbiter.claim(seen, &me) {
            Ok(Claim::Won(ownership)) => {
                tracing::info!(generation = ownership.generation, "this backup owns the VM now");
                return Ok(());
            }
            Ok(Claim::Lost(owner)) => {
                let e = ReplicationError::Fenced { owner: owner.owner, generation: owner.generation };
                tracing::error!("primary lost ({reason}) but it kept the VM: {e}");
                return Err(e);
            }
            Err(e) => {
                if !logged {
                    tracing::error!("primary lost ({reason}) and {e}: not taking over until the arbiter answers");
                    status.lock().detail = format!("primary lost; waiting for the arbiter: {e}");
                    logged = true;
                }
                std::thread::sleep(ARBITER_RETRY);
            }
        }
    }
}

/// Wait for the primary: accept connections until one completes the
/// handshake with a VM this backup can follow; build the replica VM in its
/// shape and welcome it. Every other connection is logged and dropped (a
/// refused primary is told why); the listening socket closes once the
/// primary is in.
/// Heartbeats (on `socket`) start before the Welcome that tells the primary
/// where they come from, so the first one is on its way when the primary
/// starts listening for them.
fn admit(
    config: &BackupConfig,
    host: &CpuProfile,
    listener: TcpListener,
    socket: &UdpSocket,
    mirror_socket: &UdpSocket,
) -> Result<Admitted, ReplicationError> {
    let gate = admission::Gate::open(listener, config.auth.clone(), config.handshake_timeout)?;
    loop {
        let admission::Candidate { mut link, hello, peer } = gate.next()?;
        match for_primary(config, host, &hello) {
            Ok(replica) => {
                let session = liveness::session_half().map_err(ReplicationError::Heartbeat)?;
                let port = socket.local_addr().map_err(ReplicationError::Heartbeat)?.port();
                let heartbeat = Heartbeat { session, port, interval_ms: config.heartbeat.as_millis() as u64 };
                let (beats, verdict) = watch(config, link.as_mut(), &hello, session, socket)?;
                let mirror = Mirroring::start(link.as_ref(), &hello, session, mirror_socket)?;
                let mirror_port = mirror_socket.local_addr().map_err(ReplicationError::Heartbeat)?.port();
                match link.send(&protocol::message(Kind::Welcome, &Welcome { heartbeat, mirror_port })) {
                    Ok(()) => return Ok(Admitted { link, replica, peer, beats, verdict, mirror }),
                    Err(e) => tracing::warn!(%peer, "the primary left before it was welcomed: {e}"),
                }
            }
            Err(refusal) => {
                transport::refuse(link.as_mut(), &refusal);
                tracing::warn!(%peer, "refused a primary: {refusal}");
            }
        }
    }
}

/// The primary, welcomed.
struct Admitted {
    link: Box<dyn Transport>,
    replica: Replica,
    peer: String,
    /// Heartbeats with it, and what they found.
    beats: Heartbeats,
    verdict: Verdict,
    mirror: Mirroring,
}

/// The frames the primary mirrors, and the thread receiving them.
struct Mirroring {
    frames: Arc<Mirror>,
    _receiver: mirror::Receiver,
}

impl Mirroring {
    /// Receive the mirrored frames of the session of `link` (whose primary
    /// said `hello`; this backup's half of the session id is `mine`) on `socket`.
    fn start(link: &dyn Transport, hello: &Hello, mine: SessionHalf, socket: &UdpSocket) -> Result<Mirroring, ReplicationError> {
        let codec = mirror::Codec { session: liveness::session_id(hello.heartbeat.session, mine), keys: link.heartbeat_keys() };
        let frames = Arc::new(Mirror::default());
        let socket = socket.try_clone().map_err(ReplicationError::Heartbeat)?;
        let receiver = mirror::Receiver::start(socket, codec, frames.clone()).map_err(ReplicationError::Thread)?;
        Ok(Mirroring { frames, _receiver: receiver })
    }
}

/// Start heartbeats with the primary of `link` (which said `hello`), this
/// backup's half of the session id being `mine`, and watch it: when neither
/// heartbeats nor stream bytes arrived for the failure timeout, the verdict
/// is set and the stream cut.
fn watch(
    config: &BackupConfig,
    link: &mut dyn Transport,
    hello: &Hello,
    mine: SessionHalf,
    socket: &UdpSocket,
) -> Result<(Heartbeats, Verdict), ReplicationError> {
    let timeout = config.failure_timeout.unwrap_or(liveness::DEFAULT_FAILURE_TIMEOUT);
    // No timeout on the stream: a large checkpoint or a quiet pre-copy may
    // keep it silent for long.
    link.set_recv_timeout(None).map_err(ReplicationError::Send)?;
    let pulse = Pulse::new();
    link.observe(pulse.clone());
    liveness::check_interval(Role::Primary, hello.heartbeat.interval_ms, timeout);
    let no_ip = || ReplicationError::Heartbeat(std::io::Error::other("the transport has no IP addresses"));
    let (_, remote) = link.addrs().ok_or_else(no_ip)?;
    let path = liveness::Path {
        socket: socket.try_clone().map_err(ReplicationError::Heartbeat)?,
        peer: SocketAddr::new(remote.ip(), hello.heartbeat.port),
        session: liveness::session_id(hello.heartbeat.session, mine),
        role: Role::Backup,
        keys: link.heartbeat_keys(),
    };
    let verdict = Arc::new(Mutex::new(None));
    let silence = Silence { verdict: verdict.clone(), link: link.try_clone().map_err(ReplicationError::Send)? };
    let timing = Timing { interval: config.heartbeat, timeout };
    let beats = Heartbeats::start(path, timing, pulse, silence).map_err(ReplicationError::Thread)?;
    Ok((beats, verdict))
}

/// What handling one message came to, when not simply done.
enum Stop {
    /// The stream broke: the primary is presumed dead.
    Lost(String),
    /// A whole, verified message this backup cannot apply.
    CannotApply(ApplyError),
}

/// Apply the stream until it ends; returns why it ended.
fn follow(
    link: &mut dyn Transport,
    replica: &mut Replica,
    arbiter: Option<&Arbiter>,
    status: &StatusCell,
    log: &MetricsLog,
    mirror: &Mirror,
) -> Ended {
    // What the primary may send, computed as the primary does.
    let limit = bounds::checkpoint_limit(replica.vm.config().mem_size, replica.vm.config().vcpus);
    let apply = &mut InPlace::default();
    let buf = &mut Vec::new();
    // `--prefetch-by pull`: the primary's guest memory, read-only.
    let mut primary_ram: Option<PrimaryRam> = None;
    loop {
        // Frames cut short or damaged are what a primary dying mid-send
        // leaves: this replica stays at its last checkpoint and takes over.
        let kind = match link.recv(limit, buf) {
            Ok(k) => k,
            Err(e @ (ProtocolError::Corrupt(_) | ProtocolError::Version { .. } | ProtocolError::Unauthenticated(_))) => {
                tracing::error!("rejected replication data: {e}; staying at the last good checkpoint");
                return Ended::Lost(format!("replication stream rejected: {e}"));
            }
            Err(e) => return Ended::Lost(e.to_string()),
        };
        let unexpected = |what: String| Err(Stop::CannotApply(ProtocolError::Corrupt(what).into()));
        let result = match kind {
            Kind::Pages if replica.committed.is_none() => replica.precopy_pages(buf).map_err(Stop::CannotApply),
            Kind::Disk if replica.committed.is_none() => replica.precopy_disk(buf).map_err(Stop::CannotApply),
            Kind::Prefetch if replica.committed.is_some() => replica.stage_prefetch(std::mem::take(buf), limit).map_err(Stop::CannotApply),
            Kind::PullMap if primary_ram.is_none() => match map_primary(replica, buf) {
                Ok(ram) => {
                    tracing::info!("mapped the primary's guest memory read-only; reading prefetched pages from it");
                    primary_ram = Some(ram);
                    Ok(())
                }
                Err(e) => Err(Stop::CannotApply(e)),
            },
            Kind::PullList if replica.committed.is_some() => match &primary_ram {
                Some(ram) => pull_list(link, replica, ram, buf, limit),
                None => unexpected("a list of pages to read before the primary's memory was shared".into()),
            },
            Kind::Checkpoint => apply_checkpoint(link, apply, replica, buf, status, log).map(|epoch| mirror.applied(epoch)),
            // Only after a checkpoint: the primary acknowledged state to run from.
            Kind::Handover if replica.committed.is_some() => return Ended::HandedOver,
            Kind::Bye => match protocol::decode::<i32>(buf) {
                Ok(status) => return Ended::Finished(status),
                Err(e) => Err(Stop::CannotApply(e.into())),
            },
            other => unexpected(format!("unexpected {other:?}")),
        };
        match result {
            Ok(()) => {
                // Ownership as it stands while the primary replicates is what a
                // takeover must swap out; read once synchronized (after the Ack).
                if let (Some(arbiter), None, Some(_)) = (arbiter, &replica.owner_seen, &replica.committed) {
                    match arbiter.read() {
                        Ok(ownership) => {
                            tracing::info!(generation = ownership.generation, "read the VM's ownership from the arbiter");
                            replica.owner_seen = Some(ownership);
                        }
                        Err(e) => tracing::warn!("cannot read the VM's ownership yet: {e}"),
                    }
                }
            }
            Err(Stop::Lost(reason)) => return Ended::Lost(reason),
            Err(Stop::CannotApply(e)) => {
                // Synchronized, the primary reads what this backup sends at
                // once; before that it only sends.
                let reading = replica.committed.is_some();
                refuse(link, &e, reading, limit, buf);
                return Ended::CannotApply(e);
            }
        }
    }
}

/// Tell the primary why this backup stops (it handles that as a lost
/// backup), and keep the stream open a little so the reason arrives whole
/// before the close. A primary that reads (`reading`: it is synchronized)
/// hangs up on it, and what it sends meanwhile is drained. One that is
/// still bringing this backup up to date only sends: nothing is read, so
/// its sends stall, and fail once the stream closes; it then reads the
/// reason (the kernel keeps what arrived before the reset).
fn refuse(link: &mut dyn Transport, e: &ApplyError, reading: bool, limit: u64, buf: &mut Vec<u8>) {
    let reason = format!("the backup cannot apply the primary's stream and stops: {e}");
    if link.send(&protocol::message(Kind::Refuse, &reason)).is_err() {
        return;
    }
    if !reading {
        std::thread::sleep(LINGER);
        return;
    }
    let _ = link.set_recv_timeout(Some(Duration::from_millis(100)));
    let deadline = Instant::now() + LINGER;
    while Instant::now() < deadline {
        match link.recv(limit, buf) {
            Ok(_) | Err(ProtocolError::Timeout) => {}
            Err(_) => break, // hung up
        }
    }
}

/// How long the primary's memory socket may take to hand its memfd over.
const MAP_TIMEOUT: Duration = Duration::from_secs(5);

/// `PullMap`: take the primary's guest memory from the socket it names.
fn map_primary(replica: &Replica, payload: &[u8]) -> Result<PrimaryRam, ApplyError> {
    let name = protocol::decode::<String>(payload)?;
    Ok(PrimaryRam::map(&name, replica.vm.ram().size(), MAP_TIMEOUT)?)
}

/// `PullList`: read the listed pages from the primary's memory, stage them
/// for their checkpoint, and confirm the list (only then may the primary
/// leave them out of it).
fn pull_list(link: &mut dyn Transport, replica: &mut Replica, ram: &PrimaryRam, payload: &[u8], limit: u64) -> Result<(), Stop> {
    let list = protocol::decode::<PullList>(payload).map_err(|e| Stop::CannotApply(e.into()))?;
    replica.stage_pulled(ram, &list, limit).map_err(Stop::CannotApply)?;
    link.send(&protocol::message(Kind::PullDone, &list.list)).map_err(|e| Stop::Lost(format!("cannot confirm pulled pages: {e}")))
}

fn apply_checkpoint(
    link: &mut dyn Transport,
    apply: &mut dyn Apply,
    replica: &mut Replica,
    payload: &[u8],
    status: &StatusCell,
    log: &MetricsLog,
) -> Result<u64, Stop> {
    let t0 = Instant::now();
    let staged = apply.stage(replica, payload).map_err(Stop::CannotApply)?;
    let (epoch, pages) = (staged.epoch, staged.pages.len());
    ftvm_replication::fault::stall_apply(epoch);
    apply.commit(replica, staged).map_err(Stop::CannotApply)?;
    let guest_ns = replica.committed.as_ref().and_then(|(_, state)| ftvm_vmm::clock::saved_ns(state).ok()).unwrap_or(0);
    let applied = AppliedEpoch { epoch, guest_ns, applied_unix_ns: unix_ns(), pages, apply_us: t0.elapsed().as_micros() as u64 };
    log.record(&applied);
    ftvm_replication::telemetry::telemetry().applied(&applied);
    link.send(&protocol::ack(epoch)).map_err(|e| Stop::Lost(format!("cannot acknowledge checkpoint {epoch}: {e}")))?;
    // Input queued before this checkpoint is either in it or lost for good;
    // keep only what a new primary may still need.
    replica.vm.devices().drop_queued_host_input();
    tracing::debug!(epoch, pages, apply_us = t0.elapsed().as_micros() as u64, "applied checkpoint");
    let mut st = status.lock();
    st.epoch = epoch;
    st.protected = true;
    st.detail = format!("protecting; last applied epoch {epoch}");
    Ok(epoch)
}

fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}
