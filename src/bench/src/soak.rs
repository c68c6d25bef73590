//! `ftvm-bench soak`: many randomized failovers under tracked writers, as a
//! command rather than a test (it runs for as long as it is asked to).
//!
//! It runs `ftvm demo --soak`: every round the four failures (the primary's
//! VMM killed, its host dies, it stalls, the replication link is cut) in a
//! random order, each after a random 1 s to `--seconds` of load, each with a
//! fresh primary and backup, an etcd arbiter and an authenticated channel;
//! after each, every write whose `+OK` a client got is read back from the
//! new primary. Then per kind of failure: trials, acknowledged and lost
//! writes, old primaries that lived on and were not fenced, and the first
//! reply from the new primary (median and worst). It fails if any write
//! was lost or any old primary not fenced.

use std::path::Path;
use std::process::Command;

use crate::paths;
use crate::report::{self, BarChart, Row};

#[derive(clap::Args)]
pub struct Options {
    /// Rounds; each runs the four kinds of failure once, in a random order.
    #[arg(long, default_value_t = 50)]
    trials: u32,
    /// Longest load before a failure, in seconds (each is random from 1 s up).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Random seed of the plan (default: a fresh one, printed by the demo).
    #[arg(long)]
    seed: Option<u64>,
}

type BoxError = Box<dyn std::error::Error>;

/// One failure as the demo reported it (`--results`).
#[derive(serde::Deserialize)]
struct Trial {
    scenario: String,
    first_reply_ms: Option<f64>,
    acknowledged: u64,
    lost: u64,
    fenced: bool,
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let results = out.join("soak.jsonl");
    let _ = std::fs::remove_file(&results);
    let mut demo = Command::new(paths::sibling_binary("ftvm"));
    demo.args(["demo", "--soak", "--trials", &opts.trials.to_string(), "--seconds", &opts.seconds.to_string(), "--results"]).arg(&results);
    if let Some(seed) = opts.seed {
        demo.args(["--seed", &seed.to_string()]);
    }
    // The story goes to the terminal as it happens; the figures come from --results.
    let status = demo.status()?;
    let text = std::fs::read_to_string(&results).unwrap_or_default();
    let trials: Vec<Trial> = text.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    if trials.is_empty() {
        return Err(format!("the demo ran no failure ({status})").into());
    }
    let rows = summarize(&trials);
    println!();
    let chart = BarChart {
        title: "soak: first reply from the new primary (worst)",
        category: "kind of failure",
        quantity: "ms after the failure",
        bars: rows.iter().filter(|r| r.case == "first reply (worst)").map(|r| (r.group.clone(), r.value)).collect(),
        reference: None,
    };
    report::publish(out, "soak", &rows, &chart)?;
    let (lost, unfenced): (u64, usize) = (trials.iter().map(|t| t.lost).sum(), trials.iter().filter(|t| !t.fenced).count());
    if !status.success() || lost > 0 || unfenced > 0 {
        return Err(
            format!("{} failures: {lost} acknowledged writes lost, {unfenced} old primaries not fenced ({status})", trials.len()).into()
        );
    }
    println!(
        "{} failures, {} acknowledged writes, none lost, every old primary that lived on fenced",
        trials.len(),
        trials.iter().map(|t| t.acknowledged).sum::<u64>()
    );
    Ok(())
}

/// Per kind of failure, in the order first seen.
fn summarize(trials: &[Trial]) -> Vec<Row> {
    let mut kinds: Vec<&str> = Vec::new();
    for t in trials {
        if !kinds.contains(&t.scenario.as_str()) {
            kinds.push(&t.scenario);
        }
    }
    let mut rows = Vec::new();
    for kind in kinds {
        let of_kind: Vec<&Trial> = trials.iter().filter(|t| t.scenario == kind).collect();
        let mut first: Vec<f64> = of_kind.iter().map(|t| t.first_reply_ms.unwrap_or(f64::INFINITY)).collect();
        first.sort_by(f64::total_cmp);
        let row = |case: &str, value: f64, unit| Row { group: kind.to_owned(), case: case.into(), value, unit, reference: None };
        rows.push(row("trials", of_kind.len() as f64, "failures"));
        rows.push(row("acknowledged writes", of_kind.iter().map(|t| t.acknowledged as f64).sum(), "writes"));
        rows.push(row("lost writes", of_kind.iter().map(|t| t.lost as f64).sum(), "writes"));
        rows.push(row("not fenced", of_kind.iter().filter(|t| !t.fenced).count() as f64, "primaries"));
        rows.push(row("first reply (median)", first[first.len() / 2], "ms"));
        rows.push(row("first reply (worst)", first[first.len() - 1], "ms"));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trials_are_summarized_per_kind() {
        let t = |scenario: &str, ms, lost, fenced| Trial {
            scenario: scenario.into(),
            first_reply_ms: Some(ms),
            acknowledged: 10,
            lost,
            fenced,
        };
        let rows = summarize(&[t("kill", 20.0, 0, true), t("stall", 40.0, 0, false), t("kill", 30.0, 1, true), t("kill", 25.0, 0, true)]);
        let get = |g: &str, c: &str| rows.iter().find(|r| r.group == g && r.case == c).unwrap().value;
        assert_eq!(get("kill", "trials"), 3.0);
        assert_eq!(get("kill", "lost writes"), 1.0);
        assert_eq!(get("kill", "first reply (median)"), 25.0);
        assert_eq!(get("kill", "first reply (worst)"), 30.0);
        assert_eq!(get("stall", "not fenced"), 1.0);
        assert_eq!(get("stall", "acknowledged writes"), 10.0);
    }
}
