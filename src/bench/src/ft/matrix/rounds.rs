//! The matrix's arithmetic, apart from any VM: every round's figures kept
//! side by side, ratios taken within a round (a setting against the
//! unreplicated VM measured in the same round, so drift on the host
//! reaches both), then medians and spreads across rounds, and per case
//! the verdict on ftvm's defaults against the best fixed setting.

use std::collections::HashMap;

/// The setting that gives `ftvm run` no switch: whatever ftvm chooses.
pub const DEFAULT: &str = "default";
/// The policy asked for by name: not a fixed setting (it is what the
/// default chooses), so never the "best fixed" one.
pub const POLICY: &str = "tuning=auto";
/// The defaults before the policy (Remus with sub-page diffs): no case
/// may do worse with today's default.
pub const STATIC: &str = "tuning=static";
/// The default must reach this share of the best fixed setting's ratio.
pub const GOAL: f64 = 0.95;

/// Median, least and greatest of some values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (none without values); an even count has the
    /// mean of its two middle values as median.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut v: Vec<f64> = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => return None,
            _ if n % 2 == 1 => v[n / 2],
            _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Some(Spread { median, min: v[0], max: v[n - 1] })
    }
}

/// One figure of one setting in one case, round by round.
pub struct Series {
    /// Workload and epoch length, e.g. "4096 pages seq, 1 vCPU, epoch 20 ms".
    pub case: String,
    pub setting: String,
    /// e.g. "writes/s", "GET requests/s", "pause mean".
    pub figure: String,
    pub unit: &'static str,
    /// Per round: the value, and the unreplicated VM's in the same round
    /// (none for per-epoch figures, which have no counterpart there).
    pub rounds: Vec<(f64, Option<f64>)>,
}

impl Series {
    pub fn value(&self) -> Spread {
        Spread::of(&self.rounds.iter().map(|r| r.0).collect::<Vec<_>>()).expect("a series has a round")
    }

    pub fn reference(&self) -> Option<Spread> {
        Spread::of(&self.rounds.iter().filter_map(|r| r.1).collect::<Vec<_>>())
    }

    /// Value over reference, round by round (rounds whose reference is 0
    /// left out).
    pub fn ratio(&self) -> Option<Spread> {
        Spread::of(&self.rounds.iter().filter_map(|&(v, r)| r.filter(|r| *r > 0.0).map(|r| v / r)).collect::<Vec<_>>())
    }

    /// Whether this is a throughput, the figure the verdict compares.
    pub fn is_throughput(&self) -> bool {
        matches!(self.unit, "writes/s" | "req/s" | "MB/s")
    }
}

/// Every series of a matrix run, in the order first measured.
#[derive(Default)]
pub struct Samples {
    pub series: Vec<Series>,
    index: HashMap<(String, String, String), usize>,
}

impl Samples {
    /// One round's `value` (and `reference`) of `figure` of `setting` in `case`.
    pub fn add(&mut self, case: &str, setting: &str, figure: &str, unit: &'static str, value: f64, reference: Option<f64>) {
        let key = (case.to_owned(), setting.to_owned(), figure.to_owned());
        let at = *self.index.entry(key).or_insert_with(|| {
            self.series.push(Series {
                case: case.to_owned(),
                setting: setting.to_owned(),
                figure: figure.to_owned(),
                unit,
                rounds: Vec::new(),
            });
            self.series.len() - 1
        });
        self.series[at].rounds.push((value, reference));
    }

    /// Per case and throughput figure: the default against the best fixed
    /// setting and the static defaults. The settings in `same` are the
    /// default under another name (their runs were counted as the
    /// default's too): never the best fixed one.
    pub fn summary(&self, same: &[String]) -> Vec<Verdict> {
        let mut out: Vec<Verdict> = Vec::new();
        for s in self.series.iter().filter(|s| s.is_throughput()) {
            let Some(ratio) = s.ratio() else { continue };
            let at = match out.iter().position(|v| v.case == s.case && v.figure == s.figure) {
                Some(at) => at,
                None => {
                    out.push(Verdict {
                        case: s.case.clone(),
                        figure: s.figure.clone(),
                        unit: s.unit,
                        reference: f64::NAN,
                        default: None,
                        fixed_static: None,
                        best: None,
                    });
                    out.len() - 1
                }
            };
            let v = &mut out[at];
            match s.setting.as_str() {
                DEFAULT => {
                    v.default = Some(ratio);
                    // The default is measured in every case: its rounds'
                    // references are the case's.
                    v.reference = s.reference().map_or(f64::NAN, |r| r.median);
                }
                POLICY => continue,
                setting if same.iter().any(|s| s == setting) => continue,
                setting => {
                    if setting == STATIC {
                        v.fixed_static = Some(ratio);
                    }
                    if v.best.as_ref().is_none_or(|(_, b)| ratio.median > b.median) {
                        v.best = Some((setting.to_owned(), ratio));
                    }
                }
            }
        }
        out
    }
}

/// One case's line of the summary: median ratios to the unreplicated VM.
#[derive(Debug)]
pub struct Verdict {
    pub case: String,
    pub figure: String,
    pub unit: &'static str,
    /// The unreplicated VM's median throughput.
    pub reference: f64,
    pub default: Option<Spread>,
    /// `tuning=static`, when measured.
    pub fixed_static: Option<Spread>,
    /// The fixed setting with the highest median ratio, and its spread.
    pub best: Option<(String, Spread)>,
}

impl Verdict {
    /// The default's median ratio over the best fixed setting's.
    pub fn default_over_best(&self) -> Option<f64> {
        let (d, (_, b)) = (self.default?, self.best.as_ref()?);
        (b.median > 0.0).then(|| d.median / b.median)
    }

    /// Where the default misses: below `GOAL` of the best fixed setting,
    /// below the static defaults; empty when it misses neither.
    pub fn marks(&self) -> Vec<String> {
        let mut marks = Vec::new();
        if self.default_over_best().is_some_and(|r| r < GOAL) {
            marks.push(format!("< {GOAL} x best"));
        }
        if let (Some(d), Some(s)) = (self.default, self.fixed_static) {
            if d.median < s.median {
                marks.push("< static".to_owned());
            }
        }
        marks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_the_median_and_range_of_the_rounds() {
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(Spread::of(&[0.5]), Some(Spread { median: 0.5, min: 0.5, max: 0.5 }));
        assert_eq!(Spread::of(&[0.9, 0.2, 0.5]), Some(Spread { median: 0.5, min: 0.2, max: 0.9 }));
        assert_eq!(Spread::of(&[0.4, 0.2, 0.8, 0.6]), Some(Spread { median: 0.5, min: 0.2, max: 0.8 }));
    }

    #[test]
    fn ratios_are_taken_within_each_round() {
        let mut s = Samples::default();
        // Round 2's host was twice as slow for both: its ratio is the same.
        s.add("c", "x=1", "writes/s", "writes/s", 50.0, Some(100.0));
        s.add("c", "x=1", "writes/s", "writes/s", 25.0, Some(50.0));
        s.add("c", "x=1", "writes/s", "writes/s", 90.0, Some(100.0));
        let series = &s.series[0];
        assert_eq!(series.ratio(), Some(Spread { median: 0.5, min: 0.5, max: 0.9 }));
        assert_eq!(series.value().median, 50.0);
        assert_eq!(series.reference().map(|r| r.median), Some(100.0));
        // A per-epoch figure has no ratio.
        s.add("c", "x=1", "pause mean", "us", 900.0, None);
        assert_eq!(s.series.len(), 2);
        assert_eq!(s.series[1].ratio(), None);
    }

    /// `rounds` of one setting's (value, reference) in case "c".
    fn add(s: &mut Samples, setting: &str, rounds: &[(f64, f64)]) {
        for &(v, r) in rounds {
            s.add("c", setting, "writes/s", "writes/s", v, Some(r));
        }
    }

    #[test]
    fn the_best_fixed_setting_is_the_highest_median_other_than_the_default_the_policy_and_their_aliases() {
        let mut s = Samples::default();
        add(&mut s, DEFAULT, &[(99.0, 100.0), (98.0, 100.0), (97.0, 100.0)]);
        add(&mut s, POLICY, &[(100.0, 100.0); 3]);
        add(&mut s, "a=1", &[(90.0, 100.0), (10.0, 100.0), (95.0, 100.0)]);
        // Higher median, lower maximum: the median decides.
        add(&mut s, "b=1", &[(92.0, 100.0), (91.0, 100.0), (93.0, 100.0)]);
        s.add("c", "b=1", "pause mean", "us", 1.0, None);
        add(&mut s, "d=1", &[(100.0, 100.0); 3]);
        let v = s.summary(&["d=1".to_owned()]);
        assert_eq!(v.len(), 1, "one verdict per case and throughput figure");
        let (name, best) = v[0].best.clone().unwrap();
        assert_eq!(name, "b=1");
        assert!((best.median - 0.92).abs() < 1e-9);
        assert!((v[0].default.unwrap().median - 0.98).abs() < 1e-9);
        assert_eq!(v[0].reference, 100.0);
        assert_eq!(v[0].fixed_static, None);
        assert!((v[0].default_over_best().unwrap() - 0.98 / 0.92).abs() < 1e-9);
        assert!(v[0].marks().is_empty());
    }

    #[test]
    fn marks_say_where_the_default_misses() {
        let verdict = |default: f64, fixed_static: Option<f64>, best: f64| {
            let s = |m| Spread { median: m, min: m, max: m };
            Verdict {
                case: "c".into(),
                figure: "writes/s".into(),
                unit: "writes/s",
                reference: 1.0,
                default: Some(s(default)),
                fixed_static: fixed_static.map(s),
                best: Some(("a=1".into(), s(best))),
            }
        };
        assert!(verdict(0.95, Some(0.95), 1.0).marks().is_empty(), "0.95 of the best and equal to static pass");
        assert_eq!(verdict(0.94, None, 1.0).marks(), ["< 0.95 x best"]);
        assert_eq!(verdict(0.96, Some(0.97), 1.0).marks(), ["< static"]);
        assert_eq!(verdict(0.5, Some(0.6), 1.0).marks(), ["< 0.95 x best", "< static"]);
        // Nothing to compare with: no mark.
        let mut alone = verdict(0.1, None, 1.0);
        alone.best = None;
        assert!(alone.marks().is_empty());
    }

    #[test]
    fn static_is_a_fixed_setting_and_its_own_column() {
        let mut s = Samples::default();
        add(&mut s, DEFAULT, &[(60.0, 100.0)]);
        add(&mut s, STATIC, &[(70.0, 100.0)]);
        let v = &s.summary(&[])[0];
        assert_eq!(v.fixed_static.map(|s| s.median), Some(0.7));
        assert_eq!(v.best.as_ref().map(|b| b.0.as_str()), Some(STATIC));
        assert_eq!(v.marks(), ["< 0.95 x best", "< static"]);
    }
}
