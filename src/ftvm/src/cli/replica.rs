//! `ftvm replica`: its options, checked together, and their conversion to
//! the replication crate's `ReplicaConfig`.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::TypedValueParser;
use clap::Args;

use ftvm_replication::pipeline::costs::Costs;
use ftvm_replication::pipeline::encode::Diff;
use ftvm_replication::pipeline::{policy, predict};
use ftvm_vmm::devices::virtio::block::DiskIo;
use ftvm_vmm::DirtyBackend;
use ftvm_vsmr::failover::{self, FastElection};
use ftvm_vsmr::tuning::Tuning;
use ftvm_vsmr::ReplicaConfig;

use super::config::ConfigArgs;
use super::host::{ChannelArgs, HostArgs};
use super::run::bytes_of_mib;
use super::values::{default_text, epoch_ms};
use crate::error::RunError;
use crate::roles::replica::Member;
use crate::run::Guest;

#[derive(Args)]
pub struct ReplicaArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// This replica's id in --peers (or --join).
    #[arg(long, value_name = "N")]
    pub id: u64,
    /// Every replica, this one included, as ID=HOST:PORT,... (at least
    /// three); each listens on its own address for the others.
    #[arg(long, value_name = "1=HOST:PORT,2=HOST:PORT,3=HOST:PORT", required_unless_present = "join", conflicts_with = "join")]
    pub peers: Option<String>,
    /// Join a running group instead of starting one: its members and this
    /// replica (a new id), as ID=HOST:PORT,...; it votes and leads only
    /// once the leader made it a member (`ftvm replica-replace`).
    #[arg(long, value_name = "1=HOST:PORT,3=HOST:PORT,4=HOST:PORT")]
    pub join: Option<String>,
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
    /// Root file system of a Linux program (a host directory, as for ftvm run).
    #[arg(long, value_name = "DIR", requires = "image")]
    pub rootfs: Option<PathBuf>,
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
    #[arg(long = "sync-ms", value_name = "MS", default_value = default_text!(ReplicaConfig::DEFAULT_MAX_INTERVAL, as_millis), value_parser = epoch_ms)]
    pub sync_interval: Duration,
    /// How the leader sends a divergent page at a syncvm: whole, only its
    /// 64-byte blocks that differ (one more round trip for block hashes),
    /// or adaptive (blocks while the divergent pages measured differ in at
    /// most a quarter of their blocks, else whole, measuring again every
    /// 32nd syncvm). Default (--tuning auto): adaptive; --tuning static:
    /// whole.
    #[arg(long, value_name = "whole|blocks|adaptive")]
    pub sync_pages: Option<ftvm_vsmr::sync::PageMode>,
    /// How the leader brings a replica it has not synchronized (restarted,
    /// a standby) up to date: precopy (its memory copied while the guest
    /// runs, then a full syncvm) or syncvm (the full syncvm alone, every
    /// differing page copied in the pause).
    #[arg(long, default_value = "precopy", value_name = "precopy|syncvm")]
    pub rejoin: ftvm_vsmr::rejoin::RejoinMode,
    /// Start an election as soon as this replica finds the leader dead:
    /// the link the leader dialled here closed (its VMM died), or, with
    /// --failure-timeout-ms, nothing came from it that long. Pre-vote first,
    /// so a replica that alone lost the leader disrupts nothing; the
    /// witness only votes at once. off: only raft's randomized election
    /// timeout (200-400 ms of silence). Give every replica the same.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub fast_election: ftvm_vsmr::failover::FastElection,
    /// With --fast-election on: take the leader for dead after this long
    /// without a message from it (30 to 60000; heartbeats come every 20 ms).
    /// Default: only a closed link tells (a stalled or cut-off leader is
    /// then found by the election timeout).
    #[arg(long = "failure-timeout-ms", value_name = "MS", value_parser = clap::value_parser!(u64).range(30..=60000).map(Duration::from_millis))]
    pub failure_timeout: Option<Duration>,
    /// While not leading, keep the guest's frames since the last syncvm
    /// (at most 16 MiB) and send them on becoming the leader: replies the
    /// old leader held reach their clients without waiting for a TCP
    /// retransmission. off: discard them.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub takeover_replay: ftvm_vsmr::recent::Mode,
    /// What the leader does while it has no synchronized secondary (the
    /// secondary lost, or not yet brought up to date: at the group's start
    /// and after a takeover, until its first full syncvm): continue, its
    /// output released after consensus barriers with one copy of the VM's
    /// state; pause, its guest paused and its output held until a replica
    /// is synchronized (that syncvm's acknowledgement releases it).
    #[arg(long, default_value = "continue", value_name = "continue|pause")]
    pub on_secondary_loss: ftvm_vsmr::loss::OnSecondaryLoss,
    /// When the secondary's guest gets a log entry: on, as soon as the
    /// secondary has appended it (with three replicas the leader and the
    /// secondary are then a majority: it is committed), and the leader
    /// sends no separate commit notice; off, once the leader's next message
    /// says it is committed. Give every replica the same.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub early_apply: ftvm_vsmr::tuning::EarlyApply,
    /// on: appends queued for one peer in one round of the consensus
    /// thread go as one message (fewer messages and wake-ups); off: one
    /// per proposal.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub batch_append: ftvm_vsmr::tuning::BatchAppend,
    /// What spaces two syncvms when output is held: cost (the whole syncvm,
    /// its consensus round and the acknowledgement included, as a
    /// primary-backup checkpoint) or pause (only the leader's pause).
    #[arg(long, default_value = "cost", value_name = "cost|pause")]
    pub sync_spacing: ftvm_vsmr::tuning::SyncSpacing,
    /// on: the consensus thread puts committed input into the guest itself
    /// when the applier thread has nothing earlier to run (one thread
    /// wake-up fewer per batch); off: always through the applier.
    #[arg(long, default_value = "off", value_name = "off|on")]
    pub direct_input: ftvm_vsmr::tuning::DirectInput,
    /// Which thread of the leader waits for the secondary's acknowledgement
    /// of a syncvm (after which the output is released): applier (no
    /// committed input reaches the guest meanwhile) or proposer (the
    /// applier goes on delivering input once the guest resumed).
    #[arg(long, default_value = "applier", value_name = "applier|proposer")]
    pub ack_wait: ftvm_vsmr::tuning::AckWait,
    /// When the leader's guest resumes in a syncvm: on, once the dirty
    /// sets are swapped and their union's pages and disk blocks copied
    /// aside (hashing, comparing and sending then read the copy while the
    /// guest runs; not in a full syncvm); off, once the divergent pages
    /// are sent. Output stays held until the secondary's acknowledgement
    /// either way.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub early_resume: ftvm_vsmr::tuning::EarlyResume,
    /// Before a syncvm freezes (the leader) or pauses (the secondary) its
    /// guest: on, let the guest first take and answer the input delivered
    /// to it (until the device placed every frame and every vCPU waits, at
    /// most 1 ms), so that both replicas stop at the same point of the
    /// input and fewer pages differ; off, at once.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub sync_settle: ftvm_vsmr::tuning::SyncSettle,
    /// How a VM replica's guest clock moves: step, it stands still between
    /// two syncvms (at the reading the leader froze its guest with, which
    /// the secondary takes with the leader's state) and moves when the
    /// leader freezes its guest or a guest waits for a deadline that
    /// passed, so that both replicas' guests read the same time for the
    /// same input; run, each guest reads its host's clock.
    #[arg(long, default_value = "step", value_name = "step|run")]
    pub sync_clock: ftvm_vsmr::tuning::SyncClock,
    /// Which thread of the leader releases a syncvm's held output once
    /// the secondary acknowledged it: waiter (the thread that waits for
    /// the acknowledgement, --ack-wait) or link (the thread that reads it
    /// from the secondary's link, at once; the applier goes on delivering
    /// input meanwhile).
    #[arg(long, default_value = "waiter", value_name = "waiter|link")]
    pub ack_release: ftvm_vsmr::tuning::AckRelease,
    /// How the leader's network input becomes log entries: off, one entry
    /// per frame, each handed to the consensus thread as read; on, the
    /// frames of one read pass of the TAP go to the consensus thread
    /// together and those it finds queued in one round become one entry
    /// (one raft entry, encoding and delivery per batch). Replicas with
    /// either setting work together.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub input_batch: ftvm_vsmr::tuning::InputBatch,
    /// Whether the leader proposes the next syncvm while the previous one
    /// awaits the secondary's acknowledgement: off, one at a time; on, the
    /// next one's consensus round, freeze and exchange run as soon as the
    /// previous one's pages are sent (at most two in flight), and a thread
    /// of its own awaits the acknowledgements and releases the output, in
    /// order. Only the leader's side changes.
    #[arg(long, default_value = "off", value_name = "off|on")]
    pub sync_pipeline: ftvm_vsmr::tuning::SyncPipeline,
    /// System calls per message on the links between replicas: on, the
    /// consensus thread hands each peer's sender a round's raft messages
    /// at once (one wake-up), a link's sender sends all it finds queued
    /// in one writev (each still
    /// its own frame, with its own MAC and sequence number) and a link's
    /// reader reads what has arrived in one call and parses the frames in
    /// it; off, one send per message and a read per part of each frame.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub link_batch: ftvm_vsmr::tuning::LinkBatch,
    /// Who writes a message to a peer's link: on, the thread that sends it
    /// (consensus, applier) when nothing is queued for that peer before
    /// it, the link is up and idle, and its socket has room (the write
    /// cannot block); otherwise, and always with off, the link's sender
    /// thread (one thread wake-up more per message).
    #[arg(long, default_value = "off", value_name = "off|on")]
    pub link_direct: ftvm_vsmr::tuning::LinkDirect,
    /// Messages on the links between replicas: lz4, each of at least 256
    /// bytes goes LZ4-compressed when that makes it shorter (the log
    /// entries, which carry every input frame to both peers; a syncvm's
    /// bitmaps and pages); off, as they are. A replica reads either,
    /// whatever its own setting.
    #[arg(long, default_value = "lz4", value_name = "lz4|off")]
    pub link_compress: ftvm_vsmr::tuning::LinkCompress,
    /// Write-fault prediction on each VM replica: at each syncvm, leave the
    /// pages its guest is likely to write again writable (no tracked first
    /// write for them); they are then compared at every syncvm, written or
    /// not. off, histase or adaptive, as for `ftvm run`. Default
    /// (--tuning auto): adaptive, but off with --dirty-backend ring (given
    /// beside it, it is refused).
    #[arg(long, value_name = "off|histase|adaptive")]
    pub predict_writes: Option<predict::Mode>,
    /// Who chooses the mechanisms not named here, as for `ftvm run`: auto
    /// (write prediction, weighing this host's costs measured at start, and
    /// --sync-pages adaptive) or static (neither).
    #[arg(long = "tuning", default_value = "auto", value_name = "auto|static")]
    pub policy: policy::Tuning,
    /// While this replica leads with a synchronized secondary (whose
    /// answers then commit every entry), what it sends the witness waits
    /// this long and goes with what joined it meanwhile: the witness is
    /// woken once per linger, not once per consensus round. 0: off; at
    /// most 100000 (0.1 s).
    #[arg(
        long = "witness-linger-us",
        value_name = "US",
        default_value = default_text!(Tuning::DEFAULT_WITNESS_LINGER, as_micros),
        value_parser = clap::value_parser!(u64).range(0..=100_000).map(Duration::from_micros)
    )]
    pub witness_linger: Duration,
    /// When the leader's own guest gets a log entry: commit, once it is
    /// committed (as every replica's); append, its input and its syncvms
    /// with a secondary as soon as it appended them (the consensus round
    /// no longer delays them; output still waits for the secondary's
    /// acknowledgement, which implies the commit). Only the leader's side
    /// changes.
    #[arg(long, default_value = "append", value_name = "commit|append")]
    pub leader_apply: ftvm_vsmr::tuning::LeaderApply,
    /// Whether the leader's syncvm carries its output of the epoch it
    /// closes (its first 256 KiB): on, the secondary keeps it and sends it
    /// if it takes over (with --takeover-replay on), so replies a leader
    /// dies holding after the acknowledgement reach their clients at once;
    /// off, they come back by the clients' retransmission.
    #[arg(long, default_value = "on", value_name = "on|off")]
    pub sync_output: ftvm_vsmr::tuning::SyncOutput,
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

impl ReplicaArgs {
    /// Mistakes clap cannot see: options that need others.
    fn check(&self) -> Result<(), RunError> {
        if self.host.disk.is_some() && self.image.is_none() {
            return Err(RunError::Usage("--disk needs --image: a witness without a VM has no disk".into()));
        }
        if self.image.is_none() && self.host.net.is_some() {
            return Err(RunError::Usage("--net needs --image: a witness without a VM has no network card".into()));
        }
        if self.fast_election == FastElection::Off && self.failure_timeout.is_some() {
            return Err(RunError::Usage("--failure-timeout-ms needs --fast-election on (it starts an election at once)".into()));
        }
        Ok(())
    }

    fn tuning(&self) -> Tuning {
        let predict_writes = policy::predict_writes(self.policy, self.predict_writes, self.host.dirty_backend == DirtyBackend::Ring);
        Tuning {
            early_apply: self.early_apply,
            batch_append: self.batch_append,
            sync_spacing: self.sync_spacing,
            direct_input: self.direct_input,
            ack_wait: self.ack_wait,
            early_resume: self.early_resume,
            sync_settle: self.sync_settle,
            sync_clock: self.sync_clock,
            ack_release: self.ack_release,
            input_batch: self.input_batch,
            sync_pipeline: self.sync_pipeline,
            link_batch: self.link_batch,
            link_direct: self.link_direct,
            link_compress: self.link_compress,
            predict_writes,
            costs: if predict_writes == predict::Mode::Adaptive { policy::costs(self.policy, Diff::Off) } else { Costs::default() },
            witness_linger: self.witness_linger,
            leader_apply: self.leader_apply,
            sync_output: self.sync_output,
        }
    }
}

impl TryFrom<ReplicaArgs> for Member {
    type Error = RunError;

    fn try_from(args: ReplicaArgs) -> Result<Member, RunError> {
        let peers = match (&args.peers, &args.join) {
            (_, Some(join)) => ftvm_vsmr::parse_join(join, args.id),
            (Some(peers), None) => ftvm_vsmr::parse_peers(peers, args.id),
            (None, None) => Err("--peers or --join is needed".to_string()),
        }
        .map_err(RunError::Usage)?;
        args.check()?;
        let config = ReplicaConfig {
            id: args.id,
            peers,
            join: args.join.is_some(),
            witness: args.witness,
            auth: args.channel.auth()?,
            tuning: args.tuning(),
            metrics: args.metrics,
            raft_state: args.raft_state,
            max_interval: args.sync_interval,
            pages: policy::sync_pages(args.policy, args.sync_pages),
            rejoin: args.rejoin,
            failover: failover::Options { fast: args.fast_election, failure_timeout: args.failure_timeout },
            replay: args.takeover_replay,
            on_secondary_loss: args.on_secondary_loss,
        };
        let guest = match args.image {
            Some(image) => Some(Guest::Image {
                image,
                rootfs: args.rootfs,
                mem_size: bytes_of_mib(args.memory)?,
                vcpus: args.vcpus,
                cmdline: args.cmdline,
            }),
            None => None,
        };
        let mut host = args.host;
        // A replica's disk I/O runs in the device's pass: a pause (a
        // syncvm) then finds no write in progress (docs/replicas.md).
        host.disk_io = DiskIo::Sync;
        Ok(Member { config, guest, host: host.into() })
    }
}
