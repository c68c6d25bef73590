//! `ftvm`: run fault-tolerant microVMs: as a primary replicating to a
//! backup, as that backup, or alone; snapshot and restore them; control
//! them through their API socket (`docs/api.md`).

// User-facing lines go through `output` (a closed stdout or stderr must not panic).
#![deny(clippy::print_stdout, clippy::print_stderr)]

mod api;
mod cli;
mod config;
mod demo;
mod exporter;
mod output;
mod privilege;
mod run;
mod signals;

use std::process::ExitCode;
use std::time::Duration;

use ftvm_replication::mirror::Mode;
use ftvm_replication::{BackupConfig, MetricsFile, OnBackupLoss, PrimaryConfig, Role, Switches, DEFAULT_PIPELINE_DEPTH};
use ftvm_vmm::Console;

use cli::{ChannelArgs, ClientArgs, Command, HostArgs, ReplicationArgs};
use output::{errln, outln};

impl HostArgs {
    fn into_options(self, replicate: Option<PrimaryConfig>) -> run::HostOptions {
        run::HostOptions {
            prefault: self.prefault,
            dirty_backend: self.dirty_backend,
            idle_pause: self.idle_pause,
            api_socket: self.api_socket,
            api_group: self.api_group,
            seccomp: !self.no_seccomp,
            metrics_listen: self.metrics_listen,
            devices: ftvm_vmm::devices::DeviceConfig {
                net: self.net,
                disk: self.disk,
                disk_io: self.disk_io,
                net_offload: self.net_offload,
            },
            replicate,
            standbys: Vec::new(),
            user: None,
        }
    }
}

impl ReplicationArgs {
    /// The primary's configuration, with `--replicate-to`.
    fn primary(self, host: &HostArgs) -> Result<Option<PrimaryConfig>, run::RunError> {
        let args = self;
        let Some(backup) = args.replicate_to else { return Ok(None) };
        let arbiter = args.arbiter.arbiter(host.net.as_ref());
        let on_backup_loss = match args.on_backup_loss {
            // A backup that only lost touch with this primary takes over
            // while it keeps running: two VMs. Only an arbiter prevents that.
            Some(OnBackupLoss::Continue) if arbiter.is_none() => {
                return Err(run::RunError::Usage(
                    "--on-backup-loss continue needs --arbiter URL (without an arbiter a backup that only lost touch with this primary would run the VM too); use --on-backup-loss pause or add --arbiter".into(),
                ))
            }
            Some(chosen) => chosen,
            None if arbiter.is_some() => OnBackupLoss::Continue,
            None => OnBackupLoss::Pause,
        };
        let auth = args.channel.auth()?;
        let encrypt = auth.as_ref().is_some_and(|a| a.encrypt);
        let mirror = match args.mirror {
            Some(Mode::On) if encrypt => {
                return Err(run::RunError::Usage(
                    "--mirror on cannot be used with --encrypt: the mirrored frames would travel unencrypted (leave out --mirror, or give --mirror off)".into(),
                ))
            }
            Some(chosen) => chosen,
            None if encrypt => {
                tracing::info!("not mirroring frames to the backup: they would travel unencrypted (--encrypt)");
                Mode::Off
            }
            None => Mode::On,
        };
        Ok(Some(PrimaryConfig {
            backup,
            epoch_ms: args.epoch_ms,
            failure_timeout: Duration::from_millis(args.failure_timeout_ms),
            ack_timeout: Duration::from_millis(args.ack_timeout_ms.max(args.failure_timeout_ms)),
            heartbeat: Duration::from_millis(args.heartbeat_ms),
            on_backup_loss,
            arbiter,
            connect_timeout: Duration::from_millis(args.connect_timeout_ms),
            metrics: args.metrics.map(|path| MetricsFile {
                path,
                every_epoch: args.metrics_every_epoch,
                max_bytes: args.metrics_max_bytes,
            }),
            disk: host.disk.clone(),
            switches: Switches {
                capture: args.capture,
                encoding: args.encoding,
                diff: args.diff,
                device_state: args.device_state,
                transport: args.transport,
                trigger: args.trigger,
                predict_writes: args.predict_writes,
                prefetch: args.prefetch,
                prefetch_by: args.prefetch_by,
                fake_ack_state: args.fake_ack_state,
            },
            pipeline_depth: args.pipeline_depth as usize,
            auth,
            mirror,
            priority: args.priority,
            fake_ack: args.fake_ack,
            standbys: Vec::new(),
        }))
    }
}

impl ChannelArgs {
    fn auth(&self) -> Result<Option<ftvm_replication::pipeline::transport::Auth>, run::RunError> {
        use ftvm_replication::pipeline::transport::{Auth, Secret};
        let Some(path) = &self.secret_file else {
            if self.insecure {
                return Ok(None);
            }
            // Unauthenticated, anyone who reaches the link could pose as a
            // primary (a recorded stream replayed to a backup boots the VM
            // there) or as a backup.
            return Err(run::RunError::Usage(
                "the replication channel needs --secret-file PATH (the same secret on both sides), or --insecure for a link nobody else reaches".into(),
            ));
        };
        Ok(Some(Auth { secret: Secret::from_file(path)?, encrypt: self.encrypt }))
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // Its complaint about a closed stderr would go to stderr with eprintln!, which panics.
        .log_internal_errors(false)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FTVM_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    // One line, written here: the default hook's backtrace machinery makes
    // calls (getcwd) that a thread's seccomp filter forbids, and the
    // process then ended by SIGSYS instead of saying what panicked. Then
    // the whole process ends: a VMM missing one of its threads (the one
    // reading acknowledgements, say) could hold its guest's output for good
    // while its heartbeats keep the backup from taking over.
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let what = info.payload().downcast_ref::<&str>().copied().or_else(|| info.payload().downcast_ref::<String>().map(String::as_str));
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        errln!("ftvm: error: thread {} panicked{at}: {}", thread.name().unwrap_or("?"), what.unwrap_or("(no message)"));
        std::process::abort();
    }));
    match dispatch(cli::parse().command) {
        Ok(status) => ExitCode::from(status as u8),
        Err(e) => {
            errln!("ftvm: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// One request to the VMM at `client.api_socket`.
fn call(client: &ClientArgs, request: api::Request) -> Result<api::Response, run::RunError> {
    Ok(api::client::call(&client.api_socket, &request, client.timeout)?)
}

/// `--memory` in bytes; a size no host could map is refused as given (a
/// saturated product would be reported as another number).
fn bytes_of_mib(mib: u64) -> Result<u64, run::RunError> {
    mib.checked_mul(1 << 20).ok_or_else(|| run::RunError::Usage(format!("--memory {mib} MiB is more than any host can map")))
}

fn dispatch(command: Command) -> Result<i32, run::RunError> {
    match command {
        Command::Run(args) => {
            let replicate = args.replication.primary(&args.host)?;
            let source =
                run::Source::Image { image: args.image, mem_size: bytes_of_mib(args.memory)?, vcpus: args.vcpus, cmdline: args.cmdline };
            let mut host = args.host.into_options(replicate);
            host.user = args.user.as_deref().map(privilege::User::lookup).transpose()?;
            run::run(source, host)
        }
        Command::Backup(args) => {
            let config = BackupConfig {
                listen: args.listen,
                devices: ftvm_vmm::devices::DeviceConfig {
                    net: args.host.net.clone(),
                    disk: args.host.disk.clone(),
                    disk_io: args.host.disk_io,
                    net_offload: args.host.net_offload,
                },
                mem_size: args.memory.map(bytes_of_mib).transpose()?,
                vcpus: args.vcpus,
                failure_timeout: args.failure_timeout_ms.map(Duration::from_millis),
                heartbeat: Duration::from_millis(args.heartbeat_ms),
                prefault: args.host.prefault,
                dirty_backend: args.host.dirty_backend,
                idle_pause: args.host.idle_pause,
                priority: args.priority,
                console: Console::default(),
                metrics: args.metrics.map(|path| MetricsFile {
                    path,
                    every_epoch: args.metrics_every_epoch,
                    max_bytes: args.metrics_max_bytes,
                }),
                arbiter: args.arbiter.arbiter(args.host.net.as_ref()),
                auth: args.channel.auth()?,
                handshake_timeout: Duration::from_millis(args.handshake_timeout_ms.max(1)),
            };
            // Once it took over, `ftvm protect` makes it a primary with these
            // settings (the defaults of `ftvm run`, this backup's arbiter,
            // secret and disk).
            let promotion = PrimaryConfig {
                backup: String::new(),
                epoch_ms: 20,
                failure_timeout: Duration::from_millis(1000),
                ack_timeout: Duration::from_millis(2000),
                heartbeat: config.heartbeat,
                on_backup_loss: if config.arbiter.is_some() { OnBackupLoss::Continue } else { OnBackupLoss::Pause },
                arbiter: config.arbiter.clone(),
                connect_timeout: Duration::from_millis(5000),
                metrics: None,
                disk: config.devices.disk.clone(),
                switches: Switches::default(),
                pipeline_depth: DEFAULT_PIPELINE_DEPTH as usize,
                auth: config.auth.clone(),
                // As `ftvm run` without --mirror: no unencrypted copies of an encrypted VM's frames.
                mirror: if config.auth.as_ref().is_some_and(|a| a.encrypt) { Mode::Off } else { Mode::On },
                fake_ack: Default::default(),
                priority: Default::default(),
                // After a later loss too, the standbys protect it.
                standbys: args.standby.clone(),
            };
            let mut host = args.host.into_options(Some(promotion));
            host.standbys = args.standby;
            run::run(run::Source::Backup(Box::new(config)), host)
        }
        Command::Restore { snapshot, replication, host, user } => {
            let replicate = replication.primary(&host)?;
            let mut host = host.into_options(replicate);
            host.user = user.as_deref().map(privilege::User::lookup).transpose()?;
            run::run(run::Source::Snapshot(snapshot), host)
        }
        Command::Replica(args) => {
            let peers = ftvm_replication::vsmr::parse_peers(&args.peers, args.id).map_err(run::RunError::Usage)?;
            if args.host.disk.is_some() && args.image.is_none() {
                return Err(run::RunError::Usage("--disk needs --image: a witness without a VM has no disk".into()));
            }
            if args.image.is_none() && args.host.net.is_some() {
                return Err(run::RunError::Usage("--net needs --image: a witness without a VM has no network card".into()));
            }
            if args.fast_election == ftvm_replication::vsmr::failover::FastElection::Off && args.failure_timeout_ms.is_some() {
                return Err(run::RunError::Usage("--failure-timeout-ms needs --fast-election on (it starts an election at once)".into()));
            }
            let config = ftvm_replication::vsmr::ReplicaConfig {
                id: args.id,
                peers,
                witness: args.witness,
                auth: args.channel.auth()?,
                metrics: args.metrics,
                raft_state: args.raft_state,
                max_interval: Duration::from_millis(args.sync_ms),
                pages: args.sync_pages,
                rejoin: args.rejoin,
                failover: ftvm_replication::vsmr::failover::Options {
                    fast: args.fast_election,
                    failure_timeout: args.failure_timeout_ms.map(Duration::from_millis),
                },
                replay: args.takeover_replay,
                on_secondary_loss: args.on_secondary_loss,
                tuning: ftvm_replication::vsmr::tuning::Tuning {
                    early_apply: args.early_apply,
                    batch_append: args.batch_append,
                    sync_spacing: args.sync_spacing,
                    direct_input: args.direct_input,
                    ack_wait: args.ack_wait,
                    early_resume: args.early_resume,
                    ack_release: args.ack_release,
                    input_batch: args.input_batch,
                    sync_pipeline: args.sync_pipeline,
                    link_batch: args.link_batch,
                    link_direct: args.link_direct,
                    link_compress: args.link_compress,
                    predict_writes: args.predict_writes,
                    witness_linger: Duration::from_micros(args.witness_linger_us),
                    leader_apply: args.leader_apply,
                    sync_output: args.sync_output,
                },
            };
            let source = match args.image {
                Some(image) => run::Source::Replica {
                    image,
                    mem_size: bytes_of_mib(args.memory)?,
                    vcpus: args.vcpus,
                    cmdline: args.cmdline,
                    config: Box::new(config),
                },
                None => run::Source::Witness(Box::new(config)),
            };
            let mut host = args.host;
            // A replica's disk I/O runs in the device's pass: a pause (a
            // syncvm) then finds no write in progress (docs/replicas.md).
            host.disk_io = ftvm_vmm::devices::virtio::block::DiskIo::Sync;
            run::run(source, host.into_options(None))
        }
        Command::Snapshot { api_socket, timeout, output, stop } => {
            let path = std::path::absolute(&output).unwrap_or(output);
            let request = api::Request::Snapshot { path: path.display().to_string(), stop };
            let socket = api_socket.display().to_string();
            let r = call(&ClientArgs { api_socket, timeout }, request)?;
            // Every VMM that wrote one says its size.
            let Some(bytes) = r.bytes else {
                return Err(api::client::ClientError::Protocol {
                    path: socket,
                    err: "a snapshot reply without the snapshot's size".into(),
                }
                .into());
            };
            let pending = match r.disk_pending.unwrap_or(0) {
                0 => String::new(),
                n => format!(", {n} disk request(s) in flight (issued again on restore)"),
            };
            outln!("snapshot {} written: {} bytes, VM paused {} us{pending}", path.display(), bytes, r.pause_us.unwrap_or(0));
            Ok(0)
        }
        Command::Status { client, json } => {
            let r = call(&client, api::Request::Status)?;
            if json {
                outln!("{}", serde_json::to_string(&r).expect("responses serialize"));
            } else {
                print_status(&r);
            }
            Ok(0)
        }
        Command::Pause { client } => {
            call(&client, api::Request::Pause)?;
            outln!("paused");
            Ok(0)
        }
        Command::Resume { client } => {
            call(&client, api::Request::Resume)?;
            outln!("running");
            Ok(0)
        }
        Command::Stop { client } => {
            call(&client, api::Request::Stop)?;
            outln!("stopping");
            Ok(0)
        }
        Command::Protect { client, backup } => {
            call(&client, api::Request::Protect { backup: backup.clone() })?;
            outln!("protecting with backup {backup}; `ftvm status` shows when it is synchronized");
            Ok(0)
        }
        Command::Switchover { client } => {
            let r = call(&client, api::Request::Switchover)?;
            let backup = r.replication.map(|st| st.peer).unwrap_or_default();
            outln!("handed over to the backup {backup}; this VMM exits");
            Ok(0)
        }
        Command::Demo(args) => Ok(demo::run(args)),
    }
}

fn print_status(r: &api::Response) {
    outln!("state: {}", r.state.as_deref().unwrap_or("unknown"));
    if let (Some(v), Some(m)) = (r.vcpus, r.memory_mib) {
        outln!("vcpus: {v}");
        outln!("memory: {m} MiB");
    }
    if let Some(w) = r.write_errors.filter(|w| *w != api::WriteErrors::default()) {
        outln!("write errors: {} metrics lines, {} console writes dropped", w.metrics, w.console);
    }
    if let Some(rep) = &r.replication {
        outln!("role: {}", rep.role);
        outln!("protected: {}", if rep.protected { "yes" } else { "no" });
        if matches!(rep.role, Role::Leader | Role::Secondary | Role::Witness) {
            outln!("term: {}", rep.term);
        } else {
            outln!("epoch: {}", rep.epoch);
        }
        if !rep.peer.is_empty() {
            outln!("{}: {}", if rep.role == Role::Primary { "backup" } else { "primary" }, rep.peer);
        }
        if !rep.standbys.is_empty() {
            outln!("standbys: {}", rep.standbys.join(", "));
        }
        outln!("detail: {}", rep.detail);
        if let Some(e) = &rep.election {
            outln!("elected: {e}");
        }
        if let Some(m) = &rep.last_sync {
            outln!(
                "last syncvm {} (term {}): {} pages dirty, {} divergent, pause {} us, {} bytes sent since the previous, {} us after it{}",
                m.index,
                m.term,
                m.dirty_pages,
                m.divergent_pages,
                m.pause_us,
                m.bytes,
                m.interval_us,
                if m.ok { "" } else { " (FAILED)" }
            );
        }
        let started = rep.started_by.nonzero();
        if !started.is_empty() {
            let each: Vec<String> = started.iter().map(|(reason, n)| format!("{reason} {n}")).collect();
            outln!("checkpoints started by: {}", each.join(", "));
        }
        if let Some(m) = &rep.last {
            outln!(
                "last epoch {}: started by {}, ran {} us (at most {} us), pause {} us, {} dirty pages, {} bytes, transfer {} us, ack after {} us, {} frames released (held up to {} us)",
                m.epoch,
                m.trigger,
                m.epoch_us,
                m.max_epoch_us,
                m.pause_us,
                m.dirty_pages,
                m.bytes,
                m.transfer_us,
                m.ack_us,
                m.frames_released,
                m.hold_us
            );
            if m.predicted > 0 {
                outln!(
                    "write prediction: {} pages left writable, {} of them written, {} unchanged (not sent), {} tracked first writes",
                    m.predicted,
                    m.predicted_written,
                    m.fake_dirty,
                    m.first_writes
                );
            }
            if m.prefetched_pages > 0 {
                outln!("prefetch: {} pages sent while the guest ran, {} in the stop-and-copy", m.prefetched_pages, m.commit_pages);
            }
        }
    }
}
