//! `ftvm demo`: a replicated Redis-protocol VM survives the death of its
//! host, and a stalled primary is fenced, on this machine.
//!
//! It builds a private network from namespaces (`scripts/netns.sh`): a
//! client, two hosts h1 and h2 on one LAN, and a replication link between
//! the hosts, and starts a private etcd, the arbiter that decides who owns
//! the VM. A backup waits in h2; the primary runs the guest in h1 (the kv
//! guest, or with `--app redis` the unmodified static redis-server on the
//! runtime's Linux personality) and checkpoints it to h2 over an
//! authenticated channel (a shared secret file) whenever the guest has
//! output waiting and is idle (at the latest every epoch), holding the
//! guest's network output until the backup has
//! the state that produced it. From the client, redis-benchmark loads the
//! guest while tracked writers record every write whose `+OK` arrived.
//! Then one of two failures, each with a fresh primary and backup:
//!
//! - the host dies: h1's links are cut and its VMM is SIGKILLed; the backup
//!   wins ownership from the arbiter and takes over;
//! - the primary stalls: its VMM is SIGSTOPped for about a second while its
//!   links stay up; the backup takes over as above, and when the old primary
//!   is SIGCONTed it finds it lost ownership and stops (`lost ownership of
//!   the VM`, non-zero exit) without emitting anything.
//!
//! After each, every acknowledged write is read back from the new primary.
//! Exit status 0 only if none was lost and the stalled primary was fenced.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod fleet;

use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR as GUEST, GUEST_MAC as MAC, H2_REPL_ADDR};
use ftvm_testkit::{netns, resp, writers};

use ftvm_primary_backup::PrimaryConfig;

use crate::api;
use crate::cli::values::{at_least_one, default_text, epoch_ms, positive_seconds};
use crate::output::{errln, outln};

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Rounds to run (at least 1); each runs both scenarios (the primary's
    /// host dies, then the primary stalls), each with a fresh primary and backup.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = at_least_one)]
    trials: u32,
    /// Longest epoch of the primary (its --epoch-ms), in milliseconds.
    #[arg(long = "epoch-ms", default_value = default_text!(PrimaryConfig::DEFAULT_EPOCH, as_millis), value_name = "MS", value_parser = epoch_ms)]
    epoch: Duration,
    /// Seconds of load before each failure.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS", value_parser = positive_seconds)]
    seconds: f64,
    /// The guest: `kv` (the ftvm runtime's Redis-protocol server) or `redis`
    /// (the unmodified static redis-server 6.2 built by
    /// scripts/build-redis.sh, on the runtime's Linux personality).
    #[arg(long, value_enum, default_value_t = App::Kv)]
    app: App,
    /// The soak (`ftvm-bench soak`): every round runs all four failures (the
    /// primary's VMM killed, its host dies, it stalls, the replication link
    /// is cut) in a random order, each after a random 1 s to --seconds of load.
    #[arg(long)]
    soak: bool,
    /// The soak's random seed (default: a fresh one, printed, to run the same plan again).
    #[arg(long, value_name = "N", requires = "soak")]
    seed: Option<u64>,
    /// The fleet demo instead: four hosts with an agent each keep six VMs
    /// protected while two hosts die, one comes back and one is drained.
    #[arg(long, conflicts_with_all = ["soak", "app", "trials"])]
    fleet: bool,
    /// Append one JSON line per scenario (round, scenario, load, first reply,
    /// acknowledged, verified and lost writes, fenced) to this file.
    #[arg(long, value_name = "PATH")]
    results: Option<PathBuf>,
}

/// The guest the demo protects; both serve Redis's protocol on port 6379.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum App {
    Kv,
    Redis,
}

impl App {
    /// The image under the repository root, and what builds it.
    fn image(self) -> (&'static str, &'static str) {
        match self {
            App::Kv => ("target/images/kv.elf", "scripts/build-images.sh"),
            App::Redis => ("target/images/redis-server", "scripts/build-redis.sh"),
        }
    }

    /// `ftvm run` arguments after the image: memory and command line.
    fn run_args(self) -> Vec<String> {
        match self {
            // The tracked writers' keys are unique (1 KiB values, about
            // 200,000 of them in a run here): room for several times that.
            App::Kv => vec!["--memory".into(), "1024".into(), "--cmdline".into(), format!("ip={GUEST}/24")],
            App::Redis => vec![
                "--memory".into(),
                "512".into(),
                "--cmdline".into(),
                format!("ip={GUEST}/24 -- redis-server --port 6379 --save '' --protected-mode no"),
            ],
        }
    }

    fn what(self) -> &'static str {
        match self {
            App::Kv => "a Redis-protocol VM (the kv guest)",
            App::Redis => "an unmodified redis-server in a VM",
        }
    }
}

const BACKUP_ADDR: &str = "192.168.100.2:7000";
const VALUE_LEN: usize = 1024;

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
    let result = if args.fleet { fleet::run(dir.path(), args.seconds) } else { demo(&args, dir.path()) };
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
    api::client::call(socket, &api::Request::Status, api::client::DEFAULT_TIMEOUT).ok()
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
        // One long SET test: 8 connections, 256-byte values, random keys
        // from 100,000: what the guest holds stays bounded however fast it
        // serves (with a million it grew with the throughput until the kv
        // guest ran out of memory).
        cmd.args(["-h", GUEST, "-t", "set", "-c", "8", "-d", "256", "-r", "100000", "-n", "100000000"]);
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
            "epoch {:5} {}: {:5} after {:4.1} ms, pause {:4} us, {:4} dirty pages, {:7.2} MB, ack {:5.1} ms, {:3} frames held up to {:4.1} ms",
            m.epoch,
            if r.protected { "protected" } else { "UNPROTECTED" },
            m.trigger.to_string(),
            m.epoch_us as f64 / 1e3,
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

/// The failures the demo shows (the first two), and the soak's.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// h1 dies: its links are cut and its VMM is SIGKILLed.
    HostDies,
    /// The primary's VMM is SIGSTOPped, its links up, then SIGCONTed.
    PrimaryStalls,
    /// The primary's VMM is SIGKILLed, its host and links up.
    VmmKilled,
    /// The replication link goes down on h1 (its VMM runs on, the LAN is up,
    /// the arbiter unreachable from it), then comes back.
    LinkCut,
}

impl Scenario {
    const DEMO: [Scenario; 2] = [Scenario::HostDies, Scenario::PrimaryStalls];
    const SOAK: [Scenario; 4] = [Scenario::VmmKilled, Scenario::HostDies, Scenario::PrimaryStalls, Scenario::LinkCut];

    fn title(self) -> &'static str {
        match self {
            Scenario::HostDies => "the primary's host dies",
            Scenario::PrimaryStalls => "the primary stalls",
            Scenario::VmmKilled => "the primary's VMM is killed",
            Scenario::LinkCut => "the replication link is cut",
        }
    }

    /// For file names and writer keys.
    fn tag(self) -> &'static str {
        match self {
            Scenario::HostDies => "hostdeath",
            Scenario::PrimaryStalls => "stall",
            Scenario::VmmKilled => "kill",
            Scenario::LinkCut => "linkcut",
        }
    }
}

/// The scenarios to run, in order, each with its seconds of load: the demo's
/// two per round, or the soak's four per round in a random order.
fn plan(args: &DemoArgs, seed: u64) -> Vec<(u32, Scenario, f64)> {
    let mut rng = seed | 1;
    let mut next = move || {
        // xorshift64: reproducible from the printed seed, nothing more needed.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut plan = Vec::new();
    for round in 1..=args.trials {
        if !args.soak {
            plan.extend(Scenario::DEMO.map(|s| (round, s, args.seconds)));
            continue;
        }
        let mut kinds = Scenario::SOAK;
        for i in (1..kinds.len()).rev() {
            kinds.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        for kind in kinds {
            let seconds = if args.seconds <= 1.0 { args.seconds } else { 1.0 + (next() % 1000) as f64 / 1000.0 * (args.seconds - 1.0) };
            plan.push((round, kind, seconds));
        }
    }
    plan
}

/// What every scenario runs with.
struct Setup<'a> {
    args: &'a DemoArgs,
    topo: &'a Topology,
    ftvm: PathBuf,
    image: PathBuf,
    dir: &'a Path,
    secret: PathBuf,
    /// The arbiter as the primary on h1 reaches it, and as the backup on h2 does.
    arbiter_h1: String,
    arbiter_h2: String,
    /// The backup's failure timeout, passed explicitly so the stall can be
    /// made longer than it.
    backup_timeout: Duration,
}

/// How one scenario ended.
struct Outcome {
    lost: usize,
    acknowledged: usize,
    /// From the failure to the first reply from the new primary.
    first_reply_ms: f64,
    /// The stalled primary stopped on its own, non-zero, for lost
    /// ownership (always true for a host death).
    fenced: bool,
    summary: String,
}

/// A shared secret for the replication channel: 32 random bytes in a new
/// file only its owner can read (ftvm refuses one that group or others can).
fn write_secret(path: &Path) -> Result<(), Error> {
    let bytes: [u8; 32] = random()?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(&bytes))
        .map_err(|e| format!("writing the secret {}: {e}", path.display()))
}

/// `N` random bytes from the kernel.
fn random<const N: usize>() -> Result<[u8; N], Error> {
    let mut bytes = [0u8; N];
    File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).map_err(|e| format!("reading /dev/urandom: {e}"))?;
    Ok(bytes)
}

fn demo(args: &DemoArgs, dir: &Path) -> Result<bool, Error> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (network namespaces, TAP devices)".into());
    }
    for tool in ["ip", "redis-cli", "redis-benchmark", "etcd"] {
        if !which(tool) {
            return Err(format!("{tool} not found: run scripts/setup.sh"));
        }
    }
    let root = ftvm_testkit::repo_root().map_err(|e| e.to_string())?;
    let (image, build) = args.app.image();
    let image = root.join(image);
    if !image.exists() {
        return Err(format!("{} missing: run {build}", image.display()));
    }
    let ftvm = std::env::current_exe().map_err(|e| e.to_string())?;
    stop_requested(); // install the handler before starting anything

    outln!("== ftvm demo: {} that survives the death of its host, and a stalled primary fenced by the arbiter", args.app.what());
    let topo = Topology::new("demo").map_err(|e| e.to_string())?;
    outln!(
        "network: namespaces {0}-{{client,h1,h2,lan}}; client 10.0.0.1 and the guest {GUEST} on one LAN, \
         hosts h1 and h2 joined by a replication link 192.168.100.1 <-> {H2_REPL_ADDR}",
        topo.name()
    );
    // The arbiter runs in h2's namespace: the namespaces share no link with
    // the root namespace, and h2 is the one host every scenario keeps. It
    // serves the primary on h2's replication-link address, the only one h1
    // can reach (the hosts have no address on the LAN), and the backup on
    // h2's loopback: when h1 dies its end of the link is deleted, the veth
    // goes with it, and the backup, which must win ownership at the arbiter
    // before taking over, would lose the replication-link address with it.
    // Next to the backup it also decides a cut link right: the backup wins,
    // the primary cannot reach the arbiter and keeps its output held.
    let etcd = Etcd::start_in(dir, &topo.ns("h2"), &[H2_REPL_ADDR, "127.0.0.1"]).map_err(|e| e.to_string())?;
    let (arbiter_h1, arbiter_h2) = (etcd.endpoint().to_owned(), etcd.endpoint_on("127.0.0.1"));
    outln!("arbiter: etcd in {}, reached by h1 at {arbiter_h1} and by h2 at {arbiter_h2}", topo.ns("h2"));
    let secret = dir.join("secret");
    write_secret(&secret)?;
    outln!("secret: 32 random bytes in {} (mode 0600): both sides authenticate the replication channel with it", secret.display());
    let setup = Setup {
        args,
        topo: &topo,
        ftvm,
        image,
        dir,
        secret,
        arbiter_h1,
        arbiter_h2,
        backup_timeout: ftvm_replication::liveness::DEFAULT_FAILURE_TIMEOUT,
    };

    let seed = match args.seed {
        Some(seed) => seed,
        None => u64::from_le_bytes(random()?),
    };
    if args.soak {
        outln!("soak: {} rounds of four failures in a random order, seed {seed} (--seed {seed} runs the same plan)", args.trials);
    }
    let (mut lost, mut unfenced) = (0, 0);
    let mut summary = Vec::new();
    let per_round = if args.soak { Scenario::SOAK.len() } else { Scenario::DEMO.len() };
    for (i, (trial, scenario, seconds)) in plan(args, seed).into_iter().enumerate() {
        let round = if args.trials > 1 { format!(", round {trial} of {}", args.trials) } else { String::new() };
        outln!("\n== scenario {}{round}: {}", i % per_round + 1, scenario.title());
        let outcome = scenario_run(&setup, trial, scenario, seconds)?;
        lost += outcome.lost;
        unfenced += usize::from(!outcome.fenced);
        if let Some(path) = &args.results {
            let line = serde_json::json!({
                "round": trial,
                "scenario": scenario.tag(),
                "load_s": seconds,
                "first_reply_ms": outcome.first_reply_ms,
                "acknowledged": outcome.acknowledged,
                "lost": outcome.lost,
                "fenced": outcome.fenced,
            });
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| writeln!(f, "{line}"))
                .map_err(|e| format!("--results {}: {e}", path.display()))?;
        }
        summary.push(outcome.summary);
    }
    outln!();
    for s in &summary {
        outln!("{s}");
    }
    drop(etcd);
    drop(topo);
    if lost == 0 && unfenced == 0 {
        if args.soak {
            outln!("OK: every acknowledged write survived {} failures, and every old primary that lived on was fenced", summary.len());
        } else {
            outln!(
                "OK: every acknowledged write survived the loss of its host and the stall of its primary, and the stalled primary was fenced"
            );
        }
        return Ok(true);
    }
    let mut why = Vec::new();
    if lost > 0 {
        why.push(format!("{lost} acknowledged writes were lost"));
    }
    if unfenced > 0 {
        why.push(format!("{unfenced} old primaries that lived on were not fenced"));
    }
    outln!("FAILED: {}", why.join("; "));
    Ok(false)
}

/// Take h1's end of the replication link down or up (a partition between
/// the hosts; h2 keeps its address, as when a switch port fails).
fn set_repl_link(topo: &Topology, state: &str) -> Result<(), Error> {
    let ok = Command::new("ip").args(["-n", &topo.ns("h1"), "link", "set", "repl", state]).status().is_ok_and(|s| s.success());
    ok.then_some(()).ok_or_else(|| format!("cannot set h1's replication link {state}"))
}

/// From the client, on fresh connections, until one gets PONG: when the
/// new primary served its first reply (None after 20 s).
fn first_reply(
    topo: &Topology,
    addr: SocketAddr,
    since: Instant,
) -> Result<std::thread::JoinHandle<std::io::Result<Option<Instant>>>, Error> {
    netns::spawn_in(&topo.ns("client"), "first-reply", move || {
        while since.elapsed() < Duration::from_secs(20) {
            // Short timeouts: a SYN to the dead or stopped VMM is not worth waiting for.
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
    .map_err(|e| e.to_string())
}

/// The first line of `log` mentioning `what`, from `what` on (without the
/// log's time and level).
fn log_line(log: &str, what: &str) -> Option<String> {
    log.lines().find_map(|l| l.find(what).map(|i| l[i..].trim().to_owned()))
}

/// Wait up to `timeout` for `p` to exit by itself.
fn exited_within(p: &mut Process, timeout: Duration) -> Result<Option<std::process::ExitStatus>, Error> {
    let t0 = Instant::now();
    loop {
        if let Some(status) = p.try_wait() {
            return Ok(Some(status));
        }
        if t0.elapsed() >= timeout {
            return Ok(None);
        }
        sleep(Duration::from_millis(20))?;
    }
}

fn scenario_run(s: &Setup, trial: u32, scenario: Scenario, seconds: f64) -> Result<Outcome, Error> {
    let (args, topo, dir) = (s.args, s.topo, s.dir);
    let tag = format!("{}{trial}", scenario.tag());
    topo.restore().map_err(|e| e.to_string())?;
    let backup_sock = dir.join(format!("backup-{tag}.sock"));
    let primary_sock = dir.join(format!("primary-{tag}.sock"));
    let net = format!("tap=tap0,mac={MAC}");
    let secret = s.secret.display().to_string();
    let timeout = s.backup_timeout.as_millis().to_string();
    let mut cmd = topo.command("h2", &s.ftvm);
    cmd.args(["backup", "--listen", BACKUP_ADDR, "--net", &net, "--failure-timeout-ms", &timeout])
        .args(["--arbiter", &s.arbiter_h2, "--secret-file", &secret, "--api-socket"])
        .arg(&backup_sock)
        .env("FTVM_LOG", "info");
    let mut backup = spawn(cmd, dir, &format!("backup-{tag}"))?;
    outln!(
        "[h2] ftvm backup --listen {BACKUP_ADDR} --net {net} --failure-timeout-ms {timeout} --arbiter {} --secret-file {secret}",
        s.arbiter_h2
    );
    let mut cmd = topo.command("h1", &s.ftvm);
    let app_args = args.app.run_args();
    cmd.args(["run", "--image"])
        .arg(&s.image)
        .args(&app_args)
        .args(["--net", &net, "--replicate-to", BACKUP_ADDR])
        .args(["--epoch-ms", &args.epoch.as_millis().to_string(), "--arbiter", &s.arbiter_h1, "--secret-file", &secret, "--api-socket"])
        .arg(&primary_sock)
        .arg("--metrics")
        .arg(dir.join(format!("primary-{tag}.jsonl")))
        .env("FTVM_LOG", "info");
    let t_start = Instant::now();
    let mut primary = spawn(cmd, dir, &format!("primary-{tag}"))?;
    let shown: Vec<String> = app_args.iter().map(|a| if a.contains(' ') { format!("\"{a}\"") } else { a.clone() }).collect();
    outln!(
        "[h1] ftvm run --image {} {} --net {net} --replicate-to {BACKUP_ADDR} --epoch-ms {} --arbiter {} --secret-file {secret}",
        s.image.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()),
        shown.join(" "),
        args.epoch.as_millis(),
        s.arbiter_h1
    );
    loop {
        if status(&primary_sock).and_then(|r| r.replication).is_some_and(|r| r.protected) {
            break;
        }
        if !primary.running() || !backup.running() || t_start.elapsed() > Duration::from_secs(20) {
            return Err(format!("the primary did not get protected:\n{}\n{}", primary.stderr(), backup.stderr()));
        }
        sleep(Duration::from_millis(20))?;
    }
    let owner = log_line(&primary.stderr(), "this primary owns the VM").unwrap_or_default();
    outln!("     protected after {} ms (authenticated, pre-copy, then the first checkpoint); {owner}", t_start.elapsed().as_millis());
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
        prefix: format!("demo-{tag}"),
        timeout: Duration::from_millis(500),
    })
    .map_err(|e| e.to_string())?;
    let bench = Benchmark::start(topo)?;
    outln!("[client] load: redis-benchmark (8 connections of SETs) and 4 tracked writers (unique keys, each +OK recorded)");
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < seconds {
        sleep(Duration::from_millis(1000).min(Duration::from_secs_f64((seconds - t0.elapsed().as_secs_f64()).max(0.0))))?;
        outln!("{}", progress_line(t0, &primary_sock, &writers, &bench));
    }

    let pid = primary.id() as i32;
    let failed_at = match scenario {
        // The host dies: its network first, then its VMM.
        Scenario::HostDies => {
            let at = netns::run_in(&topo.ns("h1"), move || {
                let _ = netns::del_link("repl");
                let _ = netns::del_link("uplink");
                let at = Instant::now();
                // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our
                // child, not reaped yet, so the number cannot name another process.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                at
            })
            .map_err(|e| e.to_string())?;
            primary.kill();
            at
        }
        // The VMM stops where it is; its host and links stay up.
        Scenario::PrimaryStalls => {
            let at = Instant::now();
            primary.signal(libc::SIGSTOP).map_err(|e| format!("SIGSTOP to the primary: {e}"))?;
            at
        }
        Scenario::VmmKilled => {
            let at = Instant::now();
            primary.kill();
            at
        }
        Scenario::LinkCut => {
            let at = Instant::now();
            set_repl_link(topo, "down")?;
            at
        }
    };
    writers.mark(failed_at);
    let probe = first_reply(topo, addr, failed_at)?;
    let acked_before = writers.acked();
    let when = format!("t={:.1}s", (failed_at - t0).as_secs_f64());
    let stall = (s.backup_timeout + Duration::from_millis(800)).max(Duration::from_secs(1));
    let event = match scenario {
        Scenario::HostDies => {
            outln!("[h1] HOST DIES at {when}: links repl and uplink deleted, VMM SIGKILLed ({acked_before} writes acknowledged so far)");
            "the kill"
        }
        Scenario::VmmKilled => {
            outln!("[h1] VMM KILLED at {when}: SIGKILL, its host and links up ({acked_before} writes acknowledged so far)");
            "the kill"
        }
        Scenario::LinkCut => {
            outln!(
                "[h1] REPLICATION LINK CUT at {when} for {} ms: h1 reaches neither the backup nor the arbiter, its LAN link stays up \
                 ({acked_before} writes acknowledged so far)",
                stall.as_millis()
            );
            sleep(stall)?;
            "the cut"
        }
        Scenario::PrimaryStalls => {
            outln!(
                "[h1] PRIMARY STALLS at {when}: VMM SIGSTOPped for {} ms, longer than the backup's failure timeout ({} ms); \
                 its links stay up ({acked_before} writes acknowledged so far)",
                stall.as_millis(),
                s.backup_timeout.as_millis()
            );
            sleep(stall)?;
            "the stall began"
        }
    };
    let served = probe.join().map_err(|_| "the first-reply probe panicked".to_string())?.map_err(|e| e.to_string())?;
    let took_over = log_line(&backup.stderr(), "PRIMARY LOST");
    match (&served, &took_over) {
        (Some(t), Some(line)) => {
            let won = log_line(&backup.stderr(), "this backup owns the VM now").unwrap_or_default();
            outln!("[h2] {line}");
            outln!("[h2] {won} (won at the arbiter before taking over)");
            outln!("     first reply from the new primary {:.0} ms after {event}", (*t - failed_at).as_secs_f64() * 1e3);
        }
        _ => {
            return Err(format!("the backup did not take over:\n{}", backup.stderr()));
        }
    }

    // The stalled primary resumes: it must find it lost the VM and stop.
    let mut fence_note = String::new();
    let fenced = match scenario {
        Scenario::HostDies | Scenario::VmmKilled => true,
        Scenario::PrimaryStalls | Scenario::LinkCut => {
            let resumed = if scenario == Scenario::PrimaryStalls {
                primary.signal(libc::SIGCONT).map_err(|e| format!("SIGCONT to the primary: {e}"))?;
                let resumed = Instant::now();
                outln!("[h1] VMM SIGCONTed after {} ms: the old primary resumes with its links up", (resumed - failed_at).as_millis());
                resumed
            } else {
                set_repl_link(topo, "up")?;
                let resumed = Instant::now();
                outln!(
                    "[h1] replication link up again after {} ms: the old primary reaches the arbiter",
                    (resumed - failed_at).as_millis()
                );
                resumed
            };
            let exit = exited_within(&mut primary, Duration::from_secs(10))?;
            let err = primary.stderr();
            let line = err
                .lines()
                // Its last words: `ftvm: VM failed: this side lost ownership of the VM ...`.
                .find(|l| l.starts_with("ftvm:") && l.contains("lost ownership of the VM"))
                .map(str::to_owned)
                .or_else(|| log_line(&err, "lost ownership of the VM"));
            let released = err.contains("BACKUP LOST");
            match (exit, &line) {
                (Some(status), Some(line)) if !status.success() && !released => {
                    let code = status.code().map_or_else(|| format!("signal {}", status.signal().unwrap_or(0)), |c| c.to_string());
                    outln!("[h1] {line}");
                    outln!("     FENCED: the old primary exited with status {code}, {} ms after it resumed", resumed.elapsed().as_millis());
                    fence_note = format!("old primary fenced (exit {code}); ");
                    true
                }
                (exit, _) => {
                    let how = match exit {
                        None => "is still running 10 s after it resumed".to_string(),
                        Some(status) => format!("exited ({status}) without saying it lost ownership"),
                    };
                    outln!("[h1] NOT FENCED: the old primary {how}{}", if released { " and ran on as BACKUP LOST" } else { "" });
                    fence_note = "old primary NOT FENCED; ".into();
                    primary.kill();
                    false
                }
            }
        }
    };

    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_secs(2) {
        sleep(Duration::from_millis(500))?;
        outln!("{}", progress_line(t0, &backup_sock, &writers, &bench));
    }
    let resumed = writers.first_ack_after_mark().map(|t| (t - failed_at).as_secs_f64() * 1e3);
    let report = writers.stop();
    let mut bench = bench;
    bench.proc.kill();
    outln!(
        "[client] tracked writers: first write acknowledged by the new primary {} after {event}; {} of {} writes acknowledged",
        resumed.map_or("never".into(), |ms| format!("{ms:.0} ms")),
        report.acked.len(),
        report.sent
    );
    outln!("[client] redis-cli GET demo:greeting -> {}", redis_cli(topo, &["GET", "demo:greeting"]));

    let verified = writers::verify(addr, Some(&topo.ns("client")), &report.acked, VALUE_LEN, Instant::now() + Duration::from_secs(10))
        .map_err(|e| format!("reading back: {e}"))?;
    // A key not checked counts as lost.
    let lost = verified.lost() + report.acked.len().saturating_sub(verified.checked);
    outln!(
        "verify: acknowledged {} ({acked_before} before {event}, the rest by the new primary), verified {}, lost {lost}{}",
        report.acked.len(),
        verified.checked - verified.lost(),
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
    let _ = File::open(dir.join(format!("primary-{tag}.jsonl"))).and_then(|mut f| f.read_to_string(&mut dump));
    // One line per second, each counting its epochs (--metrics' default).
    let epochs: u64 = dump.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["count"].as_u64()).sum();
    let round = if args.trials > 1 { format!(" (round {trial})") } else { String::new() };
    let summary = format!(
        "{:<28} {epochs} epochs checkpointed, first reply {:.0} ms after {event}; {fence_note}acknowledged {}, verified {}, lost {lost}",
        format!("{}{round}:", scenario.title()),
        served.map_or(f64::NAN, |t| (t - failed_at).as_secs_f64() * 1e3),
        report.acked.len(),
        verified.checked - verified.lost(),
    );
    let first_reply_ms = served.map_or(f64::NAN, |t| (t - failed_at).as_secs_f64() * 1e3);
    Ok(Outcome { lost, acknowledged: report.acked.len(), first_reply_ms, fenced, summary })
}
