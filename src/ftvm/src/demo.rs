//! `ftvm demo`: a replicated Redis-protocol VM survives the death of its
//! host, on this machine.
//!
//! It builds a private network from namespaces (`scripts/netns.sh`): a
//! client, two hosts h1 and h2 on one LAN, and a replication link between
//! the hosts. A backup waits in h2; the primary runs the kv guest in h1 and
//! checkpoints it to h2 every epoch, holding the guest's network output
//! until the backup has the state that produced it. From the client,
//! redis-benchmark loads the guest while tracked writers record every write
//! whose `+OK` arrived. Then h1 dies (its links are cut and its VMM is
//! SIGKILLed), the backup takes over, and every acknowledged write is read
//! back from it. Exit status 0 only if none was lost.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR as GUEST, GUEST_MAC as MAC};
use ftvm_testkit::{netns, resp, writers};

use crate::api;
use crate::output::{errln, outln};

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Failovers to run, each with a fresh primary and backup (at least 1).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::at_least_one)]
    trials: u32,
    /// Checkpoint interval of the primary, in milliseconds.
    #[arg(long, default_value_t = 20, value_name = "MS", value_parser = crate::cli::epoch_ms)]
    epoch_ms: u64,
    /// Seconds of load before the primary's host is killed.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS", value_parser = crate::cli::positive_seconds)]
    seconds: f64,
}

const BACKUP_ADDR: &str = "192.168.100.2:7000";
const VALUE_LEN: usize = 1024;
/// How long the demo waits for a VMM's `status`.
const STATUS_TIMEOUT: Duration = Duration::from_secs(5);

type Error = String;

/// Entry point: prints the story, returns the exit status.
pub fn run(args: DemoArgs) -> i32 {
    let dir = match Scratch::new("demo") {
        Ok(d) => d,
        Err(e) => {
            errln!("ftvm: error: demo: cannot create a directory for the logs: {e}");
            return 1;
        }
    };
    let result = demo(&args, dir.path());
    let failed = matches!(&result, Ok(false)) || matches!(&result, Err(e) if e != INTERRUPTED);
    let has_logs = std::fs::read_dir(dir.path()).is_ok_and(|mut d| d.next().is_some());
    if failed && has_logs {
        errln!("ftvm: demo: logs kept in {}", dir.keep().display());
    }
    match result {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            errln!("ftvm: error: demo: {e}");
            1
        }
    }
}

const INTERRUPTED: &str = "interrupted";

fn which(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

fn spawn(mut cmd: Command, dir: &Path, name: &str) -> Result<Process, Error> {
    Process::spawn_logged(name, &mut cmd, dir, name).map_err(|e| format!("cannot start {name}: {e}"))
}

fn status(socket: &Path) -> Option<api::Response> {
    api::client::call(socket, &api::Request::Status, STATUS_TIMEOUT).ok()
}

fn stop_requested() -> bool {
    static STOP: std::sync::OnceLock<Option<&'static vmm_sys_util::eventfd::EventFd>> = std::sync::OnceLock::new();
    STOP.get_or_init(|| crate::signals::install().ok()).is_some_and(|e| e.read().is_ok())
}

/// Sleep, but give up when Ctrl-C or SIGTERM arrived.
fn sleep(d: Duration) -> Result<(), Error> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if stop_requested() {
            return Err(INTERRUPTED.into());
        }
        std::thread::sleep((end - Instant::now()).min(Duration::from_millis(20)));
    }
    Ok(())
}

/// redis-benchmark in the client namespace, its latest progress line kept.
struct Benchmark {
    proc: Process,
    last: Arc<Mutex<String>>,
}

impl Benchmark {
    fn start(topo: &Topology) -> Result<Benchmark, Error> {
        let mut cmd = topo.command("client", "redis-benchmark");
        // One long SET test: 8 connections, random keys, 256-byte values.
        cmd.args(["-h", GUEST, "-t", "set", "-c", "8", "-d", "256", "-r", "1000000", "-n", "100000000"]);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
        let mut proc = Process::spawn("redis-benchmark", &mut cmd).map_err(|e| e.to_string())?;
        let out = proc.child_mut().stdout.take().expect("piped");
        let last = Arc::new(Mutex::new(String::new()));
        let l = last.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut buf = Vec::new();
            // Progress lines end with CR, not LF.
            while r.read_until(b'\r', &mut buf).is_ok_and(|n| n > 0) {
                let line = String::from_utf8_lossy(&buf).trim().to_string();
                if line.contains("rps=") {
                    *l.lock().unwrap() = line;
                }
                buf.clear();
            }
        });
        Ok(Benchmark { proc, last })
    }

    /// "rps=…, avg …" from the latest progress line.
    fn progress(&self) -> String {
        let line = self.last.lock().unwrap().clone();
        let rps = line.split("rps=").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or("-");
        let avg = line.split("avg_msec=").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or("-");
        format!("redis-benchmark {rps} SET/s, {avg} ms avg")
    }
}

fn progress_line(t0: Instant, socket: &Path, writers: &writers::Writers, bench: &Benchmark) -> String {
    let rep = status(socket).and_then(|r| r.replication);
    let vm = match rep.as_ref().and_then(|r| r.last.map(|m| (r, m))) {
        Some((r, m)) => format!(
            "epoch {:5} {}: pause {:4} us, {:4} dirty pages, {:7.2} MB, ack {:5.1} ms, {:3} frames held up to {:4.1} ms",
            m.epoch,
            if r.protected { "protected" } else { "UNPROTECTED" },
            m.pause_us,
            m.dirty_pages,
            m.bytes as f64 / 1e6,
            m.ack_us as f64 / 1e3,
            m.frames_released,
            m.hold_us as f64 / 1e3
        ),
        None => match rep {
            Some(r) if r.role == ftvm_replication::Role::Primary && !r.protected => {
                format!("new primary since epoch {}, UNPROTECTED (no backup left)", r.epoch)
            }
            _ => "no epoch acknowledged yet".into(),
        },
    };
    format!("  t={:4.1}s  {vm} | {} acknowledged writes | {}", t0.elapsed().as_secs_f64(), writers.acked(), bench.progress())
}

/// redis-cli's reply to `args`, or why there is none.
fn redis_cli(topo: &Topology, args: &[&str]) -> String {
    match topo.redis_cli(GUEST, args) {
        (true, out) => out.trim().to_owned(),
        (false, out) => format!("(no reply) {}", out.trim()),
    }
}

fn demo(args: &DemoArgs, dir: &Path) -> Result<bool, Error> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (network namespaces, TAP devices)".into());
    }
    for tool in ["ip", "redis-cli", "redis-benchmark"] {
        if !which(tool) {
            return Err(format!("{tool} not found: run scripts/setup.sh"));
        }
    }
    let root = ftvm_testkit::repo_root().map_err(|e| e.to_string())?;
    let image = root.join("target/images/kv.elf");
    if !image.exists() {
        return Err(format!("{} missing: run scripts/build-images.sh", image.display()));
    }
    let ftvm = std::env::current_exe().map_err(|e| e.to_string())?;
    stop_requested(); // install the handler before starting anything

    outln!("== ftvm demo: a Redis-protocol VM that survives the death of its host");
    let topo = Topology::new("demo").map_err(|e| e.to_string())?;
    outln!(
        "network: namespaces {0}-{{client,h1,h2,lan}}; client 10.0.0.1 and the guest {GUEST} on one LAN, \
         hosts h1 and h2 joined by a replication link 192.168.100.1 <-> 192.168.100.2",
        topo.name()
    );
    let mut all_ok = true;
    let mut summary = Vec::new();
    for trial in 1..=args.trials {
        if args.trials > 1 {
            outln!("\n== failover {trial} of {}", args.trials);
        }
        let (ok, line) = trial_run(args, &topo, &ftvm, &image, dir, trial)?;
        all_ok &= ok;
        summary.push(line);
    }
    outln!();
    for s in &summary {
        outln!("{s}");
    }
    drop(topo);
    if all_ok {
        outln!("OK: every acknowledged write survived the loss of its host");
    } else {
        outln!("FAILED: acknowledged writes were lost");
    }
    Ok(all_ok)
}

fn trial_run(args: &DemoArgs, topo: &Topology, ftvm: &Path, image: &Path, dir: &Path, trial: u32) -> Result<(bool, String), Error> {
    topo.restore().map_err(|e| e.to_string())?;
    let backup_sock = dir.join(format!("backup{trial}.sock"));
    let primary_sock = dir.join(format!("primary{trial}.sock"));
    let net = format!("tap=tap0,mac={MAC}");
    let mut cmd = topo.command("h2", ftvm);
    cmd.args(["backup", "--listen", BACKUP_ADDR, "--net", &net, "--api-socket"]).arg(&backup_sock).env("FTVM_LOG", "info");
    let mut backup = spawn(cmd, dir, &format!("backup{trial}"))?;
    outln!("[h2] ftvm backup --listen {BACKUP_ADDR} --net {net}");
    let mut cmd = topo.command("h1", ftvm);
    cmd.args(["run", "--image"])
        .arg(image)
        .args(["--net", &net, "--cmdline", &format!("ip={GUEST}/24"), "--replicate-to", BACKUP_ADDR])
        .args(["--epoch-ms", &args.epoch_ms.to_string(), "--api-socket"])
        .arg(&primary_sock)
        .arg("--metrics")
        .arg(dir.join(format!("primary{trial}.jsonl")))
        .env("FTVM_LOG", "info");
    let t_start = Instant::now();
    let mut primary = spawn(cmd, dir, &format!("primary{trial}"))?;
    outln!("[h1] ftvm run --image kv.elf --net {net} --replicate-to {BACKUP_ADDR} --epoch-ms {}", args.epoch_ms);
    loop {
        if status(&primary_sock).and_then(|r| r.replication).is_some_and(|r| r.protected) {
            break;
        }
        if !primary.running() || !backup.running() || t_start.elapsed() > Duration::from_secs(20) {
            return Err(format!("the primary did not get protected:\n{}\n{}", primary.stderr(), backup.stderr()));
        }
        sleep(Duration::from_millis(20))?;
    }
    outln!("     protected after {} ms (pre-copy, then the first checkpoint)", t_start.elapsed().as_millis());
    topo.forget_guest().map_err(|e| e.to_string())?;
    let t = Instant::now();
    let reply = redis_cli(topo, &["SET", "demo:greeting", "hello"]);
    outln!("[client] redis-cli SET demo:greeting hello -> {reply} ({} ms)", t.elapsed().as_millis());

    let addr: SocketAddr = format!("{GUEST}:6379").parse().expect("address");
    let writers = writers::Writers::start(writers::Config {
        addr,
        netns: Some(topo.ns("client")),
        connections: 4,
        pipeline: 4,
        value_len: VALUE_LEN,
        prefix: format!("demo{trial}"),
        timeout: Duration::from_millis(500),
    })
    .map_err(|e| e.to_string())?;
    let bench = Benchmark::start(topo)?;
    outln!("[client] load: redis-benchmark (8 connections of SETs) and 4 tracked writers (unique keys, each +OK recorded)");
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < args.seconds {
        sleep(Duration::from_millis(1000).min(Duration::from_secs_f64((args.seconds - t0.elapsed().as_secs_f64()).max(0.0))))?;
        outln!("{}", progress_line(t0, &primary_sock, &writers, &bench));
    }

    // The host dies: its network first, then its VMM.
    let pid = primary.id() as i32;
    let killed_at = netns::run_in(&topo.ns("h1"), move || {
        let _ = netns::del_link("repl");
        let _ = netns::del_link("uplink");
        let at = Instant::now();
        // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our
        // child, not reaped yet, so the number cannot name another process.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        at
    })
    .map_err(|e| e.to_string())?;
    writers.mark(killed_at);
    primary.kill();
    let acked_before = writers.acked();
    outln!(
        "[h1] HOST DIES at t={:.1}s: links repl and uplink deleted, VMM SIGKILLed ({acked_before} writes acknowledged so far)",
        t0.elapsed().as_secs_f64()
    );

    // Time to the first reply from the new primary, on fresh connections.
    let served = netns::run_in(&topo.ns("client"), move || {
        while killed_at.elapsed() < Duration::from_secs(20) {
            // Short timeouts: a SYN to the dead host is not worth waiting for.
            if let Ok(mut c) = resp::Client::connect(addr, Duration::from_millis(10)) {
                let _ = c.set_timeout(Duration::from_millis(100));
                if matches!(c.call(&[b"PING"]), Ok(resp::Reply::Simple(ref s)) if s == "PONG") {
                    return Some(Instant::now());
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        None
    })
    .map_err(|e| e.to_string())?;
    let took_over = backup.stderr().lines().find(|l| l.contains("PRIMARY LOST")).map(|l| {
        let l = l.split("PRIMARY LOST").nth(1).unwrap_or(l);
        format!("PRIMARY LOST{l}")
    });
    match (&served, &took_over) {
        (Some(t), Some(line)) => {
            outln!("[h2] {line}");
            outln!("     first reply from the new primary {:.0} ms after the kill", (*t - killed_at).as_secs_f64() * 1e3);
        }
        _ => {
            return Err(format!("the backup did not take over:\n{}", backup.stderr()));
        }
    }
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_secs(2) {
        sleep(Duration::from_millis(500))?;
        outln!("{}", progress_line(t0, &backup_sock, &writers, &bench));
    }
    let resumed = writers.first_ack_after_mark().map(|t| (t - killed_at).as_secs_f64() * 1e3);
    let report = writers.stop();
    let mut bench = bench;
    bench.proc.kill();
    outln!(
        "[client] tracked writers: first write acknowledged by the new primary {} after the kill; {} of {} writes acknowledged",
        resumed.map_or("never".into(), |ms| format!("{ms:.0} ms")),
        report.acked.len(),
        report.sent
    );
    outln!("[client] redis-cli GET demo:greeting -> {}", redis_cli(topo, &["GET", "demo:greeting"]));

    let verified = writers::verify(addr, Some(&topo.ns("client")), &report.acked, VALUE_LEN, Instant::now() + Duration::from_secs(10))
        .map_err(|e| format!("reading back: {e}"))?;
    let ok = verified.lost() == 0 && verified.checked == report.acked.len();
    outln!(
        "verify: acknowledged {} ({acked_before} before the kill, the rest by the new primary), verified {}, lost {}{}",
        report.acked.len(),
        verified.checked - verified.lost(),
        verified.lost(),
        if verified.lost() > 0 {
            format!(" (e.g. {:?})", verified.missing.iter().chain(&verified.wrong).take(3).collect::<Vec<_>>())
        } else {
            String::new()
        }
    );
    if let Some(r) = status(&backup_sock).and_then(|r| r.replication) {
        outln!("[h2] ftvm status: role {}, protected {}: {}", r.role, if r.protected { "yes" } else { "no" }, r.detail);
    }
    backup.kill();
    let mut dump = String::new();
    let _ = File::open(dir.join(format!("primary{trial}.jsonl"))).and_then(|mut f| f.read_to_string(&mut dump));
    let epochs = dump.lines().count();
    let line = format!(
        "failover {trial}: {epochs} epochs checkpointed, first reply {:.0} ms after the kill; acknowledged {}, verified {}, lost {}",
        served.map_or(f64::NAN, |t| (t - killed_at).as_secs_f64() * 1e3),
        report.acked.len(),
        verified.checked - verified.lost(),
        verified.lost()
    );
    Ok((ok, line))
}
