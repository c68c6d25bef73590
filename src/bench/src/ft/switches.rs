//! The optimisation switches of `ftvm run` that the ablation and its
//! matrix measure, and which of them `--switches` selects: one table both
//! shapes read, so neither depends on the other.

/// An optimisation switch of `ftvm run`: its values, each with the
/// arguments it adds to the primary's `ftvm run`. A value may or may not
/// be ftvm's default (some defaults are chosen at run time): the matrix
/// measures the default apart, as the run given no switch.
pub struct Switch {
    pub name: &'static str,
    pub values: &'static [(&'static str, &'static [&'static str])],
}

/// A switch whose every value is only `--NAME VALUE`:
/// `plain!("diff": "off", "xor")`.
macro_rules! plain {
    ($name:literal: $($value:literal),+) => {
        Switch { name: $name, values: &[$(($value, &[concat!("--", $name), $value])),+] }
    };
}

/// Every switch the ablation measures: one line per switch.
pub const SWITCHES: &[Switch] = &[
    // The policy choosing the mechanisms as the guest runs, or the
    // defaults from before it (Remus with sub-page diffs).
    plain!("tuning": "auto", "static"),
    plain!("dirty-backend": "bitmap", "ring"),
    plain!("mirror": "on", "per-frame", "off"),
    plain!("trigger": "output", "periodic"),
    plain!("pipeline-depth": "2", "1", "4"),
    plain!("capture": "pause", "cow"),
    plain!("predict-writes": "off", "histase", "adaptive"),
    plain!("diff": "off", "xor", "lz4", "auto"),
    plain!("device-state": "all", "changed"),
    Switch {
        name: "prefetch",
        values: &[
            ("off", &["--prefetch", "off"]),
            ("on", &["--prefetch", "on"]),
            ("adaptive", &["--prefetch", "adaptive"]),
            // The backup reads the pages itself (`--prefetch-by pull`).
            ("pull", &["--prefetch", "on", "--prefetch-by", "pull"]),
        ],
    },
    plain!("fake-ack": "off", "on", "bulk"),
    // Only with the proxy on (its state is what this switch sends).
    Switch {
        name: "fake-ack-state",
        values: &[
            ("changed", &["--fake-ack", "on", "--fake-ack-state", "changed"]),
            ("all", &["--fake-ack", "on", "--fake-ack-state", "all"]),
        ],
    },
    plain!("idle-pause": "park", "kick"),
    plain!("vcpu-state-reads": "changing", "all"),
    plain!("used-notify": "asked", "always"),
    plain!("group-commit": "on", "off"),
    plain!("priority": "normal", "realtime"),
    plain!("net-offload": "csum", "off"),
];

/// `ftvm run`'s own values of the switches it does not leave to the tuning
/// policy (its `--help` gives each as `[default: ...]`); written by hand
/// like the table, and checked against it below.
const FIXED_DEFAULTS: &[(&str, &str)] = &[
    ("tuning", "auto"),
    ("dirty-backend", "bitmap"),
    ("mirror", "on"),
    ("trigger", "output"),
    ("device-state", "changed"),
    ("fake-ack-state", "changed"),
    ("idle-pause", "park"),
    ("vcpu-state-reads", "changing"),
    ("used-notify", "asked"),
    ("group-commit", "on"),
    ("priority", "normal"),
    ("net-offload", "csum"),
];

/// ftvm's value of switch `name` when `ftvm run` is given none, on this
/// host: fixed, or the tuning policy's choice (capture weighs the costs
/// measured here, once per process).
pub fn default_value(name: &str) -> Option<String> {
    use ftvm_replication::pipeline::policy::{self, Tuning};
    let auto = Tuning::Auto;
    Some(match name {
        "predict-writes" => policy::predict_writes(auto, None, false).to_string(),
        "prefetch" => policy::prefetch(auto, None).to_string(),
        "diff" => policy::diff(auto, None).to_string(),
        "fake-ack" => policy::fake_ack(auto, None).to_string(),
        "capture" => policy::capture(auto, None, &policy::costs(auto, policy::diff(auto, None))).to_string(),
        "pipeline-depth" => ftvm_primary_backup::DEFAULT_PIPELINE_DEPTH.to_string(),
        other => FIXED_DEFAULTS.iter().find(|(n, _)| *n == other)?.1.to_owned(),
    })
}

/// Whether `setting` (with its `args`) is what ftvm runs given no switch:
/// each `name=value` of it is that switch's default, and its arguments are
/// only those values (`fake-ack-state=changed` also turns the proxy on,
/// `prefetch=pull` names how pages travel: neither is the default). The
/// matrix counts such a setting's runs as the default's.
pub fn is_default(setting: &str, args: &[&str]) -> bool {
    let parts: Vec<&str> = setting.split(' ').collect();
    args.len() == 2 * parts.len()
        && parts.iter().all(|part| part.split_once('=').is_some_and(|(name, value)| default_value(name).is_some_and(|d| d == value)))
}

/// The switch that needs a disk: the ablation measures it on its own
/// workload, a kv guest logging to its disk.
pub const DISK_IO: Switch = plain!("disk-io": "async", "sync");

/// Switch values measured together too (each is also measured alone above).
pub const COMBINATIONS: &[(&str, &[&str])] = &[
    ("capture=cow predict-writes=adaptive", &["--capture", "cow", "--predict-writes", "adaptive"]),
    ("predict-writes=adaptive diff=lz4", &["--predict-writes", "adaptive", "--diff", "lz4"]),
    (
        "capture=cow predict-writes=adaptive diff=lz4 device-state=changed",
        &["--capture", "cow", "--predict-writes", "adaptive", "--diff", "lz4", "--device-state", "changed"],
    ),
];

/// Every (switch, value, arguments) to measure, in table order.
pub fn settings() -> impl Iterator<Item = (String, &'static [&'static str])> {
    SWITCHES
        .iter()
        .flat_map(|s| s.values.iter().map(move |(value, args)| (format!("{}={value}", s.name), *args)))
        .chain(COMBINATIONS.iter().map(|(name, args)| (name.to_string(), *args)))
}

/// Whether `--switches` (`only`) selects `setting` ("name=value", or a
/// combination of them separated by spaces, which counts as each switch it
/// sets): an entry names a switch (all its values) or one value of it
/// (`prefetch=off`); no `--switches` selects everything.
pub fn wanted(only: Option<&[String]>, setting: &str) -> bool {
    only.is_none_or(|only| only.iter().any(|s| setting.split(' ').any(|part| part == s || part.starts_with(&format!("{s}=")))))
}

/// `settings()` as `--switches` selects them.
pub fn selected(only: Option<&[String]>) -> Vec<(String, &'static [&'static str])> {
    settings().filter(|(s, _)| wanted(only, s)).collect()
}

/// The names in `SWITCHES`, for messages and `--help`.
pub fn names() -> String {
    SWITCHES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_switch_value_is_one_setting_with_its_arguments() {
        let all: Vec<(String, &[&str])> = settings().collect();
        assert_eq!(all.len(), SWITCHES.iter().map(|s| s.values.len()).sum::<usize>() + COMBINATIONS.len());
        assert_eq!(all[0], ("tuning=auto".to_owned(), &["--tuning", "auto"][..]));
        assert!(all.iter().any(|(s, a)| s == "dirty-backend=ring" && a == &["--dirty-backend", "ring"]));
        for s in SWITCHES {
            assert!(s.values.len() >= 2, "{}: a switch needs something to compare", s.name);
        }
    }

    /// The table is written by hand (some values need other flags with
    /// them); this keeps it from drifting from the switches themselves.
    #[test]
    fn the_table_measures_every_value_of_each_switch() {
        use ftvm_primary_backup::mirror;
        use ftvm_replication::pipeline::{capture, encode, predict, prefetch, trigger};
        use ftvm_replication::{fakeack, liveness};
        let declared: &[(&str, &[&str])] = &[
            ("dirty-backend", ftvm_vmm::DirtyBackend::VALUES),
            ("mirror", mirror::Mode::VALUES),
            ("trigger", trigger::Mode::VALUES),
            ("capture", capture::Mode::VALUES),
            ("predict-writes", predict::Mode::VALUES),
            ("diff", encode::Diff::VALUES),
            ("device-state", encode::States::VALUES),
            ("prefetch", prefetch::Mode::VALUES),
            ("fake-ack", fakeack::Mode::VALUES),
            ("fake-ack-state", fakeack::delta::Sending::VALUES),
            ("idle-pause", ftvm_vmm::IdlePause::VALUES),
            ("vcpu-state-reads", ftvm_vmm::StateReads::VALUES),
            ("used-notify", ftvm_vmm::devices::virtio::mmio::UsedNotify::VALUES),
            ("group-commit", trigger::GroupCommit::VALUES),
            ("priority", liveness::Priority::VALUES),
            ("disk-io", ftvm_vmm::devices::virtio::block::DiskIo::VALUES),
            ("net-offload", ftvm_vmm::devices::virtio::net::NetOffload::VALUES),
        ];
        let table: Vec<&Switch> = SWITCHES.iter().chain([&DISK_IO]).collect();
        let depth = table.iter().find(|s| s.name == "pipeline-depth").expect("pipeline-depth is measured");
        assert!(depth.values.iter().any(|v| v.0 == ftvm_primary_backup::DEFAULT_PIPELINE_DEPTH.to_string()));
        for (name, values) in declared {
            let Some(switch) = table.iter().find(|s| s.name == *name) else {
                panic!("switch {name} is not in the ablation");
            };
            let measured: Vec<&str> = switch.values.iter().map(|(v, _)| *v).collect();
            for v in *values {
                assert!(measured.contains(v), "{name}: value {v} is not measured");
            }
        }
    }

    #[test]
    fn the_settings_ftvm_runs_by_default_are_known() {
        for (name, value) in FIXED_DEFAULTS {
            let switch = SWITCHES.iter().find(|s| s.name == *name).unwrap_or_else(|| panic!("{name} is not in the table"));
            assert!(switch.values.iter().any(|(v, _)| v == value), "{name}: its default {value} is not measured");
        }
        let arguments = |setting: &str| settings().find(|(s, _)| s == setting).unwrap().1;
        for default in
            ["tuning=auto", "predict-writes=adaptive", "prefetch=adaptive", "diff=lz4", "fake-ack=bulk", "mirror=on", "pipeline-depth=2"]
        {
            assert!(is_default(default, arguments(default)), "{default}");
        }
        assert!(is_default("predict-writes=adaptive diff=lz4", arguments("predict-writes=adaptive diff=lz4")));
        for other in
            ["tuning=static", "predict-writes=off", "prefetch=on", "fake-ack-state=changed", "prefetch=pull", "mirror=off", "diff=auto"]
        {
            assert!(!is_default(other, arguments(other)), "{other}");
        }
    }

    #[test]
    fn switches_select_the_settings_and_combinations_that_name_them() {
        let only = ["diff".to_owned()];
        assert!(wanted(None, "diff=lz4"));
        assert!(wanted(Some(&only), "diff=lz4"));
        assert!(wanted(Some(&only), "predict-writes=adaptive diff=lz4"));
        assert!(!wanted(Some(&only), "capture=cow"));
        assert!(!wanted(Some(&only), "disk-io="));
        assert!(selected(Some(&only)).iter().all(|(s, _)| s.contains("diff=")));
        let one = ["prefetch=off".to_owned()];
        assert!(wanted(Some(&one), "prefetch=off"));
        assert!(!wanted(Some(&one), "prefetch=on"));
        assert!(!wanted(Some(&one), "prefetch=offset"));
    }
}
