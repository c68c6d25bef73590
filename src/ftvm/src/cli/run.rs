//! `ftvm run` and `ftvm restore`: a VM of its own, alone or as a primary
//! replicating to a backup (`--replicate-to`); the primary's options, and
//! their conversion to the replication crate's `PrimaryConfig` (shared with
//! a promoted backup, `cli::backup`).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, FromArgMatches};

use ftvm_primary_backup::mirror::Mode;
use ftvm_primary_backup::{LossPolicy, OnBackupLoss, PrimaryConfig, SessionOptions, DEFAULT_PIPELINE_DEPTH};
use ftvm_replication::arbiter::Arbiter;
use ftvm_replication::liveness;
use ftvm_replication::pipeline::transport::Auth;
use ftvm_replication::pipeline::{capture, encode, policy, predict, prefetch, transport, trigger};
use ftvm_replication::Switches;
use ftvm_vmm::DirtyBackend;

use super::config::ConfigArgs;
use super::host::{ArbiterArgs, ChannelArgs, HostArgs, MetricsArgs};
use super::values::{default_text, epoch_ms, host_port, millis, positive_ms};
use crate::error::RunError;
use crate::roles::Launch;
use crate::run::Guest;

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Guest image: a static x86-64 ELF built for the ftvm guest ABI, or an
    /// unmodified static Linux program (run on the runtime's Linux
    /// personality, linux.elf; --cmdline "OPTIONS -- PROGRAM ARGS...").
    #[arg(long, value_name = "PATH")]
    pub image: PathBuf,
    /// Root file system of a Linux program: a host directory (made by
    /// scripts/make-rootfs.sh) packed read-only into guest memory. A
    /// dynamically linked program (PIE) needs one: the runtime loads it,
    /// its interpreter and its libraries from there.
    #[arg(long, value_name = "DIR")]
    pub rootfs: Option<PathBuf>,
    /// Guest memory in MiB (a multiple of 2).
    #[arg(long, value_name = "MIB", default_value_t = 256)]
    pub memory: u64,
    /// Number of vCPUs (1 to 32).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub vcpus: u32,
    /// Command line passed to the guest.
    #[arg(long, default_value = "")]
    pub cmdline: String,
    /// Run as this user (no supplementary groups, no capabilities) once
    /// /dev/kvm, the TAP, the disk and the control socket are open.
    #[arg(long, value_name = "NAME")]
    pub user: Option<String>,
    #[command(flatten)]
    pub replication: ReplicationArgs,
    #[command(flatten)]
    pub host: HostArgs,
}

/// `ftvm restore`'s options.
#[derive(Args)]
pub struct RestoreArgs {
    /// Snapshot file to continue from (written by `ftvm snapshot`).
    #[arg(long, value_name = "PATH")]
    pub snapshot: PathBuf,
    #[command(flatten)]
    pub replication: Box<ReplicationArgs>,
    #[command(flatten)]
    pub host: HostArgs,
    /// Run as this user once /dev/kvm, the TAP, the disk and the control socket are open.
    #[arg(long, value_name = "NAME")]
    pub user: Option<String>,
}

/// How a primary replicates (`ftvm run`, `ftvm restore`): everything but
/// `--replicate-to` itself needs `--replicate-to`.
#[derive(Args)]
pub struct ReplicationArgs {
    /// Replicate to the backup listening at this address (host:port). The
    /// replication options (--epoch-ms to --transport, --arbiter, --name) need it.
    #[arg(long, value_name = "ADDR", value_parser = host_port)]
    pub replicate_to: Option<String>,
    /// Longest epoch in milliseconds (5 to 60000): the checkpoint interval
    /// with --trigger periodic; with --trigger output, the most an epoch
    /// runs without output (less when checkpoints are cheap).
    #[arg(long = "epoch-ms", value_name = "MS", default_value = default_text!(PrimaryConfig::DEFAULT_EPOCH, as_millis), value_parser = epoch_ms)]
    pub epoch: Duration,
    /// When the backup is lost: keep running unprotected (continue), or pause with
    /// output held (pause). Default: continue with --arbiter (after winning
    /// ownership), pause without (a cut link must not leave two VMs running);
    /// continue needs --arbiter.
    #[arg(long, value_name = "continue|pause")]
    pub on_backup_loss: Option<OnBackupLoss>,
    /// Declare the backup lost after this long without hearing from it: no
    /// heartbeat, no acknowledgement.
    #[arg(long = "failure-timeout-ms", value_name = "MS", default_value = default_text!(PrimaryConfig::DEFAULT_FAILURE_TIMEOUT, as_millis), value_parser = positive_ms)]
    pub failure_timeout: Duration,
    /// Declare the backup lost when a checkpoint stays unacknowledged this
    /// long after it was sent, though the backup still sends heartbeats (its
    /// apply hangs, say). At least the failure timeout.
    #[arg(long = "ack-timeout-ms", value_name = "MS", default_value = default_text!(PrimaryConfig::DEFAULT_ACK_TIMEOUT, as_millis), value_parser = positive_ms)]
    pub ack_timeout: Duration,
    /// Send the backup a heartbeat (a UDP datagram) this often.
    #[arg(long = "heartbeat-ms", value_name = "MS", default_value = default_text!(liveness::DEFAULT_INTERVAL, as_millis), value_parser = positive_ms)]
    pub heartbeat: Duration,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Give up reaching the backup at start after this long.
    #[arg(long = "connect-timeout-ms", value_name = "MS", default_value = default_text!(PrimaryConfig::DEFAULT_CONNECT_TIMEOUT, as_millis), value_parser = millis())]
    pub connect_timeout: Duration,
    /// Checkpoint capture stage. pause: copy the dirty pages while the VM is
    /// paused. cow: resume at once and copy each dirty page before it is
    /// written again (userfaultfd write protection; with --predict-writes the
    /// pages left writable are copied in the pause). Default (--tuning
    /// auto): cow where a probe at start finds write-protecting a page
    /// costs under half a copy, else pause; --tuning static: pause.
    #[arg(long, value_name = "pause|cow")]
    pub capture: Option<capture::Mode>,
    /// Checkpoint page encoding. raw: whole pages, zero pages as a bare tag.
    #[arg(long, default_value = "raw", value_name = "raw")]
    pub encoding: encode::Encoding,
    /// Send a page the backup has an earlier version of as a diff: off (whole
    /// pages), xor (the XOR of its changed 64-byte blocks; `--diff` alone), lz4
    /// (each diff LZ4-compressed when that is smaller; the default), auto
    /// (xor while the replication link has room, lz4 while it is busy or for
    /// a checkpoint of 1024 pages or more).
    #[arg(long, value_name = "off|xor|lz4|auto", num_args = 0..=1, default_missing_value = "xor")]
    pub diff: Option<encode::Diff>,
    /// Which vCPU and device state each checkpoint carries: all, or changed
    /// (only what differs from the previous checkpoint; the backup keeps the rest).
    #[arg(long, default_value = "changed", value_name = "all|changed")]
    pub device_state: encode::States,
    /// Replication transport. tcp: one TCP connection to the backup.
    #[arg(long, default_value = "tcp", value_name = "tcp")]
    pub transport: transport::Kind,
    /// Give the backup a copy of every frame the guest sends and receives,
    /// so that after a takeover it replays them and clients need not wait
    /// for TCP retransmissions. on: input in UDP datagrams, those queued
    /// together in one, and each epoch's first 64 KiB of output inside its
    /// checkpoint; per-frame: a UDP datagram per frame, output included;
    /// off: only checkpoints. Default: on, but off with --encrypt (the
    /// copies travel unencrypted), and --mirror on or per-frame with
    /// --encrypt is refused.
    #[arg(long, value_name = "on|per-frame|off")]
    pub mirror: Option<ftvm_primary_backup::mirror::Mode>,
    /// Scheduling of the checkpoint thread (while it protects) and of the
    /// acknowledgement reader: normal, or real-time (SCHED_FIFO, as the
    /// heartbeats), so a held reply does not wait for the host's other work
    /// to let them run.
    #[arg(long, default_value = "normal", value_name = "normal|realtime")]
    pub priority: ftvm_replication::liveness::Priority,
    /// Fake ACK: while the guest's TCP data waits in the output buffer,
    /// acknowledge it to the guest on the peer's behalf so its send buffer
    /// empties at once (on: every flow; bulk: only flows found carrying
    /// bulk data, full-sized segments with 32 KiB or more the peer has not
    /// acknowledged, until a lone short reply on an idle connection); the
    /// proxy's state (what was acknowledged and not yet received) travels
    /// with every checkpoint, and a backup that takes over sends it. off:
    /// the guest hears only the peer's ACKs. Default (--tuning auto):
    /// bulk; --tuning static: off.
    #[arg(long, value_name = "off|on|bulk")]
    pub fake_ack: Option<ftvm_replication::fakeack::Mode>,
    /// With --fake-ack on or bulk, how each checkpoint carries the proxy's state:
    /// changed (what changed since the previous checkpoint: segments stored
    /// and acknowledged since, flows changed; the backup keeps the rest), or
    /// all (the whole state every time).
    #[arg(long, default_value = "changed", value_name = "changed|all")]
    pub fake_ack_state: ftvm_replication::fakeack::delta::Sending,
    /// What starts a checkpoint. output: output is held and the guest idle,
    /// or held output waited its bound, or the epoch reached its maximum;
    /// periodic: every --epoch-ms.
    #[arg(long, default_value = "output", value_name = "output|periodic")]
    pub trigger: trigger::Mode,
    /// With --trigger output, whether a checkpoint waits to carry more
    /// clients' requests: on, the spacing after a resume grows from two
    /// pauses (one client waiting on the checkpoints) to eight (four or
    /// more: their next requests arrive meanwhile and share one checkpoint);
    /// off, always two pauses.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub group_commit: trigger::GroupCommit,
    /// Checkpoints sent and not yet acknowledged at most (1 to 64): the next
    /// checkpoint may be taken while this many are in flight.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PIPELINE_DEPTH, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub pipeline_depth: u64,
    /// Who chooses the mechanisms not named here: auto (write prediction
    /// and prefetch, each adaptive, weighing this host's costs measured at
    /// start) or static (neither: every dirty page tracked and sent at the
    /// checkpoint). A switch given overrides the choice.
    #[arg(long, default_value = "auto", value_name = "auto|static")]
    pub tuning: policy::Tuning,
    /// Write-fault prediction: leave pages likely to be written again
    /// writable at each checkpoint (no tracked first write for them); pages
    /// left writable but unchanged are not sent. off, histase (HBFT's
    /// stride and history predictor) or adaptive (per-region rewrite rate).
    /// Default (--tuning auto): adaptive, but off with --dirty-backend ring
    /// (given beside it, it is refused).
    #[arg(long, value_name = "off|histase|adaptive")]
    pub predict_writes: Option<predict::Mode>,
    /// In-epoch transfer: during each epoch, send the backup the write-cold
    /// pages dirtied earlier in it while the guest runs (staged there until
    /// the epoch's checkpoint commits them), so the checkpoint carries only
    /// the pages written again since. off, on, or adaptive (after an epoch
    /// in which more than one page in seven the rounds sent was written
    /// again before the checkpoint, each such send a tracked first write
    /// for the guest, the rounds start later in the epoch, down to the
    /// last alone, then stop for a while). Pages write prediction keeps
    /// writable are not sent ahead (the checkpoint carries them). Default
    /// (--tuning auto): adaptive; --tuning static: off.
    #[arg(long, value_name = "off|on|adaptive")]
    pub prefetch: Option<prefetch::Mode>,
    /// How --prefetch's pages reach the backup: push (the primary reads
    /// and sends them) or pull (it sends their numbers; the backup, on
    /// the same host, reads them itself from a read-only mapping of this
    /// VM's memory, handed over a Unix socket to a process of the same
    /// user). Needs --prefetch on or adaptive.
    #[arg(long, default_value = "push", value_name = "push|pull")]
    pub prefetch_by: prefetch::pull::By,
    #[command(flatten)]
    pub arbiter: ArbiterArgs,
    #[command(flatten)]
    pub channel: ChannelArgs,
}

/// What a primary's configuration takes from elsewhere than its
/// replication options: from `ftvm run`'s other options, or from the
/// backup that a promotion makes a primary.
pub struct Protection {
    pub backup: String,
    pub arbiter: Option<Arbiter>,
    pub auth: Option<Auth>,
    pub disk: Option<PathBuf>,
    /// How the VM's dirty pages are tracked (the ring excludes prediction).
    pub dirty_backend: DirtyBackend,
}

impl ReplicationArgs {
    /// The options as `ftvm run` has them when none is given.
    pub fn defaults() -> ReplicationArgs {
        let command = <ReplicationArgs as Args>::augment_args(clap::Command::new("defaults"));
        let matches = command.try_get_matches_from(["defaults"]).expect("every replication option has a default or is optional");
        ReplicationArgs::from_arg_matches(&matches).expect("the defaults are valid")
    }

    /// The primary's configuration with `--replicate-to` (none without).
    pub fn primary(self, host: &HostArgs) -> Result<Option<PrimaryConfig>, RunError> {
        let Some(backup) = self.replicate_to.clone() else { return Ok(None) };
        let arbiter = self.arbiter.arbiter(host.net.as_ref());
        // Refused before the secret file is read.
        on_backup_loss(self.on_backup_loss, arbiter.is_some())?;
        let auth = self.channel.auth()?;
        self.protecting(Protection { backup, arbiter, auth, disk: host.disk.clone(), dirty_backend: host.dirty_backend }).map(Some)
    }

    /// The primary's configuration: these options, and what `with` gives.
    pub fn protecting(self, with: Protection) -> Result<PrimaryConfig, RunError> {
        let args = self;
        let on_backup_loss = on_backup_loss(args.on_backup_loss, with.arbiter.is_some())?;
        let mirror = mirror(args.mirror, with.auth.as_ref().is_some_and(|a| a.encrypt))?;
        let predict_writes = policy::predict_writes(args.tuning, args.predict_writes, with.dirty_backend == DirtyBackend::Ring);
        let prefetch = policy::prefetch(args.tuning, args.prefetch);
        // Measured under auto (once per process), assumed under static.
        let diff = policy::diff(args.tuning, args.diff);
        let costs = policy::costs(args.tuning, diff);
        let capture = policy::capture(args.tuning, args.capture, &costs);
        let fake_ack = policy::fake_ack(args.tuning, args.fake_ack);
        Ok(PrimaryConfig {
            backup: with.backup,
            session: SessionOptions {
                epoch: args.epoch,
                liveness: liveness::Timing { interval: args.heartbeat, timeout: args.failure_timeout },
                ack_timeout: args.ack_timeout.max(args.failure_timeout),
                connect_timeout: args.connect_timeout,
                auth: with.auth,
                mirror,
                priority: args.priority,
                disk: with.disk,
            },
            loss: LossPolicy { on_backup_loss, arbiter: with.arbiter, standbys: Vec::new() },
            metrics: args.metrics.file(),
            switches: Switches {
                capture,
                encoding: args.encoding,
                diff,
                device_state: args.device_state,
                transport: args.transport,
                trigger: args.trigger,
                group_commit: args.group_commit,
                predict_writes,
                prefetch,
                prefetch_by: args.prefetch_by,
                fake_ack_state: args.fake_ack_state,
                costs,
            },
            pipeline_depth: args.pipeline_depth as usize,
            fake_ack,
        })
    }
}

/// `--on-backup-loss`, or its default: continue with an arbiter, pause without.
fn on_backup_loss(chosen: Option<OnBackupLoss>, arbiter: bool) -> Result<OnBackupLoss, RunError> {
    match chosen {
        // A backup that only lost touch with this primary takes over
        // while it keeps running: two VMs. Only an arbiter prevents that.
        Some(OnBackupLoss::Continue) if !arbiter => Err(RunError::Usage(
            "--on-backup-loss continue needs --arbiter URL (without an arbiter a backup that only lost touch with this primary would run the VM too); use --on-backup-loss pause or add --arbiter".into(),
        )),
        Some(chosen) => Ok(chosen),
        None if arbiter => Ok(OnBackupLoss::Continue),
        None => Ok(OnBackupLoss::Pause),
    }
}

/// `--mirror`, or its default: on, but off on an encrypted channel.
fn mirror(chosen: Option<Mode>, encrypt: bool) -> Result<Mode, RunError> {
    match chosen {
        Some(chosen @ (Mode::On | Mode::PerFrame)) if encrypt => Err(RunError::Usage(format!(
            "--mirror {chosen} cannot be used with --encrypt: the mirrored frames would travel unencrypted (leave out --mirror, or give --mirror off)"
        ))),
        Some(chosen) => Ok(chosen),
        None if encrypt => {
            tracing::info!("not mirroring frames to the backup: they would travel unencrypted (--encrypt)");
            Ok(Mode::Off)
        }
        None => Ok(Mode::On),
    }
}

/// `--memory` in bytes; a size no host could map is refused as given (a
/// saturated product would be reported as another number).
pub fn bytes_of_mib(mib: u64) -> Result<u64, RunError> {
    mib.checked_mul(1 << 20).ok_or_else(|| RunError::Usage(format!("--memory {mib} MiB is more than any host can map")))
}

/// `--user NAME`, looked up now.
fn user(name: Option<&str>) -> Result<Option<crate::privilege::User>, RunError> {
    Ok(name.map(crate::privilege::User::lookup).transpose()?)
}

impl TryFrom<RunArgs> for Launch {
    type Error = RunError;

    fn try_from(args: RunArgs) -> Result<Launch, RunError> {
        let replicate = args.replication.primary(&args.host)?;
        let guest = Guest::Image {
            image: args.image,
            rootfs: args.rootfs,
            mem_size: bytes_of_mib(args.memory)?,
            vcpus: args.vcpus,
            cmdline: args.cmdline,
        };
        let mut host: crate::run::HostOptions = args.host.into();
        host.user = user(args.user.as_deref())?;
        Ok(Launch { guest, host, replicate })
    }
}

impl TryFrom<RestoreArgs> for Launch {
    type Error = RunError;

    fn try_from(args: RestoreArgs) -> Result<Launch, RunError> {
        let replicate = args.replication.primary(&args.host)?;
        let mut host: crate::run::HostOptions = args.host.into();
        host.user = user(args.user.as_deref())?;
        Ok(Launch { guest: Guest::Snapshot(args.snapshot), host, replicate })
    }
}
