//! `ftvm-bench`: measurements that back ftvm's performance claims. Each
//! subcommand prints a table, writes CSV and an SVG plot, and compares
//! against a reference measured in the same run (never against constants).

mod channel;
mod cores;
mod cost;
mod ft;
mod ha;
mod kv;
mod paths;
mod redis_benchmark;
mod redis_guest;
mod redis_suite;
mod report;
mod soak;
mod threads;
mod vm_costs;
mod vsmr;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ftvm-bench", about = "ftvm benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Directory for CSV and plots.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// The microVM itself: memtouch in the VM vs natively, pause/resume,
    /// state save/restore, and the cost of tracked first writes per backend
    /// (and as the calibration at start measures it).
    Vm(vm_costs::Options),
    /// What protection costs per request: CPU per request of every thread
    /// of the unreplicated VMM, the protected primary and the backup, per
    /// checkpoint by thread and step, with throughput and added latency
    /// (kv and redis-server, SET and GET, -P 1 and 16; medians of
    /// interleaved rounds).
    Cost(cost::Options),
    /// Fault tolerance: memtouch and kv under replication for several epoch
    /// lengths against the unreplicated VM, per-epoch costs, failover time;
    /// with --ablation, each optimisation switch on and off instead.
    Ft(ft::Options),
    /// The replication channel: checkpoint frames through TCP in clear,
    /// authenticated and encrypted (throughput and round trip).
    Channel(channel::Options),
    /// The kv guest under redis-benchmark (SET/GET throughput, p50/p99
    /// latency) against redis-server run natively in the same run.
    Kv(kv::Options),
    /// Acknowledged writes lost when the primary's host is cut: redis-server
    /// with its asynchronous replication against ftvm protecting the kv
    /// guest (same client, cut and promotion delay), with throughput and
    /// latency against each without replication.
    Ha(ha::Options),
    /// Consensus-ordered replicas (PLOVER's VSMR) against primary-backup
    /// and the unreplicated VM: kv under redis-benchmark, throughput and
    /// latency ratios, replication bytes per request, divergent pages;
    /// then per setting a failover (first reply after the serving VMM is
    /// killed) and, for VSMR, the killed replica's rejoin.
    Vsmr(vsmr::Options),
    /// Randomized failovers under tracked writers (`ftvm demo --soak`): the
    /// primary's VMM killed, its host dead, stalled, its replication link
    /// cut, in random orders; acknowledged writes lost (must be 0), old
    /// primaries not fenced (must be 0), first reply after each failure.
    Soak(soak::Options),
    /// Redis's own test suite (external-server mode, a fresh server per
    /// unit) against redis-server natively, in ftvm and in ftvm protected:
    /// tests passed and failed, wall time, and every test that passes
    /// natively but not in ftvm.
    RedisSuite(redis_suite::Options),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = std::fs::create_dir_all(&cli.out) {
        eprintln!("ftvm-bench: error: cannot create {}: {e}", cli.out.display());
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Vm(opts) => vm_costs::run(&opts, &cli.out),
        Command::Ft(opts) => ft::run(&opts, &cli.out),
        Command::Cost(opts) => cost::run(&opts, &cli.out),
        Command::Kv(opts) => kv::run(&opts, &cli.out),
        Command::Channel(opts) => channel::run(&opts, &cli.out),
        Command::Ha(opts) => ha::run(&opts, &cli.out),
        Command::Vsmr(opts) => vsmr::run(&opts, &cli.out),
        Command::Soak(opts) => soak::run(&opts, &cli.out),
        Command::RedisSuite(opts) => redis_suite::run(&opts, &cli.out),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ftvm-bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}
