//! `ftvm`: run, snapshot and restore fault-tolerant microVMs.

mod api;
mod run;
mod signals;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use vmm::devices::virtio::net::NetConfig;
use vmm::DirtyBackend;

#[derive(Parser)]
#[command(name = "ftvm", version, about = "A fault-tolerant virtual machine monitor on KVM")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest image and run it until it exits.
    Run(RunArgs),
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
    /// Show a running VM's state.
    Status {
        #[arg(long)]
        api_socket: PathBuf,
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

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FTVM_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(run::Source::Image {
            image: args.image,
            mem_size: args.memory << 20,
            vcpus: args.vcpus,
            cmdline: args.cmdline,
        }, args.host.into()),
        Command::Restore { snapshot, host } => run::run(run::Source::Snapshot(snapshot), host.into()),
        Command::Snapshot { api_socket, output, stop } => {
            let path = std::path::absolute(&output).unwrap_or(output);
            let request = api::Request::Snapshot { path: path.display().to_string(), stop };
            api::client::call(&api_socket, &request).map(|r| {
                println!("snapshot {} written: {} bytes, VM paused {} us", path.display(), r.bytes.unwrap_or(0), r.pause_us.unwrap_or(0));
                0
            }).map_err(run::RunError::from)
        }
        Command::Status { api_socket } => api::client::call(&api_socket, &api::Request::Status)
            .map(|r| {
                println!("state: {}", r.state.unwrap_or_default());
                println!("vcpus: {}", r.vcpus.unwrap_or(0));
                println!("memory: {} MiB", r.memory_mib.unwrap_or(0));
                0
            })
            .map_err(run::RunError::from),
    };
    match result {
        Ok(status) => ExitCode::from(status as u8),
        Err(e) => {
            eprintln!("ftvm: error: {e}");
            ExitCode::from(1)
        }
    }
}

impl From<HostArgs> for run::HostOptions {
    fn from(h: HostArgs) -> Self {
        run::HostOptions {
            prefault: h.prefault,
            dirty_backend: h.dirty_backend,
            api_socket: h.api_socket,
            devices: vmm::devices::DeviceConfig { net: h.net, disk: h.disk },
        }
    }
}
