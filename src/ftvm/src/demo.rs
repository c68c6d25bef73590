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

pub mod netns;
pub mod resp;
pub mod writer;

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::api;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Failovers to run, each with a fresh primary and backup.
    #[arg(long, default_value_t = 1)]
    trials: u32,
    /// Checkpoint interval of the primary, in milliseconds.
    #[arg(long, default_value_t = 20)]
    epoch_ms: u64,
    /// Seconds of load before the primary's host is killed.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
}

const GUEST: &str = "10.0.0.2";
const MAC: &str = "52:54:00:12:34:56";
const BACKUP_ADDR: &str = "192.168.100.2:7000";
const VALUE_LEN: usize = 1024;

type Error = String;

/// Entry point: prints the story, returns the exit status.
pub fn run(args: DemoArgs) -> i32 {
    let dir = std::env::temp_dir().join(format!("ftvm-demo-{}", std::process::id()));
    let result = demo(&args, &dir);
    let keep = matches!(&result, Ok(false)) || matches!(&result, Err(e) if e != INTERRUPTED);
    if keep && dir.exists() {
        eprintln!("ftvm: demo: logs kept in {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    match result {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("ftvm: error: demo: {e}");
            1
        }
    }
}

const INTERRUPTED: &str = "interrupted";

/// The repository: the binary is ROOT/target/release/ftvm (or .../debug).
fn repo_root() -> Result<PathBuf, Error> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let candidates = [
        exe.parent().and_then(Path::parent).and_then(Path::parent).map(Path::to_path_buf),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|r| r.join("scripts/netns.sh").exists())
        .ok_or_else(|| "cannot find scripts/netns.sh next to this ftvm (run it as target/release/ftvm of a checkout)".into())
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

/// The namespaces, torn down on Drop.
struct Topology {
    script: PathBuf,
    name: String,
}

impl Topology {
    fn up(script: PathBuf) -> Result<Topology, Error> {
        let name = format!("demo{:04x}", std::process::id() & 0xffff);
        let topo = Topology { script, name };
        // A namespace of this name left by an interrupted demo goes first.
        let _ = Command::new(&topo.script).arg("down").arg(&topo.name).output();
        let out = Command::new(&topo.script).arg("up").arg(&topo.name).output().map_err(|e| format!("netns.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!("netns.sh up {}: {}", topo.name, String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(topo)
    }

    fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.name)
    }

    fn command(&self, role: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(role)]).arg(program);
        c
    }

    /// Links deleted by a kill come back. A new bridge port forwards only
    /// once the kernel has seen its carrier (linkwatch, up to a second
    /// later); until then the LAN silently drops frames, so wait for it.
    fn restore(&self) -> Result<(), Error> {
        let out = Command::new(&self.script).arg("up").arg(&self.name).output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("netns.sh up: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (role, dev) in [("lan", "client"), ("lan", "h1"), ("lan", "h2"), ("h1", "uplink"), ("h2", "uplink")] {
            loop {
                let out =
                    Command::new("bridge").args(["-n", &self.ns(role), "link", "show", "dev", dev]).output().map_err(|e| e.to_string())?;
                if String::from_utf8_lossy(&out.stdout).contains("state forwarding") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("bridge port {dev} in {} does not forward", self.ns(role)));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// The client forgets where the guest was (once a new guest runs:
    /// connections of a previous failover still retransmit, and an ARP
    /// request nobody answers would hold new connections for a second).
    fn forget_guest(&self) {
        let _ = Command::new("ip").args(["-n", &self.ns("client"), "neigh", "flush", "all"]).output();
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let _ = Command::new(&self.script).arg("down").arg(&self.name).output();
    }
}

/// A child process SIGKILLed and reaped on Drop.
struct Proc {
    child: Child,
    stderr: PathBuf,
}

impl Proc {
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn(mut cmd: Command, dir: &Path, name: &str) -> Result<Proc, Error> {
    let stderr = dir.join(format!("{name}.err"));
    let out = File::create(dir.join(format!("{name}.out"))).map_err(|e| e.to_string())?;
    let err = File::create(&stderr).map_err(|e| e.to_string())?;
    let child = cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().map_err(|e| format!("cannot start {name}: {e}"))?;
    Ok(Proc { child, stderr })
}

fn status(socket: &Path) -> Option<api::Response> {
    api::client::call(socket, &api::Request::Status).ok()
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
    proc: Proc,
    last: Arc<Mutex<String>>,
}

impl Benchmark {
    fn start(topo: &Topology) -> Result<Benchmark, Error> {
        let mut cmd = topo.command("client", "redis-benchmark");
        // One long SET test: 8 connections, random keys, 256-byte values.
        cmd.args(["-h", GUEST, "-t", "set", "-c", "8", "-d", "256", "-r", "1000000", "-n", "100000000"]);
        let mut child =
            cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().map_err(|e| format!("redis-benchmark: {e}"))?;
        let out = child.stdout.take().expect("piped");
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
        Ok(Benchmark { proc: Proc { child, stderr: PathBuf::new() }, last })
    }

    /// "rps=…, avg …" from the latest progress line.
    fn progress(&self) -> String {
        let line = self.last.lock().unwrap().clone();
        let rps = line.split("rps=").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or("-");
        let avg = line.split("avg_msec=").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or("-");
        format!("redis-benchmark {rps} SET/s, {avg} ms avg")
    }
}

fn progress_line(t0: Instant, socket: &Path, writers: &writer::Writers, bench: &Benchmark) -> String {
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

fn redis_cli(topo: &Topology, args: &[&str]) -> String {
    let out = topo.command("client", "timeout").args(["10", "redis-cli", "-h", GUEST]).args(args).stdin(Stdio::null()).output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        Err(e) => format!("(redis-cli failed: {e})"),
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
    let root = repo_root()?;
    let image = root.join("target/images/kv.elf");
    if !image.exists() {
        return Err(format!("{} missing: run scripts/build-images.sh", image.display()));
    }
    let ftvm = std::env::current_exe().map_err(|e| e.to_string())?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    stop_requested(); // install the handler before starting anything

    println!("== ftvm demo: a Redis-protocol VM that survives the death of its host");
    let topo = Topology::up(root.join("scripts/netns.sh"))?;
    println!(
        "network: namespaces {0}-{{client,h1,h2,lan}}; client 10.0.0.1 and the guest {GUEST} on one LAN, \
         hosts h1 and h2 joined by a replication link 192.168.100.1 <-> 192.168.100.2",
        topo.name
    );
    let mut all_ok = true;
    let mut summary = Vec::new();
    for trial in 1..=args.trials {
        if args.trials > 1 {
            println!("\n== failover {trial} of {}", args.trials);
        }
        let (ok, line) = trial_run(args, &topo, &ftvm, &image, dir, trial)?;
        all_ok &= ok;
        summary.push(line);
    }
    println!();
    for s in &summary {
        println!("{s}");
    }
    drop(topo);
    if all_ok {
        println!("OK: every acknowledged write survived the loss of its host");
    } else {
        println!("FAILED: acknowledged writes were lost");
    }
    Ok(all_ok)
}

fn trial_run(args: &DemoArgs, topo: &Topology, ftvm: &Path, image: &Path, dir: &Path, trial: u32) -> Result<(bool, String), Error> {
    topo.restore()?;
    let backup_sock = dir.join(format!("backup{trial}.sock"));
    let primary_sock = dir.join(format!("primary{trial}.sock"));
    let net = format!("tap=tap0,mac={MAC}");
    let mut cmd = topo.command("h2", ftvm);
    cmd.args(["backup", "--listen", BACKUP_ADDR, "--net", &net, "--api-socket"]).arg(&backup_sock).env("FTVM_LOG", "info");
    let mut backup = spawn(cmd, dir, &format!("backup{trial}"))?;
    println!("[h2] ftvm backup --listen {BACKUP_ADDR} --net {net}");
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
    println!("[h1] ftvm run --image kv.elf --net {net} --replicate-to {BACKUP_ADDR} --epoch-ms {}", args.epoch_ms);
    loop {
        if status(&primary_sock).and_then(|r| r.replication).is_some_and(|r| r.protected) {
            break;
        }
        if !primary.running() || !backup.running() || t_start.elapsed() > Duration::from_secs(20) {
            return Err(format!("the primary did not get protected:\n{}\n{}", primary.log(), backup.log()));
        }
        sleep(Duration::from_millis(20))?;
    }
    println!("     protected after {} ms (pre-copy, then the first checkpoint)", t_start.elapsed().as_millis());
    topo.forget_guest();
    let t = Instant::now();
    let reply = redis_cli(topo, &["SET", "demo:greeting", "hello"]);
    println!("[client] redis-cli SET demo:greeting hello -> {reply} ({} ms)", t.elapsed().as_millis());

    let addr: SocketAddr = format!("{GUEST}:6379").parse().expect("address");
    let writers = writer::Writers::start(writer::Config {
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
    println!("[client] load: redis-benchmark (8 connections of SETs) and 4 tracked writers (unique keys, each +OK recorded)");
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < args.seconds {
        sleep(Duration::from_millis(1000).min(Duration::from_secs_f64((args.seconds - t0.elapsed().as_secs_f64()).max(0.0))))?;
        println!("{}", progress_line(t0, &primary_sock, &writers, &bench));
    }

    // The host dies: its network first, then its VMM.
    let pid = primary.child.id() as i32;
    let killed_at = netns::run_in(&topo.ns("h1"), move || {
        let _ = netns::del_link("repl");
        let _ = netns::del_link("uplink");
        let at = Instant::now();
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        at
    })
    .map_err(|e| e.to_string())?;
    writers.mark(killed_at);
    primary.kill();
    let acked_before = writers.acked();
    println!(
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
    let took_over = backup.log().lines().find(|l| l.contains("PRIMARY LOST")).map(|l| {
        let l = l.split("PRIMARY LOST").nth(1).unwrap_or(l);
        format!("PRIMARY LOST{l}")
    });
    match (&served, &took_over) {
        (Some(t), Some(line)) => {
            println!("[h2] {line}");
            println!("     first reply from the new primary {:.0} ms after the kill", (*t - killed_at).as_secs_f64() * 1e3);
        }
        _ => {
            return Err(format!("the backup did not take over:\n{}", backup.log()));
        }
    }
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_secs(2) {
        sleep(Duration::from_millis(500))?;
        println!("{}", progress_line(t0, &backup_sock, &writers, &bench));
    }
    let resumed = writers.first_ack_after_mark().map(|t| (t - killed_at).as_secs_f64() * 1e3);
    let report = writers.stop();
    let mut bench = bench;
    bench.proc.kill();
    println!(
        "[client] tracked writers: first write acknowledged by the new primary {} after the kill; {} of {} writes acknowledged",
        resumed.map_or("never".into(), |ms| format!("{ms:.0} ms")),
        report.acked.len(),
        report.sent
    );
    println!("[client] redis-cli GET demo:greeting -> {}", redis_cli(topo, &["GET", "demo:greeting"]));

    let verified = writer::verify(addr, Some(&topo.ns("client")), &report.acked, VALUE_LEN, Instant::now() + Duration::from_secs(10))
        .map_err(|e| format!("reading back: {e}"))?;
    let ok = verified.lost() == 0 && verified.checked == report.acked.len();
    println!(
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
        println!("[h2] ftvm status: role {}, protected {}: {}", r.role, if r.protected { "yes" } else { "no" }, r.detail);
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
