//! The command line: subcommands and their options (a module per role's
//! options, each with its conversion to that role's configuration), the
//! checks on values (`values`) and on the whole command line (`checks`),
//! and `--config FILE` (`config`).

mod backup;
mod checks;
pub mod config;
mod host;
mod replica;
mod run;
#[cfg(test)]
mod tests;
pub mod values;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

pub use backup::BackupArgs;
pub use replica::ReplicaArgs;
pub use run::{RestoreArgs, RunArgs};

use crate::api::client::{DEFAULT_TIMEOUT, SNAPSHOT_TIMEOUT};
use crate::demo::DemoArgs;
use crate::output::errln;
use values::{default_text, timeout};

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
    /// Ask a VSMR group's leader to replace a member (a lost replica) by a
    /// new one started with `ftvm replica --join`: raft adds it as a
    /// learner, then makes it a voter in place of the removed one.
    ReplicaReplace {
        #[command(flatten)]
        client: ClientArgs,
        /// The member to remove (its --id).
        #[arg(long, value_name = "ID")]
        remove: u64,
        /// The new replica: its --id and the address it listens on.
        #[arg(long, value_name = "ID=HOST:PORT", value_parser = values::member)]
        add: (u64, String),
    },
    /// Write a running VM's complete state to a file.
    Snapshot {
        /// Control socket of the VM (the --api-socket it runs with).
        #[arg(long, value_name = "PATH")]
        api_socket: PathBuf,
        /// Give up when the VMM has not answered within this many seconds.
        #[arg(long, value_name = "SECONDS", default_value = default_text!(SNAPSHOT_TIMEOUT, as_secs_f64), value_parser = timeout)]
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
    Restore(RestoreArgs),
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
    /// Run this host's part of a fleet: enter it under a lease in etcd, run
    /// the VM processes the fleet places here, lead placement when no other
    /// agent does (docs/fleet.md).
    Agent(crate::fleet::agent::AgentArgs),
    /// The fleet's VMs (in etcd): create, list, show, delete.
    #[command(subcommand)]
    Vm(crate::fleet::VmCommand),
    /// The fleet's hosts (in etcd): list, drain, undrain.
    #[command(subcommand)]
    Host(crate::fleet::HostCommand),
    /// Show failover on this machine: a replicated kv VM loses its host, then its primary stalls and is fenced, under load; no acknowledged write is lost.
    Demo(DemoArgs),
}

/// How a command reaches a running VMM.
#[derive(Args)]
pub struct ClientArgs {
    /// Control socket of the VM (the --api-socket it runs with).
    #[arg(long, value_name = "PATH")]
    pub api_socket: PathBuf,
    /// Give up when the VMM has not answered within this many seconds.
    #[arg(long, value_name = "SECONDS", default_value = default_text!(DEFAULT_TIMEOUT, as_secs_f64), value_parser = timeout)]
    pub timeout: Duration,
}

/// Parse the command line (exits with clap's usage error on a mistake).
pub fn parse() -> Cli {
    let mut command = Cli::command();
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    checks::refuse_repeats(&command, &args);
    let expanded = config::expand(&command, args).unwrap_or_else(|e| {
        // Exit status 2, like the same mistake on the command line.
        errln!("ftvm: error: {e}");
        std::process::exit(2)
    });
    let matches = command.try_get_matches_from_mut(expanded.args.clone()).unwrap_or_else(|e| checks::in_file(e, &expanded, &command));
    checks::primary_only(&mut command, &matches, &expanded);
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}
