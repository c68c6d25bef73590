//! The command line: mistakes are refused with a message naming them,
//! every option is described, and a closed stdout or stderr never turns
//! into a panic.

mod common;

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

/// Long enough that only a hang reaches it.
const HANG: Duration = Duration::from_secs(30);

fn within(cmd: &mut std::process::Command, what: &str) -> Output {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    Process::spawn(what, cmd).unwrap().wait_with_output_within(HANG).unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn ftvm_args(args: &[&str]) -> Output {
    within(ftvm().args(args), &format!("ftvm {args:?}"))
}

/// A usage error from the parser: exit 2, the message names every `want`.
fn assert_refused(out: &Output, wants: &[&str], case: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{case}: {err}{}", stdout(out));
    for want in wants {
        assert!(err.contains(want), "{case}: expected '{want}' in: {err}");
    }
    assert!(!err.contains("panicked"), "{case}: {err}");
}

/// One `ftvm: error: ` line and exit 1.
fn assert_one_line_error(out: &Output, want: &str, case: &str) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{case}: {err}");
    assert_eq!(err.lines().count(), 1, "{case}: exactly one line: {err}");
    assert!(err.starts_with("ftvm: error: ") && err.contains(want), "{case}: expected '{want}' in: {err}");
    err
}

/// `ftvm ARGS` refused with the one-line error `want` before any guest
/// printed anything; the error.
fn refused_before_the_guest_runs(args: &[&str], want: &str) -> String {
    let out = ftvm_args(args);
    let err = assert_one_line_error(&out, want, &format!("{args:?}"));
    assert!(stdout(&out).is_empty(), "{args:?}: the guest ran: {}", stdout(&out));
    err
}

/// The probe guest's image, as an argument.
fn probe_image() -> &'static str {
    static PROBE: OnceLock<String> = OnceLock::new();
    PROBE.get_or_init(|| image("probe").to_str().expect("a UTF-8 path").to_owned())
}

#[test]
fn replication_flags_need_replicate_to() {
    let probe = probe_image();
    let cases: [&[&str]; 15] = [
        &["--epoch-ms", "10"],
        &["--insecure"],
        &["--fake-ack", "on"],
        &["--ack-timeout-ms", "500"],
        &["--heartbeat-ms", "2"],
        &["--metrics", "/tmp/ftvm-never-written.jsonl"],
        &["--on-backup-loss", "pause"],
        &["--failure-timeout-ms", "500"],
        &["--connect-timeout-ms", "500"],
        &["--arbiter", "http://127.0.0.1:2379"],
        &["--arbiter", "http://127.0.0.1:2379", "--name", "vm1"],
        &["--capture", "pause"],
        &["--encoding", "raw"],
        &["--transport", "tcp"],
        &["--epoch-ms", "10", "--failure-timeout-ms", "500"],
    ];
    for flags in cases {
        let mut args = vec!["run", "--image", probe, "--cmdline", "exit=0"];
        args.extend_from_slice(flags);
        assert_refused(&ftvm_args(&args), &[flags[0], "--replicate-to"], &format!("{flags:?}"));
        // `ftvm restore` takes the same options, with the same rule.
        let mut args = vec!["restore", "--snapshot", "/nonexistent.snap"];
        args.extend_from_slice(flags);
        assert_refused(&ftvm_args(&args), &[flags[0], "--replicate-to"], &format!("restore {flags:?}"));
    }
}

#[test]
fn fake_ack_takes_off_or_on_and_its_state_changed_or_all() {
    let probe = probe_image();
    let out = ftvm_args(&["run", "--image", probe, "--replicate-to", "127.0.0.1:1", "--fake-ack", "maybe"]);
    assert_refused(&out, &["--fake-ack", "'maybe'", "off or on"], "maybe");
    let out = ftvm_args(&["run", "--image", probe, "--replicate-to", "127.0.0.1:1", "--fake-ack-state", "some"]);
    assert_refused(&out, &["--fake-ack-state", "'some'", "changed or all"], "some");
}

#[test]
fn replica_on_secondary_loss_takes_continue_or_pause() {
    let peers = "1=127.0.0.1:7101,2=127.0.0.1:7102,3=127.0.0.1:7103";
    let out = ftvm_args(&["replica", "--id", "1", "--peers", peers, "--witness", "--on-secondary-loss", "hold"]);
    assert_refused(&out, &["--on-secondary-loss", "'hold'", "continue or pause"], "hold");
}

#[test]
fn epoch_ms_has_a_minimum() {
    let probe = probe_image();
    for epoch in ["0", "4"] {
        let out = ftvm_args(&["run", "--image", probe, "--replicate-to", "127.0.0.1:1", "--epoch-ms", epoch]);
        assert_refused(&out, &["--epoch-ms", "at least 5 ms"], epoch);
    }
}

#[test]
fn backup_checks_its_flags_at_start() {
    let dir = Scratch::new("cli-backup").unwrap();
    let missing = dir.join("missing.img");
    let missing = missing.to_str().unwrap();
    let probe = probe_image();
    let cases: [(&[&str], &str); 5] = [
        (&["--memory", "3"], "multiple of 2 MiB"),
        (&["--memory", "1000000"], "multiple of 2 MiB"),
        (&["--vcpus", "0"], "0 vCPUs requested"),
        (&["--disk", missing], "cannot open disk"),
        (&["--net", "tap=a-name-too-long-for-linux"], "longer than 15 bytes"),
    ];
    for (flags, want) in cases {
        // No primary ever connects: the error must come at start.
        let mut args = vec!["backup", "--insecure", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(flags);
        let backup = assert_one_line_error(&ftvm_args(&args), want, &format!("backup {flags:?}"));
        let mut args = vec!["run", "--image", probe];
        args.extend_from_slice(flags);
        let run = assert_one_line_error(&ftvm_args(&args), want, &format!("run {flags:?}"));
        assert_eq!(backup, run, "ftvm backup and ftvm run word {flags:?} alike");
    }
}

#[test]
fn mac_addresses_must_be_unicast_and_not_zero() {
    let probe = probe_image();
    let cases = [
        ("01:00:5e:00:00:01", "multicast"),
        ("ff:ff:ff:ff:ff:ff", "multicast"),
        ("33:33:00:00:00:01", "multicast"),
        ("00:00:00:00:00:00", "all zero"),
    ];
    for (mac, want) in cases {
        let net = format!("tap=ftvmmac0,mac={mac}");
        let out = ftvm_args(&["run", "--image", probe, "--cmdline", "exit=0", "--net", &net]);
        assert_refused(&out, &[want, mac], mac);
        let out = ftvm_args(&["backup", "--listen", "127.0.0.1:0", "--net", &net]);
        assert_refused(&out, &[want, mac], mac);
    }
    let help = ftvm_args(&["run", "--help"]);
    assert!(stdout(&help).contains("52:54:00:12:34:56"), "the default MAC is documented: {}", stdout(&help));
}

#[test]
fn demo_refuses_zero_trials() {
    let out = ftvm_args(&["demo", "--trials", "0"]);
    assert_refused(&out, &["--trials", "at least 1"], "--trials 0");
    assert!(!stdout(&out).contains("OK"), "{}", stdout(&out));
}

/// A pipe whose reading end is already closed: every write fails with EPIPE.
fn closed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills two descriptors, which we own from here on.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both are fresh descriptors nobody else owns.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

/// Run `ftvm ARGS` with stdout and stderr both on a closed pipe; its exit code.
fn exit_with_closed_output(args: &[&str], signal_after: Option<Duration>) -> Option<i32> {
    let pipe = closed_pipe();
    let mut cmd = ftvm();
    cmd.args(args).stdin(Stdio::null()).stdout(pipe.try_clone().unwrap()).stderr(pipe);
    let mut p = Process::spawn("ftvm", &mut cmd).unwrap();
    if let Some(after) = signal_after {
        std::thread::sleep(after);
        p.signal(libc::SIGTERM).unwrap();
    }
    wait_code(p, args)
}

fn within_status(cmd: &mut std::process::Command) -> Option<i32> {
    wait_code(Process::spawn("ftvm", cmd).unwrap(), cmd.get_args())
}

fn wait_code(mut p: Process, what: impl std::fmt::Debug) -> Option<i32> {
    match p.wait_until(HANG, |_| false) {
        Err(ftvm_testkit::process::WaitError::Exited(status)) => status.code(),
        other => panic!("ftvm {what:?} did not end: {other:?}"),
    }
}

#[test]
fn closed_stdout_and_stderr_do_not_panic() {
    let dir = Scratch::new("cli-epipe").unwrap();
    let probe = probe_image();
    // The guest prints and exits 7: its status is still ftvm's.
    assert_eq!(exit_with_closed_output(&["run", "--image", probe, "--cmdline", "hello"], None), Some(0));
    assert_eq!(exit_with_closed_output(&["run", "--image", probe, "--cmdline", "exit=7"], None), Some(7));
    // The VMM's logs on a closed stderr.
    let logged = ["run", "--image", probe, "--cmdline", "exit=3"];
    let pipe = closed_pipe();
    let mut cmd = ftvm();
    cmd.args(logged).env("FTVM_LOG", "debug").stdin(Stdio::null()).stdout(pipe.try_clone().unwrap()).stderr(pipe);
    assert_eq!(within_status(&mut cmd), Some(3), "FTVM_LOG=debug");
    // "VM stopped" on a closed stderr.
    assert_eq!(exit_with_closed_output(&["run", "--image", probe, "--cmdline", "ticker=10"], Some(Duration::from_millis(500))), Some(0));
    // An error line on a closed stderr.
    let missing = dir.join("missing.elf");
    assert_eq!(exit_with_closed_output(&["run", "--image", missing.to_str().unwrap()], None), Some(1));
    assert_eq!(exit_with_closed_output(&["status", "--api-socket", missing.to_str().unwrap()], None), Some(1));
    assert_eq!(exit_with_closed_output(&["help"], None), Some(0));
    assert_eq!(exit_with_closed_output(&["run", "--help"], None), Some(0));

    // `ftvm status | head -0` against a live VM.
    let socket = dir.join("api.sock");
    let mut cmd = ftvm();
    cmd.args(["run", "--cmdline", "ticker=50", "--image", probe, "--api-socket"]).arg(&socket);
    let mut vm = Process::spawn_collected("vm", &mut cmd).unwrap();
    vm.wait_until(Duration::from_secs(10), |p| p.stdout().contains("probe: tick")).unwrap();
    let socket = socket.to_str().unwrap();
    for args in [&["status", "--api-socket", socket][..], &["status", "--json", "--api-socket", socket]] {
        assert_eq!(exit_with_closed_output(args, None), Some(0), "{args:?}");
    }
    assert_eq!(exit_with_closed_output(&["stop", "--api-socket", socket], None), Some(0));
    assert_eq!(vm.wait().unwrap().code(), Some(0), "{}", vm.output());
}

/// The options and positionals of one help text that have no description.
fn undescribed(help: &str) -> Vec<String> {
    let mut missing = Vec::new();
    let mut in_args = false;
    let lines: Vec<&str> = help.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if !line.starts_with(' ') {
            in_args = matches!(line.trim_end(), "Options:" | "Arguments:");
            continue;
        }
        let entry = line.trim_start();
        let indent = line.len() - entry.len();
        // Entries are indented 2 (6 for a long option without a short one).
        if !in_args || indent > 6 || !(entry.starts_with('-') || entry.starts_with('<') || entry.starts_with('[')) {
            continue;
        }
        // The signature has no double space; a description follows on the
        // same line after two or more, or on the next, indented deeper.
        let same_line = entry.split_once("  ").map(|(_, rest)| rest.trim()).unwrap_or("");
        let next_line = lines.get(i + 1).filter(|l| l.len() - l.trim_start().len() > 6 && !l.trim().is_empty()).map_or("", |l| l.trim());
        let text = if same_line.is_empty() { next_line } else { same_line };
        if strip_specs(text).is_empty() {
            missing.push(entry.split("  ").next().unwrap_or(entry).to_string());
        }
    }
    missing
}

/// A description without clap's `[default: ..]` and `[possible values: ..]`.
fn strip_specs(text: &str) -> String {
    let mut out = String::new();
    let mut depth = 0;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if depth == 0 && (rest.starts_with("[default:") || rest.starts_with("[possible values:") || rest.starts_with("[aliases:")) {
            depth = 1;
        } else if depth > 0 && c == '[' {
            depth += 1;
        } else if depth > 0 && c == ']' {
            depth -= 1;
        } else if depth == 0 {
            out.push(c);
        }
        rest = &rest[c.len_utf8()..];
    }
    out.trim().to_string()
}

#[test]
fn undescribed_finds_missing_descriptions() {
    let help = "Usage: x\n\nArguments:\n  <FILE>  the file\n\nOptions:\n      --vcpus <VCPUS>  [default: 1]\n      --memory <M>  Guest memory [default: 256]\n  -h, --help\n          Print help\n      --bare\n";
    assert_eq!(undescribed(help), vec!["--vcpus <VCPUS>", "--bare"]);
}

#[test]
fn every_option_has_help_text() {
    let top = ftvm_args(&["help"]);
    assert_eq!(top.status.code(), Some(0), "{}", stderr(&top));
    let top = stdout(&top);
    let commands: Vec<String> = top
        .lines()
        .skip_while(|l| l.trim_end() != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .filter(|c| c != "help")
        .collect();
    for want in ["run", "backup", "snapshot", "restore", "status", "protect", "pause", "resume", "stop", "demo"] {
        assert!(commands.iter().any(|c| c == want), "ftvm help lists {want}: {top}");
    }
    let mut missing = undescribed(&top).into_iter().map(|o| format!("ftvm {o}")).collect::<Vec<_>>();
    for command in &commands {
        for help in [&["help", command.as_str()][..], &[command.as_str(), "-h"]] {
            let out = ftvm_args(help);
            assert_eq!(out.status.code(), Some(0), "{help:?}: {}", stderr(&out));
            missing.extend(undescribed(&stdout(&out)).into_iter().map(|o| format!("ftvm {command} {o}")));
        }
    }
    missing.dedup();
    assert!(missing.is_empty(), "options without a description:\n{}", missing.join("\n"));
}

/// `--api-socket` names a socket: a file of the user's at that path is
/// neither deleted nor replaced (it was, before).
#[test]
fn api_socket_never_replaces_a_file_that_is_not_a_socket() {
    let dir = Scratch::new("apisock").unwrap();
    let precious = dir.join("notes.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    let probe = probe_image();
    for command in [&["run", "--image", probe, "--cmdline", "exit=0"][..], &["backup", "--insecure", "--listen", "127.0.0.1:0"][..]] {
        let mut args = command.to_vec();
        args.extend(["--api-socket", precious.to_str().unwrap()]);
        let out = ftvm_args(&args);
        assert_one_line_error(&out, "is not a socket", &format!("{command:?}"));
        assert_eq!(std::fs::read(&precious).unwrap(), b"keep me", "{command:?}");
    }
}

/// `--config FILE`: the file's keys are the options' long names, the command
/// line overrides them, and a mistake in the file is one line naming its key.
#[test]
fn config_file_options_and_overrides() {
    let dir = Scratch::new("cli-config").unwrap();
    let config = dir.join("vm.toml");
    let probe = probe_image();
    std::fs::write(&config, format!("# a probe that exits 3\nimage = {:?}\ncmdline = \"exit=3\"\nvcpus = 2\n", probe)).unwrap();
    let config = config.to_str().unwrap();
    assert_eq!(ftvm_args(&["run", "--config", config]).status.code(), Some(3));
    assert_eq!(ftvm_args(&["run", "--config", config, "--cmdline", "exit=4"]).status.code(), Some(4));
    assert_eq!(ftvm_args(&["run", "--cmdline", "exit=5", &format!("--config={config}")]).status.code(), Some(5));

    let bad = |name: &str, text: &str, want: &[&str]| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let out = ftvm_args(&["run", "--config", path.to_str().unwrap(), "--image", probe]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert_eq!(err.lines().count(), 1, "{name}: one line: {err}");
        for w in want {
            assert!(err.contains(w), "{name}: expected '{w}' in: {err}");
        }
    };
    bad("unknown.toml", "vcpu = 2\n", &["ftvm: error: config file", "unknown.toml", "unknown key `vcpu`"]);
    bad("value.toml", "memory = \"lots\"\n", &["`memory`", "invalid digit"]);
    bad("type.toml", "prefault = 1\n", &["`prefault` is a switch"]);
    bad("syntax.toml", "memory = 64\ncmdline = \"unterminated\n", &["line 2"]);
    let out = ftvm_args(&["run", "--config", dir.join("missing.toml").to_str().unwrap()]);
    assert!(stderr(&out).contains("cannot read config file"), "{}", stderr(&out));
    // Replication options in the file need replicate-to like their flags.
    let path = dir.join("primary-only.toml");
    std::fs::write(&path, "epoch-ms = 30\n").unwrap();
    let out = ftvm_args(&["run", "--config", path.to_str().unwrap(), "--image", probe]);
    assert_refused(
        &out,
        &["ftvm: error: config file", "primary-only.toml: `epoch-ms` applies only to a replicating primary", "replicate-to"],
        "primary-only",
    );
    assert_eq!(stderr(&out).lines().count(), 1, "primary-only: one line: {}", stderr(&out));
    // A config file cannot name another one.
    let path = dir.join("nested.toml");
    std::fs::write(&path, "config = \"other.toml\"\n").unwrap();
    for command in ["run", "backup", "replica"] {
        let out = ftvm_args(&[command, "--config", path.to_str().unwrap()]);
        assert_refused(&out, &["ftvm: error: config file", "`config` cannot name another config file"], command);
        assert!(!stderr(&out).contains("has no --config"), "{}", stderr(&out));
        assert_eq!(stderr(&out).lines().count(), 1, "{command}: one line: {}", stderr(&out));
    }
}

/// A single-valued option given twice on the command line is a usage
/// error, as in the client commands (it kept the last one silently), while
/// the command line still overrides a config file's option of the same name.
#[test]
fn repeated_options_are_refused() {
    let cases: [&[&str]; 6] = [
        &["run", "--image", "/a.elf", "--disk", "/a.img", "--disk", "/b.img"],
        &["run", "--image", "/a.elf", "--image=/b.elf"],
        &["run", "--image", "/a.elf", "--prefault", "--prefault"],
        &["backup", "--listen", "127.0.0.1:1", "--memory", "64", "--memory", "128"],
        &["replica", "--id", "1", "--id", "2", "--peers", "1=a:1,2=b:1,3=c:1"],
        &["restore", "--snapshot", "/a.snap", "--snapshot", "/b.snap"],
    ];
    for args in cases {
        let repeated = args
            .iter()
            .skip(1)
            .find(|a| a.starts_with("--") && args.iter().filter(|b| b.split('=').next() == a.split('=').next()).count() > 1);
        let flag = repeated.unwrap().split('=').next().unwrap();
        assert_refused(&ftvm_args(args), &[flag, "cannot be used multiple times"], &format!("{args:?}"));
    }
    // Repeatable options stay repeatable.
    let out = ftvm_args(&["backup", "--listen", "127.0.0.1:0", "--standby", "127.0.0.1:1", "--standby", "127.0.0.1:2", "--memory", "3"]);
    assert!(!stderr(&out).contains("multiple times"), "{}", stderr(&out));
}

#[test]
fn backup_takes_a_config_file() {
    let dir = Scratch::new("cli-config-backup").unwrap();
    let path = dir.join("backup.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:1\"\nmemory = 3\ninsecure = true\n").unwrap();
    let out = ftvm_args(&["backup", "--config", path.to_str().unwrap()]);
    assert_one_line_error(&out, "memory", "backup config with a bad memory size");
}

/// Addresses are checked for their shape at start, not when first dialled
/// (a standby only after a takeover), and a witness's VM options need a VM.
#[test]
fn addresses_and_witness_options_are_checked_at_start() {
    let peers = "1=127.0.0.1:7101,2=127.0.0.1:7102,3=127.0.0.1:7103";
    let cases: [(&[&str], &[&str]); 6] = [
        (&["backup", "--listen", "127.0.0.1:0", "--standby", "garbage"], &["--standby", "not HOST:PORT"]),
        (&["backup", "--listen", "127.0.0.1:0", "--standby", "h3:99999"], &["--standby", "is not a port"]),
        (&["backup", "--listen", "127.0.0.1:0", "--arbiter", "garbage"], &["--arbiter", "not http://HOST:PORT"]),
        (&["backup", "--listen", "nowhere"], &["--listen", "not HOST:PORT"]),
        (&["run", "--image", "x", "--replicate-to", "h2:port"], &["--replicate-to", "is not a port"]),
        (&["replica", "--id", "3", "--peers", peers, "--witness", "--memory", "512"], &["--image"]),
    ];
    for (args, wants) in cases {
        assert_refused(&ftvm_args(args), wants, &format!("{args:?}"));
    }
    let out = ftvm_args(&["replica", "--id", "3", "--peers", "1=127.0.0.1:7101,2=127.0.0.1:7101,3=127.0.0.1:7103", "--witness"]);
    assert_one_line_error(&out, "replicas 1 and 2 are both at 127.0.0.1:7101", "one address for two replicas");
}

/// A replica that joins a group names itself and a member in `--join`,
/// and not `--peers` too; `ftvm replica-replace --add` is ID=HOST:PORT.
#[test]
fn join_and_replace_options_are_checked() {
    let join = "1=127.0.0.1:7101,3=127.0.0.1:7103";
    let out = ftvm_args(&["replica", "--id", "4", "--join", join, "--witness", "--insecure"]);
    assert_one_line_error(&out, "--id 4 is not in --join", "--join without this replica");
    let out = ftvm_args(&["replica", "--id", "4", "--join", "4=127.0.0.1:7104", "--witness", "--insecure"]);
    assert_one_line_error(&out, "--join names no member", "--join with no member");
    let peers = "1=127.0.0.1:7101,2=127.0.0.1:7102,4=127.0.0.1:7104";
    let out = ftvm_args(&["replica", "--id", "4", "--join", peers, "--peers", peers, "--witness"]);
    assert_refused(&out, &["--peers", "cannot be used with", "--join"], "--join and --peers");
    assert_refused(&ftvm_args(&["replica", "--id", "4", "--witness"]), &["--peers"], "neither --peers nor --join");
    for (add, want) in [("4", "`4` is not ID=HOST:PORT"), ("0=h:1", "replica ids start at 1"), ("4=h", "`h` is not HOST:PORT")] {
        let out = ftvm_args(&["replica-replace", "--api-socket", "/nonexistent.sock", "--remove", "2", "--add", add]);
        assert_refused(&out, &["--add", want], add);
    }
}

/// A secret file only its owner can read.
fn secret_file(dir: &Scratch) -> String {
    let path = dir.join("secret");
    std::fs::write(&path, [0x5a; 32]).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Issue 29, no unauthenticated channel by default: a primary (`run`,
/// `restore`), a backup and a replica without `--secret-file` refuse to
/// start, on one line naming both ways out, before any guest runs or any
/// primary is waited for (a backup used to wait, unauthenticated);
/// `--insecure` opts out, and is refused together with `--secret-file`.
#[test]
fn replication_needs_a_secret_file_or_insecure() {
    let dir = Scratch::new("cli-insecure").unwrap();
    let probe = probe_image();
    let peers = "1=127.0.0.1:7101,2=127.0.0.1:7102,3=127.0.0.1:7103";
    let want = "ftvm: error: the replication channel needs --secret-file PATH (the same secret on both sides), or --insecure for a link nobody else reaches";
    let cases: [&[&str]; 4] = [
        &["run", "--image", probe, "--cmdline", "hello", "--replicate-to", "127.0.0.1:1"],
        &["restore", "--snapshot", "/nonexistent.snap", "--replicate-to", "127.0.0.1:1"],
        &["backup", "--listen", "127.0.0.1:0"],
        &["replica", "--id", "3", "--peers", peers, "--witness"],
    ];
    for args in cases {
        assert_eq!(refused_before_the_guest_runs(args, want).trim_end(), want);
    }
    // The same from a config file.
    let config = dir.join("backup.toml");
    std::fs::write(&config, "listen = \"127.0.0.1:0\"\n").unwrap();
    assert_one_line_error(&ftvm_args(&["backup", "--config", config.to_str().unwrap()]), want, "backup config file");

    // Both at once is a usage error, on the command line or in a file.
    let secret = secret_file(&dir);
    let out = ftvm_args(&["backup", "--listen", "127.0.0.1:0", "--insecure", "--secret-file", &secret]);
    assert_refused(&out, &["--insecure", "--secret-file"], "backup --insecure --secret-file");
    let out = ftvm_args(&["run", "--image", probe, "--replicate-to", "127.0.0.1:1", "--secret-file", &secret, "--insecure"]);
    assert_refused(&out, &["--insecure", "--secret-file"], "run --insecure --secret-file");
    std::fs::write(&config, format!("listen = \"127.0.0.1:0\"\nsecret-file = {secret:?}\ninsecure = true\n")).unwrap();
    let out = ftvm_args(&["backup", "--config", config.to_str().unwrap()]);
    assert_refused(&out, &["--insecure", "--secret-file"], "config file with both");

    // --insecure lets a backup start: it waits for its primary until stopped.
    let socket = dir.join("b.sock");
    let mut cmd = ftvm();
    cmd.args(["backup", "--insecure", "--listen", "127.0.0.1:0", "--api-socket"]).arg(&socket).env("FTVM_LOG", "info");
    let mut b = Process::spawn_collected("backup", &mut cmd).unwrap();
    wait_for(&mut b, "backup", "waiting for a primary", HANG);
    assert_eq!(ftvm_args(&["stop", "--api-socket", socket.to_str().unwrap()]).status.code(), Some(0));
    assert_eq!(b.wait().unwrap().code(), Some(0), "{}", b.output());
}

/// Issue 29: `--on-backup-loss continue` without `--arbiter` let a primary
/// that only lost touch with its backup run on while the backup took over
/// (two VMs); it is refused at start, from the command line (`run`,
/// `restore`) or a config file, before any guest runs.
#[test]
fn continue_on_backup_loss_needs_an_arbiter() {
    let dir = Scratch::new("cli-continue").unwrap();
    let probe = probe_image();
    let want = "ftvm: error: --on-backup-loss continue needs --arbiter URL";
    let primary = ["--insecure", "--replicate-to", "127.0.0.1:1", "--on-backup-loss", "continue"];
    let run = [&["run", "--image", probe, "--cmdline", "hello"][..], &primary].concat();
    let restore = [&["restore", "--snapshot", "/nonexistent.snap"][..], &primary].concat();
    let config = dir.join("primary.toml");
    std::fs::write(&config, "replicate-to = \"127.0.0.1:1\"\ninsecure = true\non-backup-loss = \"continue\"\n").unwrap();
    let from_file = ["run", "--image", probe, "--cmdline", "hello", "--config", config.to_str().unwrap()];
    for args in [&run[..], &restore, &from_file] {
        refused_before_the_guest_runs(args, want);
    }
    // With an arbiter it is taken: the primary goes on to claim the VM there
    // (no etcd listens: it says so).
    let out = ftvm_args(&[&run[..], &["--arbiter", "http://127.0.0.1:1"]].concat());
    let err = assert_one_line_error(&out, "arbiter", "continue with --arbiter");
    assert!(!err.contains("--on-backup-loss"), "{err}");
    // pause needs none.
    let out = ftvm_args(
        &[&["run", "--image", probe, "--cmdline", "hello", "--connect-timeout-ms", "100"][..], &primary[..4], &["pause"]].concat(),
    );
    assert!(out.status.code() == Some(1) && !stderr(&out).contains("--on-backup-loss"), "{}", stderr(&out));
}

/// Issue 29: mirrored frames travel in clear, so `--mirror on` with
/// `--encrypt` is refused at start (command line or config file); with
/// `--encrypt` alone the mirror is off, and the log says so.
#[test]
fn mirror_on_is_refused_with_encrypt() {
    let dir = Scratch::new("cli-mirror").unwrap();
    let probe = probe_image();
    let secret = secret_file(&dir);
    let want = "ftvm: error: --mirror on cannot be used with --encrypt";
    let encrypted = ["--replicate-to", "127.0.0.1:1", "--connect-timeout-ms", "100", "--secret-file", &secret, "--encrypt"];
    let run = [&["run", "--image", probe, "--cmdline", "hello"][..], &encrypted].concat();
    let restore = [&["restore", "--snapshot", "/nonexistent.snap"][..], &encrypted].concat();
    let config = dir.join("primary.toml");
    std::fs::write(&config, format!("replicate-to = \"127.0.0.1:1\"\nsecret-file = {secret:?}\nencrypt = true\nmirror = \"on\"\n"))
        .unwrap();
    let from_file = ["run", "--image", probe, "--cmdline", "hello", "--config", config.to_str().unwrap()];
    for args in [&[&run[..], &["--mirror", "on"]].concat()[..], &[&restore[..], &["--mirror=on"]].concat(), &from_file] {
        let out = ftvm_args(args);
        assert_one_line_error(&out, want, &format!("{args:?}"));
        assert!(stdout(&out).is_empty(), "{args:?}: the guest ran: {}", stdout(&out));
    }
    // --mirror off, or no --mirror (off, logged), go on to reach the backup (none there).
    let out = ftvm_args(&[&run[..], &["--mirror", "off"]].concat());
    assert!(out.status.code() == Some(1) && !stderr(&out).contains("--mirror"), "{}", stderr(&out));
    let out = within(ftvm().args(&run).env("FTVM_LOG", "info"), "encrypted, no --mirror");
    let err = stderr(&out);
    assert!(out.status.code() == Some(1) && !err.contains("--mirror on"), "{err}");
    assert!(err.contains("not mirroring frames to the backup: they would travel unencrypted (--encrypt)"), "{err}");
}
