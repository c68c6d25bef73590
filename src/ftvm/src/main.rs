//! `ftvm`: run fault-tolerant microVMs: as a primary replicating to a
//! backup, as that backup, or alone; snapshot and restore them; control
//! them through their API socket (`docs/api.md`).

// User-facing lines go through `output` (a closed stdout or stderr must not panic).
#![deny(clippy::print_stdout, clippy::print_stderr)]

mod api;
mod cli;
mod control;
mod demo;
mod error;
mod exporter;
mod fleet;
mod output;
mod privilege;
mod roles;
mod run;
mod signals;

use std::process::ExitCode;

use cli::Command;
use error::RunError;
use output::errln;
use roles::backup::Follower;
use roles::replica::Member;
use roles::Launch;

fn main() -> ExitCode {
    // Before anything allocates much (seccomp::prime_allocator says why).
    ftvm_vmm::seccomp::prime_allocator();
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

/// Run the subcommand; returns the exit status for this process.
fn dispatch(command: Command) -> Result<i32, RunError> {
    match command {
        Command::Run(args) => Launch::try_from(args)?.run(),
        Command::Restore(args) => Launch::try_from(args)?.run(),
        Command::Backup(args) => Follower::try_from(args)?.run(),
        Command::Replica(args) => Member::try_from(args)?.run(),
        Command::Snapshot { api_socket, timeout, output, stop } => control::snapshot(api_socket, timeout, output, stop),
        Command::Status { client, json } => control::status(&client, json),
        Command::Pause { client } => control::simple(&client, api::Request::Pause, "paused"),
        Command::Resume { client } => control::simple(&client, api::Request::Resume, "running"),
        Command::Stop { client } => control::simple(&client, api::Request::Stop, "stopping"),
        Command::Protect { client, backup } => control::protect(&client, backup),
        Command::Switchover { client } => control::switchover(&client),
        Command::ReplicaReplace { client, remove, add: (add, addr) } => control::replica_replace(&client, remove, add, addr),
        Command::Demo(args) => Ok(demo::run(args)),
        Command::Agent(args) => fleet::agent::run(args),
        Command::Vm(command) => fleet::vm(command),
        Command::Host(command) => fleet::host(command),
    }
}
