//! `ftvm`: run fault-tolerant microVMs: as a primary replicating to a
//! backup, as that backup, or alone; snapshot and restore them.

mod api;
mod demo;
mod run;
mod signals;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use ftvm_replication::pipeline::{capture, encode, transport};
use ftvm_replication::{BackupConfig, OnBackupLoss, PrimaryConfig, Switches};
use ftvm_vmm::devices::virtio::net::NetConfig;
use ftvm_vmm::{Console, DirtyBackend};

#[derive(Parser)]
#[command(name = "ftvm", version, about = "A fault-tolerant virtual machine monitor on KVM")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest image and run it until it exits (as a primary with --replicate-to).
    Run(RunArgs),
    /// Wait for a primary, follow its checkpoints, and take its VM over when it fails.
    Backup(BackupArgs),
    /// Write a running VM's complete state to a file.
    Snapshot {
        /// Control socket of the VM (its --api-socket).
        #[arg(long)]
        api_socket: PathBuf,
        /// Snapshot file to write.
        #[arg(long, short)]
        output: PathBuf,
        /// Stop the VM after the snapshot instead of resuming it.
        #[arg(long)]
        stop: bool,
    },
    /// Continue a VM from a snapshot file in this process.
    Restore {
        #[arg(long)]
        snapshot: PathBuf,
        #[command(flatten)]
        host: HostArgs,
    },
    /// Show a VM's state and replication figures.
    Status {
        #[arg(long)]
        api_socket: PathBuf,
    },
    /// Show failover on this machine: a replicated kv VM loses its host, then its primary stalls and is fenced, under load; no acknowledged write is lost.
    Demo(demo::DemoArgs),
    /// Protect an unprotected primary again with a new backup.
    Protect {
        #[arg(long)]
        api_socket: PathBuf,
        /// The new backup's replication address (its --listen).
        #[arg(long)]
        backup: String,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Guest image: a static x86-64 ELF built for the ftvm guest ABI.
    #[arg(long)]
    image: PathBuf,
    /// Guest memory in MiB (a multiple of 2).
    #[arg(long, default_value_t = 256)]
    memory: u64,
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// Command line passed to the guest.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Replicate to the backup listening at this address (host:port).
    #[arg(long, value_name = "ADDR")]
    replicate_to: Option<String>,
    /// Checkpoint interval in milliseconds.
    #[arg(long, default_value_t = 20)]
    epoch_ms: u64,
    /// When the backup is lost: keep running unprotected (continue), or pause with
    /// output held (pause). Default: continue with --arbiter (after winning
    /// ownership), pause without (a cut link must not leave two VMs running).
    #[arg(long, value_name = "continue|pause")]
    on_backup_loss: Option<OnBackupLoss>,
    /// Declare the backup lost after this long without an acknowledgement.
    #[arg(long, default_value_t = 1000)]
    failure_timeout_ms: u64,
    /// Write per-epoch metrics as JSON lines to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Give up reaching the backup at start after this long.
    #[arg(long, default_value_t = 5000)]
    connect_timeout_ms: u64,
    /// Checkpoint capture stage. pause: copy the dirty pages while the VM is paused.
    #[arg(long, default_value = "pause", value_name = "pause")]
    capture: capture::Mode,
    /// Checkpoint page encoding. raw: whole pages, zero pages as a bare tag.
    #[arg(long, default_value = "raw", value_name = "raw")]
    encoding: encode::Encoding,
    /// Replication transport. tcp: one TCP connection to the backup.
    #[arg(long, default_value = "tcp", value_name = "tcp")]
    transport: transport::Kind,
    #[command(flatten)]
    arbiter: ArbiterArgs,
    #[command(flatten)]
    channel: ChannelArgs,
    #[command(flatten)]
    host: HostArgs,
}

/// Who owns a replicated VM when primary and backup lose each other.
#[derive(Args)]
struct ArbiterArgs {
    /// etcd endpoint deciding ownership (http://HOST:PORT); both sides must name the same one.
    #[arg(long, value_name = "URL")]
    arbiter: Option<String>,
    /// The VM's name at the arbiter (default: from its MAC address).
    #[arg(long, requires = "arbiter")]
    name: Option<String>,
}

impl ArbiterArgs {
    fn arbiter(&self, net: Option<&NetConfig>) -> Option<ftvm_replication::arbiter::Arbiter> {
        let endpoint = self.arbiter.as_deref()?;
        let name = self.name.clone().unwrap_or_else(|| match net {
            Some(n) => format!("vm-{}", n.mac.iter().map(|b| format!("{b:02x}")).collect::<String>()),
            None => "vm".into(),
        });
        Some(ftvm_replication::arbiter::Arbiter::new(endpoint, &name))
    }
}

/// Options that secure the replication channel (both sides).
#[derive(Args)]
struct ChannelArgs {
    /// Authenticate the replication channel with the secret in this file
    /// (both sides use the same file; it must not be accessible by group or
    /// others). Without it the channel is unauthenticated.
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
    /// Encrypt the replication channel too (needs --secret-file; on a
    /// backup: refuse a primary that does not encrypt).
    #[arg(long, requires = "secret_file")]
    encrypt: bool,
}

impl ChannelArgs {
    fn auth(&self) -> Result<Option<transport::Auth>, run::RunError> {
        let Some(path) = &self.secret_file else { return Ok(None) };
        Ok(Some(transport::Auth { secret: transport::Secret::from_file(path)?, encrypt: self.encrypt }))
    }
}

#[derive(Args)]
struct BackupArgs {
    /// Address to accept the primary on (host:port).
    #[arg(long, value_name = "ADDR")]
    listen: String,
    /// Refuse a primary whose VM has another memory size (MiB).
    #[arg(long)]
    memory: Option<u64>,
    /// Refuse a primary whose VM has another number of vCPUs.
    #[arg(long)]
    vcpus: Option<u32>,
    /// Take over after this long without hearing from the primary
    /// (default: five epochs, at least 200 ms).
    #[arg(long)]
    failure_timeout_ms: Option<u64>,
    /// Log every applied checkpoint (epoch, guest time, wall-clock time) as JSON lines.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Drop a connection that has not authenticated and said Hello within this long.
    #[arg(long, default_value_t = 5000)]
    handshake_timeout_ms: u64,
    #[command(flatten)]
    channel: ChannelArgs,
    #[command(flatten)]
    arbiter: ArbiterArgs,
    #[command(flatten)]
    host: HostArgs,
}

/// Options about how this host runs the VM (not part of the VM's shape).
#[derive(Args)]
struct HostArgs {
    /// Populate all guest memory before the guest starts.
    #[arg(long)]
    prefault: bool,
    /// Dirty-page tracking backend: bitmap or ring.
    #[arg(long, default_value = "bitmap")]
    dirty_backend: DirtyBackend,
    /// Serve the control socket here (for `ftvm snapshot`, `ftvm status`).
    #[arg(long)]
    api_socket: Option<PathBuf>,
    /// Network card backed by a TAP device: tap=NAME[,mac=MAC] (created if absent).
    #[arg(long, value_name = "tap=NAME,mac=MAC")]
    net: Option<NetConfig>,
    /// Disk backed by a raw file (its size must be a multiple of 512 bytes).
    #[arg(long)]
    disk: Option<PathBuf>,
}

impl HostArgs {
    fn into_options(self, replicate: Option<PrimaryConfig>) -> run::HostOptions {
        run::HostOptions {
            prefault: self.prefault,
            dirty_backend: self.dirty_backend,
            api_socket: self.api_socket,
            devices: ftvm_vmm::devices::DeviceConfig { net: self.net, disk: self.disk },
            replicate,
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FTVM_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    match dispatch(Cli::parse().command) {
        Ok(status) => ExitCode::from(status as u8),
        Err(e) => {
            eprintln!("ftvm: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn dispatch(command: Command) -> Result<i32, run::RunError> {
    match command {
        Command::Run(args) => {
            if args.channel.secret_file.is_some() && args.replicate_to.is_none() {
                return Err(run::RunError::Usage("--secret-file secures replication: it needs --replicate-to"));
            }
            let auth = args.channel.auth()?;
            let arbiter = args.arbiter.arbiter(args.host.net.as_ref());
            let on_backup_loss =
                args.on_backup_loss.unwrap_or(if arbiter.is_some() { OnBackupLoss::Continue } else { OnBackupLoss::Pause });
            let replicate = args.replicate_to.map(|backup| PrimaryConfig {
                backup,
                epoch_ms: args.epoch_ms.max(1),
                failure_timeout: Duration::from_millis(args.failure_timeout_ms),
                on_backup_loss,
                arbiter,
                connect_timeout: Duration::from_millis(args.connect_timeout_ms),
                metrics: args.metrics,
                disk: args.host.disk.clone(),
                switches: Switches { capture: args.capture, encoding: args.encoding, transport: args.transport },
                auth,
            });
            let source = run::Source::Image { image: args.image, mem_size: args.memory << 20, vcpus: args.vcpus, cmdline: args.cmdline };
            run::run(source, args.host.into_options(replicate))
        }
        Command::Backup(args) => {
            let config = BackupConfig {
                listen: args.listen,
                devices: ftvm_vmm::devices::DeviceConfig { net: args.host.net.clone(), disk: args.host.disk.clone() },
                mem_size: args.memory.map(|m| m << 20),
                vcpus: args.vcpus,
                failure_timeout: args.failure_timeout_ms.map(Duration::from_millis),
                prefault: args.host.prefault,
                dirty_backend: args.host.dirty_backend,
                console: Console::default(),
                metrics: args.metrics,
                arbiter: args.arbiter.arbiter(args.host.net.as_ref()),
                auth: args.channel.auth()?,
                handshake_timeout: Duration::from_millis(args.handshake_timeout_ms.max(1)),
            };
            run::run(run::Source::Backup(Box::new(config)), args.host.into_options(None))
        }
        Command::Restore { snapshot, host } => run::run(run::Source::Snapshot(snapshot), host.into_options(None)),
        Command::Snapshot { api_socket, output, stop } => {
            let path = std::path::absolute(&output).unwrap_or(output);
            let request = api::Request::Snapshot { path: path.display().to_string(), stop };
            let r = api::client::call(&api_socket, &request)?;
            println!("snapshot {} written: {} bytes, VM paused {} us", path.display(), r.bytes.unwrap_or(0), r.pause_us.unwrap_or(0));
            Ok(0)
        }
        Command::Status { api_socket } => {
            let r = api::client::call(&api_socket, &api::Request::Status)?;
            print_status(&r);
            Ok(0)
        }
        Command::Demo(args) => Ok(demo::run(args)),
        Command::Protect { api_socket, backup } => {
            api::client::call(&api_socket, &api::Request::Protect { backup: backup.clone() })?;
            println!("protecting with backup {backup}; `ftvm status` shows when it is synchronized");
            Ok(0)
        }
    }
}

fn print_status(r: &api::Response) {
    println!("state: {}", r.state.as_deref().unwrap_or("unknown"));
    if let (Some(v), Some(m)) = (r.vcpus, r.memory_mib) {
        println!("vcpus: {v}");
        println!("memory: {m} MiB");
    }
    if let Some(rep) = &r.replication {
        println!("role: {}", rep.role);
        println!("protected: {}", if rep.protected { "yes" } else { "no" });
        println!("epoch: {}", rep.epoch);
        println!("detail: {}", rep.detail);
        if let Some(m) = &rep.last {
            println!(
                "last epoch {}: pause {} us, {} dirty pages, {} bytes, transfer {} us, ack after {} us, {} frames released (held up to {} us)",
                m.epoch, m.pause_us, m.dirty_pages, m.bytes, m.transfer_us, m.ack_us, m.frames_released, m.hold_us
            );
        }
    }
}
