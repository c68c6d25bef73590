//! The epoch sweep: for each epoch length with periodic checkpoints, for
//! output-triggered checkpoints, and for the unreplicated VM in the same
//! run: memtouch at several dirty rates, kv under redis-benchmark (SET and
//! GET, -P 1 and -P 16, 50 connections; at the default epoch also with
//! `--fake-ack on`, the others with the default `bulk`), a bulk read (GET
//! of a 4 MiB value, repeated; at the default epoch also with `--fake-ack
//! on`, and output-triggered with the
//! proxy's state sent whole, `--fake-ack-state all`), per-epoch pause, dirty pages, bytes, epoch length and
//! output hold with its steps (trigger wait, stop, resume to ack, release),
//! and failover per kind of failure (`failover`).

use std::path::Path;

use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::Topology;

use super::failover;
use super::runs::{self, BoxError, EpochMeans, Figure, Replicated};
use super::Options;
use crate::report::{self, Row};

pub const DEFAULT_EPOCHS: [u64; 4] = [5, 10, 20, 50];
/// `--epoch-ms` of the output-triggered setting: ftvm's default.
const OUTPUT_MAX_EPOCH_MS: u64 = 20;

/// One replicated configuration: its name in the table, `--epoch-ms` and
/// the trigger arguments.
struct Setting {
    name: String,
    epoch_ms: u64,
    args: &'static [&'static str],
}

impl Setting {
    fn replicated(&self) -> Replicated<'_> {
        Replicated { epoch_ms: self.epoch_ms, args: self.args }
    }
}

/// Periodic checkpoints at each epoch length, then output-triggered ones.
fn settings(epochs: &[u64]) -> Vec<Setting> {
    let periodic = epochs.iter().map(|&e| Setting { name: format!("periodic {e} ms"), epoch_ms: e, args: &["--trigger", "periodic"] });
    let output =
        Setting { name: format!("output, max {OUTPUT_MAX_EPOCH_MS} ms"), epoch_ms: OUTPUT_MAX_EPOCH_MS, args: &["--trigger", "output"] };
    periodic.chain(std::iter::once(output)).collect()
}

/// The bulk read's row pair for `--fake-ack`: the output-triggered setting
/// and the periodic one at ftvm's default epoch (when swept) again, with
/// the proxy on (the rows without it are the settings themselves).
fn fake_ack_settings(settings: &[Setting]) -> Vec<Setting> {
    settings
        .iter()
        .filter(|s| s.epoch_ms == OUTPUT_MAX_EPOCH_MS)
        .map(|s| Setting {
            name: format!("{}, fake ACK", s.name),
            epoch_ms: s.epoch_ms,
            args: if s.args.contains(&"output") { FAKE_ACK_OUTPUT } else { FAKE_ACK_PERIODIC },
        })
        .collect()
}

const FAKE_ACK_OUTPUT: &[&str] = &["--trigger", "output", "--fake-ack", "on"];
const FAKE_ACK_PERIODIC: &[&str] = &["--trigger", "periodic", "--fake-ack", "on"];
const FAKE_ACK_OUTPUT_WHOLE: &[&str] = &["--trigger", "output", "--fake-ack", "on", "--fake-ack-state", "all"];

/// The bulk read's extra settings: `fake_ack_settings`, then the
/// output-triggered one with the proxy's state sent whole every checkpoint
/// (what `--fake-ack-state changed` saves).
fn bulk_settings(settings: &[Setting]) -> Vec<Setting> {
    let mut extra = fake_ack_settings(settings);
    if let Some(s) = extra.iter().find(|s| s.args == FAKE_ACK_OUTPUT) {
        extra.push(Setting { name: format!("{}, state whole", s.name), epoch_ms: s.epoch_ms, args: FAKE_ACK_OUTPUT_WHOLE });
    }
    extra
}

/// The per-epoch figures of every run.
const EPOCH: &[Figure] = &[
    ("epoch length", |m| m.epoch_us / 1e3, "ms"),
    ("pause", |m| m.pause_us, "us"),
    ("dirty pages/epoch", |m| m.dirty_pages, "pages"),
    ("bytes/epoch", |m| m.bytes, "bytes"),
];
/// The output hold and its steps, for workloads with network output: about
/// wait + stop + pause + ack, then the release.
const HOLD: &[Figure] = &[
    ("output hold", |m| m.hold_us / 1e3, "ms"),
    ("started by output", |m| m.output_share, "share"),
    ("hold: wait for the trigger", |m| m.wait_us, "us"),
    ("hold: stopping the VM", |m| m.stop_us, "us"),
    ("hold: resume to ack", |m| m.ack_us, "us"),
    ("hold: release after ack", |m| m.release_us, "us"),
];
/// What the fake-ACK proxy adds to a checkpoint.
const FAKE_ACK: &[Figure] = &[
    ("fake-acked bytes stored at a checkpoint", |m| m.fake_ack_bytes, "bytes"),
    ("fake-acked bytes carried by a checkpoint", |m| m.fake_ack_sent_bytes, "bytes"),
    ("state bytes/epoch", |m| m.state_bytes, "bytes"),
];

/// Per-epoch rows of one replicated run.
fn epoch_rows(group: &str, setting: &str, m: &EpochMeans, output: bool) -> Vec<Row> {
    let mut rows = runs::figure_rows(group, setting, m, EPOCH);
    if output {
        rows.extend(runs::figure_rows(group, setting, m, HOLD));
    }
    rows
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let epochs = opts.epochs.clone().unwrap_or(DEFAULT_EPOCHS.to_vec());
    let settings = settings(&epochs);
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
    for (name, cmdline) in loads.iter().filter(|_| !opts.bulk_only && !opts.kv_only) {
        let (base, _) = runs::memtouch(cmdline, None, scratch)?;
        for s in &settings {
            let (rate, m) = runs::memtouch(cmdline, Some(s.replicated()), scratch)?;
            let group = format!("memtouch {name}");
            rows.push(Row {
                group: group.clone(),
                case: format!("{}: writes/s", s.name),
                value: rate,
                unit: "writes/s",
                reference: Some(base),
            });
            rows.extend(epoch_rows(&group, &s.name, &m.unwrap_or_default(), false));
        }
    }
    if !opts.no_network {
        let topo = Topology::new("ftb")?;
        let metrics = scratch.join("kv.jsonl");
        for pipeline in [1, 16].into_iter().filter(|_| !opts.bulk_only) {
            let base = {
                let _vm = runs::start_kv(&topo, None, scratch, "kv", &metrics)?;
                runs::redis_benchmark(&topo, pipeline, opts.requests, 3)?
            };
            for s in settings.iter().chain(&fake_ack_settings(&settings)) {
                let ft = {
                    let _vm = runs::start_kv(&topo, Some(s.replicated()), scratch, "kv", &metrics)?;
                    runs::redis_benchmark(&topo, pipeline, opts.requests, 3)?
                };
                for (b, r) in ft.iter().zip(&base) {
                    let row = |case: &str, value, unit, reference| Row {
                        group: format!("kv {} -P {pipeline} -c 50", b.test),
                        case: format!("{}: {case}", s.name),
                        value,
                        unit,
                        reference: Some(reference),
                    };
                    rows.push(row("requests/s", b.rps, "req/s", r.rps));
                    rows.push(row("p50", b.p50_ms, "ms", r.p50_ms));
                    rows.push(row("p99", b.p99_ms, "ms", r.p99_ms));
                }
                rows.extend(epoch_rows(&format!("kv epochs -P {pipeline}"), &s.name, &runs::epoch_means(&metrics), true));
            }
        }
        if opts.kv_only {
            return publish(out, &rows);
        }
        let group = format!("kv bulk read GET {} MiB x{}", runs::BULK_BYTES >> 20, opts.bulk_reads);
        let base = {
            let _vm = runs::start_kv(&topo, None, scratch, "kv", &metrics)?;
            runs::bulk_read(&topo, opts.bulk_reads)?
        };
        for s in settings.iter().chain(&bulk_settings(&settings)) {
            let rate = {
                let _vm = runs::start_kv(&topo, Some(s.replicated()), scratch, "kv", &metrics)?;
                runs::bulk_read(&topo, opts.bulk_reads)?
            };
            rows.push(Row { group: group.clone(), case: format!("{}: read", s.name), value: rate, unit: "MB/s", reference: Some(base) });
            let means = runs::epoch_means(&metrics);
            rows.extend(epoch_rows(&group, &s.name, &means, true));
            if s.args.contains(&"--fake-ack") {
                rows.extend(runs::figure_rows(&group, &s.name, &means, FAKE_ACK));
            }
        }
        for &e in epochs.iter().filter(|_| !opts.bulk_only) {
            rows.extend(failover::measure(&topo, scratch, e, opts)?);
        }
    }
    publish(out, &rows)
}

fn publish(out: &Path, rows: &[Row]) -> Result<(), BoxError> {
    let bars = rows
        .iter()
        .filter(|r| matches!(r.unit, "writes/s" | "req/s" | "MB/s"))
        .filter_map(|r| r.ratio().map(|ratio| (format!("{} {}", r.group, r.case), ratio)))
        .collect();
    report::publish(
        out,
        "ft",
        rows,
        &report::BarChart {
            title: "throughput under FT relative to the unreplicated VM",
            category: "workload, trigger and epoch length",
            quantity: "throughput / unreplicated throughput (ratio)",
            bars,
            reference: Some(1.0),
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_is_periodic_and_output_comes_last() {
        let s = settings(&[5, 20]);
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].name.as_str(), s[0].epoch_ms, s[0].args), ("periodic 5 ms", 5, &["--trigger", "periodic"][..]));
        assert_eq!((s[1].name.as_str(), s[1].epoch_ms), ("periodic 20 ms", 20));
        assert_eq!((s[2].name.as_str(), s[2].epoch_ms, s[2].args), ("output, max 20 ms", 20, &["--trigger", "output"][..]));
    }

    #[test]
    fn fake_ack_pairs_the_settings_at_the_default_epoch() {
        let f = fake_ack_settings(&settings(&[5, 20]));
        assert_eq!(f.len(), 2);
        assert_eq!((f[0].name.as_str(), f[0].args), ("periodic 20 ms, fake ACK", FAKE_ACK_PERIODIC));
        assert_eq!((f[1].name.as_str(), f[1].args), ("output, max 20 ms, fake ACK", FAKE_ACK_OUTPUT));
        let b = bulk_settings(&settings(&[5, 20]));
        assert_eq!(b.len(), 3);
        assert_eq!((b[2].name.as_str(), b[2].args), ("output, max 20 ms, fake ACK, state whole", FAKE_ACK_OUTPUT_WHOLE));
    }
}
