//! The epoch sweep: for each epoch length, and for the unreplicated VM in
//! the same run, memtouch at several dirty rates, kv under redis-benchmark,
//! per-epoch pause, dirty pages and bytes, and failover time.

use std::path::Path;

use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::Topology;

use super::runs::{self, BoxError, Replicated};
use super::Options;
use crate::report::{self, Row};

pub const DEFAULT_EPOCHS: [u64; 4] = [5, 10, 20, 50];

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let epochs = opts.epochs.clone().unwrap_or(DEFAULT_EPOCHS.to_vec());
    let mut rows = Vec::new();
    let scratch = Scratch::new("bench-ft")?;
    let scratch = scratch.path();
    let secs = opts.seconds;
    // Dirty rates: writes per second into random pages of a 64 MiB set
    // (almost every write dirties a new page), and an unthrottled sweep.
    let loads = [
        ("1k pages/s", format!("ws=64M pattern=random rate=1000 duration={secs}s report=0")),
        ("10k pages/s", format!("ws=64M pattern=random rate=10000 duration={secs}s report=0")),
        ("50k pages/s", format!("ws=64M pattern=random rate=50000 duration={secs}s report=0")),
        ("unthrottled 4 MiB hot set", format!("ws=4M pattern=random duration={secs}s report=0")),
    ];
    for (name, cmdline) in &loads {
        let (base, _) = runs::memtouch(cmdline, None, scratch)?;
        for &e in &epochs {
            let (rate, m) = runs::memtouch(cmdline, Some(Replicated { epoch_ms: e, args: &[] }), scratch)?;
            let m = m.unwrap_or_default();
            let row = |case: &str, value, unit, reference| Row {
                group: format!("memtouch {name}"),
                case: format!("epoch {e} ms: {case}"),
                value,
                unit,
                reference,
            };
            rows.push(row("writes/s", rate, "writes/s", Some(base)));
            rows.push(row("pause", m.pause_us, "us", None));
            rows.push(row("dirty pages/epoch", m.dirty_pages, "pages", None));
            rows.push(row("bytes/epoch", m.bytes, "bytes", None));
        }
    }
    if !opts.no_network {
        let topo = Topology::new("ftb")?;
        let metrics = scratch.join("kv.jsonl");
        for pipeline in [1, 16] {
            let base = {
                let _vm = runs::start_kv(&topo, None, scratch, "kv", &metrics)?;
                runs::redis_benchmark(&topo, pipeline, opts.requests, 3)?
            };
            for &e in &epochs {
                let ft = {
                    let _vm = runs::start_kv(&topo, Some(Replicated { epoch_ms: e, args: &[] }), scratch, "kv", &metrics)?;
                    runs::redis_benchmark(&topo, pipeline, opts.requests, 3)?
                };
                let m = runs::epoch_means(&metrics);
                for (b, r) in ft.iter().zip(&base) {
                    let row = |case: &str, value, unit, reference| Row {
                        group: format!("kv {} -P {pipeline} -c 50", b.test),
                        case: format!("epoch {e} ms: {case}"),
                        value,
                        unit,
                        reference: Some(reference),
                    };
                    rows.push(row("requests/s", b.rps, "req/s", r.rps));
                    rows.push(row("p50", b.p50_ms, "ms", r.p50_ms));
                    rows.push(row("p99", b.p99_ms, "ms", r.p99_ms));
                }
                let row = |case: &str, value, unit| Row {
                    group: format!("kv epochs -P {pipeline}"),
                    case: format!("epoch {e} ms: {case}"),
                    value,
                    unit,
                    reference: None,
                };
                rows.push(row("pause", m.pause_us, "us"));
                rows.push(row("dirty pages/epoch", m.dirty_pages, "pages"));
                rows.push(row("bytes/epoch", m.bytes, "bytes"));
                rows.push(row("output hold", m.hold_us / 1e3, "ms"));
            }
        }
        for &e in &epochs {
            for cut in [false, true] {
                let mut times = Vec::new();
                for _ in 0..opts.failovers {
                    times.push(runs::failover(&topo, e, cut, scratch)?);
                }
                times.sort_by(f64::total_cmp);
                let how = if cut { "host cut (detected by timeout)" } else { "VMM killed (socket closed)" };
                rows.push(Row {
                    group: "failover".into(),
                    case: format!("epoch {e} ms, {how}: median"),
                    value: times[times.len() / 2],
                    unit: "ms",
                    reference: None,
                });
            }
        }
    }
    let bars = rows
        .iter()
        .filter(|r| r.unit == "writes/s" || r.unit == "req/s")
        .filter_map(|r| r.ratio().map(|ratio| (format!("{} {}", r.group, r.case), ratio)))
        .collect();
    report::publish(
        out,
        "ft",
        &rows,
        &report::BarChart {
            title: "throughput under FT relative to the unreplicated VM",
            category: "workload, epoch length",
            quantity: "throughput / unreplicated throughput (ratio)",
            bars,
            reference: Some(1.0),
        },
    )?;
    Ok(())
}
