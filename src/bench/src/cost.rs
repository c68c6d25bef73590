//! `ftvm-bench cost`: what protection costs per request, where a host of
//! its own would feel it. For each guest (kv, the static redis-server),
//! test (SET, GET) and pipeline depth, redis-benchmark runs against the
//! unreplicated VM and against the protected primary, one VM after the
//! other, repeatedly (medians). Measured around each run:
//!
//! - CPU time per request of every thread of the VMM (`/proc/PID/task`),
//!   the unreplicated one's and the primary's, and of the backup: unlike
//!   throughput on a shared 2-core host, it does not depend on what else
//!   runs there;
//! - checkpoints per second and requests per checkpoint, and per
//!   checkpoint the primary's CPU by thread and its steps' times (from its
//!   `--metrics-every-epoch` lines);
//! - throughput and p50/p99 latency, protected against unreplicated.
//!
//! The protected primary runs with the product's defaults; each `--variant`
//! adds a protected primary with more options to every round (one switch
//! on and off in the same run). Its metrics writer is measuring equipment:
//! its thread is shown apart and left out of the totals.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ftvm_replication::figures::EpochMetrics;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR};

use crate::redis_benchmark::{self, Figures};
use crate::redis_guest::{ftvm_binary, wait_serving, App, Guest, Protection};
use crate::report::{self, Row};
use crate::threads;

type BoxError = Box<dyn std::error::Error>;

/// The primary's metrics writer (see the module's header).
const MEASURING_THREAD: &str = "metrics-file";

#[derive(clap::Args)]
pub struct Options {
    /// Guests to measure, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [App::Kv, App::Redis])]
    app: Vec<App>,
    /// Pipeline depths (-P), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 16])]
    pipeline: Vec<u32>,
    /// Requests per run at -P 1 (-n).
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    /// Requests per run at deeper pipelines (-n).
    #[arg(long, default_value_t = 1_000_000)]
    requests_pipelined: u64,
    /// Parallel connections (-c).
    #[arg(long, default_value_t = 50)]
    clients: u32,
    /// Value size of SET and GET, bytes (-d).
    #[arg(long, default_value_t = 100)]
    value_bytes: u32,
    /// Rounds: each runs every case on the unreplicated VM, then on the
    /// protected one; medians over the rounds.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Also measure a protected primary with these `ftvm run` options
    /// (whitespace-separated), e.g. `--variant='--mirror per-frame'`, in
    /// every round after the default one. Repeatable.
    #[arg(long, allow_hyphen_values = true)]
    variant: Vec<String>,
    /// Directory holding kv.elf and redis-server.
    #[arg(long, default_value = "target/images")]
    images: PathBuf,
    /// The ftvm binary (default: next to ftvm-bench).
    #[arg(long)]
    ftvm: Option<PathBuf>,
}

const TESTS: [&str; 2] = ["SET", "GET"];

/// One redis-benchmark run of one test, and what it cost.
#[derive(Clone, Default)]
struct Sample {
    figures: Option<Figures>,
    /// CPU time per request of each kind of the VMM's threads, in µs.
    threads: BTreeMap<String, f64>,
    /// The backup's CPU time per request (all its threads), in µs.
    backup: f64,
    /// Checkpoints acknowledged during the run.
    checkpoints: u64,
    /// Their steps summed: see [`STEPS`].
    steps: [f64; STEPS.len()],
    seconds: f64,
}

impl Sample {
    /// The VMM's CPU time per request, its metrics writer left out.
    fn vmm(&self) -> f64 {
        self.threads.iter().filter(|(k, _)| k.as_str() != MEASURING_THREAD).map(|(_, v)| v).sum()
    }
}

/// A checkpoint's steps (times in µs) and counts as its metrics line gives
/// them: name, and how to read it.
type Step = (&'static str, fn(&EpochMetrics) -> f64);
const STEPS: [Step; 11] = [
    ("stop (vCPUs out of the guest), us", |m| m.stop_us as f64),
    ("pause (harvest, capture, state), us", |m| m.pause_us as f64),
    ("encode (after the resume), us", |m| m.encode_ns as f64 / 1000.0),
    ("resume to sent, us", |m| m.transfer_us as f64),
    ("resume to acknowledged, us", |m| m.ack_us as f64),
    ("release, us", |m| m.release_us as f64),
    ("dirty pages", |m| m.dirty_pages as f64),
    ("tracked first writes", |m| m.first_writes as f64),
    ("pages sent", |m| m.commit_pages as f64),
    ("bytes sent", |m| m.bytes as f64),
    ("frames released", |m| m.frames_released as f64),
];

/// What a VM's metrics file held when last read: its lines so far.
struct MetricsTail {
    path: PathBuf,
    lines: usize,
}

impl MetricsTail {
    /// The checkpoints recorded since the last call.
    fn new_checkpoints(&mut self) -> Result<Vec<EpochMetrics>, BoxError> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| format!("{}: {e}", self.path.display()))?;
        let mut out = Vec::new();
        let all: Vec<&str> = text.lines().collect();
        for line in all.iter().skip(self.lines) {
            out.push(serde_json::from_str(line).map_err(|e| format!("{}: bad metrics line {line:?}: {e}", self.path.display()))?);
        }
        self.lines = all.len();
        Ok(out)
    }
}

/// A running VM under measurement: unreplicated, or primary and backup.
struct Measured {
    guest: Guest,
    metrics: Option<MetricsTail>,
}

impl Measured {
    /// The VM of `setup`, protected with its options (scratch in `dir`) or not.
    fn start(
        topo: &Topology,
        ftvm: &Path,
        image: &Path,
        app: App,
        setup: &Setup,
        dir: &Scratch,
        opts: &Options,
    ) -> Result<Measured, BoxError> {
        let (protection, metrics, extra);
        match setup {
            Setup::Protected(options) => {
                let path = dir.join("primary-metrics.jsonl");
                let _ = std::fs::remove_file(&path);
                // Never rotated: `MetricsTail` reads one file from its start.
                let mut args = vec!["--metrics".to_string(), path.display().to_string(), "--metrics-every-epoch".into()];
                args.extend(["--metrics-max-bytes".to_string(), "0".into()]);
                args.extend(options.split_whitespace().map(String::from));
                extra = args;
                protection = Some(Protection { dir: dir.path(), epoch_ms: None, extra: &extra });
                metrics = Some(MetricsTail { path, lines: 0 });
            }
            Setup::Unreplicated => {
                protection = None;
                metrics = None;
            }
        }
        let mut guest = Guest::start(topo, ftvm, image, app, "", protection)?;
        wait_serving(topo, GUEST_ADDR, &mut guest.vmm)?;
        // A fresh server first grows its memory (each new page costs the
        // VM a fault): not in the measured runs.
        for test in TESTS {
            benchmark(topo, opts, *opts.pipeline.iter().max().unwrap_or(&1), test, opts.requests)?;
        }
        let mut measured = Measured { guest, metrics };
        if let Some(m) = &mut measured.metrics {
            m.new_checkpoints()?;
        }
        Ok(measured)
    }

    /// One run of `test` at `depth`, and what it cost.
    fn run(&mut self, topo: &Topology, opts: &Options, depth: u32, test: &str) -> Result<Sample, BoxError> {
        let requests = if depth > 1 { opts.requests_pipelined } else { opts.requests };
        let backup_cpu = |g: &Guest| -> Result<u64, BoxError> {
            Ok(match &g.backup {
                Some(b) => threads::tasks(b.id())?.iter().map(|t| t.cpu_ns).sum(),
                None => 0,
            })
        };
        let (vmm0, backup0) = (threads::cpu_ns_by_thread(self.guest.vmm.id())?, backup_cpu(&self.guest)?);
        if let Some(m) = &mut self.metrics {
            m.new_checkpoints()?;
        }
        let t0 = std::time::Instant::now();
        let figures = benchmark(topo, opts, depth, test, requests)?;
        let seconds = t0.elapsed().as_secs_f64();
        let (vmm1, backup1) = (threads::cpu_ns_by_thread(self.guest.vmm.id())?, backup_cpu(&self.guest)?);
        self.guest.check_alive()?;
        let per_request = |ns: u64| ns as f64 / 1000.0 / requests as f64;
        let mut sample = Sample {
            figures: Some(figures),
            threads: threads::spent(&vmm0, &vmm1).into_iter().map(|(k, ns)| (k, per_request(ns))).collect(),
            backup: per_request(backup1.saturating_sub(backup0)),
            seconds,
            ..Sample::default()
        };
        if let Some(m) = &mut self.metrics {
            let checkpoints = m.new_checkpoints()?;
            sample.checkpoints = checkpoints.len() as u64;
            for (sum, (_, read)) in sample.steps.iter_mut().zip(STEPS) {
                *sum = checkpoints.iter().map(read).sum();
            }
        }
        Ok(sample)
    }
}

fn benchmark(topo: &Topology, opts: &Options, depth: u32, test: &str, requests: u64) -> Result<Figures, BoxError> {
    let args = [("-n", requests), ("-c", opts.clients.into()), ("-P", depth.into()), ("-d", opts.value_bytes.into())]
        .into_iter()
        .flat_map(|(flag, v)| [flag.to_string(), v.to_string()])
        .collect::<Vec<_>>();
    Ok(redis_benchmark::run(topo, GUEST_ADDR, &[test], &args)?.remove(0))
}

/// What runs the guest: the unreplicated VM, or a protected primary with
/// these extra options (none: the defaults).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Setup {
    Unreplicated,
    Protected(String),
}

impl Setup {
    fn label(&self) -> String {
        match self {
            Setup::Unreplicated => "unreplicated".into(),
            Setup::Protected(o) if o.is_empty() => "protected".into(),
            Setup::Protected(o) => format!("protected, {o}"),
        }
    }
}

/// Samples of one case: (app, depth, test, setup).
type Key = (App, u32, &'static str, Setup);

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    if opts.repeat == 0 || opts.pipeline.is_empty() || opts.app.is_empty() {
        return Err("--repeat, --pipeline and --app need at least one value".into());
    }
    let ftvm = ftvm_binary(opts.ftvm.as_deref())?;
    let images = opts.app.iter().map(|&app| Ok((app, app.existing_image(&opts.images)?))).collect::<Result<Vec<_>, BoxError>>()?;
    let topo = Topology::new("cost")?;
    let dir = Scratch::new("bench-cost")?;
    let setups: Vec<Setup> = [Setup::Unreplicated, Setup::Protected(String::new())]
        .into_iter()
        .chain(opts.variant.iter().map(|v| Setup::Protected(v.trim().to_string())))
        .collect();
    let mut samples: BTreeMap<Key, Vec<Sample>> = BTreeMap::new();
    for round in 0..opts.repeat {
        for (app, image) in &images {
            // Interleaved: the same cases on each VM in turn, so that drift
            // on the host reaches them all.
            for setup in &setups {
                eprintln!("round {}/{}: {} {}", round + 1, opts.repeat, app.name(), setup.label());
                let mut vm = Measured::start(&topo, &ftvm, image, *app, setup, &dir, opts)?;
                for &depth in &opts.pipeline {
                    for test in TESTS {
                        samples.entry((*app, depth, test, setup.clone())).or_default().push(vm.run(&topo, opts, depth, test)?);
                    }
                }
            }
        }
    }
    drop(topo);
    let (rows, bars) = table(opts, &samples);
    report::publish(
        out,
        "cost",
        &rows,
        &report::BarChart {
            title: "CPU per request: protected primary against the unreplicated VMM (ratio, medians)",
            category: "guest, test, pipeline depth",
            quantity: "primary CPU per request / unreplicated VMM's",
            bars,
            reference: Some(1.0),
        },
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median over `samples` of `pick`.
fn med(samples: &[Sample], pick: impl Fn(&Sample) -> f64) -> f64 {
    median(samples.iter().map(pick).collect())
}

/// The rows of every case, and the chart's bars (the CPU ratio per case).
fn table(opts: &Options, samples: &BTreeMap<Key, Vec<Sample>>) -> (Vec<Row>, Vec<(String, f64)>) {
    let (mut rows, mut bars) = (Vec::new(), Vec::new());
    for ((app, depth, test, setup), prot) in samples {
        let (app, depth, test) = (*app, *depth, *test);
        let Some(unrep) = samples.get(&(app, depth, test, Setup::Unreplicated)).filter(|_| *setup != Setup::Unreplicated) else {
            continue;
        };
        let label = setup.label();
        let group = format!("{} {test} -P {depth} -c {} -d {}, {label}", app.name(), opts.clients, opts.value_bytes);
        let mut row = |case: String, value: f64, unit: &'static str, reference: Option<f64>| {
            rows.push(Row { group: group.clone(), case, value, unit, reference });
        };
        let (unrep_cpu, prot_cpu) = (med(unrep, Sample::vmm), med(prot, Sample::vmm));
        row("CPU per request, protected primary (ref: unreplicated VMM)".into(), prot_cpu, "us", Some(unrep_cpu));
        bars.push((format!("{} {test} -P {depth}, {label}", app.name()), prot_cpu / unrep_cpu.max(f64::MIN_POSITIVE)));
        row("CPU per request, backup (ref: unreplicated VMM)".into(), med(prot, |s| s.backup), "us", Some(unrep_cpu));
        let kinds: std::collections::BTreeSet<&String> = prot.iter().chain(unrep).flat_map(|s| s.threads.keys()).collect();
        for kind in kinds {
            let of = |s: &Sample| s.threads.get(kind).copied().unwrap_or(0.0);
            if med(prot, of) == 0.0 && med(unrep, of) == 0.0 {
                // Idle (the main thread waiting for the VM, a kernel worker).
                continue;
            }
            let note = if kind == MEASURING_THREAD { ", measuring only" } else { "" };
            row(format!("CPU per request, thread {kind}{note} (ref: unreplicated)"), med(prot, of), "us", Some(med(unrep, of)));
        }
        let figure = |s: &Sample, f: fn(&Figures) -> f64| s.figures.as_ref().map_or(0.0, f);
        for (what, unit, f) in [
            ("throughput", "req/s", (|f| f.rps) as fn(&Figures) -> f64),
            ("latency p50", "ms", |f| f.p50_ms),
            ("latency p99", "ms", |f| f.p99_ms),
        ] {
            row(format!("{what} protected (ref: unreplicated)"), med(prot, |s| figure(s, f)), unit, Some(med(unrep, |s| figure(s, f))));
        }
        for (what, f) in [("p50", (|f| f.p50_ms) as fn(&Figures) -> f64), ("p99", |f| f.p99_ms)] {
            let added = median(prot.iter().zip(unrep).map(|(p, u)| figure(p, f) - figure(u, f)).collect());
            row(format!("latency {what} added by protection"), added, "ms", None);
        }
        let requests = if depth > 1 { opts.requests_pipelined } else { opts.requests } as f64;
        row("checkpoints per second".into(), med(prot, |s| s.checkpoints as f64 / s.seconds), "1/s", None);
        row("requests per checkpoint".into(), med(prot, |s| requests / s.checkpoints.max(1) as f64), "", None);
        // Per checkpoint: the primary's threads' CPU, and its steps' times.
        let per_checkpoint = |s: &Sample, us_per_request: f64| us_per_request * requests / s.checkpoints.max(1) as f64;
        let kinds: std::collections::BTreeSet<&String> = prot.iter().flat_map(|s| s.threads.keys()).collect();
        for kind in kinds {
            let v = med(prot, |s| per_checkpoint(s, s.threads.get(kind).copied().unwrap_or(0.0)));
            if v == 0.0 {
                continue;
            }
            row(format!("primary CPU per checkpoint, thread {kind}"), v, "us", None);
        }
        for (i, (step, _)) in STEPS.iter().enumerate() {
            row(format!("per checkpoint: {step}"), med(prot, |s| s.steps[i] / s.checkpoints.max(1) as f64), "", None);
        }
    }
    (rows, bars)
}
