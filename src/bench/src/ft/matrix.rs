//! The ablation matrix (`ftvm-bench ft --ablation --matrix`): memtouch over
//! working sets, write patterns, vCPU counts and epoch lengths, once
//! unreplicated and once per value of each switch, so a switch's effect is
//! a difference between ratios measured minutes apart on the same host.

use std::path::Path;

use ftvm_testkit::scratch::Scratch;

use super::runs::{self, BoxError, Figure, Replicated, COPY_FIGURES};
use super::switches;
use super::Options;
use crate::report::{self, Row};

/// The per-epoch figures of every case, around `COPY_FIGURES`.
const PAUSES: &[Figure] = &[("pause mean", |m| m.pause_us, "us"), ("pause p99", |m| m.pause_p99_us, "us")];
const AFTER_COPY: &[Figure] = &[
    // Every byte of the epoch on the link, early or late.
    ("bytes/epoch", |m| m.bytes, "bytes"),
    ("pause to ack", |m| m.pause_to_ack_us() / 1e3, "ms"),
    ("first writes/epoch", |m| m.first_writes, "pages"),
    ("left writable/epoch", |m| m.predicted, "pages"),
    ("fake dirty filtered/epoch", |m| m.fake_dirty, "pages"),
];

/// The epochs measured unless `--epochs` says otherwise.
const EPOCHS_MS: [u64; 2] = [20, 100];

pub fn long_help() -> String {
    format!(
        "Run memtouch (unthrottled writes, one qword a write, from every vCPU) for each working set (--pages), pattern \
         (--patterns: seq writes each page in turn, random any page, hotcold 90% of writes into 10% of the pages), vCPU \
         count (--vcpus) and epoch length (--epochs, default {EPOCHS_MS:?} ms): once unreplicated, then replicated once per \
         value of each switch (--switches, default all of {}) and per combination of them in the COMBINATIONS table. Prints per case: writes/s against the unreplicated run \
         (ratio), pause mean and p99, dirty pages, pages in the stop-and-copy and prefetched ahead of it, bytes on the link, time from pause \
         to acknowledgement, tracked first writes (dirty pages not left writable), pages left \
         writable and fake-dirty pages filtered per epoch; writes ablation-matrix.csv and .svg (the ratios). Each run \
         lasts --seconds.",
        switches::names()
    )
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let epochs = opts.epochs.clone().unwrap_or(EPOCHS_MS.to_vec());
    let settings = switches::selected(opts.switches.as_deref());
    if settings.is_empty() {
        return Err(format!("--switches names no switch (known: {})", switches::names()).into());
    }
    let scratch = Scratch::new("bench-matrix")?;
    let scratch = scratch.path();
    let mut rows = Vec::new();
    for &pages in &opts.pages {
        for pattern in &opts.patterns {
            for &vcpus in &opts.vcpus {
                let cmdline = format!("ws={}K pattern={pattern} duration={}s report=0", pages * 4, opts.seconds);
                let (base, _) = runs::memtouch_on(vcpus, &cmdline, None, scratch)?;
                let workload = format!("{pages} pages {pattern}, {vcpus} vCPU");
                for (setting, args) in &settings {
                    for &e in &epochs {
                        let (rate, m) = runs::memtouch_on(vcpus, &cmdline, Some(Replicated { epoch_ms: e, args }), scratch)?;
                        let m = m.unwrap_or_default();
                        let case = format!("{workload}, epoch {e} ms");
                        rows.push(Row {
                            group: setting.clone(),
                            case: format!("{case}: writes/s"),
                            value: rate,
                            unit: "writes/s",
                            reference: Some(base),
                        });
                        for part in [PAUSES, &COPY_FIGURES, AFTER_COPY] {
                            rows.extend(runs::figure_rows(setting, &case, &m, part));
                        }
                    }
                }
            }
        }
    }
    println!("each switch value against the unreplicated VM of the same run (reference; ratio = value / reference)\n");
    let bars = rows
        .iter()
        .filter(|r| r.unit == "writes/s")
        .filter_map(|r| r.ratio().map(|ratio| (format!("{}: {}", r.group, r.case), ratio)))
        .collect();
    report::publish(
        out,
        "ablation-matrix",
        &rows,
        &report::BarChart {
            title: "ablation matrix: memtouch under FT relative to the unreplicated VM, per switch value",
            category: "switch=value: working set, pattern, vCPUs, epoch length",
            quantity: "writes/s / unreplicated writes/s (ratio)",
            bars,
            reference: Some(1.0),
        },
    )?;
    Ok(())
}
