//! `ftvm-bench ft`: what fault tolerance costs, always against the
//! unreplicated VM measured in the same run. Two shapes: the epoch sweep
//! (`sweep`) and the ablation of the optimisation switches (`ablation`).

mod ablation;
mod failover;
mod runs;
mod sweep;

use std::path::Path;

use runs::BoxError;

#[derive(clap::Args)]
pub struct Options {
    /// Epoch lengths to measure, in milliseconds [default: 5,10,20,50; with
    /// --ablation: 20].
    #[arg(long, value_delimiter = ',')]
    epochs: Option<Vec<u64>>,
    /// Seconds per memtouch run.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Requests per redis-benchmark run.
    #[arg(long, default_value_t = 20000)]
    requests: u64,
    /// Failover trials per kind of failure and epoch length (not with
    /// --ablation).
    #[arg(long, default_value_t = 3)]
    failovers: usize,
    /// Failure timeout of both sides in the failover runs, in milliseconds.
    #[arg(long, default_value_t = 30)]
    failure_timeout_ms: u64,
    /// Only the failovers: per kind of failure (VMM killed, host cut,
    /// primary stalled), detection, first reply and client-seen gap.
    #[arg(long, conflicts_with = "ablation")]
    failover: bool,
    /// Skip the network (kv and failover) measurements.
    #[arg(long)]
    no_network: bool,
    /// Measure each optimisation switch on and off instead of sweeping
    /// epoch lengths (--help says how).
    #[arg(long, long_help = ablation::long_help())]
    ablation: bool,
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    if opts.ablation {
        ablation::run(opts, out)
    } else if opts.failover {
        failover::run(opts, out)
    } else {
        sweep::run(opts, out)
    }
}
