//! The command line: subcommands, their options, and the checks on values
//! that clap runs before anything starts.

use std::path::PathBuf;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use ftvm_replication::pipeline::{capture, encode, predict, prefetch, transport, trigger};
use ftvm_replication::{OnBackupLoss, DEFAULT_PIPELINE_DEPTH};
use ftvm_vmm::devices::virtio::block::DiskIo;
use ftvm_vmm::devices::virtio::net::{NetConfig, NetOffload};
use ftvm_vmm::{DirtyBackend, IdlePause};

use crate::output::errln;
use crate::{config, demo};

/// Shortest checkpoint interval: every epoch pauses the guest and waits for
/// a round trip, so shorter ones spend the VM's time on checkpoints.
pub const MIN_EPOCH_MS: u64 = 5;
/// Longest: output waits up to an epoch before it leaves.
pub const MAX_EPOCH_MS: u64 = 60_000;

#[derive(Parser)]
#[command(name = "ftvm", version, about = "A fault-tolerant virtual machine monitor on KVM")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Boot a guest image and run it until it exits (as a primary with --replicate-to).
    // A later option replaces an earlier one: the command line's replace --config's.
    #[command(args_override_self = true)]
    Run(RunArgs),
    /// Wait for a primary, follow its checkpoints, and take its VM over when it fails.
    #[command(args_override_self = true)]
    Backup(BackupArgs),
    /// Run one of three consensus-ordered replicas of a VM (PLOVER's VSMR):
    /// raft orders the leader's input, both VM replicas run it, and the leader
    /// sends only divergent pages at each syncvm (docs/replicas.md).
    #[command(args_override_self = true)]
    Replica(ReplicaArgs),
    /// Write a running VM's complete state to a file.
    Snapshot {
        /// Control socket of the VM (the --api-socket it runs with).
        #[arg(long, value_name = "PATH")]
        api_socket: PathBuf,
        /// Give up when the VMM has not answered within this many seconds.
        #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = timeout)]
        timeout: Duration,
        /// Snapshot file to write.
        #[arg(long, short, value_name = "PATH")]
        output: PathBuf,
        /// Stop the VM after the snapshot instead of resuming it.
        #[arg(long)]
        stop: bool,
    },
    /// Continue a VM from a snapshot file in this process.
    /// With --replicate-to ADDR the restored VM is protected from the start.
    #[command(args_override_self = true)]
    Restore {
        /// Snapshot file to continue from (written by `ftvm snapshot`).
        #[arg(long, value_name = "PATH")]
        snapshot: PathBuf,
        #[command(flatten)]
        replication: Box<ReplicationArgs>,
        #[command(flatten)]
        host: HostArgs,
        /// Run as this user once /dev/kvm, the TAP, the disk and the control socket are open.
        #[arg(long, value_name = "NAME")]
        user: Option<String>,
    },
    /// Show a VM's state and replication figures.
    Status {
        #[command(flatten)]
        client: ClientArgs,
        /// Print the VMM's reply as one JSON object (docs/api.md) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Hold a running VM paused (its vCPUs and devices) until `ftvm resume`.
    Pause {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Resume a VM paused by `ftvm pause`.
    Resume {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Stop a VM (its VMM exits 0), or a backup that has not taken over.
    Stop {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Protect an unprotected primary again with a new backup.
    Protect {
        #[command(flatten)]
        client: ClientArgs,
        /// The new backup's replication address (its --listen).
        #[arg(long, value_name = "ADDR")]
        backup: String,
    },
    /// Hand a protected VM over to its backup (a planned switch-over): a last
    /// checkpoint with the guest stopped, its acknowledgement, then the backup
    /// runs the VM and this VMM exits 0. No output is lost.
    Switchover {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show failover on this machine: a replicated kv VM loses its host, then its primary stalls and is fenced, under load; no acknowledged write is lost.
    Demo(demo::DemoArgs),
}

/// How a command reaches a running VMM.
#[derive(Args)]
pub struct ClientArgs {
    /// Control socket of the VM (the --api-socket it runs with).
    #[arg(long, value_name = "PATH")]
    pub api_socket: PathBuf,
    /// Give up when the VMM has not answered within this many seconds.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = timeout)]
    pub timeout: Duration,
}

/// `--config FILE` (src/config.rs): the subcommand's options from a TOML file.
#[derive(Args)]
pub struct ConfigArgs {
    /// Read options from this TOML file: each key is an option's long name
    /// (`epoch-ms = 20`); options given on the command line override it
    /// (examples: docs/config/).
    #[arg(long = config::CONFIG, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Guest image: a static x86-64 ELF built for the ftvm guest ABI, or an
    /// unmodified static Linux program (run on the runtime's Linux
    /// personality, linux.elf; --cmdline "OPTIONS -- PROGRAM ARGS...").
    #[arg(long, value_name = "PATH")]
    pub image: PathBuf,
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
    #[arg(long, value_name = "MS", default_value_t = 20, value_parser = epoch_ms)]
    pub epoch_ms: u64,
    /// When the backup is lost: keep running unprotected (continue), or pause with
    /// output held (pause). Default: continue with --arbiter (after winning
    /// ownership), pause without (a cut link must not leave two VMs running);
    /// continue needs --arbiter.
    #[arg(long, value_name = "continue|pause")]
    pub on_backup_loss: Option<OnBackupLoss>,
    /// Declare the backup lost after this long without hearing from it: no
    /// heartbeat, no acknowledgement.
    #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = positive_ms)]
    pub failure_timeout_ms: u64,
    /// Declare the backup lost when a checkpoint stays unacknowledged this
    /// long after it was sent, though the backup still sends heartbeats (its
    /// apply hangs, say). At least the failure timeout.
    #[arg(long, value_name = "MS", default_value_t = 2000, value_parser = positive_ms)]
    pub ack_timeout_ms: u64,
    /// Send the backup a heartbeat (a UDP datagram) this often.
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_HEARTBEAT_MS, value_parser = positive_ms)]
    pub heartbeat_ms: u64,
    /// Write metrics as JSON lines to this file: one line per second
    /// summing that second's epochs (count, first and last epoch, sum and
    /// max of each figure, epochs per trigger), or one per epoch with
    /// --metrics-every-epoch. A line that cannot be written (a full disk)
    /// is dropped, counted and warned about once; the VM goes on.
    #[arg(long, value_name = "PATH")]
    pub metrics: Option<PathBuf>,
    /// Write one --metrics line per epoch instead of one per second.
    #[arg(long)]
    pub metrics_every_epoch: bool,
    /// Rotate the --metrics file at this size: it becomes PATH.1 (replacing
    /// the previous PATH.1) and a new PATH starts; 0 never rotates.
    #[arg(long, value_name = "BYTES", default_value_t = ftvm_replication::metrics::DEFAULT_METRICS_MAX_BYTES)]
    pub metrics_max_bytes: u64,
    /// Give up reaching the backup at start after this long.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub connect_timeout_ms: u64,
    /// Checkpoint capture stage. pause: copy the dirty pages while the VM is
    /// paused. cow: resume at once and copy each dirty page before it is
    /// written again (userfaultfd write protection; with --predict-writes the
    /// pages left writable are copied in the pause).
    #[arg(long, default_value = "pause", value_name = "pause|cow")]
    pub capture: capture::Mode,
    /// Checkpoint page encoding. raw: whole pages, zero pages as a bare tag.
    #[arg(long, default_value = "raw", value_name = "raw")]
    pub encoding: encode::Encoding,
    /// Send a page the backup has an earlier version of as a diff: off (whole
    /// pages), xor (the XOR of its changed 64-byte blocks; `--diff` alone), lz4
    /// (each diff LZ4-compressed when that is smaller).
    #[arg(long, default_value = "lz4", value_name = "off|xor|lz4", num_args = 0..=1, default_missing_value = "xor")]
    pub diff: encode::Diff,
    /// Which vCPU and device state each checkpoint carries: all, or changed
    /// (only what differs from the previous checkpoint; the backup keeps the rest).
    #[arg(long, default_value = "changed", value_name = "all|changed")]
    pub device_state: encode::States,
    /// Replication transport. tcp: one TCP connection to the backup.
    #[arg(long, default_value = "tcp", value_name = "tcp")]
    pub transport: transport::Kind,
    /// Send the backup a copy of every frame the guest sends and receives
    /// (UDP), so that after a takeover it replays them and clients need not
    /// wait for TCP retransmissions (on); or only checkpoints (off).
    /// Default: on, but off with --encrypt (the copies travel unencrypted),
    /// and --mirror on with --encrypt is refused.
    #[arg(long, value_name = "on|off")]
    pub mirror: Option<ftvm_replication::mirror::Mode>,
    /// Scheduling of the checkpoint thread (while it protects) and of the
    /// acknowledgement reader: normal, or real-time (SCHED_FIFO, as the
    /// heartbeats), so a held reply does not wait for the host's other work
    /// to let them run.
    #[arg(long, default_value = "normal", value_name = "normal|realtime")]
    pub priority: ftvm_replication::liveness::Priority,
    /// Fake ACK: while the guest's TCP data waits in the output buffer,
    /// acknowledge it to the guest on the peer's behalf so its send buffer
    /// empties at once (on); the proxy's state (what was acknowledged and
    /// not yet received) travels with every checkpoint, and a backup that
    /// takes over sends it. off: the guest hears only the peer's ACKs.
    #[arg(long, default_value = "off", value_name = "off|on")]
    pub fake_ack: ftvm_replication::fakeack::Mode,
    /// With --fake-ack on, how each checkpoint carries the proxy's state:
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
    /// Checkpoints sent and not yet acknowledged at most (1 to 64): the next
    /// checkpoint may be taken while this many are in flight.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PIPELINE_DEPTH, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub pipeline_depth: u64,
    /// Write-fault prediction: leave pages likely to be written again
    /// writable at each checkpoint (no tracked first write for them); pages
    /// left writable but unchanged are not sent. off, histase (HBFT's
    /// stride and history predictor) or adaptive (per-region rewrite rate).
    /// Needs --dirty-backend bitmap.
    #[arg(long, default_value = "off", value_name = "off|histase|adaptive")]
    pub predict_writes: predict::Mode,
    /// In-epoch transfer: during each epoch, send the backup the write-cold
    /// pages dirtied earlier in it while the guest runs (staged there until
    /// the epoch's checkpoint commits them), so the checkpoint carries only
    /// the pages written again since. off, on, or adaptive (after an epoch
    /// in which more than one page in seven the rounds sent was written
    /// again before the checkpoint, each such send a tracked first write
    /// for the guest, the rounds start later in the epoch, down to the
    /// last alone, then stop for a while). Not with --predict-writes.
    #[arg(long, default_value = "off", value_name = "off|on|adaptive")]
    pub prefetch: prefetch::Mode,
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

#[derive(Args)]
pub struct ReplicaArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// This replica's id in --peers.
    #[arg(long, value_name = "N")]
    pub id: u64,
    /// Every replica, this one included, as ID=HOST:PORT,... (at least
    /// three); each listens on its own address for the others.
    #[arg(long, value_name = "1=HOST:PORT,2=HOST:PORT,3=HOST:PORT")]
    pub peers: String,
    /// The third replica: vote and keep the log, stand late in elections.
    /// Alone, it runs no VM and never leads; with the VM options (--image,
    /// --net, ...) it is a standby: its VM stays paused until a leader that
    /// lost its secondary brings it up to date and makes it the secondary.
    #[arg(long)]
    pub witness: bool,
    /// Guest image (every VM replica boots the same one); a witness with one
    /// is a standby.
    #[arg(long, value_name = "PATH", required_unless_present = "witness")]
    pub image: Option<PathBuf>,
    /// Guest memory in MiB (a multiple of 2).
    #[arg(long, value_name = "MIB", default_value_t = 256, requires = "image")]
    pub memory: u64,
    /// Number of vCPUs (1 to 32).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "image")]
    pub vcpus: u32,
    /// Command line passed to the guest.
    #[arg(long, default_value = "", requires = "image")]
    pub cmdline: String,
    /// Longest interval between two syncvms in milliseconds (5 to 60000);
    /// a syncvm starts sooner when output is held and the guest is idle.
    #[arg(long, value_name = "MS", default_value_t = 100, value_parser = epoch_ms)]
    pub sync_ms: u64,
    /// How the leader sends a divergent page at a syncvm: whole, or only
    /// its 64-byte blocks that differ (one more round trip for block hashes).
    #[arg(long, default_value = "whole", value_name = "whole|blocks")]
    pub sync_pages: ftvm_replication::vsmr::sync::PageMode,
    /// How the leader brings a replica it has not synchronized (restarted,
    /// a standby) up to date: precopy (its memory copied while the guest
    /// runs, then a full syncvm) or syncvm (the full syncvm alone, every
    /// differing page copied in the pause).
    #[arg(long, default_value = "precopy", value_name = "precopy|syncvm")]
    pub rejoin: ftvm_replication::vsmr::rejoin::RejoinMode,
    /// Start an election as soon as this replica finds the leader dead:
    /// the link the leader dialled here closed (its VMM died), or, with
    /// --failure-timeout-ms, nothing came from it that long. Pre-vote first,
    /// so a replica that alone lost the leader disrupts nothing; the
    /// witness only votes at once. off: only raft's randomized election
    /// timeout (200-400 ms of silence). Give every replica the same.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub fast_election: ftvm_replication::vsmr::failover::FastElection,
    /// With --fast-election on: take the leader for dead after this long
    /// without a message from it (30 to 60000; heartbeats come every 20 ms).
    /// Default: only a closed link tells (a stalled or cut-off leader is
    /// then found by the election timeout).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(30..=60000))]
    pub failure_timeout_ms: Option<u64>,
    /// While not leading, keep the guest's frames since the last syncvm
    /// (at most 16 MiB) and send them on becoming the leader: replies the
    /// old leader held reach their clients without waiting for a TCP
    /// retransmission. off: discard them.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub takeover_replay: ftvm_replication::vsmr::recent::Mode,
    /// What the leader does while it has no synchronized secondary (the
    /// secondary lost, or not yet brought up to date: at the group's start
    /// and after a takeover, until its first full syncvm): continue, its
    /// output released after consensus barriers with one copy of the VM's
    /// state; pause, its guest paused and its output held until a replica
    /// is synchronized (that syncvm's acknowledgement releases it).
    #[arg(long, default_value = "continue", value_name = "continue|pause")]
    pub on_secondary_loss: ftvm_replication::vsmr::loss::OnSecondaryLoss,
    /// When the secondary's guest gets a log entry: on, as soon as the
    /// secondary has appended it (with three replicas the leader and the
    /// secondary are then a majority: it is committed), and the leader
    /// sends no separate commit notice; off, once the leader's next message
    /// says it is committed. Give every replica the same.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub early_apply: ftvm_replication::vsmr::tuning::EarlyApply,
    /// on: appends queued for one peer in one round of the consensus
    /// thread go as one message (fewer messages and wake-ups); off: one
    /// per proposal.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub batch_append: ftvm_replication::vsmr::tuning::BatchAppend,
    /// What spaces two syncvms when output is held: cost (the whole syncvm,
    /// its consensus round and the acknowledgement included, as a
    /// primary-backup checkpoint) or pause (only the leader's pause).
    #[arg(long, default_value = "cost", value_name = "cost|pause")]
    pub sync_spacing: ftvm_replication::vsmr::tuning::SyncSpacing,
    /// on: the consensus thread puts committed input into the guest itself
    /// when the applier thread has nothing earlier to run (one thread
    /// wake-up fewer per batch); off: always through the applier.
    #[arg(long, default_value = "off", value_name = "off|on")]
    pub direct_input: ftvm_replication::vsmr::tuning::DirectInput,
    /// Which thread of the leader waits for the secondary's acknowledgement
    /// of a syncvm (after which the output is released): applier (no
    /// committed input reaches the guest meanwhile) or proposer (the
    /// applier goes on delivering input once the guest resumed).
    #[arg(long, default_value = "applier", value_name = "applier|proposer")]
    pub ack_wait: ftvm_replication::vsmr::tuning::AckWait,
    /// When the leader's guest resumes in a syncvm: on, once the dirty
    /// sets are swapped and their union's pages and disk blocks copied
    /// aside (hashing, comparing and sending then read the copy while the
    /// guest runs; not in a full syncvm); off, once the divergent pages
    /// are sent. Output stays held until the secondary's acknowledgement
    /// either way.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub early_resume: ftvm_replication::vsmr::tuning::EarlyResume,
    /// Which thread of the leader releases a syncvm's held output once
    /// the secondary acknowledged it: waiter (the thread that waits for
    /// the acknowledgement, --ack-wait) or link (the thread that reads it
    /// from the secondary's link, at once; the applier goes on delivering
    /// input meanwhile).
    #[arg(long, default_value = "waiter", value_name = "waiter|link")]
    pub ack_release: ftvm_replication::vsmr::tuning::AckRelease,
    /// How the leader's network input becomes log entries: off, one entry
    /// per frame, each handed to the consensus thread as read; on, the
    /// frames of one read pass of the TAP go to the consensus thread
    /// together and those it finds queued in one round become one entry
    /// (one raft entry, encoding and delivery per batch). Replicas with
    /// either setting work together.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub input_batch: ftvm_replication::vsmr::tuning::InputBatch,
    /// Whether the leader proposes the next syncvm while the previous one
    /// awaits the secondary's acknowledgement: off, one at a time; on, the
    /// next one's consensus round, freeze and exchange run as soon as the
    /// previous one's pages are sent (at most two in flight), and a thread
    /// of its own awaits the acknowledgements and releases the output, in
    /// order. Only the leader's side changes.
    #[arg(long, default_value = "off", value_name = "off|on")]
    pub sync_pipeline: ftvm_replication::vsmr::tuning::SyncPipeline,
    /// System calls per message on the links between replicas: on, the
    /// consensus thread hands each peer's sender a round's raft messages
    /// at once (one wake-up), a link's sender sends all it finds queued
    /// in one writev (each still
    /// its own frame, with its own MAC and sequence number) and a link's
    /// reader reads what has arrived in one call and parses the frames in
    /// it; off, one send per message and a read per part of each frame.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub link_batch: ftvm_replication::vsmr::tuning::LinkBatch,
    /// Who writes a message to a peer's link: on, the thread that sends it
    /// (consensus, applier) when nothing is queued for that peer before
    /// it, the link is up and idle, and its socket has room (the write
    /// cannot block); otherwise, and always with off, the link's sender
    /// thread (one thread wake-up more per message).
    #[arg(long, default_value = "off", value_name = "off|on")]
    pub link_direct: ftvm_replication::vsmr::tuning::LinkDirect,
    /// Messages on the links between replicas: lz4, each of at least 256
    /// bytes goes LZ4-compressed when that makes it shorter (the log
    /// entries, which carry every input frame to both peers; a syncvm's
    /// bitmaps and pages); off, as they are. A replica reads either,
    /// whatever its own setting.
    #[arg(long, default_value = "lz4", value_name = "lz4|off")]
    pub link_compress: ftvm_replication::vsmr::tuning::LinkCompress,
    /// Write-fault prediction on each VM replica: at each syncvm, leave the
    /// pages its guest is likely to write again writable (no tracked first
    /// write for them); they are then compared at every syncvm, written or
    /// not. off, histase or adaptive, as for `ftvm run`. Needs
    /// --dirty-backend bitmap.
    #[arg(long, default_value = "adaptive", value_name = "off|histase|adaptive")]
    pub predict_writes: predict::Mode,
    /// While this replica leads with a synchronized secondary (whose
    /// answers then commit every entry), what it sends the witness waits
    /// this long and goes with what joined it meanwhile: the witness is
    /// woken once per linger, not once per consensus round. 0: off; at
    /// most 100000 (0.1 s).
    #[arg(long, value_name = "US", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub witness_linger_us: u64,
    /// When the leader's own guest gets a log entry: commit, once it is
    /// committed (as every replica's); append, its input and its syncvms
    /// with a secondary as soon as it appended them (the consensus round
    /// no longer delays them; output still waits for the secondary's
    /// acknowledgement, which implies the commit). Only the leader's side
    /// changes.
    #[arg(long, default_value = "append", value_name = "commit|append")]
    pub leader_apply: ftvm_replication::vsmr::tuning::LeaderApply,
    /// Whether the leader's syncvm carries its output of the epoch it
    /// closes (its first 256 KiB): on, the secondary keeps it and sends it
    /// if it takes over (with --takeover-replay on), so replies a leader
    /// dies holding after the acknowledgement reach their clients at once;
    /// off, they come back by the clients' retransmission.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub sync_output: ftvm_replication::vsmr::tuning::SyncOutput,
    /// Write one JSON line per syncvm to this file.
    #[arg(long, value_name = "PATH")]
    pub metrics: Option<PathBuf>,
    /// Keep this replica's raft term and vote in this file (created if
    /// missing; synced before any vote or acknowledgement leaves), so that
    /// once restarted it cannot vote twice in one term. Without it a
    /// restarted replica starts from term 0.
    #[arg(long, value_name = "PATH")]
    pub raft_state: Option<PathBuf>,
    #[command(flatten)]
    pub channel: ChannelArgs,
    #[command(flatten)]
    pub host: HostArgs,
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
    pub fn arbiter(&self, net: Option<&NetConfig>) -> Option<ftvm_replication::arbiter::Arbiter> {
        let endpoint = self.arbiter.as_deref()?;
        let name = self.name.clone().unwrap_or_else(|| match net {
            Some(n) => format!("vm-{}", n.mac.iter().map(|b| format!("{b:02x}")).collect::<String>()),
            None => "vm".into(),
        });
        Some(ftvm_replication::arbiter::Arbiter::new(endpoint, &name))
    }
}

#[derive(Args)]
pub struct BackupArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Address to accept the primary on (host:port).
    #[arg(long, value_name = "ADDR", value_parser = host_port)]
    pub listen: String,
    /// Refuse a primary whose VM has another memory size (MiB, a multiple of 2).
    #[arg(long, value_name = "MIB")]
    pub memory: Option<u64>,
    /// Refuse a primary whose VM has another number of vCPUs.
    #[arg(long, value_name = "N")]
    pub vcpus: Option<u32>,
    /// Take over after this long without hearing from the primary: no
    /// heartbeat, no byte of its stream (default: 30 ms, six heartbeats of
    /// the primary's default --heartbeat-ms).
    #[arg(long, value_name = "MS", value_parser = positive_ms)]
    pub failure_timeout_ms: Option<u64>,
    /// Send the primary a heartbeat (a UDP datagram from the --listen port) this often.
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_HEARTBEAT_MS, value_parser = positive_ms)]
    pub heartbeat_ms: u64,
    /// Log applied checkpoints as JSON lines to this file: one line per
    /// second summing that second's checkpoints (count, first and last
    /// epoch, sum and max of each figure), or one per checkpoint (epoch,
    /// guest time, wall-clock time, pages, apply time) with
    /// --metrics-every-epoch. A line that cannot be written is dropped,
    /// counted and warned about once; the backup goes on.
    #[arg(long, value_name = "PATH")]
    pub metrics: Option<PathBuf>,
    /// Write one --metrics line per applied checkpoint instead of one per second.
    #[arg(long)]
    pub metrics_every_epoch: bool,
    /// Rotate the --metrics file at this size: it becomes PATH.1 (replacing
    /// the previous PATH.1) and a new PATH starts; 0 never rotates.
    #[arg(long, value_name = "BYTES", default_value_t = ftvm_replication::metrics::DEFAULT_METRICS_MAX_BYTES)]
    pub metrics_max_bytes: u64,
    /// Drop a connection that has not authenticated and said Hello within this long.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub handshake_timeout_ms: u64,
    /// Scheduling of the thread that receives and applies checkpoints:
    /// normal, or real-time (SCHED_FIFO, as the heartbeats).
    #[arg(long, default_value = "normal", value_name = "normal|realtime")]
    pub priority: ftvm_replication::liveness::Priority,
    /// Once this backup took over, protect the VM with the first of these
    /// backups (`ftvm backup --listen ADDR`) that answers, in order, without
    /// an operator, and again after every loss of its backup
    /// (comma-separated host:port).
    #[arg(long, value_name = "ADDR[,ADDR...]", value_delimiter = ',', value_parser = host_port)]
    pub standby: Vec<String>,
    #[command(flatten)]
    pub arbiter: ArbiterArgs,
    #[command(flatten)]
    pub channel: ChannelArgs,
    #[command(flatten)]
    pub host: HostArgs,
}

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
    /// Run the VMM's threads without their seccomp filters (docs/seccomp.md).
    #[arg(long)]
    pub no_seccomp: bool,
    /// Serve Prometheus metrics (checkpoints, pause and acknowledgement
    /// times, dirty pages, bytes, held output, failovers, role) on
    /// http://ADDR/metrics (host:port).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
}

/// `ftvm run` options that only a replicating primary uses (argument ids).
const PRIMARY_ONLY: [&str; 28] = [
    "epoch_ms",
    "on_backup_loss",
    "failure_timeout_ms",
    "ack_timeout_ms",
    "heartbeat_ms",
    "metrics",
    "metrics_every_epoch",
    "metrics_max_bytes",
    "connect_timeout_ms",
    "capture",
    "encoding",
    "diff",
    "device_state",
    "transport",
    "mirror",
    "priority",
    "fake_ack",
    "fake_ack_state",
    "trigger",
    "pipeline_depth",
    "predict_writes",
    "prefetch",
    "prefetch_by",
    "arbiter",
    "name",
    "secret_file",
    "encrypt",
    "insecure",
];

/// A mistake in a config file: one line and exit status 2, like the same
/// mistake on the command line.
fn config_error(path: &std::path::Path, msg: &str) -> ! {
    errln!("ftvm: error: config file {}: {msg}", path.display());
    std::process::exit(2)
}

/// The subcommands that take `--config` let a later option replace an
/// earlier one, so that the command line's replace the file's; a
/// single-valued option given twice on the command line itself is still a
/// mistake (`--disk a --disk b` would keep `b` silently): clap's usage
/// error, as for the other subcommands.
fn refuse_repeats(cli: &clap::Command, args: &[std::ffi::OsString]) {
    let Some(name) = args.get(1).and_then(|a| a.to_str()) else { return };
    let Some(sub) = cli.find_subcommand(name) else { return };
    if !sub.is_args_override_self() {
        return;
    }
    let name = sub.get_name().to_owned();
    let strict = cli.clone().mut_subcommand(&name, |sub| sub.args_override_self(false));
    if let Err(e) = strict.try_get_matches_from(args) {
        if e.kind() == ErrorKind::ArgumentConflict {
            e.exit();
        }
    }
}

/// clap's error `e` on the command line with `expanded`'s config file put
/// in: about an option the file set, one `config file` line (exit 2);
/// otherwise clap's usage error.
fn in_file(e: clap::Error, expanded: &config::Expanded, cli: &clap::Command) -> ! {
    use clap::error::{ContextKind, ContextValue};
    let sub = expanded.args.get(1).and_then(|a| a.to_str()).and_then(|name| cli.find_subcommand(name));
    if let (Some(path), Some(sub)) = (&expanded.path, sub) {
        let named = |arg: &str| {
            sub.get_arguments().filter(|a| expanded.from_file.iter().any(|f| f == a.get_id().as_str())).find_map(|a| {
                let flag = format!("--{}", a.get_long()?);
                (arg == flag || arg.starts_with(&format!("{flag} ")) || arg.starts_with(&format!("{flag}="))).then_some(flag)
            })
        };
        let in_file = [ContextKind::InvalidArg, ContextKind::PriorArg].into_iter().any(|kind| match e.get(kind) {
            Some(ContextValue::String(arg)) => named(arg).is_some(),
            Some(ContextValue::Strings(args)) => args.iter().any(|a| named(a).is_some()),
            _ => false,
        });
        if in_file {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            config_error(path, first.strip_prefix("error: ").unwrap_or(first));
        }
    }
    e.exit()
}

/// Parse the command line (exits with clap's usage error on a mistake).
pub fn parse() -> Cli {
    let mut command = Cli::command();
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    refuse_repeats(&command, &args);
    let expanded = config::expand(&command, args).unwrap_or_else(|e| {
        // Exit status 2, like the same mistake on the command line.
        errln!("ftvm: error: {e}");
        std::process::exit(2)
    });
    let matches = command.try_get_matches_from_mut(expanded.args.clone()).unwrap_or_else(|e| in_file(e, &expanded, &command));
    if let Some((name @ ("run" | "restore"), sub)) = matches.subcommand() {
        // Given without --replicate-to, these would be silently ignored.
        if let Some(id) = PRIMARY_ONLY.iter().find(|id| sub.value_source(id) == Some(ValueSource::CommandLine)) {
            if sub.get_one::<String>("replicate_to").is_none() {
                let sub = command.find_subcommand_mut(name).expect("the subcommand exists");
                let flag = sub.get_arguments().find(|a| a.get_id() == id).and_then(|a| a.get_long()).unwrap_or(id);
                if let Some(path) = expanded.path.as_ref().filter(|_| expanded.from_file.iter().any(|f| f == id)) {
                    config_error(
                        path,
                        &format!("`{flag}` applies only to a replicating primary: add `replicate-to` (or --replicate-to ADDR)"),
                    );
                }
                let msg = format!("--{flag} applies only to a replicating primary: add --replicate-to ADDR");
                sub.error(ErrorKind::MissingRequiredArgument, msg).exit();
            }
        }
    }
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// `--epoch-ms`: an interval between [`MIN_EPOCH_MS`] and [`MAX_EPOCH_MS`].
pub fn epoch_ms(s: &str) -> Result<u64, String> {
    let ms: u64 = s.parse().map_err(|e| format!("not a number of milliseconds: {e}"))?;
    if !(MIN_EPOCH_MS..=MAX_EPOCH_MS).contains(&ms) {
        return Err(format!(
            "the checkpoint interval must be at least {MIN_EPOCH_MS} ms (each epoch pauses the guest for a checkpoint) and at most {MAX_EPOCH_MS} ms"
        ));
    }
    Ok(ms)
}

/// Default of `--heartbeat-ms` (both sides).
const DEFAULT_HEARTBEAT_MS: u64 = ftvm_replication::liveness::DEFAULT_INTERVAL.as_millis() as u64;

/// `HOST:PORT` (a name, an IPv4 address or a bracketed IPv6 one), checked
/// for its shape at start rather than when it is first dialled (a standby,
/// say, only after a takeover).
pub fn host_port(s: &str) -> Result<String, String> {
    let (host, port) = s.rsplit_once(':').ok_or("not HOST:PORT")?;
    port.parse::<u16>().map_err(|_| format!("{port:?} is not a port (0 to 65535)"))?;
    let bracketed = host.starts_with('[') && host.ends_with(']');
    if host.is_empty() || (host.contains(':') && !bracketed) || host.chars().any(char::is_whitespace) {
        return Err(format!("{host:?} is not a host name or address"));
    }
    Ok(s.to_string())
}

/// An etcd endpoint: `http://HOST:PORT`.
pub fn arbiter_url(s: &str) -> Result<String, String> {
    let rest = s.strip_prefix("http://").ok_or("not http://HOST:PORT")?;
    host_port(rest.trim_end_matches('/'))?;
    Ok(s.to_string())
}

/// A number of milliseconds that must be at least 1.
pub fn positive_ms(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1 ms".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a number of milliseconds: {e}")),
    }
}

/// A count that must be at least 1.
pub fn at_least_one(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A number of seconds greater than zero.
pub fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        Ok(_) => Err("must be a number of seconds greater than 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A client timeout in seconds (fractions allowed), at most a day.
pub fn timeout(s: &str) -> Result<Duration, String> {
    let secs = positive_seconds(s)?;
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| *d <= Duration::from_secs(86_400))
        .ok_or_else(|| "must be at most 86400 seconds".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn value_checks() {
        assert!(epoch_ms("0").unwrap_err().contains("at least 5 ms"));
        assert!(epoch_ms("4").is_err());
        assert_eq!(epoch_ms("5"), Ok(5));
        assert!(epoch_ms("60001").is_err());
        assert!(positive_ms("0").unwrap_err().contains("at least 1 ms"));
        assert!(positive_ms("x").is_err());
        assert_eq!(positive_ms("30"), Ok(30));
        assert!(at_least_one("0").is_err());
        assert_eq!(at_least_one("3"), Ok(3));
        assert!(positive_seconds("0").is_err() && positive_seconds("-1").is_err() && positive_seconds("nan").is_err());
        assert_eq!(timeout("1.5"), Ok(Duration::from_millis(1500)));
        assert!(timeout("inf").is_err() && timeout("1e9").is_err());
        for good in ["10.0.0.1:7000", "h2.example:7000", "localhost:1", "[::1]:65535"] {
            assert_eq!(host_port(good).as_deref(), Ok(good));
        }
        for bad in ["garbage", ",", ":7000", "h2:65536", "h2:port", "::1:7000", "a b:7000", "h2:"] {
            assert!(host_port(bad).is_err(), "{bad:?} accepted");
        }
        assert!(arbiter_url("http://10.0.0.3:2379/").is_ok());
        assert!(arbiter_url("garbage").is_err() && arbiter_url("http://h3").is_err() && arbiter_url("10.0.0.3:2379").is_err());
    }
}
