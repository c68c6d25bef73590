//! The primary: brings a backup up to date with live pre-copy, then takes a
//! checkpoint every epoch and releases each epoch's output when the backup
//! acknowledges it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use ftvm_vmm::{DirtyBitmap, Vm};

use crate::checkpoint;
use crate::metrics::{EpochMetrics, MetricsLog, Status, StatusCell};
use crate::protocol::{self, Hello, Kind, ProtocolError, HANDSHAKE_LIMIT, PAGE};
use crate::{fault, ReplicationError};

/// What the primary does when it loses its backup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnBackupLoss {
    /// Release what the backup acknowledged, then run unprotected.
    #[default]
    Continue,
    /// Pause the guest (outputs stay held) until a new backup protects it.
    Pause,
}

impl std::str::FromStr for OnBackupLoss {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "continue" => Ok(OnBackupLoss::Continue),
            "pause" => Ok(OnBackupLoss::Pause),
            _ => Err(format!("unknown policy '{s}' (expected continue or pause)")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct PrimaryConfig {
    /// The backup's replication address.
    pub backup: String,
    pub epoch_ms: u64,
    /// No acknowledgement for this long means the backup is gone.
    pub failure_timeout: Duration,
    pub on_backup_loss: OnBackupLoss,
    /// How long to keep trying to reach the backup at start.
    pub connect_timeout: Duration,
    pub metrics: Option<PathBuf>,
    /// The primary's disk image, copied to the backup during pre-copy.
    pub disk: Option<PathBuf>,
}

/// Pages per pre-copy message.
const BATCH_PAGES: usize = 256;
/// Pre-copy stops iterating when a round finds this few dirty pages...
const PRECOPY_DONE_PAGES: u64 = 512;
/// ... or after this many rounds.
const PRECOPY_ROUNDS: usize = 8;
const DISK_CHUNK: usize = 1 << 20;

/// A running primary's replication.
pub struct Primary {
    status: StatusCell,
    requests: Sender<String>,
    stop: Arc<AtomicBool>,
    exit_status: Arc<AtomicI32>,
    thread: Option<JoinHandle<()>>,
}

impl Primary {
    /// Reach the backup and synchronize it (pre-copy and the first
    /// checkpoint) before returning, so a bad backup is an error here; then
    /// keep checkpointing in the background.
    pub fn start(vm: Arc<Vm>, config: PrimaryConfig) -> Result<Primary, ReplicationError> {
        let status = StatusCell::new("primary");
        let metrics = Arc::new(MetricsLog::open(config.metrics.as_deref()).map_err(ReplicationError::Metrics)?);
        let mut epoch = 0;
        let session = Session::open(&vm, &config, &status, &metrics, &mut epoch)?;
        let (requests, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let exit_status = Arc::new(AtomicI32::new(0));
        let worker = Worker {
            vm,
            config,
            status: status.clone(),
            metrics,
            stop: stop.clone(),
            exit_status: exit_status.clone(),
            requests: rx,
            epoch,
            held_by_policy: false,
        };
        let thread = std::thread::Builder::new()
            .name("replication".into())
            .spawn(move || worker.run(session))
            .map_err(ReplicationError::Thread)?;
        Ok(Primary { status, requests, stop, exit_status, thread: Some(thread) })
    }

    pub fn status(&self) -> Status {
        self.status.get()
    }

    pub fn status_cell(&self) -> StatusCell {
        self.status.clone()
    }

    /// Protect the VM again with a new backup at `addr` (after losing one).
    pub fn protect(&self, addr: String) {
        let _ = self.requests.send(addr);
    }

    /// The VM stopped for good with `status`: send a last checkpoint, wait
    /// for its acknowledgement (so the guest's last output is released), and
    /// tell the backup to stop too instead of taking over.
    pub fn finish(&mut self, status: i32) {
        self.exit_status.store(status, Ordering::SeqCst);
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        self.finish(0);
    }
}

struct Worker {
    vm: Arc<Vm>,
    config: PrimaryConfig,
    status: StatusCell,
    metrics: Arc<MetricsLog>,
    stop: Arc<AtomicBool>,
    exit_status: Arc<AtomicI32>,
    requests: Receiver<String>,
    /// The next checkpoint's number; never reused, across backups.
    epoch: u64,
    /// The loss policy paused the VM (released once protected again).
    held_by_policy: bool,
}

impl Worker {
    fn run(mut self, first: Session) {
        let mut session = Some(first);
        loop {
            // `protect` also says goodbye when asked to stop, even if the
            // guest exited before this thread got going.
            if let Some(s) = session.take() {
                let reason = self.protect(&s);
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                self.backup_lost(&reason);
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            match self.requests.recv_timeout(Duration::from_millis(100)) {
                Ok(addr) => {
                    let config = PrimaryConfig { backup: addr, ..self.config.clone() };
                    match Session::open(&self.vm, &config, &self.status, &self.metrics, &mut self.epoch) {
                        Ok(s) => {
                            self.config = config;
                            if std::mem::take(&mut self.held_by_policy) {
                                self.vm.release();
                            }
                            session = Some(s);
                        }
                        Err(e) => {
                            tracing::error!("re-protection failed: {e}");
                            self.status.lock().detail = format!("unprotected: re-protection failed: {e}");
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Checkpoint every epoch until the backup is lost; returns why.
    fn protect(&mut self, session: &Session) -> String {
        let mut frame = Vec::new();
        let mut dirty = DirtyBitmap::new(self.vm.ram().pages());
        let epoch_len = Duration::from_millis(self.config.epoch_ms);
        let mut next = Instant::now() + epoch_len;
        loop {
            if let Some(reason) = session.lost() {
                return reason;
            }
            let now = Instant::now();
            if self.stop.load(Ordering::SeqCst) {
                self.farewell(session);
                return "stopping".into();
            }
            if now < next {
                std::thread::sleep((next - now).min(Duration::from_millis(20)));
                continue;
            }
            let epoch = self.epoch;
            let taken = match checkpoint::take(&self.vm, epoch, &mut dirty, &mut frame, None) {
                Ok(t) => t,
                Err(e) => return format!("checkpoint {epoch} failed: {e}"),
            };
            let resumed = Instant::now();
            next = resumed + epoch_len;
            self.epoch += 1;
            if let Err(reason) = session.send_checkpoint(&taken, &frame, resumed) {
                return reason;
            }
            let mut st = self.status.lock();
            st.epoch = epoch;
        }
    }

    /// Last checkpoint of the stopped VM, its acknowledgement, then Bye.
    fn farewell(&mut self, session: &Session) {
        let mut frame = Vec::new();
        let mut dirty = DirtyBitmap::new(self.vm.ram().pages());
        let epoch = self.epoch;
        let Ok(taken) = checkpoint::take(&self.vm, epoch, &mut dirty, &mut frame, None) else { return };
        self.epoch += 1;
        if session.send_checkpoint(&taken, &frame, Instant::now()).is_err() {
            return;
        }
        let deadline = Instant::now() + self.config.failure_timeout;
        while session.lost().is_none() && !session.acked_all() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let status = self.exit_status.load(Ordering::SeqCst);
        let mut stream = session.stream.lock().unwrap_or_else(|p| p.into_inner());
        let _ = protocol::write_message(&mut *stream, Kind::Bye, &status);
    }

    fn backup_lost(&mut self, reason: &str) {
        let output = self.vm.devices().output();
        match self.config.on_backup_loss {
            OnBackupLoss::Continue => {
                let released = output.unprotect();
                self.vm.devices().disk_journal().stop();
                tracing::error!(
                    frames_released = released.frames,
                    "BACKUP LOST ({reason}): the VM now runs UNPROTECTED; attach a new backup to protect it again"
                );
                let mut st = self.status.lock();
                st.protected = false;
                st.detail = format!("UNPROTECTED: backup lost: {reason}");
            }
            OnBackupLoss::Pause => {
                self.vm.hold();
                self.held_by_policy = true;
                tracing::error!(held = output.held_frames(), "BACKUP LOST ({reason}): the VM is paused until a new backup protects it");
                let mut st = self.status.lock();
                st.protected = false;
                st.detail = format!("PAUSED: backup lost: {reason}");
            }
        }
    }
}

/// Partial metrics of a checkpoint waiting for its acknowledgement.
struct InFlight {
    metrics: EpochMetrics,
    resumed: Instant,
}

/// One connection to one backup.
struct Session {
    stream: Mutex<TcpStream>,
    inflight: Arc<Mutex<BTreeMap<u64, InFlight>>>,
    lost: Arc<Mutex<Option<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl Session {
    /// Connect, handshake, pre-copy and send the first checkpoint.
    fn open(vm: &Vm, config: &PrimaryConfig, status: &StatusCell, metrics: &Arc<MetricsLog>, epoch: &mut u64) -> Result<Session, ReplicationError> {
        let mut stream = connect(&config.backup, config.connect_timeout)?;
        {
            let mut st = status.lock();
            st.detail = format!("synchronizing backup {}", config.backup);
        }
        handshake(&mut stream, vm, config, *epoch)?;
        let t0 = Instant::now();
        let sent = precopy(&mut stream, vm, config)?;
        // The stop-and-copy: the first checkpoint, which also starts output commit.
        let mut frame = Vec::new();
        let mut dirty = DirtyBitmap::new(vm.ram().pages());
        let protect_from = (!vm.devices().output().is_protected()).then_some(*epoch + 1);
        let taken = checkpoint::take(vm, *epoch, &mut dirty, &mut frame, protect_from)?;
        let resumed = Instant::now();
        stream.write_all(&frame).map_err(ReplicationError::Send)?;
        let first = *epoch;
        *epoch += 1;
        tracing::info!(
            backup = %config.backup,
            precopy_bytes = sent,
            precopy_ms = t0.elapsed().as_millis() as u64,
            pause_us = taken.pause.as_micros() as u64,
            "backup synchronized; the VM is protected"
        );
        let inflight = Arc::new(Mutex::new(BTreeMap::new()));
        inflight.lock().unwrap_or_else(|p| p.into_inner()).insert(
            first,
            InFlight { metrics: metrics_of(&taken, frame.len(), resumed.elapsed()), resumed },
        );
        let lost = Arc::new(Mutex::new(None));
        let reader = {
            let stream = stream.try_clone().map_err(ReplicationError::Send)?;
            stream.set_read_timeout(Some(config.failure_timeout)).map_err(ReplicationError::Send)?;
            let (vm_out, inflight, lost, status, metrics) =
                (vm.devices().output().clone(), inflight.clone(), lost.clone(), status.clone(), metrics.clone());
            std::thread::Builder::new()
                .name("replication-acks".into())
                .spawn(move || read_acks(stream, &vm_out, &inflight, &lost, &status, &metrics))
                .map_err(ReplicationError::Thread)?
        };
        {
            let mut st = status.lock();
            st.protected = true;
            st.epoch = first;
            st.detail = format!("protected by {}", config.backup);
        }
        Ok(Session { stream: Mutex::new(stream), inflight, lost, reader: Some(reader) })
    }

    fn acked_all(&self) -> bool {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn send_checkpoint(&self, taken: &checkpoint::Taken, frame: &[u8], resumed: Instant) -> Result<(), String> {
        let mut stream = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        // Register before sending: the acknowledgement can beat our bookkeeping.
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).insert(
            taken.epoch,
            InFlight { metrics: metrics_of(taken, frame.len(), Duration::ZERO), resumed },
        );
        let result = match fault::for_epoch(taken.epoch) {
            Some(fault) => fault.inject(&mut *stream, frame),
            None => stream.write_all(frame),
        };
        if let Err(e) = result {
            return Err(format!("sending checkpoint {} failed: {e}", taken.epoch));
        }
        if let Some(f) = self.inflight.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&taken.epoch) {
            f.metrics.transfer_us = resumed.elapsed().as_micros() as u64;
        }
        Ok(())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.stream.lock().unwrap_or_else(|p| p.into_inner()).shutdown(Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn metrics_of(taken: &checkpoint::Taken, bytes: usize, transfer: Duration) -> EpochMetrics {
    EpochMetrics {
        epoch: taken.epoch,
        pause_us: taken.pause.as_micros() as u64,
        dirty_pages: taken.dirty_pages,
        disk_writes: taken.disk_writes,
        bytes: bytes as u64,
        transfer_us: transfer.as_micros() as u64,
        ..EpochMetrics::default()
    }
}

fn connect(addr: &str, timeout: Duration) -> Result<TcpStream, ReplicationError> {
    let deadline = Instant::now() + timeout;
    let unreachable = |err: String| ReplicationError::Unreachable { addr: addr.into(), err };
    loop {
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(|e| unreachable(e.to_string()))?.collect();
        let mut last = String::from("no address");
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(1)) {
                Ok(s) => {
                    s.set_nodelay(true).map_err(ReplicationError::Send)?;
                    return Ok(s);
                }
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err(unreachable(last));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn handshake(stream: &mut TcpStream, vm: &Vm, config: &PrimaryConfig, first_epoch: u64) -> Result<(), ReplicationError> {
    let disk_size = match &config.disk {
        Some(p) => Some(std::fs::metadata(p).map_err(ReplicationError::PrimaryDisk)?.len()),
        None => None,
    };
    let hello = Hello {
        mem_size: vm.config().mem_size,
        vcpus: vm.config().vcpus,
        devices: vm.devices().types(),
        mac: vm.config().devices.net.as_ref().map(|n| n.mac),
        disk_size,
        epoch_ms: config.epoch_ms,
        first_epoch,
    };
    protocol::write_message(stream, Kind::Hello, &hello)?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(ReplicationError::Send)?;
    let mut buf = Vec::new();
    let kind = protocol::read_frame(stream, HANDSHAKE_LIMIT, &mut buf)?;
    stream.set_read_timeout(None).map_err(ReplicationError::Send)?;
    match kind {
        Kind::Welcome => Ok(()),
        Kind::Refuse => Err(ReplicationError::Refused(protocol::decode::<String>(&buf)?)),
        other => Err(ProtocolError::Corrupt(format!("expected Welcome, got {other:?}")).into()),
    }
}

/// Copy memory and disk while the guest runs, then re-copy what it dirtied
/// until little is left. Returns the bytes sent.
fn precopy(stream: &mut TcpStream, vm: &Vm, config: &PrimaryConfig) -> Result<u64, ReplicationError> {
    vm.devices().disk_journal().start();
    vm.start_dirty_tracking()?;
    let mut sent = 0u64;
    let mut frame = Vec::new();
    // Round 0: every page that is not zero (the backup's RAM starts zeroed).
    let all: Vec<u64> = vm
        .ram()
        .populated_ranges()
        .into_iter()
        .flat_map(|(s, e)| s / PAGE as u64..e.div_ceil(PAGE as u64))
        .filter(|&p| !page_is_zero(vm, p))
        .collect();
    sent += send_pages(stream, vm, &all, &mut frame)?;
    if let Some(path) = &config.disk {
        sent += send_disk(stream, path, &mut frame)?;
    }
    let mut dirty = DirtyBitmap::new(vm.ram().pages());
    for _ in 0..PRECOPY_ROUNDS {
        dirty.clear();
        vm.collect_dirty(&mut dirty)?;
        let pages: Vec<u64> = dirty.pages().collect();
        sent += send_pages(stream, vm, &pages, &mut frame)?;
        if (pages.len() as u64) < PRECOPY_DONE_PAGES {
            break;
        }
    }
    Ok(sent)
}

fn page(vm: &Vm, p: u64) -> &[u8] {
    // SAFETY: reading guest RAM while the guest may write it: a torn page
    // is harmless, because dirty tracking was re-armed before the read and
    // the page will be sent again.
    let mem = unsafe { vm.ram().as_slice() };
    &mem[p as usize * PAGE..(p as usize + 1) * PAGE]
}

fn page_is_zero(vm: &Vm, p: u64) -> bool {
    page(vm, p).chunks_exact(8).all(|c| c == [0u8; 8])
}

fn send_pages(stream: &mut TcpStream, vm: &Vm, pages: &[u64], frame: &mut Vec<u8>) -> Result<u64, ReplicationError> {
    let mut sent = 0;
    for batch in pages.chunks(BATCH_PAGES) {
        protocol::begin_frame(frame, Kind::Pages);
        protocol::put_pages(frame, batch, |p| page(vm, p));
        protocol::finish_frame(frame);
        stream.write_all(frame).map_err(ReplicationError::Send)?;
        sent += frame.len() as u64;
    }
    Ok(sent)
}

/// The disk's data regions in chunks, skipping holes and all-zero chunks.
fn send_disk(stream: &mut TcpStream, path: &PathBuf, frame: &mut Vec<u8>) -> Result<u64, ReplicationError> {
    let file = File::open(path).map_err(ReplicationError::PrimaryDisk)?;
    let len = file.metadata().map_err(ReplicationError::PrimaryDisk)?.len();
    let mut chunk = vec![0u8; DISK_CHUNK];
    let mut sent = 0;
    let mut offset = 0u64;
    while offset < len {
        let n = (len - offset).min(DISK_CHUNK as u64) as usize;
        file.read_exact_at(&mut chunk[..n], offset).map_err(ReplicationError::PrimaryDisk)?;
        if chunk[..n].iter().any(|&b| b != 0) {
            protocol::begin_frame(frame, Kind::Disk);
            frame.extend_from_slice(&offset.to_le_bytes());
            frame.extend_from_slice(&chunk[..n]);
            protocol::finish_frame(frame);
            stream.write_all(frame).map_err(ReplicationError::Send)?;
            sent += frame.len() as u64;
        }
        offset += n as u64;
    }
    Ok(sent)
}

/// Acknowledgements release output; silence or a closed stream means the
/// backup is gone.
fn read_acks(
    mut stream: TcpStream,
    output: &ftvm_vmm::devices::virtio::net::OutputBuffer,
    inflight: &Mutex<BTreeMap<u64, InFlight>>,
    lost: &Mutex<Option<String>>,
    status: &StatusCell,
    metrics: &MetricsLog,
) {
    let mut buf = Vec::new();
    let reason = loop {
        match protocol::read_frame(&mut stream, HANDSHAKE_LIMIT, &mut buf) {
            Ok(Kind::Ack) => {
                let Ok(epoch) = protocol::decode::<u64>(&buf) else { break "malformed acknowledgement".to_string() };
                let released = output.release_through(epoch);
                let mut done = Vec::new();
                {
                    let mut inflight = inflight.lock().unwrap_or_else(|p| p.into_inner());
                    while inflight.first_key_value().is_some_and(|(&e, _)| e <= epoch) {
                        let (_, f) = inflight.pop_first().expect("non-empty");
                        done.push(f);
                    }
                }
                for mut f in done {
                    f.metrics.ack_us = f.resumed.elapsed().as_micros() as u64;
                    if f.metrics.transfer_us == 0 {
                        // Acknowledged before the sender finished its bookkeeping:
                        // the transfer was over by then at the latest.
                        f.metrics.transfer_us = f.metrics.ack_us;
                    }
                    if f.metrics.epoch == epoch {
                        f.metrics.hold_us = released.max_hold_us;
                        f.metrics.frames_released = released.frames;
                    }
                    metrics.record(&f.metrics);
                    status.lock().last = Some(f.metrics);
                }
            }
            Ok(other) => break format!("unexpected {other:?} from the backup"),
            Err(ProtocolError::Timeout) => {
                if inflight.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
                    continue;
                }
                break "no acknowledgement within the failure timeout".to_string();
            }
            Err(e) => break e.to_string(),
        }
    };
    let _ = stream.shutdown(Shutdown::Both);
    *lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
}
