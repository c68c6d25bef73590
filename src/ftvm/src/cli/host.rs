//! Options every role shares: how this host runs the VM, how the
//! replication channel is secured, and who arbitrates ownership; with
//! their conversions to the runtime's and the replication crate's types.

use std::path::PathBuf;

use clap::Args;

use ftvm_replication::arbiter::Arbiter;
use ftvm_replication::pipeline::transport::{Auth, Secret};
use ftvm_replication::MetricsFile;
use ftvm_vmm::devices::virtio::block::DiskIo;
use ftvm_vmm::devices::virtio::mmio::UsedNotify;
use ftvm_vmm::devices::virtio::net::{NetConfig, NetOffload};
use ftvm_vmm::devices::DeviceConfig;
use ftvm_vmm::{DirtyBackend, IdlePause, StateReads};

use super::values::arbiter_url;
use crate::error::RunError;
use crate::run::HostOptions;

/// Options about how this host runs the VM (not part of the VM's shape).
#[derive(Args)]
pub struct HostArgs {
    /// Populate all guest memory before the guest starts.
    #[arg(long)]
    pub prefault: bool,
    /// Dirty-page tracking backend: bitmap or ring.
    #[arg(long, value_name = "bitmap|ring", default_value = "bitmap")]
    pub dirty_backend: DirtyBackend,
    /// How a pause (a checkpoint, a snapshot) stops a vCPU idle in the wait
    /// hypercall: `park` counts it stopped where it waits, without waking it;
    /// `kick` wakes it and steps it back over its wait first.
    #[arg(long, value_name = "park|kick", default_value = "park")]
    pub idle_pause: IdlePause,
    /// What a checkpoint's pause reads of each vCPU from KVM: `changing`
    /// reads only what a guest at CPL3 can change (registers, segments,
    /// FPU state, pending events, the time-stamp counter) and the rest (the
    /// other MSRs, XCR0, debug registers) once, as the VMM set it up or
    /// loaded it; `all` reads every register set each time (three more
    /// ioctls per vCPU).
    #[arg(long, value_name = "changing|all", default_value = "changing")]
    pub vcpu_state_reads: StateReads,
    /// Serve the control API on this Unix socket (for `ftvm status`, `pause`, `resume`, `stop`, `snapshot`, `protect`).
    #[arg(long, value_name = "PATH")]
    pub api_socket: Option<PathBuf>,
    /// Let the members of this group use the control socket too (mode
    /// 0660). By default only the user the VMM runs as and root can: whoever
    /// can use it can snapshot all of guest memory.
    #[arg(long, value_name = "NAME", requires = "api_socket")]
    pub api_group: Option<String>,
    /// Network card on TAP device NAME (created if absent) with MAC address MAC
    /// (default 52:54:00:12:34:56; unicast and not all zero).
    #[arg(long, value_name = "tap=NAME[,mac=MAC]")]
    pub net: Option<NetConfig>,
    /// Disk backed by a raw file (its size must be a multiple of 512 bytes).
    #[arg(long, value_name = "PATH")]
    pub disk: Option<PathBuf>,
    /// Where the disk's I/O runs: `async` after its device thread's pass, with
    /// the device unlocked, so a pause (a checkpoint, a snapshot) never waits
    /// for the disk: requests in flight are saved with the disk and issued
    /// again by a VM restored from that state; `sync` inside the pass, which a
    /// pause waits for.
    #[arg(long, value_name = "sync|async", default_value = "async")]
    pub disk_io: DiskIo,
    /// What the network card offers the guest to leave to the host: `csum`
    /// (checksum offload both ways: the guest's runtime leaves the TCP
    /// checksums of what it sends partial, for the host to complete, and
    /// checks no TCP/UDP checksum of frames the TAP marks as checked or
    /// partial) or `off`. A restored
    /// or taken-over VM keeps what its driver negotiated.
    #[arg(long, value_name = "csum|off", default_value = "csum")]
    pub net_offload: NetOffload,
    /// When the buffers a device returns wake the guest: `asked`, as its
    /// driver asks through the virtio event index (ftvm's guests do not ask
    /// to hear of frames sent, only of frames received and, with the
    /// transmit ring full, of room in it); `always`, after every pass that
    /// returned a buffer.
    #[arg(long, value_name = "asked|always", default_value = "asked")]
    pub used_notify: UsedNotify,
    /// Run the VMM's threads without their seccomp filters (docs/seccomp.md).
    #[arg(long)]
    pub no_seccomp: bool,
    /// Serve Prometheus metrics (checkpoints, pause and acknowledgement
    /// times, dirty pages, bytes, held output, failovers, role) on
    /// http://ADDR/metrics (host:port).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
}

impl HostArgs {
    /// The VM's devices as these options give them.
    pub fn devices(&self) -> DeviceConfig {
        DeviceConfig {
            net: self.net.clone(),
            disk: self.disk.clone(),
            disk_io: self.disk_io,
            net_offload: self.net_offload,
            used_notify: self.used_notify,
        }
    }
}

impl From<HostArgs> for HostOptions {
    fn from(args: HostArgs) -> HostOptions {
        HostOptions {
            devices: args.devices(),
            prefault: args.prefault,
            dirty_backend: args.dirty_backend,
            idle_pause: args.idle_pause,
            vcpu_state_reads: args.vcpu_state_reads,
            api_socket: args.api_socket,
            api_group: args.api_group,
            seccomp: !args.no_seccomp,
            metrics_listen: args.metrics_listen,
            user: None,
        }
    }
}

/// Options that secure the replication channel (both sides).
#[derive(Args)]
pub struct ChannelArgs {
    /// Authenticate the replication channel with the secret in this file
    /// (both sides use the same file; it must not be accessible by group or
    /// others). Required, unless --insecure.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Encrypt the replication channel too (needs --secret-file; on a
    /// backup: refuse a primary that does not encrypt).
    #[arg(long, requires = "secret_file")]
    pub encrypt: bool,
    /// Run the replication channel unauthenticated, without --secret-file:
    /// only for a link nobody else reaches (loopback tests, say), since
    /// anyone who reaches it can pose as either side or replay a recorded
    /// stream to a backup.
    #[arg(long, conflicts_with = "secret_file")]
    pub insecure: bool,
}

/// Who owns a replicated VM when primary and backup lose each other.
#[derive(Args)]
pub struct ArbiterArgs {
    /// etcd endpoint deciding ownership (http://HOST:PORT); both sides must name the same one.
    #[arg(long, value_name = "URL", value_parser = arbiter_url)]
    pub arbiter: Option<String>,
    /// The VM's name at the arbiter (default: from its MAC address).
    #[arg(long, requires = "arbiter")]
    pub name: Option<String>,
}

impl ArbiterArgs {
    pub fn arbiter(&self, net: Option<&NetConfig>) -> Option<Arbiter> {
        let endpoint = self.arbiter.as_deref()?;
        let name = self.name.clone().unwrap_or_else(|| match net {
            Some(n) => format!("vm-{}", n.mac.iter().map(|b| format!("{b:02x}")).collect::<String>()),
            None => "vm".into(),
        });
        Some(Arbiter::new(endpoint, &name))
    }
}

impl ChannelArgs {
    /// The channel's secret (none with `--insecure`); neither is a mistake.
    pub fn auth(&self) -> Result<Option<Auth>, RunError> {
        let Some(path) = &self.secret_file else {
            if self.insecure {
                return Ok(None);
            }
            // Unauthenticated, anyone who reaches the link could pose as a
            // primary (a recorded stream replayed to a backup boots the VM
            // there) or as a backup.
            return Err(RunError::Usage(
                "the replication channel needs --secret-file PATH (the same secret on both sides), or --insecure for a link nobody else reaches".into(),
            ));
        };
        Ok(Some(Auth { secret: Secret::from_file(path)?, encrypt: self.encrypt }))
    }
}

/// `--metrics` and its options, alike for every role that writes its
/// figures (a primary's epochs, a backup's applied checkpoints).
#[derive(Args, Clone, Debug)]
pub struct MetricsArgs {
    /// Write this side's replication figures as JSON lines to this file:
    /// one line per second summing that second's checkpoints (count, first
    /// and last epoch, sum and max of each figure, on a primary the
    /// checkpoints per trigger), or one per checkpoint with
    /// --metrics-every-epoch. A line that cannot be written (a full disk)
    /// is dropped, counted and warned about once; the VM goes on.
    #[arg(long, value_name = "PATH")]
    pub metrics: Option<PathBuf>,
    /// Write one --metrics line per checkpoint instead of one per second.
    #[arg(long)]
    pub metrics_every_epoch: bool,
    /// Rotate the --metrics file at this size: it becomes PATH.1 (replacing
    /// the previous PATH.1) and a new PATH starts; 0 never rotates.
    #[arg(long, value_name = "BYTES", default_value_t = ftvm_replication::metrics::DEFAULT_METRICS_MAX_BYTES)]
    pub metrics_max_bytes: u64,
}

impl MetricsArgs {
    /// The file to write, if one was asked for.
    pub fn file(self) -> Option<MetricsFile> {
        let (every_epoch, max_bytes) = (self.metrics_every_epoch, self.metrics_max_bytes);
        self.metrics.map(|path| MetricsFile { path, every_epoch, max_bytes })
    }
}
