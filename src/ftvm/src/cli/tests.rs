//! The command line as a whole: clap's own consistency checks, and
//! `--config FILE` parsed together with it.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};

use super::config::{configurable, expand, options};
use super::{Cli, Command as Sub, RunArgs};

#[test]
fn the_command_line_is_consistent() {
    Cli::command().debug_assert();
}

fn parse(file: &str, command_line: &[&str]) -> Result<Cli, String> {
    let dir = std::env::temp_dir().join(format!("ftvm-config-test-{}-{}", std::process::id(), file.len()));
    std::fs::write(&dir, file).unwrap();
    let mut args: Vec<OsString> = vec!["ftvm".into(), command_line[0].into(), "--config".into(), dir.clone().into()];
    args.extend(command_line[1..].iter().map(OsString::from));
    let expanded = expand(&Cli::command(), args);
    std::fs::remove_file(&dir).unwrap();
    let expanded = expanded.map_err(|e| e.to_string())?;
    let matches = Cli::command().try_get_matches_from(expanded.args).map_err(|e| e.to_string())?;
    Cli::from_arg_matches(&matches).map_err(|e| e.to_string())
}

fn run_args(cli: Cli) -> RunArgs {
    match cli.command {
        Sub::Run(args) => args,
        _ => panic!("not ftvm run"),
    }
}

#[test]
fn keys_are_long_option_names_and_the_command_line_wins() {
    let file = "image = \"/vm.elf\"\nmemory = 64\ncmdline = \"-x\"\nreplicate-to = \"h:1\"\nepoch-ms = 30\nprefault = true\n";
    let args = run_args(parse(file, &["run"]).unwrap());
    assert_eq!((args.memory, args.replication.epoch, args.cmdline.as_str()), (64, Duration::from_millis(30), "-x"));
    assert!(args.host.prefault);
    let args = run_args(parse(file, &["run", "--epoch-ms", "40", "--memory=128"]).unwrap());
    assert_eq!((args.memory, args.replication.epoch), (128, Duration::from_millis(40)));
    assert_eq!(args.image, PathBuf::from("/vm.elf"));
}

#[test]
fn mistakes_name_the_key() {
    let e = parse("image = \"/vm.elf\"\nepoch_ms = 30\n", &["run"]).err().expect("refused");
    assert!(e.contains("unknown key `epoch_ms`") && e.contains("ftvm run"), "{e}");
    let e = parse("image = \"/vm.elf\"\nreplicate-to = \"h:1\"\nepoch-ms = 0\n", &["run"]).err().expect("refused");
    assert!(e.contains("`epoch-ms` = \"0\"") && e.contains("at least 5 ms"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    let e = parse("image = \"/vm.elf\"\nprefault = \"yes\"\n", &["run"]).err().expect("refused");
    assert!(e.contains("`prefault` is a switch"), "{e}");
    let e = parse("image = [\"/a\", \"/b\"]\n", &["run"]).err().expect("refused");
    assert!(e.contains("`image` takes one value, not a list"), "{e}");
    let e = parse("image = \"/vm.elf\"\ndirty-backend = \"log\"\n", &["run"]).err().expect("refused");
    assert!(e.contains("`dirty-backend`") && e.contains("bitmap"), "{e}");
    let e = parse("image = \"/vm.elf\"\nmemory = \n", &["run"]).err().expect("refused");
    assert!(e.contains("line 2, column 10"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    let e = parse("config = \"/other.toml\"\n", &["backup"]).err().expect("refused");
    assert!(e.contains("`config` cannot name another config file"), "{e}");
    assert!(!e.contains("has no --config"), "{e}");
}

/// The commented examples in docs/config/ parse, and each names every
/// option of its command (commented out or not), so they cannot rot.
#[test]
fn documented_examples_parse_and_are_complete() {
    let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/config");
    for (file, command) in [("run.toml", "run"), ("backup.toml", "backup"), ("replica.toml", "replica")] {
        let path = docs.join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let cli = Cli::command();
        let sub = cli.find_subcommand(command).unwrap();
        options(sub, &path, &text).unwrap_or_else(|e| panic!("{e}"));
        parse(&text, &[command]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for arg in sub.get_arguments().filter(|a| configurable(a)) {
            let long = arg.get_long().expect("options are long");
            let named = text.lines().any(|l| {
                let l = l.trim_start_matches(['#', ' ']);
                l.strip_prefix(long).is_some_and(|rest| rest.trim_start().starts_with('='))
            });
            assert!(named, "{} does not describe `{long}`", path.display());
        }
        // And every key it shows, commented out or not, is an option.
        for line in text.lines().filter(|l| l.starts_with('#')) {
            let Some((key, _)) = line.trim_start_matches(['#', ' ']).split_once(" = ") else { continue };
            let key = key.trim();
            if !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                options(sub, &path, &format!("{key} = {}", line.split_once(" = ").unwrap().1.split('#').next().unwrap()))
                    .unwrap_or_else(|e| panic!("{}: {line}: {e}", path.display()));
            }
        }
    }
}

/// A promoted backup protects its VM with `ftvm run`'s defaults (from the
/// same conversion), its own heartbeat and its standbys.
#[test]
fn a_promoted_backup_runs_with_the_defaults_of_ftvm_run() {
    use ftvm_primary_backup::mirror::Mode;
    use ftvm_primary_backup::{OnBackupLoss, PrimaryConfig, DEFAULT_PIPELINE_DEPTH};
    use ftvm_replication::pipeline::encode::Diff;

    let args = ["ftvm", "backup", "--listen", "h:1", "--insecure", "--heartbeat-ms", "7", "--standby", "h:2,h:3"];
    let Sub::Backup(args) = Cli::try_parse_from(args).unwrap().command else { panic!("not ftvm backup") };
    let promotion = crate::roles::backup::Follower::try_from(args).unwrap().promotion;
    let session = &promotion.session;
    assert_eq!((session.epoch, session.liveness.timeout), (PrimaryConfig::DEFAULT_EPOCH, PrimaryConfig::DEFAULT_FAILURE_TIMEOUT));
    assert_eq!(
        (session.ack_timeout, session.connect_timeout),
        (PrimaryConfig::DEFAULT_ACK_TIMEOUT, PrimaryConfig::DEFAULT_CONNECT_TIMEOUT)
    );
    assert_eq!((promotion.loss.on_backup_loss, session.mirror), (OnBackupLoss::Pause, Mode::On));
    assert_eq!((promotion.pipeline_depth, promotion.switches.diff), (DEFAULT_PIPELINE_DEPTH as usize, Diff::Lz4));
    assert_eq!(session.liveness.interval, Duration::from_millis(7));
    assert_eq!(promotion.loss.standbys, ["h:2", "h:3"]);
    assert!(promotion.metrics.is_none() && session.auth.is_none());
}
