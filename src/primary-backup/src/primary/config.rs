//! What `ftvm run` asks of its primary, resolved into one piece for each
//! part of the primary that uses it: how a session with a backup runs, what
//! losing one does, and which mechanism each checkpoint stage uses.

use std::path::PathBuf;
use std::time::Duration;

use ftvm_replication::arbiter::Arbiter;
use ftvm_replication::liveness::{Priority, Timing};
use ftvm_replication::metrics::MetricsFile;
use ftvm_replication::pipeline::transport::Auth;
use ftvm_replication::pipeline::Switches;
use ftvm_vmm::switch;

switch! {
    /// `--on-backup-loss`: what the primary does when it loses its backup.
    pub enum OnBackupLoss {
        /// Release what the backup acknowledged, then run unprotected.
        Continue = "continue",
        /// Pause the guest (outputs stay held) until a new backup protects it.
        Pause = "pause",
    }
}

#[derive(Clone, Debug)]
pub struct PrimaryConfig {
    /// The backup's replication address.
    pub backup: String,
    /// How a session with a backup runs (this one, and each that replaces it).
    pub session: SessionOptions,
    /// What the primary does when it loses its backup.
    pub loss: LossPolicy,
    /// Which implementation each checkpoint stage uses.
    pub switches: Switches,
    /// Checkpoints sent and not yet acknowledged at most: checkpoint n+1
    /// may be taken while n is in flight, up to this many.
    pub pipeline_depth: usize,
    /// Acknowledge the guest's held TCP data on the peer's behalf (`fakeack`).
    pub fake_ack: ftvm_replication::fakeack::Mode,
    pub metrics: Option<MetricsFile>,
}

/// What a session with one backup needs: how to reach it, what to tell it,
/// and how long each of its waits lasts.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Longest epoch: the checkpoint interval (`--trigger periodic`), or the
    /// most an epoch runs without output (the backup is told in the Hello).
    pub epoch: Duration,
    /// How often to send the backup a heartbeat, and how long nothing heard
    /// from it (no heartbeat, no byte of the stream) means it is gone.
    pub liveness: Timing,
    /// A checkpoint unacknowledged this long after it was sent means the
    /// backup is gone even though it beats (its apply hangs, say).
    pub ack_timeout: Duration,
    /// How long to keep trying to reach the backup.
    pub connect_timeout: Duration,
    /// Authenticate to the backup with this secret (and make it
    /// authenticate to us), and encrypt the channel if asked.
    pub auth: Option<Auth>,
    /// Copy the guest's frames to the backup, so a takeover replays them.
    pub mirror: crate::mirror::Mode,
    /// How the checkpoint thread and the acknowledgement reader run.
    pub priority: Priority,
    /// The primary's disk image, copied to the backup during pre-copy.
    pub disk: Option<PathBuf>,
}

/// What the primary does when it loses its backup (`--on-backup-loss`).
#[derive(Clone, Debug)]
pub struct LossPolicy {
    pub on_backup_loss: OnBackupLoss,
    /// Decides who owns the VM's output when primary and backup lose each other.
    pub arbiter: Option<Arbiter>,
    /// After losing its backup, try these backups in order, again every
    /// [`STANDBY_RETRY`] until one protects the VM (a promoted backup's
    /// `--standby`); empty: wait for `Primary::protect`.
    pub standbys: Vec<String>,
}

/// The defaults of `ftvm run`'s replication options, for the command line
/// and for a promoted backup alike.
impl PrimaryConfig {
    /// `--epoch-ms` unless given.
    pub const DEFAULT_EPOCH: Duration = Duration::from_millis(20);
    /// `--failure-timeout-ms` unless given.
    pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_secs(1);
    /// `--ack-timeout-ms` unless given.
    pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(2);
    /// `--connect-timeout-ms` unless given.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
}

/// How often a primary that lost its backup tries its standbys again.
pub const STANDBY_RETRY: Duration = Duration::from_secs(1);

/// `--pipeline-depth` unless given: checkpoints in flight at most.
pub const DEFAULT_PIPELINE_DEPTH: u64 = 2;
