//! The ablation: the same short workloads once per value of every
//! optimisation switch, each against the unreplicated VM measured in the
//! same run, so a switch's effect shows as the difference between ratios
//! measured minutes apart on the same host.

use std::path::Path;

use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::Topology;

use super::runs::{self, BoxError, EpochMeans, Figure, Replicated, COPY_FIGURES};
use super::switches::{self, DISK_IO, SWITCHES};
use super::Options;
use crate::report::{self, Row};

/// The `--disk-io` workloads: the kv guest logging every write to its disk
/// (`aof=on`) under redis-benchmark SET and GET, the disk as it is and
/// slowed to `SLOW_DISK_MS` a write (`FTVM_TEST_FAULT=slow-disk`), each
/// with its number of requests.
const DISK_RUNS: [(u64, u64); 2] = [(0, 10_000), (SLOW_DISK_MS, 1000)];
const SLOW_DISK_MS: u64 = 5;
/// Its value size.
const DISK_VALUE: u32 = 100;

/// The epoch length measured unless `--epochs` says otherwise.
pub const DEFAULT_EPOCH_MS: u64 = 20;
/// The memtouch workload: random writes into 64 MiB, almost every write a
/// new dirty page.
const MEMTOUCH: (&str, &str) = ("memtouch 10k pages/s", "ws=64M pattern=random rate=10000 report=0");
/// redis-benchmark's pipeline depth for the kv workload.
const KV_PIPELINE: u32 = 16;
/// Value sizes of the kv workload (redis-benchmark -d).
const KV_VALUES: [u32; 3] = [3, 100, 1000];

/// What `--ablation` measures, for `--help`.
pub fn long_help() -> String {
    let switches: Vec<String> =
        SWITCHES.iter().map(|s| format!("--{} {}", s.name, s.values.iter().map(|(v, _)| *v).collect::<Vec<_>>().join("|"))).collect();
    format!(
        "Measure each optimisation switch on and off instead of sweeping epoch lengths. The same short workloads ({}: \
         random writes into 64 MiB, almost every one a new dirty page; the kv guest under redis-benchmark SET and GET, \
         -P 16 (or --pipeline) -c 50, with values of {} bytes) run replicated with epochs of {DEFAULT_EPOCH_MS} ms (or --epochs) \
         once per value of each switch of `ftvm run` ({}) and for each combination in COMBINATIONS, the other switches at their defaults, and once on the \
         unreplicated VM in the same run. Prints, per switch value: throughput and latency with the unreplicated figure and \
         their ratio, and per epoch the mean pause, dirty pages, pages in the stop-and-copy and prefetched ahead of it, \
         time from pause to acknowledgement, bytes, bytes per byte of dirty page, bytes saved by diffs, \
         encoding time per page and output hold. `--disk-io async|sync` is measured on its own workload: the kv guest logging \
         every write to its disk (10000 requests of {DISK_VALUE} bytes), and with each write slowed by {SLOW_DISK_MS} ms \
         (FTVM_TEST_FAULT=slow-disk, 1000 requests), with the pause's 99th percentile, the time stopping the VM before it (which waits for the disk's \
         device thread) and the disk requests in flight per checkpoint. --switches NAME,... \
         measures only those switches. Writes ablation.csv and ablation.svg (the throughput ratios).",
        MEMTOUCH.0,
        KV_VALUES.map(|v| v.to_string()).join(", "),
        switches.join(", ")
    )
}

/// The per-epoch figures of every run, around `COPY_FIGURES`.
const PAUSE: &[Figure] = &[("pause", |m| m.pause_us, "us")];
const COSTS: &[Figure] = &[
    ("pause to ack", |m| m.pause_to_ack_us() / 1e3, "ms"),
    ("bytes/epoch", |m| m.bytes, "bytes"),
    ("bytes per dirty-page byte", EpochMeans::bytes_per_dirty_byte, "ratio"),
    ("diff bytes saved/epoch", |m| m.diff_bytes_saved, "bytes"),
    ("state bytes/epoch", |m| m.state_bytes, "bytes"),
    ("fake-acked bytes carried/epoch", |m| m.fake_ack_sent_bytes, "bytes"),
    ("encode/page", EpochMeans::encode_ns_per_page, "ns"),
];
/// The output hold and its steps, for workloads with network output.
const HOLD: &[Figure] = &[
    ("output hold", |m| m.hold_us / 1e3, "ms"),
    ("hold: waiting for the trigger", |m| m.wait_us / 1e3, "ms"),
    ("hold: stopping the VM", |m| m.stop_us / 1e3, "ms"),
    ("hold: resume to ack", |m| m.ack_us / 1e3, "ms"),
    ("hold: release", |m| m.release_us / 1e3, "ms"),
];
/// What `--disk-io` adds: a pause waits for the device threads in
/// `stop_us`, before `pause_us` counts.
const DISK_FIGURES: &[Figure] = &[
    ("pause p99", |m| m.pause_p99_us, "us"),
    ("stop", |m| m.stop_us, "us"),
    ("stop p99", |m| m.stop_p99_us, "us"),
    ("disk requests in flight/checkpoint", |m| m.disk_pending, "requests"),
];

/// The rows of one replicated run: its throughput figures against the
/// unreplicated ones, then its per-epoch figures (with the output hold if
/// the workload has network output).
fn rows_of(group: &str, workload: &str, e: u64, figures: &[(String, f64, &'static str, f64)], m: &EpochMeans, output: bool) -> Vec<Row> {
    let case = format!("{workload}, epoch {e} ms");
    let mut rows: Vec<Row> = figures
        .iter()
        .map(|(f, v, unit, r)| Row { group: group.to_owned(), case: format!("{case}: {f}"), value: *v, unit, reference: Some(*r) })
        .collect();
    let hold = if output { HOLD } else { &[] };
    for part in [PAUSE, &COPY_FIGURES, COSTS, hold] {
        rows.extend(runs::figure_rows(group, &case, m, part));
    }
    rows
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let epochs = opts.epochs.clone().unwrap_or(vec![DEFAULT_EPOCH_MS]);
    let scratch = Scratch::new("bench-ablation")?;
    let scratch = scratch.path();
    let mut rows = Vec::new();
    let settings = switches::selected(opts.switches.as_deref());
    let disk_io = switches::wanted(opts.switches.as_deref(), "disk-io=");

    let (workload, load) = MEMTOUCH;
    let cmdline = format!("{load} duration={}s", opts.seconds);
    if !settings.is_empty() {
        let (base, _) = runs::memtouch(&cmdline, None, scratch)?;
        for (setting, args) in &settings {
            for &e in &epochs {
                let (rate, m) = runs::memtouch(&cmdline, Some(Replicated { epoch_ms: e, args }), scratch)?;
                rows.extend(rows_of(setting, workload, e, &[("writes/s".into(), rate, "writes/s", base)], &m.unwrap_or_default(), false));
            }
        }
    }

    if !opts.no_network && disk_io {
        rows.extend(disk_io_rows(&epochs, scratch)?);
    }
    if !opts.no_network && !settings.is_empty() {
        let topo = Topology::new("abl")?;
        let metrics = scratch.join("kv.jsonl");
        for value in KV_VALUES {
            // The unreplicated VM serves some 20 times faster: ten times the
            // requests keep its run from being over in a few tens of ms.
            let base = {
                let _vm = runs::start_kv(&topo, None, scratch, "kv", &metrics)?;
                runs::redis_benchmark(&topo, opts.pipeline, opts.requests * 10, value)?
            };
            for (setting, args) in &settings {
                for &e in &epochs {
                    let ft = {
                        let _vm = runs::start_kv(&topo, Some(Replicated { epoch_ms: e, args }), scratch, "kv", &metrics)?;
                        runs::redis_benchmark(&topo, opts.pipeline, opts.requests, value)?
                    };
                    let m = runs::epoch_means(&metrics);
                    let workload = format!("kv -P {} -d {value}", opts.pipeline);
                    let mut figures = Vec::new();
                    for (b, r) in ft.iter().zip(&base) {
                        figures.push((format!("{} requests/s", b.test), b.rps, "req/s", r.rps));
                        figures.push((format!("{} p50", b.test), b.p50_ms, "ms", r.p50_ms));
                        figures.push((format!("{} p99", b.test), b.p99_ms, "ms", r.p99_ms));
                    }
                    rows.extend(rows_of(setting, &workload, e, &figures, &m, true));
                }
            }
        }
    }

    rows.extend(diff_kernels());

    println!("each switch value against the unreplicated VM of the same run (reference; ratio = value / reference)\n");
    let bars = rows
        .iter()
        .filter(|r| r.unit == "writes/s" || r.unit == "req/s")
        .filter_map(|r| r.ratio().map(|ratio| (format!("{}: {}", r.group, r.case), ratio)))
        .collect();
    report::publish(
        out,
        "ablation",
        &rows,
        &report::BarChart {
            title: "ablation: throughput under FT relative to the unreplicated VM, per switch value",
            category: "switch=value: workload, epoch length, figure",
            quantity: "throughput / unreplicated throughput (ratio)",
            bars,
            reference: Some(1.0),
        },
    )?;
    Ok(())
}

/// `--disk-io`, each value against the unreplicated VM on the same slow disk.
fn disk_io_rows(epochs: &[u64], scratch: &Path) -> Result<Vec<Row>, BoxError> {
    let topo = Topology::new("abld")?;
    let metrics = scratch.join("kvdisk.jsonl");
    let mut rows = Vec::new();
    for (slow_ms, requests) in DISK_RUNS {
        rows.extend(disk_io_workload(&topo, epochs, scratch, &metrics, slow_ms, requests)?);
    }
    Ok(rows)
}

/// `disk_io_rows` for one workload: writes `slow_ms` slower, `requests` per run.
fn disk_io_workload(
    topo: &Topology,
    epochs: &[u64],
    scratch: &Path,
    metrics: &Path,
    slow_ms: u64,
    requests: u64,
) -> Result<Vec<Row>, BoxError> {
    let fault = format!("slow-disk:{slow_ms}");
    let disk = runs::KvDisk { fault: &fault };
    let base = {
        let _vm = runs::start_kv_on(topo, None, scratch, "kvdisk", metrics, Some(&disk))?;
        runs::redis_benchmark(topo, KV_PIPELINE, requests, DISK_VALUE)?
    };
    let workload = format!("kv aof, writes +{slow_ms} ms, -P {KV_PIPELINE} -d {DISK_VALUE}");
    let mut rows = Vec::new();
    for (value, args) in DISK_IO.values {
        for &e in epochs {
            let ft = {
                let _vm = runs::start_kv_on(topo, Some(Replicated { epoch_ms: e, args }), scratch, "kvdisk", metrics, Some(&disk))?;
                runs::redis_benchmark(topo, KV_PIPELINE, requests, DISK_VALUE)?
            };
            let m = runs::epoch_means(metrics);
            let mut figures = Vec::new();
            for (b, r) in ft.iter().zip(&base) {
                figures.push((format!("{} requests/s", b.test), b.rps, "req/s", r.rps));
                figures.push((format!("{} p99", b.test), b.p99_ms, "ms", r.p99_ms));
            }
            let group = format!("{}={value}", DISK_IO.name);
            rows.extend(rows_of(&group, &workload, e, &figures, &m, true));
            rows.extend(runs::figure_rows(&group, &format!("{workload}, epoch {e} ms"), &m, DISK_FIGURES));
        }
    }
    Ok(rows)
}

/// The diff encoder's block compare per page, for every kernel this CPU
/// runs, against the scalar one: on 64 pages that stay in cache (the
/// compute) and on a 64 MiB pool (mostly out of cache, as in a checkpoint),
/// each page with two bytes changed; the best of three passes.
fn diff_kernels() -> Vec<Row> {
    use ftvm_replication::pipeline::encode::xor::Kernel;
    use ftvm_vmm::memory::PAGE;
    let mut rows = Vec::new();
    for (what, pages, passes) in [("in cache", 64, 2000), ("64 MiB of pages", 16384, 1)] {
        let old: Vec<[u8; PAGE]> = (0..pages).map(|i| [i as u8; PAGE]).collect();
        let mut new = old.clone();
        for (i, p) in new.iter_mut().enumerate() {
            p[(i * 61) % PAGE] ^= 1;
            p[(i * 997) % PAGE] ^= 2;
        }
        let mut out = Box::new([0u8; PAGE]);
        let mut timed = |k: Kernel| {
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t0 = std::time::Instant::now();
                let mut blocks = 0u64;
                for _ in 0..passes {
                    for (o, n) in old.iter().zip(&new) {
                        blocks += u64::from(k.diff(o, n, &mut out).count_ones());
                    }
                }
                assert!(blocks >= (pages * passes) as u64, "every page changed");
                best = best.min(t0.elapsed().as_nanos() as f64 / (pages * passes) as f64);
            }
            best
        };
        let scalar = timed(Kernel::SCALAR);
        for k in Kernel::available() {
            let value = timed(k);
            rows.push(Row {
                group: "diff kernel".into(),
                case: format!("{}: block compare, {what}", k.name()),
                value,
                unit: "ns/page",
                reference: Some(scalar),
            });
        }
    }
    rows
}
