//! The ablation matrix (`ftvm-bench ft --ablation --matrix`): memtouch over
//! working sets, write patterns, vCPU counts and epoch lengths, once
//! unreplicated and once per value of each switch, so a switch's effect is
//! a difference between ratios measured minutes apart on the same host.

use std::path::Path;

use ftvm_testkit::scratch::Scratch;

use super::runs::{self, BoxError, Replicated};
use super::switches;
use super::Options;
use crate::report::{self, Row};

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
                        let row = |figure: &str, value, unit, reference| Row {
                            group: setting.clone(),
                            case: format!("{workload}, epoch {e} ms: {figure}"),
                            value,
                            unit,
                            reference,
                        };
                        rows.push(row("writes/s", rate, "writes/s", Some(base)));
                        rows.push(row("pause mean", m.pause_us, "us", None));
                        rows.push(row("pause p99", m.pause_p99_us, "us", None));
                        rows.push(row("dirty pages/epoch", m.dirty_pages, "pages", None));
                        rows.push(row("stop-and-copy pages/epoch", m.commit_pages, "pages", None));
                        rows.push(row("prefetched pages/epoch", m.prefetched_pages, "pages", None));
                        rows.push(row("prefetch wasted/epoch", m.prefetch_wasted, "pages", None));
                        // Every byte of the epoch on the link, early or late.
                        rows.push(row("bytes/epoch", m.bytes, "bytes", None));
                        rows.push(row("pause to ack", m.pause_to_ack_us() / 1e3, "ms", None));
                        rows.push(row("first writes/epoch", m.first_writes, "pages", None));
                        rows.push(row("left writable/epoch", m.predicted, "pages", None));
                        rows.push(row("fake dirty filtered/epoch", m.fake_dirty, "pages", None));
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
