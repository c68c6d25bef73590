//! One connection to one backup: handshake, pre-copy, checkpoints out,
//! acknowledgements in.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ftvm_vmm::seccomp;
use ftvm_vmm::sync::Lock;
use ftvm_vmm::Vm;

use super::config::SessionOptions;
use super::loss::BackupLoss;
use super::precopy;
use crate::mirror;
use ftvm_replication::fault;
use ftvm_replication::liveness::{self, Heartbeats, Observer, Pulse};
use ftvm_replication::metrics::{EpochMetrics, MetricsLog, Role, StatusCell};
use ftvm_replication::output::{DiskJournal, OutputBuffer};
use ftvm_replication::pipeline::epochs::EpochLink;
use ftvm_replication::pipeline::prefetch::pull::Offer;
use ftvm_replication::pipeline::transport::{self, AuthTransport, Transport};
use ftvm_replication::pipeline::trigger::{Reason, Trigger};
use ftvm_replication::pipeline::{Pipeline, Taken};
use ftvm_replication::protocol::{self, Heartbeat, Hello, Kind, ProtocolError, Welcome, HANDSHAKE_LIMIT};
use ftvm_replication::ReplicationError;

/// How long a backup that accepted the connection may take over each step
/// of the handshake (answering the hello, mapping the guest's memory); the
/// connect timeout bounds only reaching it.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(30);

/// Partial metrics of a checkpoint waiting for its acknowledgement.
struct InFlight {
    metrics: EpochMetrics,
    resumed: Instant,
    /// When the transport took all of it (the acknowledgement timeout runs from here).
    sent: Option<Instant>,
}

/// What the sender, the acknowledgement reader and the heartbeat thread share.
#[derive(Default)]
struct Shared {
    inflight: Mutex<BTreeMap<u64, InFlight>>,
    lost: Mutex<Option<BackupLoss>>,
}

impl Shared {
    /// Record why the backup was lost, unless a reason was found first.
    fn lose(&self, loss: BackupLoss) {
        let mut lost = self.lost.locked();
        if lost.is_none() {
            *lost = Some(loss);
        }
    }
}

pub struct Session {
    /// The backup's replication address.
    backup: String,
    link: Mutex<Box<dyn Transport>>,
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
    heartbeats: Option<Heartbeats>,
    /// Copies of the guest's frames to this backup, if mirroring.
    mirror: Option<Arc<mirror::Sender>>,
}

/// The primary's side of the heartbeat thread: a silent backup is lost, and
/// so is one that leaves a checkpoint unacknowledged for the (longer)
/// acknowledgement timeout while it still beats (its apply hangs, say).
/// Either way the stream is cut, so a send blocked on it returns.
struct Watch {
    shared: Arc<Shared>,
    link: Box<dyn Transport>,
    ack_timeout: Duration,
}

impl Observer for Watch {
    fn lost_otherwise(&mut self) -> bool {
        if self.shared.lost.locked().is_some() {
            return true;
        }
        let overdue = self
            .shared
            .inflight
            .locked()
            .iter()
            .find_map(|(&epoch, f)| f.sent.map(|sent| (epoch, sent.elapsed())))
            .filter(|(_, waited)| *waited > self.ack_timeout);
        let Some((epoch, waited)) = overdue else { return false };
        self.shared.lose(BackupLoss::Unacknowledged { epoch, waited_ms: waited.as_millis() as u64 });
        self.link.shutdown();
        true
    }

    fn silent(&mut self, silence: Duration, timeout: Duration) {
        self.shared.lose(BackupLoss::Silent { silence_ms: silence.as_millis() as u64, timeout_ms: timeout.as_millis() as u64 });
        self.link.shutdown();
    }
}

/// What a session shares with the primary: the VM and the objects around
/// it (its options come apart, `SessionOptions`).
pub struct Context<'a> {
    pub vm: &'a Vm,
    pub status: &'a StatusCell,
    pub metrics: &'a Arc<MetricsLog>,
    pub output: &'a Arc<OutputBuffer>,
    pub journal: &'a DiskJournal,
    pub trigger: &'a Arc<Trigger>,
    /// Set when the primary is asked to stop: pre-copy gives up.
    pub stop: &'a AtomicBool,
}

impl Session {
    /// Connect to the backup at `backup`, handshake, pre-copy and send the
    /// first checkpoint (`*epoch`, advanced past it).
    pub fn open(
        backup: &str,
        options: &SessionOptions,
        cx: &Context,
        pipeline: &mut Pipeline,
        epoch: &mut u64,
    ) -> Result<Session, ReplicationError> {
        let tcp = transport::connect_unless(backup, options.connect_timeout, cx.stop)?;
        let no_ip = || ReplicationError::Heartbeat(std::io::Error::other("the transport has no IP addresses"));
        let (local, remote) = tcp.addrs().ok_or_else(no_ip)?;
        let socket = liveness::bind_primary(local.ip()).map_err(ReplicationError::Heartbeat)?;
        let mine = Heartbeat {
            session: liveness::session_half().map_err(ReplicationError::Heartbeat)?,
            port: socket.local_addr().map_err(ReplicationError::Heartbeat)?.port(),
            interval_ms: options.liveness.interval.as_millis() as u64,
        };
        cx.status.lock().detail = format!("synchronizing backup {backup}");
        let pull = pipeline.pull_confirmations().is_some();
        // A backup that accepted and then says nothing would hold the
        // handshake for its whole timeout: a stop signal cuts it short
        // (pre-copy watches the signal itself, and says goodbye).
        let cut = tcp.try_clone().map_err(ReplicationError::Send)?;
        let first = *epoch;
        let (mut link, welcome) = unless_stopped(cx.stop, cut, move || {
            let mut link: Box<dyn Transport> = match &options.auth {
                Some(auth) => Box::new(AuthTransport::initiate(tcp, auth)?),
                None => Box::new(tcp),
            };
            let welcome = handshake(link.as_mut(), cx.vm, options, first, mine)?;
            if pull {
                share_memory(link.as_mut(), cx.vm)?;
            }
            Ok((link, welcome))
        })?;
        let theirs = welcome.heartbeat;
        // Heartbeats both ways from here on, pre-copy included.
        let shared = Arc::new(Shared::default());
        let pulse = Pulse::new();
        link.observe(pulse.clone());
        cx.output.set_release_gate(Some(release_gate(&pulse, Duration::from_millis(theirs.interval_ms))));
        let session = liveness::session_id(mine.session, theirs.session);
        let mirror = start_mirror(cx, options, link.as_ref(), SocketAddr::new(remote.ip(), welcome.mirror_port), session)?;
        liveness::check_interval(Role::Backup, theirs.interval_ms, options.liveness.timeout);
        let path = liveness::Path {
            socket,
            peer: SocketAddr::new(remote.ip(), theirs.port),
            session,
            role: Role::Primary,
            keys: link.heartbeat_keys(),
        };
        let watch =
            Watch { shared: shared.clone(), link: link.try_clone().map_err(ReplicationError::Send)?, ack_timeout: options.ack_timeout };
        let heartbeats = Heartbeats::start(path, options.liveness, pulse, watch).map_err(ReplicationError::Thread)?;
        tracing::info!(backup = %backup, "bringing the backup up to date (pre-copy)");
        let t0 = Instant::now();
        // Pre-copy restarts dirty tracking.
        pipeline.restart();
        let sent = precopy::run(link.as_mut(), cx.vm, cx.journal, cx.trigger, options.disk.as_deref(), cx.stop)
            .map_err(|e| sync_failed(link.as_mut(), &shared, e))?;
        // The stop-and-copy: the first checkpoint, which also starts output commit.
        cx.trigger.clear();
        pipeline.new_backup();
        let first = *epoch;
        // Its number is used even if sending fails: numbers never repeat.
        *epoch += 1;
        let (mut taken, frame) = pipeline.take(cx.vm, first)?;
        taken.trigger.reason = Reason::Sync;
        let resumed = Instant::now();
        link.send(frame).map_err(|e| sync_failed(link.as_mut(), &shared, ReplicationError::Send(e)))?;
        tracing::info!(
            backup = %backup,
            precopy_bytes = sent,
            precopy_ms = t0.elapsed().as_millis() as u64,
            pause_us = taken.freeze.pause.as_micros() as u64,
            "backup synchronized; the VM is protected"
        );
        shared
            .inflight
            .locked()
            .insert(first, InFlight { metrics: metrics_of(&taken, frame.len(), resumed.elapsed()), resumed, sent: Some(Instant::now()) });
        {
            // Protected only once the backup acknowledged a checkpoint (the
            // acknowledgement reader says so, naming the peer set here first).
            let mut st = cx.status.lock();
            st.epoch = first;
            st.peer = backup.to_string();
            st.detail = format!("backup {backup} synchronized; waiting for its first acknowledgement");
        }
        let reader = {
            // No timeout: the heartbeat thread decides when the backup is lost
            // and cuts the stream then.
            let mut acks = link.try_clone().map_err(ReplicationError::Send)?;
            acks.set_recv_timeout(None).map_err(ReplicationError::Send)?;
            let (output, shared, status, metrics) = (cx.output.clone(), shared.clone(), cx.status.clone(), cx.metrics.clone());
            let trigger = cx.trigger.clone();
            let priority = options.priority;
            let pulled = pipeline.pull_confirmations();
            std::thread::Builder::new()
                .name("replication-acks".into())
                .spawn(move || {
                    seccomp::install_or_exit(seccomp::ThreadKind::Replication);
                    priority.apply();
                    read_acks(acks.as_mut(), &output, &shared, &trigger, &status, &metrics, pulled.as_deref())
                })
                .map_err(ReplicationError::Thread)?
        };
        Ok(Session {
            backup: backup.to_string(),
            link: Mutex::new(link),
            shared,
            reader: Some(reader),
            heartbeats: Some(heartbeats),
            mirror,
        })
    }

    /// The backup's replication address.
    pub fn backup(&self) -> &str {
        &self.backup
    }

    pub fn acked_all(&self) -> bool {
        self.shared.inflight.locked().is_empty()
    }

    /// Checkpoints sent (or being sent) and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.shared.inflight.locked().len()
    }

    pub fn is_lost(&self) -> bool {
        self.shared.lost.locked().is_some()
    }

    /// Why the backup was lost, once it was.
    pub fn take_loss(&self) -> Option<BackupLoss> {
        self.shared.lost.locked().take()
    }

    /// Why the backup was lost, given that sending to it failed with
    /// `failed`: what the acknowledgement reader found (the backup may have
    /// said why it stopped) if it finds it soon, else `failed`.
    pub fn loss_after(&self, failed: BackupLoss) -> BackupLoss {
        let deadline = Instant::now() + Duration::from_millis(200);
        while Instant::now() < deadline {
            if let Some(loss) = self.take_loss() {
                return loss;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        failed
    }

    pub fn send_checkpoint(&self, taken: &Taken, frame: &[u8], resumed: Instant) -> Result<(), BackupLoss> {
        let mut link = self.link.locked();
        // Register before sending: the acknowledgement can beat our bookkeeping.
        self.shared
            .inflight
            .locked()
            .insert(taken.epoch, InFlight { metrics: metrics_of(taken, frame.len(), Duration::ZERO), resumed, sent: None });
        let result = match fault::for_epoch(taken.epoch) {
            Some(fault) => fault.inject(link.as_mut(), frame),
            None => link.send(frame),
        };
        result.map_err(|err| BackupLoss::Send { epoch: taken.epoch, err })?;
        if let Some(f) = self.shared.inflight.locked().get_mut(&taken.epoch) {
            f.metrics.transfer_us = resumed.elapsed().as_micros() as u64;
            f.sent = Some(Instant::now());
        }
        Ok(())
    }

    /// Send a prefetch frame of epoch `epoch` (`--prefetch`), while the guest runs.
    pub fn send_prefetch(&self, epoch: u64, frame: &[u8]) -> Result<(), BackupLoss> {
        let mut link = self.link.locked();
        link.send(frame).map_err(|err| BackupLoss::Send { epoch, err })?;
        if fault::dies_after_prefetch(epoch) {
            tracing::warn!(epoch, "test fault injected; the primary dies after a prefetch round");
            // SAFETY: _exit ends the process immediately, as a crash would.
            unsafe { libc::_exit(137) }
        }
        Ok(())
    }

    /// Tell the backup it runs the VM from here on (the last checkpoint is acknowledged).
    pub fn hand_over(&self) -> std::io::Result<()> {
        self.link.locked().send(&protocol::message(Kind::Handover, &()))
    }

    /// Tell the backup the guest stopped for good with `status`.
    pub fn bye(&self, status: i32) {
        let _ = self.link.locked().send(&protocol::message(Kind::Bye, &status));
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // No more heartbeats or frames: this primary no longer follows this backup.
        drop(self.heartbeats.take());
        if let Some(m) = &self.mirror {
            m.stop();
        }
        self.link.locked().shutdown();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// `--prefetch-by pull`: hand the backup a read-only view of the guest's
/// memory (`prefetch::pull`), before anything else it is sent.
/// It is a step of the handshake: the backup has as long to come for it as
/// it has to answer the hello.
fn share_memory(link: &mut dyn Transport, vm: &Vm) -> Result<(), ReplicationError> {
    let offer = Offer::new()?;
    link.send(&protocol::message(Kind::PullMap, &offer.name())).map_err(ReplicationError::Send)?;
    if let Err(e) = offer.serve(vm.ram().memfd(), HANDSHAKE_WAIT) {
        // A backup that could not take it (on another host, say) said why.
        return Err(match refusal_behind(link, ReplicationError::Send(std::io::Error::other(e.to_string()))) {
            refused @ ReplicationError::Refused(_) => refused,
            _ => e.into(),
        });
    }
    tracing::info!("the backup maps the guest's memory; it reads prefetched pages itself");
    Ok(())
}

/// Run `work` (the handshake on `link`'s socket) while a
/// watcher shuts `link` down once `stop` is set, so a read that waits for a
/// silent backup ends at once; what fails after a stop is
/// `ReplicationError::Stopped`.
fn unless_stopped<T>(
    stop: &AtomicBool,
    link: Box<dyn Transport>,
    work: impl FnOnce() -> Result<T, ReplicationError>,
) -> Result<T, ReplicationError> {
    let done = &AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        let watcher = std::thread::Builder::new().name("sync-stop".into()).spawn_scoped(scope, move || {
            seccomp::install_or_exit(seccomp::ThreadKind::Replication);
            while !done.load(Ordering::SeqCst) {
                if stop.load(Ordering::SeqCst) {
                    link.shutdown();
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        if let Err(e) = watcher {
            return Err(ReplicationError::Thread(e));
        }
        let result = work();
        done.store(true, Ordering::SeqCst);
        result
    });
    match result {
        Err(_) if stop.load(Ordering::SeqCst) => Err(ReplicationError::Stopped),
        other => other,
    }
}

/// Bringing a new backup up to date failed with `e`. Asked to stop, the
/// primary tells the backup goodbye (it stops too instead of waiting for a
/// stream that will not come). Otherwise: if the backup said why it stopped
/// (a `Refuse`, say its disk is full), that is the error; if the heartbeat
/// thread found it lost (and cut the stream), that.
fn sync_failed(link: &mut dyn Transport, shared: &Shared, e: ReplicationError) -> ReplicationError {
    if matches!(e, ReplicationError::Stopped) {
        let _ = link.send(&protocol::message(Kind::Bye, &0i32));
        return e;
    }
    let e = refusal_behind(link, e);
    if matches!(e, ReplicationError::Refused(_)) {
        return e;
    }
    match shared.lost.locked().take() {
        Some(loss) => ReplicationError::LostDuringSync(loss.to_string()),
        None => e,
    }
}

/// Sending to a new backup failed with `e`: if the backup said why it
/// stopped (a `Refuse`, say its disk is full), that is the error.
fn refusal_behind(link: &mut dyn Transport, e: ReplicationError) -> ReplicationError {
    if !matches!(e, ReplicationError::Send(_)) || link.set_recv_timeout(Some(Duration::from_millis(200))).is_err() {
        return e;
    }
    let mut buf = Vec::new();
    match link.recv(HANDSHAKE_LIMIT, &mut buf) {
        Ok(Kind::Refuse) => protocol::decode::<String>(&buf).map_or(e, ReplicationError::Refused),
        _ => e,
    }
}

/// Acknowledged output goes out only while the backup's heartbeats keep
/// arriving: a primary that was stopped (SIGSTOP, a frozen host) longer
/// than its backup's failure timeout may find, on waking, an
/// acknowledgement that arrived meanwhile, or be in the middle of a
/// release; its backup may have taken over since, and this side must not
/// emit another frame until it knows (`Worker::reclaim`). The newest
/// heartbeat's arrival (stamped by the kernel) says so at once: four of the
/// backup's intervals without one, at least 20 ms, and the output waits
/// for the next acknowledgement, or for the verdict on the backup.
fn release_gate(pulse: &Arc<Pulse>, interval: Duration) -> ftvm_replication::output::ReleaseGate {
    let window = (interval * 4).max(Duration::from_millis(20));
    let pulse = pulse.clone();
    Arc::new(move || pulse.heard_within(window))
}

fn metrics_of(taken: &Taken, bytes: usize, transfer: Duration) -> EpochMetrics {
    let Taken { epoch, trigger, freeze, dirty_pages, predict, state, encoded, prefetched, costs: _, compressed } = *taken;
    EpochMetrics {
        epoch,
        pause_us: freeze.pause.as_micros() as u64,
        dirty_pages,
        disk_writes: state.disk_writes,
        disk_bytes: state.disk_bytes,
        disk_pending: state.disk_pending,
        trigger: trigger.reason,
        epoch_us: trigger.epoch_len.as_micros() as u64,
        max_epoch_us: trigger.max_epoch.as_micros() as u64,
        wait_us: trigger.output_wait.as_micros() as u64,
        clients: trigger.clients,
        spacing_us: trigger.spacing.as_micros() as u64,
        stop_us: freeze.stop.as_micros() as u64,
        predicted: predict.predicted,
        predicted_written: predict.predicted_written,
        fake_dirty: predict.fake_dirty,
        first_writes: predict.first_writes,
        regions_kept: predict.regions_kept,
        regions_flipped: predict.regions_flipped,
        bytes: bytes as u64 + prefetched.bytes,
        commit_pages: encoded.pages.pages,
        prefetched_pages: prefetched.pages,
        prefetch_wasted: prefetched.wasted(),
        prefetch_start: prefetched.start,
        page_bytes: encoded.pages.bytes,
        diff_bytes_saved: encoded.pages.diff_saved,
        diffs_compressed: compressed,
        state_bytes: encoded.state_bytes,
        fake_ack_bytes: state.fake_ack_bytes,
        fake_ack_flows: state.fake_ack_flows,
        fake_ack_bulk_flows: state.fake_ack_bulk_flows,
        fake_ack_sent_bytes: state.fake_ack_sent_bytes,
        encode_ns: encoded.pages_ns,
        transfer_us: transfer.as_micros() as u64,
        ..EpochMetrics::default()
    }
}

/// With `--mirror on` (and no `--encrypt`), copy the guest's frames to the
/// backup's mirror socket at `peer` from now on: output through the output
/// buffer, input through the VM's input hook (`mirror`).
fn start_mirror(
    cx: &Context,
    options: &SessionOptions,
    link: &dyn Transport,
    peer: SocketAddr,
    session: liveness::SessionId,
) -> Result<Option<Arc<mirror::Sender>>, ReplicationError> {
    if options.mirror == mirror::Mode::Off {
        return Ok(None);
    }
    if options.auth.as_ref().is_some_and(|a| a.encrypt) {
        tracing::info!("not mirroring frames to the backup: they would travel unencrypted (--encrypt)");
        return Ok(None);
    }
    let Some((local, _)) = link.addrs() else { return Ok(None) };
    let codec = mirror::Codec { session, keys: link.heartbeat_keys() };
    let mode = options.mirror;
    let sender = Arc::new(mirror::Sender::new(local.ip(), peer, codec, mode == mirror::Mode::On).map_err(ReplicationError::Heartbeat)?);
    cx.output.set_mirror(Some(sender.clone()), mode.fold());
    cx.vm.hooks().set_host_input(Some(Arc::new(mirror::InputMirror { sender: sender.clone(), output: cx.output.clone() })));
    Ok(Some(sender))
}

fn handshake(
    link: &mut dyn Transport,
    vm: &Vm,
    options: &SessionOptions,
    first_epoch: u64,
    heartbeat: Heartbeat,
) -> Result<Welcome, ReplicationError> {
    let disk_size = match &options.disk {
        Some(p) => Some(std::fs::metadata(p).map_err(ReplicationError::PrimaryDisk)?.len()),
        None => None,
    };
    let hello = Hello {
        mem_size: vm.config().mem_size,
        vcpus: vm.config().vcpus,
        devices: vm.devices().kinds(),
        mac: vm.config().devices.net.as_ref().map(|n| n.mac),
        disk_size,
        epoch_ms: options.epoch.as_millis() as u64,
        first_epoch,
        heartbeat,
        cpu: vm.cpu_profile().clone(),
    };
    link.send(&protocol::message(Kind::Hello, &hello)).map_err(ReplicationError::Send)?;
    link.set_recv_timeout(Some(HANDSHAKE_WAIT)).map_err(ReplicationError::Send)?;
    let mut buf = Vec::new();
    let kind = link.recv(HANDSHAKE_LIMIT, &mut buf)?;
    link.set_recv_timeout(None).map_err(ReplicationError::Send)?;
    match kind {
        Kind::Welcome => Ok(protocol::decode::<Welcome>(&buf)?),
        Kind::Refuse => Err(ReplicationError::Refused(protocol::decode::<String>(&buf)?)),
        other => Err(ProtocolError::Corrupt(format!("expected Welcome, got {other:?}")).into()),
    }
}

/// Acknowledgements release output; silence or a closed stream means the
/// backup is gone.
fn read_acks(
    link: &mut dyn Transport,
    output: &OutputBuffer,
    shared: &Shared,
    trigger: &Trigger,
    status: &StatusCell,
    metrics: &MetricsLog,
    pulled: Option<&AtomicU64>,
) {
    let mut buf = Vec::new();
    let loss = loop {
        match link.recv(HANDSHAKE_LIMIT, &mut buf) {
            Ok(Kind::Ack) => {
                let Ok(epoch) = protocol::read_ack(&buf) else { break BackupLoss::MalformedAck };
                let arrived = Instant::now();
                let released = output.release_through(epoch);
                let release_us = arrived.elapsed().as_micros() as u64;
                {
                    let mut st = status.lock();
                    if !st.protected {
                        st.protected = true;
                        st.detail = format!("protected by {}", st.peer);
                    }
                }
                let mut done = Vec::new();
                {
                    let mut inflight = shared.inflight.locked();
                    while inflight.first_key_value().is_some_and(|(&e, _)| e <= epoch) {
                        let (_, f) = inflight.pop_first().expect("non-empty");
                        done.push(f);
                    }
                }
                // Room in the pipeline window.
                trigger.poke();
                for mut f in done {
                    // To the acknowledgement's arrival: the release is `release_us`.
                    f.metrics.ack_us = arrived.saturating_duration_since(f.resumed).as_micros() as u64;
                    if f.metrics.transfer_us == 0 {
                        // Acknowledged before the sender finished its bookkeeping:
                        // the transfer was over by then at the latest.
                        f.metrics.transfer_us = f.metrics.ack_us;
                    }
                    if f.metrics.epoch == epoch {
                        f.metrics.hold_us = released.max_hold_us;
                        f.metrics.frames_released = released.frames;
                        f.metrics.release_us = release_us;
                    }
                    metrics.record(&f.metrics);
                    ftvm_replication::telemetry::telemetry().acknowledged(&f.metrics);
                    let mut st = status.lock();
                    st.started_by.count(f.metrics.trigger);
                    st.last = Some(f.metrics);
                }
            }
            // `--prefetch-by pull`: the backup read this list of pages.
            Ok(Kind::PullDone) => match (pulled, protocol::decode::<u64>(&buf)) {
                (Some(confirmed), Ok(list)) => {
                    confirmed.fetch_max(list, Ordering::AcqRel);
                }
                _ => break BackupLoss::Unexpected(Kind::PullDone),
            },
            Ok(Kind::Refuse) => break BackupLoss::Refused(protocol::decode::<String>(&buf).unwrap_or_else(|e| e.to_string())),
            Ok(other) => break BackupLoss::Unexpected(other),
            Err(e) => break BackupLoss::Stream(e),
        }
    };
    // A reason the heartbeat thread found first (it cut the stream) stays.
    shared.lose(loss);
    link.shutdown();
}
/// The epoch loop's frames go to the backup; a failed send is reported
/// as the loss behind it when the acknowledgement reader found one.
impl EpochLink for Session {
    type Loss = BackupLoss;

    fn take_loss(&self) -> Option<BackupLoss> {
        Session::take_loss(self)
    }

    fn in_flight(&self) -> usize {
        Session::in_flight(self)
    }

    fn send_checkpoint(&self, taken: &Taken, frame: &[u8], resumed: Instant) -> Result<(), BackupLoss> {
        Session::send_checkpoint(self, taken, frame, resumed).map_err(|loss| self.loss_after(loss))
    }

    fn send_round(&self, epoch: u64, frame: &[u8]) -> Result<(), BackupLoss> {
        self.send_prefetch(epoch, frame).map_err(|loss| self.loss_after(loss))
    }

    fn checkpoint_failed(&self, epoch: u64, err: ReplicationError) -> BackupLoss {
        BackupLoss::Checkpoint { epoch, err }
    }

    fn busy(&self) -> Option<Duration> {
        self.link.locked().busy()
    }
}
