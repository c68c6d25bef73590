//! Checks on the whole command line that clap's per-option checks cannot
//! make: an option repeated where a config file's may be replaced, a
//! mistake named by the config file it came from, and a primary's option
//! without `--replicate-to`.

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::ArgMatches;

use super::config;
use crate::output::errln;

/// `ftvm run` options that only a replicating primary uses (argument ids).
const PRIMARY_ONLY: [&str; 29] = [
    "epoch",
    "on_backup_loss",
    "failure_timeout",
    "ack_timeout",
    "heartbeat",
    "metrics",
    "metrics_every_epoch",
    "metrics_max_bytes",
    "connect_timeout",
    "capture",
    "encoding",
    "diff",
    "device_state",
    "transport",
    "mirror",
    "priority",
    "fake_ack",
    "fake_ack_state",
    "trigger",
    "pipeline_depth",
    "tuning",
    "predict_writes",
    "prefetch",
    "prefetch_by",
    "arbiter",
    "name",
    "secret_file",
    "encrypt",
    "insecure",
];

/// A mistake in a config file: one line and exit status 2, like the same
/// mistake on the command line.
fn config_error(path: &std::path::Path, msg: &str) -> ! {
    errln!("ftvm: error: config file {}: {msg}", path.display());
    std::process::exit(2)
}

/// The subcommands that take `--config` let a later option replace an
/// earlier one, so that the command line's replace the file's; a
/// single-valued option given twice on the command line itself is still a
/// mistake (`--disk a --disk b` would keep `b` silently): clap's usage
/// error, as for the other subcommands.
pub fn refuse_repeats(cli: &clap::Command, args: &[std::ffi::OsString]) {
    let Some(name) = args.get(1).and_then(|a| a.to_str()) else { return };
    let Some(sub) = cli.find_subcommand(name) else { return };
    if !sub.is_args_override_self() {
        return;
    }
    let name = sub.get_name().to_owned();
    let strict = cli.clone().mut_subcommand(&name, |sub| sub.args_override_self(false));
    if let Err(e) = strict.try_get_matches_from(args) {
        if e.kind() == ErrorKind::ArgumentConflict {
            e.exit();
        }
    }
}

/// clap's error `e` on the command line with `expanded`'s config file put
/// in: about an option the file set, one `config file` line (exit 2);
/// otherwise clap's usage error.
pub fn in_file(e: clap::Error, expanded: &config::Expanded, cli: &clap::Command) -> ! {
    use clap::error::{ContextKind, ContextValue};
    let sub = expanded.args.get(1).and_then(|a| a.to_str()).and_then(|name| cli.find_subcommand(name));
    if let (Some(path), Some(sub)) = (&expanded.path, sub) {
        let named = |arg: &str| {
            sub.get_arguments().filter(|a| expanded.from_file.iter().any(|f| f == a.get_id().as_str())).find_map(|a| {
                let flag = format!("--{}", a.get_long()?);
                (arg == flag || arg.starts_with(&format!("{flag} ")) || arg.starts_with(&format!("{flag}="))).then_some(flag)
            })
        };
        let in_file = [ContextKind::InvalidArg, ContextKind::PriorArg].into_iter().any(|kind| match e.get(kind) {
            Some(ContextValue::String(arg)) => named(arg).is_some(),
            Some(ContextValue::Strings(args)) => args.iter().any(|a| named(a).is_some()),
            _ => false,
        });
        if in_file {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            config_error(path, first.strip_prefix("error: ").unwrap_or(first));
        }
    }
    e.exit()
}

/// Given without `--replicate-to`, `ftvm run`'s and `ftvm restore`'s
/// primary options would be silently ignored: refused (exit status 2).
pub fn primary_only(command: &mut clap::Command, matches: &ArgMatches, expanded: &config::Expanded) {
    let Some((name @ ("run" | "restore"), sub)) = matches.subcommand() else { return };
    let Some(id) = PRIMARY_ONLY.iter().find(|id| sub.value_source(id) == Some(ValueSource::CommandLine)) else { return };
    if sub.get_one::<String>("replicate_to").is_some() {
        return;
    }
    let sub = command.find_subcommand_mut(name).expect("the subcommand exists");
    let flag = sub.get_arguments().find(|a| a.get_id() == id).and_then(|a| a.get_long()).unwrap_or(id);
    if let Some(path) = expanded.path.as_ref().filter(|_| expanded.from_file.iter().any(|f| f == id)) {
        config_error(path, &format!("`{flag}` applies only to a replicating primary: add `replicate-to` (or --replicate-to ADDR)"));
    }
    let msg = format!("--{flag} applies only to a replicating primary: add --replicate-to ADDR");
    sub.error(ErrorKind::MissingRequiredArgument, msg).exit();
}
