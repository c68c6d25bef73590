//! `ftvm-bench ft`: what fault tolerance costs, always against the
//! unreplicated VM measured in the same run. Two shapes: the epoch sweep
//! (`sweep`) and the ablation of the optimisation switches (`ablation`,
//! or over a matrix of workloads against ftvm's defaults, `matrix`; both
//! read the switch table in `switches`).

mod ablation;
pub(crate) mod failover;
mod matrix;
mod runs;
mod sweep;
mod switches;

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
    /// GETs of the 4 MiB value per bulk-read run (not with --ablation
    /// unless --matrix).
    #[arg(long, default_value_t = 5)]
    bulk_reads: usize,
    /// Failover trials per kind of failure and epoch length (not with
    /// --ablation).
    #[arg(long, default_value_t = 3)]
    failovers: usize,
    /// Failure timeout of both sides in the failover runs, in milliseconds.
    #[arg(long, default_value_t = 30)]
    failure_timeout_ms: u64,
    /// In the failover runs, the clients' minimum TCP retransmission timeout
    /// (a route's rto_min in their namespace; Linux's default is 200 ms):
    /// isolates what the clients' own timer adds to the client-seen gap.
    #[arg(long, value_name = "MS")]
    client_rto_min_ms: Option<u64>,
    /// Only the failovers: per kind of failure (VMM killed, host cut,
    /// primary stalled), detection, first reply and client-seen gap.
    #[arg(long, conflicts_with = "ablation")]
    failover: bool,
    /// Skip the network (kv and failover) measurements.
    #[arg(long)]
    no_network: bool,
    /// Only the bulk read (each setting, and at the default epoch also with
    /// --fake-ack on, against the unreplicated VM; the other settings run
    /// the default, --fake-ack bulk).
    #[arg(long, conflicts_with_all = ["ablation", "failover", "no_network"])]
    bulk_only: bool,
    /// Only kv under redis-benchmark, -P 1 and -P 16 (each setting, and at
    /// the default epoch also with --fake-ack on, against the unreplicated
    /// VM; the other settings run the default, --fake-ack bulk).
    #[arg(long, conflicts_with_all = ["ablation", "failover", "no_network", "bulk_only"])]
    kv_only: bool,
    /// Measure each optimisation switch on and off instead of sweeping
    /// epoch lengths (--help says how).
    #[arg(long, long_help = ablation::long_help())]
    ablation: bool,
    /// With --ablation: instead of the short workloads, a matrix of
    /// workloads and epochs in rounds, ftvm's defaults against each switch
    /// value, with a summary per case (--help says how).
    #[arg(long, requires = "ablation", long_help = matrix::long_help())]
    matrix: bool,
    /// Matrix working sets, in pages.
    #[arg(long, value_delimiter = ',', default_values_t = [1000, 4096, 10000])]
    pages: Vec<u64>,
    /// Matrix memtouch patterns.
    #[arg(long, value_delimiter = ',', default_values = ["seq", "random", "hotcold"])]
    patterns: Vec<String>,
    /// Matrix vCPU counts (memtouch writes from every vCPU).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2])]
    vcpus: Vec<u32>,
    /// Matrix: memtouch's writes per second over all its vCPUs (its
    /// `rate=`; 0: as fast as it can). A limited writer with the hotcold
    /// pattern also moves its hot set every half second (`shift=`), and
    /// runs `--seconds` either way.
    #[arg(long, default_value_t = 0, requires = "matrix")]
    write_rate: u64,
    /// Matrix: the workloads, comma-separated (memtouch, kv, redis, bulk).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [matrix::Kind::Memtouch], requires = "matrix")]
    cases: Vec<matrix::Kind>,
    /// Matrix: value sizes of the kv and redis cases, in bytes
    /// (redis-benchmark -d).
    #[arg(long, value_delimiter = ',', default_values_t = [3, 100, 1000], requires = "matrix")]
    values: Vec<u32>,
    /// Matrix: rounds, interleaved, each with its own unreplicated run;
    /// tables give medians over them.
    #[arg(long, default_value_t = 3, requires = "matrix")]
    rounds: usize,
    /// Ablation: requests each connection pipelines in the kv runs
    /// (redis-benchmark -P).
    #[arg(long, default_value_t = 16)]
    pipeline: u32,
    /// Ablation and matrix: only these switches (names as in the SWITCHES
    /// table, e.g. predict-writes, or one value of one, e.g. prefetch=off;
    /// the ablation also knows disk-io) [default: all].
    #[arg(long, value_delimiter = ',')]
    switches: Option<Vec<String>>,
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    if opts.ablation && opts.matrix {
        matrix::run(opts, out)
    } else if opts.ablation {
        ablation::run(opts, out)
    } else if opts.failover {
        failover::run(opts, out)
    } else {
        sweep::run(opts, out)
    }
}
