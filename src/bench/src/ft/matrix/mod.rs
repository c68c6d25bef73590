//! The ablation matrix (`ftvm-bench ft --ablation --matrix`): workloads
//! (memtouch over working sets, write patterns and vCPU counts; the kv
//! guest and redis-server under redis-benchmark; the bulk read) at each
//! epoch length, under ftvm's defaults and each selected switch value, in
//! interleaved rounds each with its own unreplicated run, so a setting's
//! ratio is taken against the VM measured minutes apart on the same host.
//! It ends with the verdict on the defaults: per case, the default against
//! the best fixed setting and against the static defaults.

mod cases;
mod rounds;

use std::path::Path;

use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::Topology;

use super::runs::{BoxError, Figure, Replicated, COPY_FIGURES};
use super::switches;
use super::Options;
use crate::report::{self, Table};
pub use cases::Kind;
use cases::{Place, Workload};
use rounds::{Samples, Spread, Verdict, DEFAULT, GOAL, POLICY, STATIC};

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
        "Run each workload of --cases (default memtouch): memtouch (writes of one qword, from every vCPU, unthrottled or --write-rate a second) for \
         each working set (--pages), pattern (--patterns: seq writes each page in turn, random any page, hotcold 90% of writes \
         into 10% of the pages) and vCPU count (--vcpus); kv and redis (the kv guest, redis-server on the Linux personality) \
         under redis-benchmark SET and GET, -c 50, -P {}, values of --values bytes, --requests a run times the pipeline \
         depth (ten times that unreplicated); bulk (GETs of a 4 MiB value from the kv guest, --bulk-reads a run). Each workload runs at every epoch \
         length (--epochs, default {EPOCHS_MS:?} ms) under ftvm's defaults (setting \"{DEFAULT}\": no switch given), under \
         each value of each switch (--switches, default all of {}) and each combination in the COMBINATIONS table, and \
         unreplicated; all of it --rounds times (default 3), the rounds interleaved (round 1 of every setting, then round \
         2, ...), each round with its own unreplicated run. A ratio is a setting's throughput over the unreplicated one of \
         the same round; tables give medians over the rounds and the ratio's range. Prints per case and setting: \
         throughput and its ratio (and redis-benchmark's p50 and p99), pause mean and p99, dirty pages, pages in the \
         stop-and-copy and prefetched ahead of it, bytes on the link, time from pause to acknowledgement, tracked first \
         writes, pages left writable and fake-dirty pages filtered per epoch (ablation-matrix.csv and .svg); then the \
         summary, one line per case: the unreplicated throughput, the default's ratio and range (its rounds pooled with those \
         of every measured setting that names what ftvm chooses anyway on this host, such as {POLICY} or predict-writes=adaptive: \
         the same runs under another name), {STATIC}'s (the defaults before the tuning policy; measured with --switches \
         tuning), the best fixed setting (any other measured setting) and its ratio, default / best, and a mark where the default is below {GOAL} x best or below \
         {STATIC} (ablation-matrix-summary.csv and .svg). memtouch runs last --seconds.",
        cases::PIPELINES.map(|p| p.to_string()).join(" and -P "),
        switches::names()
    )
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    if opts.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let epochs = opts.epochs.clone().unwrap_or(EPOCHS_MS.to_vec());
    let chosen = switches::selected(opts.switches.as_deref());
    if opts.switches.is_some() && chosen.is_empty() {
        return Err(format!("--switches names no switch (known: {})", switches::names()).into());
    }
    let settings: Vec<(String, &[&str])> = std::iter::once((DEFAULT.to_owned(), &[][..])).chain(chosen).collect();
    // Settings that name what ftvm chooses anyway are the default run again:
    // their rounds count as the default's (identical runs differ by up to a
    // fifth on a busy host; the best of several copies would otherwise pass
    // for a better fixed setting).
    let same: Vec<String> =
        settings.iter().filter(|(s, args)| s != DEFAULT && switches::is_default(s, args)).map(|(s, _)| s.clone()).collect();
    if !same.is_empty() {
        eprintln!("counted as the default (ftvm chooses the same on this host): {}", same.join(", "));
    }
    let workloads = Workload::selected(opts);
    if workloads.is_empty() || epochs.is_empty() {
        return Err("--cases, --epochs (and for the cases chosen --pages, --patterns, --vcpus, --values) need a value".into());
    }
    for w in &workloads {
        w.check_image()?;
    }
    let scratch = Scratch::new("bench-matrix")?;
    let topo = if workloads.iter().any(Workload::needs_network) { Some(Topology::new("abm")?) } else { None };
    let place = Place { topo: topo.as_ref(), scratch: scratch.path() };
    let mut samples = Samples::default();
    for w in &workloads {
        let name = w.name(opts);
        for round in 1..=opts.rounds {
            eprintln!("{name}: round {round}/{}", opts.rounds);
            let (base, _) = cases::measure(w, None, opts, &place)?;
            for (setting, args) in &settings {
                if w.needs_network() && args.windows(2).any(|a| a == ["--prefetch-by", "pull"]) {
                    // The backup runs in another network namespace, where
                    // the primary's abstract memory socket is out of reach.
                    if round == 1 {
                        eprintln!("{name}: {setting} not measured: --prefetch-by pull needs both sides in one network namespace");
                    }
                    continue;
                }
                for &e in &epochs {
                    let (figures, m) = cases::measure(w, Some(Replicated { epoch_ms: e, args }), opts, &place)?;
                    let case = format!("{name}, epoch {e} ms");
                    // An alias of the default is recorded under both names.
                    let recorded: &[&str] = if same.contains(setting) { &[setting, DEFAULT] } else { &[setting] };
                    let m = m.unwrap_or_default();
                    for &as_setting in recorded {
                        for (figure, value, unit) in &figures {
                            let reference = base.iter().find(|b| b.0 == *figure).map(|b| b.1);
                            samples.add(&case, as_setting, figure, unit, *value, reference);
                        }
                        for (figure, read, unit) in [PAUSES, &COPY_FIGURES, AFTER_COPY].concat() {
                            samples.add(&case, as_setting, figure, unit, read(&m), None);
                        }
                    }
                }
            }
        }
    }
    drop(topo);
    publish(out, &samples, opts.rounds, &same)
}

fn num(v: f64) -> String {
    format!("{v:.3}")
}

fn range(s: Spread) -> String {
    format!("{}-{}", num(s.min), num(s.max))
}

/// The per-figure table and its chart, then the summary and its chart.
fn publish(out: &Path, samples: &Samples, rounds: usize, same: &[String]) -> Result<(), BoxError> {
    println!(
        "each setting against the unreplicated VM of the same round (ratio = value / unreplicated), medians over {rounds} \
         round(s), the ratio's range across them\n"
    );
    let mut table = Table {
        columns: vec!["setting", "case", "figure", "value", "unit", "unreplicated", "ratio", "ratio min", "ratio max"],
        rows: Vec::new(),
    };
    for s in &samples.series {
        let (reference, ratio) = (s.reference(), s.ratio());
        table.rows.push(vec![
            s.setting.clone(),
            s.case.clone(),
            s.figure.clone(),
            num(s.value().median),
            s.unit.to_owned(),
            reference.map_or(String::new(), |r| num(r.median)),
            ratio.map_or(String::new(), |r| num(r.median)),
            ratio.map_or(String::new(), |r| num(r.min)),
            ratio.map_or(String::new(), |r| num(r.max)),
        ]);
    }
    let bars = samples
        .series
        .iter()
        .filter(|s| s.is_throughput())
        .filter_map(|s| s.ratio().map(|r| (format!("{}: {}: {}", s.setting, s.case, s.figure), r.median)))
        .collect();
    report::publish_table(
        out,
        "ablation-matrix",
        &table,
        &report::BarChart {
            title: "ablation matrix: throughput under FT relative to the unreplicated VM, per setting (medians)",
            category: "setting: workload, epoch length: figure",
            quantity: "throughput / unreplicated throughput (ratio)",
            bars,
            reference: Some(1.0),
        },
    )?;

    let verdicts = samples.summary(same);
    println!(
        "\nsummary: median ratios to the unreplicated VM; {DEFAULT} pools the rounds of the settings that name its own choices \
         ({}); best fixed = the highest of every other measured setting; marked where {DEFAULT} < {GOAL} x best or < {STATIC}\n",
        if same.is_empty() { "none measured".to_owned() } else { same.join(", ") }
    );
    let summary = summary_table(&verdicts);
    let bars: Vec<(String, f64)> =
        verdicts.iter().filter_map(|v| v.default_over_best().map(|r| (format!("{}: {}", v.case, v.figure), r))).collect();
    if bars.is_empty() {
        // Only the default (and its aliases) measured: nothing to chart.
        summary.print();
        let csv = out.join("ablation-matrix-summary.csv");
        summary.write_csv(&csv)?;
        println!("\nno setting other than the default measured: no summary chart; wrote {}", csv.display());
        return Ok(());
    }
    report::publish_table(
        out,
        "ablation-matrix-summary",
        &summary,
        &report::BarChart {
            title: "ablation matrix: ftvm's defaults against the best fixed setting (line: the goal)",
            category: "workload, epoch length: figure",
            quantity: "default's ratio / best fixed setting's ratio",
            bars,
            reference: Some(GOAL),
        },
    )?;
    Ok(())
}

/// One line per case: see `long_help`.
fn summary_table(verdicts: &[Verdict]) -> Table {
    let opt = |s: Option<Spread>| s.map_or(String::new(), |s| num(s.median));
    Table {
        columns: vec!["case", "unreplicated", "unit", DEFAULT, "default range", STATIC, "best fixed", "best", "default/best", "mark"],
        rows: verdicts
            .iter()
            .map(|v| {
                vec![
                    format!("{}: {}", v.case, v.figure),
                    num(v.reference),
                    v.unit.to_owned(),
                    opt(v.default),
                    v.default.map_or(String::new(), range),
                    opt(v.fixed_static),
                    v.best.as_ref().map_or(String::new(), |b| b.0.clone()),
                    opt(v.best.as_ref().map(|b| b.1)),
                    v.default_over_best().map_or(String::new(), num),
                    v.marks().join(", "),
                ]
            })
            .collect(),
    }
}
