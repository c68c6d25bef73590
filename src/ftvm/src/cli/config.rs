//! `--config FILE`: the options of a subcommand, read from a TOML file.
//!
//! The file's keys are the long names of the subcommand's options
//! (`epoch-ms = 20` is `--epoch-ms 20`), so every option, including one added
//! later, has its key without a list kept by hand: the mapping is read from
//! clap's own description of the command. The file's options are placed
//! before the command line's, and the subcommand lets a later option replace
//! an earlier one, so the command line wins. Values go through the option's
//! own parser: a bad value in the file is refused with the same check as on
//! the command line, named by its key and the file.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use clap::error::ErrorKind;
use clap::{Arg, Args, Command};

/// The option that names the file (on every subcommand that takes one).
pub const CONFIG: &str = "config";

/// `--config FILE`: the subcommand's options from a TOML file.
#[derive(Args)]
pub struct ConfigArgs {
    /// Read options from this TOML file: each key is an option's long name
    /// (`epoch-ms = 20`); options given on the command line override it
    /// (examples: docs/config/).
    #[arg(long = CONFIG, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("config file {path}, line {line}, column {column}: {message}")]
    Syntax { path: String, line: usize, column: usize, message: String },
    #[error("config file {path}: unknown key `{key}` (`ftvm {command}` has no --{key})")]
    UnknownKey { path: String, key: String, command: String },
    #[error("config file {path}: `{CONFIG}` cannot name another config file (give --{CONFIG} once, on the command line)")]
    Nested { path: String },
    #[error("config file {path}: `{key}` {problem}")]
    Value { path: String, key: String, problem: String },
}

/// The command line with the options of its `--config FILE` put in.
pub struct Expanded {
    pub args: Vec<OsString>,
    /// Argument ids that the file set.
    pub from_file: Vec<String>,
    pub path: Option<PathBuf>,
}

/// Put the options of the `--config FILE` in `args` (a whole command line,
/// program name first) before the subcommand's own options. A command line
/// without one, or whose subcommand takes none, is returned as it is.
pub fn expand(cli: &Command, args: Vec<OsString>) -> Result<Expanded, ConfigError> {
    let unchanged = |args| Ok(Expanded { args, from_file: Vec::new(), path: None });
    let Some(sub) = args.get(1).and_then(|a| a.to_str()).and_then(|name| cli.find_subcommand(name)) else { return unchanged(args) };
    if !sub.get_arguments().any(|a| a.get_id() == CONFIG) {
        return unchanged(args);
    }
    let Some(path) = config_path(&args[2..]) else { return unchanged(args) };
    let text = std::fs::read_to_string(&path).map_err(|err| ConfigError::Read { path: path.display().to_string(), err })?;
    let (options, from_file) = options(sub, &path, &text)?;
    let mut expanded = args[..2].to_vec();
    expanded.extend(options);
    expanded.extend_from_slice(&args[2..]);
    Ok(Expanded { args: expanded, from_file, path: Some(path) })
}

/// The last `--config FILE` or `--config=FILE` among a subcommand's arguments.
fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let flag = format!("--{CONFIG}");
    let mut path = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let bytes = a.as_encoded_bytes();
        if a == flag.as_str() {
            path = it.next().map(PathBuf::from);
        } else if let Some(value) = bytes.strip_prefix(format!("{flag}=").as_bytes()) {
            // SAFETY: `value` is the tail of an `OsStr`'s encoded bytes after
            // an ASCII prefix, so it is itself a valid encoding.
            path = Some(PathBuf::from(unsafe { OsStr::from_encoded_bytes_unchecked(value) }));
        } else if a == "--" {
            break;
        }
    }
    path
}

/// The command-line options that `text`, the TOML file at `path`, stands
/// for, and the ids of the arguments they set.
pub fn options(sub: &Command, path: &Path, text: &str) -> Result<(Vec<OsString>, Vec<String>), ConfigError> {
    let shown = path.display().to_string();
    let table: toml::Table = toml::from_str(text).map_err(|e| syntax_error(&shown, text, &e))?;
    let mut options = Vec::new();
    let mut ids = Vec::new();
    for (key, value) in &table {
        let value_error = |problem: String| ConfigError::Value { path: shown.clone(), key: key.clone(), problem };
        if key == CONFIG && sub.get_arguments().any(|a| a.get_id() == CONFIG) {
            return Err(ConfigError::Nested { path: shown });
        }
        let arg = sub
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()) && configurable(a))
            .ok_or_else(|| ConfigError::UnknownKey { path: shown.clone(), key: key.clone(), command: sub.get_name().to_owned() })?;
        let flag = format!("--{key}");
        if !arg.get_action().takes_values() {
            match value {
                toml::Value::Boolean(true) => options.push(OsString::from(&flag)),
                toml::Value::Boolean(false) => {}
                other => return Err(value_error(format!("is a switch: true or false, not {}", describe(other)))),
            }
        } else {
            let value = scalar(value).map_err(value_error)?;
            let option = OsString::from(format!("{flag}={value}"));
            check(sub, &option).map_err(|e| value_error(format!("= {}: {e}", toml::Value::String(value.clone()))))?;
            options.push(option);
        }
        ids.push(arg.get_id().to_string());
    }
    Ok((options, ids))
}

/// Options a file may set: not `--config` itself, `--help` or `--version`.
pub(super) fn configurable(arg: &Arg) -> bool {
    !matches!(arg.get_id().as_str(), CONFIG | "help" | "version")
}

/// A TOML value as the text an option takes.
fn scalar(value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(format!("takes one value, not {}", describe(other))),
    }
}

fn describe(value: &toml::Value) -> &'static str {
    match value {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "a number",
        toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "true or false",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "a list",
        toml::Value::Table(_) => "a table",
    }
}

/// Run the option's own value check (the subcommand parsed with this one
/// option: errors about other options, such as a missing required one, are
/// for the whole command line to report).
fn check(sub: &Command, option: &OsStr) -> Result<(), String> {
    let argv = [OsStr::new(sub.get_name()), option];
    match sub.clone().try_get_matches_from(argv) {
        Err(e) if matches!(e.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation | ErrorKind::InvalidUtf8) => {
            // clap's message, without its "error: " and the usage lines.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            Err(first.strip_prefix("error: ").unwrap_or(first).to_owned())
        }
        _ => Ok(()),
    }
}

fn syntax_error(path: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    let offset = e.span().map_or(0, |s| s.start).min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    ConfigError::Syntax { path: path.to_owned(), line, column, message: e.message().trim().to_owned() }
}
