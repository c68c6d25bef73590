//! The backup: takes the VM's shape from the primary, applies its pre-copy
//! and then one checkpoint per epoch (whole or not at all), acknowledges
//! each, and takes the VM over when the primary falls silent.

use std::fs::{File, OpenOptions};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ftvm_vmm::devices::DeviceConfig;
use ftvm_vmm::{Console, DirtyBackend, Vm, VmConfig};

use crate::checkpoint::{self, Checkpoint};
use crate::metrics::{AppliedEpoch, MetricsLog, StatusCell};
use crate::protocol::{self, Cursor, Hello, Kind, PageSet, ProtocolError, HANDSHAKE_LIMIT};
use crate::ReplicationError;

#[derive(Clone, Debug)]
pub struct BackupConfig {
    pub listen: String,
    pub devices: DeviceConfig,
    /// The shape this backup was explicitly given, if any; a primary of
    /// another shape is refused.
    pub mem_size: Option<u64>,
    pub vcpus: Option<u32>,
    /// Silence from the primary for this long means it is dead (default:
    /// five epochs, at least 200 ms).
    pub failure_timeout: Option<Duration>,
    pub prefault: bool,
    pub dirty_backend: DirtyBackend,
    pub console: Console,
    /// Log every applied checkpoint as a JSON line here.
    pub metrics: Option<std::path::PathBuf>,
}

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
    Finished(i32),
}

/// A backup waiting for, or following, its primary.
pub struct Backup {
    config: BackupConfig,
    listener: TcpListener,
    status: StatusCell,
}

/// The state of the replica between checkpoints.
struct Replica {
    vm: Arc<Vm>,
    disk: Option<File>,
    disk_size: u64,
    /// The last checkpoint applied: its epoch and its VM state.
    committed: Option<(u64, Vec<u8>)>,
    next_epoch: u64,
}

impl Backup {
    pub fn bind(config: BackupConfig) -> Result<Backup, ReplicationError> {
        let listener =
            TcpListener::bind(&config.listen).map_err(|err| ReplicationError::Listen { addr: config.listen.clone(), err })?;
        let status = StatusCell::new("backup");
        status.lock().detail = format!("waiting for a primary on {}", config.listen);
        Ok(Backup { config, listener, status })
    }

    pub fn status(&self) -> StatusCell {
        self.status.clone()
    }

    /// Follow a primary until it fails, then return the VM, resumed from the
    /// last committed checkpoint and announced on the network.
    pub fn run(self) -> Result<Outcome, ReplicationError> {
        let (mut stream, peer) = self.listener.accept().map_err(|err| ReplicationError::Listen { addr: self.config.listen.clone(), err })?;
        stream.set_nodelay(true).map_err(ReplicationError::Send)?;
        tracing::info!(%peer, "primary connected");
        let (mut replica, hello) = self.welcome(&mut stream)?;
        let timeout = self.config.failure_timeout.unwrap_or(Duration::from_millis((5 * hello.epoch_ms).max(200)));
        stream.set_read_timeout(Some(timeout)).map_err(ReplicationError::Send)?;
        {
            let mut st = self.status.lock();
            st.detail = format!("synchronizing from primary {peer}");
        }
        let log = MetricsLog::open(self.config.metrics.as_deref()).map_err(ReplicationError::Metrics)?;
        let reason = match follow(&mut stream, &mut replica, &self.status, &log) {
            Ended::Lost(reason) => reason,
            Ended::Finished(status) => {
                tracing::info!(status, "the primary's guest stopped; the backup stops too");
                return Ok(Outcome::PrimaryFinished(status));
            }
        };
        let Some((epoch, state)) = replica.committed.take() else {
            tracing::error!("primary lost ({reason}) before the first checkpoint");
            return Err(ReplicationError::NotSynchronized);
        };
        let t0 = Instant::now();
        let state = protocol::decode(&state)?;
        replica.vm.restore_state(&state)?;
        replica.vm.start().map_err(ReplicationError::Thread)?;
        announce(&replica.vm);
        tracing::warn!(epoch, reason, resume_us = t0.elapsed().as_micros() as u64, "PRIMARY LOST: took over from the last committed checkpoint");
        {
            let mut st = self.status.lock();
            st.role = "primary".into();
            st.protected = false;
            st.epoch = epoch;
            st.detail = format!("took over at epoch {epoch} after the primary was lost: {reason}; UNPROTECTED");
        }
        Ok(Outcome::TookOver(replica.vm))
    }

    /// Handshake: check the primary against what this backup was given and
    /// build the replica VM in the primary's shape.
    fn welcome(&self, stream: &mut TcpStream) -> Result<(Replica, Hello), ReplicationError> {
        stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(ReplicationError::Send)?;
        let mut buf = Vec::new();
        let kind = match protocol::read_frame(stream, HANDSHAKE_LIMIT, &mut buf) {
            Ok(k) => k,
            Err(e @ ProtocolError::Version { .. }) => {
                // Tell the primary in words it can read (the frame header is versioned, the refusal text is not).
                let _ = protocol::write_message(stream, Kind::Refuse, &e.to_string());
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        if kind != Kind::Hello {
            return Err(ProtocolError::Corrupt(format!("expected Hello, got {kind:?}")).into());
        }
        let hello: Hello = protocol::decode(&buf)?;
        match self.replica_for(&hello) {
            Ok(replica) => {
                protocol::write_message(stream, Kind::Welcome, &())?;
                Ok((replica, hello))
            }
            Err(refusal) => {
                let _ = protocol::write_message(stream, Kind::Refuse, &refusal);
                Err(ReplicationError::Refused(refusal))
            }
        }
    }

    fn replica_for(&self, hello: &Hello) -> Result<Replica, String> {
        let c = &self.config;
        if c.mem_size.is_some_and(|m| m != hello.mem_size) || c.vcpus.is_some_and(|v| v != hello.vcpus) {
            return Err(format!(
                "the primary's VM has {} MiB and {} vCPUs, this backup was started for {} MiB and {} vCPUs",
                hello.mem_size >> 20,
                hello.vcpus,
                c.mem_size.map_or(hello.mem_size, |m| m) >> 20,
                c.vcpus.unwrap_or(hello.vcpus)
            ));
        }
        if let (Some(theirs), Some(ours)) = (hello.mac, c.devices.net.as_ref().map(|n| n.mac)) {
            if theirs != ours {
                return Err("the primary's network card has another MAC address than this backup's --net".into());
            }
        }
        let config = VmConfig {
            mem_size: hello.mem_size,
            vcpus: hello.vcpus,
            prefault: c.prefault,
            dirty_backend: c.dirty_backend,
            console: c.console.clone(),
            devices: c.devices.clone(),
        };
        let vm = Vm::new(config).map_err(|e| format!("cannot build the replica VM: {e}"))?;
        let ours = vm.devices().types();
        if ours != hello.devices {
            return Err(format!(
                "the primary's VM has devices {} but this backup was given {}",
                device_names(&hello.devices),
                device_names(&ours)
            ));
        }
        let (disk, disk_size) = match (&c.devices.disk, hello.disk_size) {
            (Some(path), Some(size)) => {
                // The replica starts empty: pre-copy sends everything that is not zero.
                let f = OpenOptions::new().write(true).open(path).map_err(|e| format!("cannot open the disk replica: {e}"))?;
                f.set_len(0).and_then(|_| f.set_len(size)).map_err(|e| format!("cannot size the disk replica: {e}"))?;
                (Some(f), size)
            }
            _ => (None, 0),
        };
        Ok(Replica { vm: Arc::new(vm), disk, disk_size, committed: None, next_epoch: hello.first_epoch })
    }
}

fn device_names(types: &[u32]) -> String {
    let names: Vec<&str> = types
        .iter()
        .map(|&t| match t {
            ftvm_vmm::devices::virtio::TYPE_NET => "net",
            ftvm_vmm::devices::virtio::TYPE_BLOCK => "disk",
            _ => "?",
        })
        .collect();
    format!("[{}]", names.join(", "))
}

/// Apply the stream until it ends; returns why it ended.
fn follow(stream: &mut TcpStream, replica: &mut Replica, status: &StatusCell, log: &MetricsLog) -> Ended {
    let mem_size = replica.vm.config().mem_size;
    // A checkpoint holds at most every page once plus the epoch's disk writes.
    let limit = mem_size + mem_size / 256 + (256 << 20);
    let mut buf = Vec::new();
    loop {
        let kind = match protocol::read_frame(stream, limit, &mut buf) {
            Ok(k) => k,
            Err(e @ (ProtocolError::Corrupt(_) | ProtocolError::Version { .. })) => {
                tracing::error!("rejected replication data: {e}; staying at the last good checkpoint");
                return Ended::Lost(format!("replication stream rejected: {e}"));
            }
            Err(e) => return Ended::Lost(e.to_string()),
        };
        let result = match kind {
            Kind::Pages if replica.committed.is_none() => precopy_pages(replica, &buf),
            Kind::Disk if replica.committed.is_none() => precopy_disk(replica, &buf),
            Kind::Checkpoint => apply_checkpoint(stream, replica, &buf, status, log),
            Kind::Heartbeat => Ok(()),
            Kind::Bye => match protocol::decode::<i32>(&buf) {
                Ok(status) => return Ended::Finished(status),
                Err(e) => Err(e.into()),
            },
            other => Err(ReplicationError::Protocol(ProtocolError::Corrupt(format!("unexpected {other:?}")))),
        };
        if let Err(e) = result {
            tracing::error!("rejected replication data: {e}; staying at the last good checkpoint");
            return Ended::Lost(format!("replication stream rejected: {e}"));
        }
    }
}

fn precopy_pages(replica: &Replica, payload: &[u8]) -> Result<(), ReplicationError> {
    let mut c = Cursor::new(payload);
    let pages = PageSet::read(&mut c)?;
    if pages.iter().any(|(p, _)| p >= replica.vm.ram().pages()) || !c.is_empty() {
        return Err(ProtocolError::Corrupt("pre-copy page beyond guest RAM".into()).into());
    }
    checkpoint::apply_pages(&replica.vm, &pages);
    Ok(())
}

fn precopy_disk(replica: &Replica, payload: &[u8]) -> Result<(), ReplicationError> {
    let mut c = Cursor::new(payload);
    let offset = c.u64()?;
    let data = &payload[8..];
    let (Some(disk), true) = (&replica.disk, offset.checked_add(data.len() as u64).is_some_and(|e| e <= replica.disk_size)) else {
        return Err(ProtocolError::Corrupt("pre-copy disk data beyond the disk".into()).into());
    };
    disk.write_all_at(data, offset).map_err(ReplicationError::BackupDisk)
}

fn apply_checkpoint(
    stream: &mut TcpStream,
    replica: &mut Replica,
    payload: &[u8],
    status: &StatusCell,
    log: &MetricsLog,
) -> Result<(), ReplicationError> {
    let t0 = Instant::now();
    let ckpt = Checkpoint::parse(payload, replica.vm.ram().pages(), replica.disk_size)?;
    if ckpt.epoch != replica.next_epoch {
        return Err(ProtocolError::Corrupt(format!("checkpoint {} arrived, {} was expected", ckpt.epoch, replica.next_epoch)).into());
    }
    // A state that does not decode is rejected before anything changes.
    let guest_ns = ckpt.vm_state()?.clock_ns;
    ckpt.apply(&replica.vm, replica.disk.as_ref())?;
    replica.committed = Some((ckpt.epoch, ckpt.state.to_vec()));
    replica.next_epoch = ckpt.epoch + 1;
    log.record(&AppliedEpoch {
        epoch: ckpt.epoch,
        guest_ns,
        applied_unix_ns: unix_ns(),
        pages: ckpt.pages.len() as u64,
        apply_us: t0.elapsed().as_micros() as u64,
    });
    protocol::write_message(stream, Kind::Ack, &ckpt.epoch)?;
    // Input queued before this checkpoint is either in it or lost for good;
    // keep only what a new primary may still need.
    replica.vm.devices().discard_host_input();
    tracing::debug!(epoch = ckpt.epoch, pages = ckpt.pages.len(), apply_us = t0.elapsed().as_micros() as u64, "applied checkpoint");
    let mut st = status.lock();
    st.epoch = ckpt.epoch;
    st.protected = true;
    st.detail = format!("protecting; last applied epoch {}", ckpt.epoch);
    Ok(())
}

fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Tell the L2 network that the guest's MAC now lives here: reverse-ARP
/// broadcasts need no IP address, and every switch learns the new port.
fn announce(vm: &Vm) {
    let Some(mac) = vm.config().devices.net.as_ref().map(|n| n.mac) else { return };
    let mut frame = vec![0u8; ftvm_vmm::devices::virtio::net::VNET_HDR_LEN];
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&[0x80, 0x35]); // RARP
    frame.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 3]); // Ethernet/IPv4, reverse request
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&[0; 4]);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&[0; 4]);
    frame.resize(ftvm_vmm::devices::virtio::net::VNET_HDR_LEN + 60, 0);
    for _ in 0..3 {
        vm.devices().output().submit(&frame);
    }
}
