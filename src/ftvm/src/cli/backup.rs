//! `ftvm backup`: its options, and their conversion to the replication
//! crate's `BackupConfig` and to the primary it becomes once promoted.

use std::time::Duration;

use clap::Args;

use ftvm_primary_backup::backup::HANDSHAKE_TIMEOUT;
use ftvm_primary_backup::{BackupConfig, PrimaryConfig};
use ftvm_replication::liveness;
use ftvm_vmm::Console;

use super::config::ConfigArgs;
use super::host::{ArbiterArgs, ChannelArgs, HostArgs, MetricsArgs};
use super::run::{bytes_of_mib, Protection, ReplicationArgs};
use super::values::{default_text, host_port, millis, positive_ms};
use crate::error::RunError;
use crate::roles::backup::Follower;

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
    #[arg(long = "failure-timeout-ms", value_name = "MS", value_parser = positive_ms)]
    pub failure_timeout: Option<Duration>,
    /// Send the primary a heartbeat (a UDP datagram from the --listen port) this often.
    #[arg(long = "heartbeat-ms", value_name = "MS", default_value = default_text!(liveness::DEFAULT_INTERVAL, as_millis), value_parser = positive_ms)]
    pub heartbeat: Duration,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Drop a connection that has not authenticated and said Hello within this long.
    #[arg(long = "handshake-timeout-ms", value_name = "MS", default_value = default_text!(HANDSHAKE_TIMEOUT, as_millis), value_parser = millis())]
    pub handshake_timeout: Duration,
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

impl TryFrom<BackupArgs> for Follower {
    type Error = RunError;

    fn try_from(args: BackupArgs) -> Result<Follower, RunError> {
        let config = BackupConfig {
            listen: args.listen,
            devices: args.host.devices(),
            mem_size: args.memory.map(bytes_of_mib).transpose()?,
            vcpus: args.vcpus,
            failure_timeout: args.failure_timeout,
            heartbeat: args.heartbeat,
            prefault: args.host.prefault,
            dirty_backend: args.host.dirty_backend,
            idle_pause: args.host.idle_pause,
            vcpu_state_reads: args.host.vcpu_state_reads,
            priority: args.priority,
            console: Console::default(),
            metrics: args.metrics.file(),
            arbiter: args.arbiter.arbiter(args.host.net.as_ref()),
            auth: args.channel.auth()?,
            handshake_timeout: args.handshake_timeout.max(Duration::from_millis(1)),
        };
        let promotion = promotion(&config, args.standby)?;
        Ok(Follower { config, promotion, host: args.host.into() })
    }
}

/// Once it took over, `ftvm protect` makes the backup a primary with these
/// settings: the defaults of `ftvm run`, this backup's heartbeat, arbiter,
/// secret and disk; after a later loss too, the standbys protect it.
fn promotion(backup: &BackupConfig, standbys: Vec<String>) -> Result<PrimaryConfig, RunError> {
    let with = Protection {
        backup: String::new(),
        arbiter: backup.arbiter.clone(),
        auth: backup.auth.clone(),
        disk: backup.devices.disk.clone(),
        dirty_backend: backup.dirty_backend,
    };
    let mut config = ReplicationArgs::defaults().protecting(with)?;
    // The proxy restored at the takeover keeps rewriting its flows (the
    // guest was told acknowledged what the peer may not have): a second
    // proxy in front of it would not know them.
    config.fake_ack = ftvm_replication::fakeack::Mode::Off;
    config.session.liveness.interval = backup.heartbeat;
    config.loss.standbys = standbys;
    Ok(config)
}
