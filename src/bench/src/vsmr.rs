//! Consensus-ordered replicas (PLOVER's VSMR) against primary-backup and
//! the unreplicated VM, all in one run: the kv guest under redis-benchmark
//! (SET and GET at each pipeline depth), throughput and p50/p99 latency as
//! ratios against the unreplicated VM, bytes on the replication links per
//! request, and for VSMR the share of dirty pages that diverged and the
//! interval between `syncvm`s. Last, per replicated setting, one failover:
//! the serving VMM (the primary, the VSMR leader) is SIGKILLed under 8
//! clients sending SETs back to back; the time to the first reply from
//! the new one, and (VSMR) how long the killed replica, restarted, takes
//! to protect the VM again and the pause of its full `syncvm`.
//!
//! One private topology (scripts/netns.sh): the serving VMM in `NAME-h1`,
//! the backup (primary-backup) or the secondary and the witness (VSMR) in
//! `NAME-h2`, redis-benchmark in `NAME-client`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC, H1_REPL_ADDR, H2_REPL_ADDR};

use crate::cores::Cores;
use crate::ft::failover::Clients;
use crate::paths::sibling_binary;
use crate::redis_benchmark::{self, Figures};
use crate::report::{self, Row};
use crate::threads;

type BoxError = Box<dyn std::error::Error>;

#[derive(clap::Args)]
pub struct Options {
    /// Requests per redis-benchmark run (-n), for SET and again for GET.
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    /// Parallel connections (-c).
    #[arg(long, default_value_t = 50)]
    clients: u32,
    /// Random keys from a keyspace this large (redis-benchmark -r); 0:
    /// every request uses the same key, as redis-benchmark does by default
    /// (a stream that compresses far better than real traffic).
    #[arg(long, default_value_t = 0)]
    keyspace: u32,
    /// Pipeline depths to measure (-P), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 16])]
    pipeline: Vec<u32>,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 64)]
    memory: u64,
    /// Primary-backup: `ftvm run` replication options (its best: sub-page
    /// diffs, changed state only, write prediction, the output trigger).
    #[arg(long, default_value = "--epoch-ms 20 --diff lz4 --device-state changed --predict-writes adaptive", allow_hyphen_values = true)]
    pb_flags: String,
    /// Primary-backup as PLOVER compared against (MC/Remus): whole pages.
    #[arg(long, default_value = "--epoch-ms 20 --diff off", allow_hyphen_values = true)]
    pb_whole_flags: String,
    /// VSMR: longest interval between syncvms (ms).
    #[arg(long, default_value_t = 100)]
    sync_ms: u64,
    /// VSMR: more `ftvm replica` options for both VSMR settings (e.g.
    /// `--rejoin syncvm` to measure rejoining without pre-copy).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    vsmr_flags: String,
    /// VSMR: also measure a third VSMR setting in the same run, "VSMR B":
    /// whole pages with these options after --vsmr-flags (a switch on
    /// against its default in "VSMR"; with `--sync-pages blocks` among
    /// them, against "VSMR blocks").
    #[arg(long, allow_hyphen_values = true)]
    vsmr_b_flags: Option<String>,
    /// Give the serving VMM (the unreplicated VM, the primary, the VSMR
    /// leader) this CPU to itself and run everything else (the backup, the
    /// other replicas, the clients, this program) on the other CPUs, as if
    /// the serving VMM had a host of its own. Default: every process may
    /// run on every CPU.
    #[arg(long)]
    serving_core: Option<usize>,
    /// Skip the failover of each replicated setting (throughput only).
    #[arg(long)]
    no_failover: bool,
    /// The ftvm binary (default: next to ftvm-bench).
    #[arg(long)]
    ftvm: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Unreplicated,
    PrimaryBackup,
    /// Primary-backup sending whole pages.
    PrimaryBackupWhole,
    /// `--sync-pages whole` (PLOVER).
    Vsmr,
    /// `--sync-pages blocks`.
    VsmrBlocks,
    /// `--sync-pages whole` with `--vsmr-b-flags` (which may name another).
    VsmrB,
}

const MODES: [Mode; 5] = [Mode::Unreplicated, Mode::PrimaryBackup, Mode::PrimaryBackupWhole, Mode::Vsmr, Mode::VsmrBlocks];

/// The settings of this run: `MODES`, and "VSMR B" with `--vsmr-b-flags`.
fn modes(opts: &Options) -> Vec<Mode> {
    let mut modes = MODES.to_vec();
    if opts.vsmr_b_flags.is_some() {
        modes.push(Mode::VsmrB);
    }
    modes
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Unreplicated => "unreplicated",
            Mode::PrimaryBackup => "primary-backup",
            Mode::PrimaryBackupWhole => "primary-backup whole pages",
            Mode::Vsmr => "VSMR",
            Mode::VsmrBlocks => "VSMR blocks",
            Mode::VsmrB => "VSMR B",
        }
    }
}

/// The processes of one configuration and where they write metrics.
struct Setup {
    procs: Vec<Process>,
    metrics: Vec<PathBuf>,
    /// VSMR: each replica's command line (to restart it) and control
    /// socket (the witness has none), by id - 1.
    replicas: Vec<(Command, Option<PathBuf>)>,
}

impl Setup {
    fn check_alive(&mut self) -> Result<(), BoxError> {
        for p in &mut self.procs {
            if let Some(status) = p.try_wait() {
                return Err(format!("{} exited ({status}): {}", p.name(), p.output()).into());
            }
        }
        Ok(())
    }
}

fn start(topo: &Topology, ftvm: &Path, dir: &Scratch, mode: Mode, opts: &Options) -> Result<Setup, BoxError> {
    let image = sibling_binary("ftvm").parent().and_then(|p| p.parent()).map(|t| t.join("images/kv.elf")).ok_or("no target dir")?;
    if !image.exists() {
        return Err(format!("{} missing: run scripts/build-images.sh", image.display()).into());
    }
    let vm = |cmd: &mut Command| {
        cmd.arg("--image").arg(&image).args(["--memory", &opts.memory.to_string(), "--cmdline", &format!("ip={GUEST_ADDR}/24")]);
        cmd.args(["--net", &format!("tap=tap0,mac={GUEST_MAC}")]);
    };
    let tag = mode.name();
    let mut procs = Vec::new();
    let mut metrics = Vec::new();
    let socket = dir.join(format!("{}.sock", tag.replace(' ', "-")));
    let mut sockets = vec![socket.clone()];
    let mut replicas = Vec::new();
    match mode {
        Mode::Unreplicated => {
            let mut cmd = topo.command("h1", ftvm);
            cmd.arg("run");
            vm(&mut cmd);
            procs.push(Process::spawn_collected("ftvm run", &mut cmd)?);
        }
        Mode::PrimaryBackup | Mode::PrimaryBackupWhole => {
            let backup = format!("{H2_REPL_ADDR}:7000");
            let mut cmd = topo.command("h2", ftvm);
            cmd.args(["backup", "--insecure", "--listen", &backup, "--net", &format!("tap=tap0,mac={GUEST_MAC}")]);
            procs.push(Process::spawn_collected("ftvm backup", &mut cmd)?);
            let m = dir.join(format!("{}.jsonl", tag.replace(' ', "-")));
            let mut cmd = topo.command("h1", ftvm);
            cmd.arg("run");
            vm(&mut cmd);
            cmd.args(["--insecure", "--replicate-to", &backup, "--metrics-every-epoch", "--metrics"])
                .arg(&m)
                .arg("--api-socket")
                .arg(&socket);
            let flags = if mode == Mode::PrimaryBackup { &opts.pb_flags } else { &opts.pb_whole_flags };
            cmd.args(flags.split_whitespace());
            procs.push(Process::spawn_collected("ftvm run (primary)", &mut cmd)?);
            metrics.push(m);
        }
        Mode::Vsmr | Mode::VsmrBlocks | Mode::VsmrB => {
            let peers = format!("1={H1_REPL_ADDR}:7101,2={H2_REPL_ADDR}:7102,3={H2_REPL_ADDR}:7103");
            for (id, host) in [(1, "h1"), (2, "h2"), (3, "h2")] {
                let mut cmd = topo.command(host, ftvm);
                cmd.args(["replica", "--insecure", "--id", &id.to_string(), "--peers", &peers, "--sync-ms", &opts.sync_ms.to_string()]);
                let b_flags: Vec<&str> = match mode {
                    Mode::VsmrB => opts.vsmr_b_flags.as_deref().unwrap_or_default().split_whitespace().collect(),
                    _ => Vec::new(),
                };
                // (Named twice, the option would be refused.)
                if !b_flags.contains(&"--sync-pages") {
                    cmd.args(["--sync-pages", if mode == Mode::VsmrBlocks { "blocks" } else { "whole" }]);
                }
                cmd.args(opts.vsmr_flags.split_whitespace());
                cmd.args(b_flags);
                let mut socket = None;
                if id == 3 {
                    cmd.arg("--witness");
                } else {
                    vm(&mut cmd);
                    let m = dir.join(format!("{}{id}.jsonl", tag.replace(' ', "-")));
                    cmd.arg("--metrics").arg(&m);
                    metrics.push(m);
                    let s = dir.join(format!("{}{id}.sock", tag.replace(' ', "-")));
                    cmd.arg("--api-socket").arg(&s);
                    sockets.push(s.clone());
                    socket = Some(s);
                }
                procs.push(Process::spawn_collected(&format!("ftvm replica {id}"), &mut cmd)?);
                replicas.push((cmd, socket));
            }
        }
    }
    let mut setup = Setup { procs, metrics, replicas };
    if mode != Mode::Unreplicated {
        wait_protected(ftvm, &sockets, &mut setup)?;
    }
    wait_serving(topo, &mut setup)?;
    Ok(setup)
}

/// Until the serving side (the primary, or the VSMR leader) is protected.
fn wait_protected(ftvm: &Path, sockets: &[PathBuf], setup: &mut Setup) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut st = String::new();
    loop {
        setup.check_alive()?;
        for socket in sockets.iter().filter(|s| s.exists()) {
            let out = Command::new(ftvm).args(["status", "--api-socket"]).arg(socket).output()?;
            st = String::from_utf8_lossy(&out.stdout).into_owned();
            if st.contains("protected: yes") && !st.contains("role: secondary") {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("not protected within 30 s: {st}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_serving(topo: &Topology, setup: &mut Setup) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        setup.check_alive()?;
        if topo.redis_cli(GUEST_ADDR, &["PING"]).1.trim() == "PONG" {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the guest does not answer PING".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn benchmark(topo: &Topology, opts: &Options, pipeline: u32) -> Result<(Figures, Figures), BoxError> {
    let mut args = vec!["-n".into(), opts.requests.to_string(), "-c".into(), opts.clients.to_string(), "-P".into(), pipeline.to_string()];
    if opts.keyspace > 0 {
        args.extend(["-r".into(), opts.keyspace.to_string()]);
    }
    let [set, get]: [Figures; 2] = redis_benchmark::run(topo, GUEST_ADDR, &["SET", "GET"], &args)?.try_into().expect("a line per test");
    Ok((set, get))
}

/// Sums over the metrics lines written so far: (bytes, dirty, divergent,
/// syncs, interval µs), as the records of `files` (from line `from[i]` on) say.
#[derive(Clone, Copy, Default)]
struct Sums {
    bytes: f64,
    dirty: f64,
    divergent: f64,
    syncs: f64,
    interval_us: f64,
    /// Frames sent on the replication links (every replica's lines).
    messages: f64,
    /// VSMR: the leader's `syncvm`s proposed while the previous one awaited
    /// its acknowledgement (`--sync-pipeline on`).
    overlapped: f64,
    /// VSMR: the leader's steps, summed over its `syncvm`s (`STEPS`).
    steps: [f64; STEPS.len()],
    /// VSMR: divergent pages sent as block patches (the leader's lines),
    /// and of them those that came whole in a repair round after a
    /// block-hash collision (the secondaries' lines).
    patched: f64,
    repaired: f64,
}

/// The leader's per-step `syncvm` timings (metrics fields, µs).
const STEPS: [&str; 8] = ["propose_us", "pause_us", "freeze_us", "bitmap_us", "copy_us", "hash_us", "wait_us", "ack_us"];

fn read_sums(files: &[PathBuf], from: &[usize]) -> (Sums, Vec<usize>) {
    let mut s = Sums::default();
    let mut ends = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        ends.push(lines.len());
        for line in lines.iter().skip(from.get(i).copied().unwrap_or(0)) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let num = |k: &str| v.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0);
            s.bytes += num("bytes");
            s.messages += num("messages");
            s.repaired += num("repaired_pages");
            // VSMR: the leader's lines carry the comparison (not full ones).
            if v.get("role").and_then(|r| r.as_str()) == Some("leader") && v.get("full") == Some(&serde_json::Value::Bool(false)) {
                s.dirty += num("dirty_pages");
                s.divergent += num("divergent_pages");
                s.patched += num("patched_pages");
                s.syncs += 1.0;
                s.interval_us += num("interval_us");
                s.overlapped += f64::from(u8::from(v.get("overlapped") == Some(&serde_json::Value::Bool(true))));
                for (sum, k) in s.steps.iter_mut().zip(STEPS) {
                    *sum += num(k);
                }
            }
        }
    }
    (s, ends)
}

struct Measured {
    set: Figures,
    get: Figures,
    sums: Sums,
    /// CPU time (user and system) of this setting's VMM processes during
    /// the redis-benchmark run, in µs: a count the host's load disturbs
    /// less than throughput.
    cpu_us: f64,
    /// CPU time (ns) by process and kind of thread during the run, each
    /// process named by its part (`leader`, `backup`, ...).
    threads: Vec<(String, BTreeMap<String, u64>)>,
}

/// What each process of `setup` does (for the CPU rows by thread).
fn parts(ftvm: &Path, setup: &Setup, mode: Mode) -> Vec<String> {
    match mode {
        Mode::Unreplicated => vec!["VMM".into()],
        Mode::PrimaryBackup | Mode::PrimaryBackupWhole => vec!["backup".into(), "primary".into()],
        Mode::Vsmr | Mode::VsmrBlocks | Mode::VsmrB => setup
            .replicas
            .iter()
            .map(|(_, socket)| {
                let Some(socket) = socket else { return "witness".to_string() };
                let st = status(ftvm, socket);
                st.lines().find_map(|l| l.strip_prefix("role: ")).unwrap_or("replica").trim().to_string()
            })
            .collect(),
    }
}

/// CPU time so far (user and system, µs) of the processes `pids`, from
/// `/proc/PID/stat` (each VMM is `ip netns exec`, which execs it in place).
fn cpu_us(pids: &[u32]) -> f64 {
    // SAFETY: sysconf reads a constant.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
        })
        .sum::<f64>()
        * 1e6
        / tick
}

/// One failover of the serving VMM, in milliseconds.
#[derive(Clone, Copy, Default)]
struct Failover {
    /// From the kill to the first reply any client got from the new VM.
    first_reply_ms: f64,
    /// From the kill until every connection had answered again.
    all_replied_ms: f64,
    /// VSMR: from the killed replica's restart until the leader is protected again.
    rejoin_ms: f64,
    /// VSMR: the leader's pause in the full syncvm that made it the secondary.
    rejoin_pause_ms: f64,
    /// VSMR: pages the pre-copy sent (0 with `--rejoin syncvm`), and pages
    /// the full syncvm then sent.
    precopy_pages: f64,
    full_sync_pages: f64,
    /// VSMR: the new leader's election, from its start (the failure
    /// detected, or the election timeout) to leading; and whether the
    /// failure detection started it (`--fast-election`).
    election_ms: f64,
    started_by: &'static str,
}

fn status(ftvm: &Path, socket: &Path) -> String {
    Command::new(ftvm)
        .args(["status", "--timeout", "1", "--api-socket"])
        .arg(socket)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Which of `setup.procs` serves the guest: the only VMM, the primary (PB:
/// procs are [backup, primary]), or the VSMR leader (the replicas by id -
/// 1; none while no replica says it leads).
fn serving(ftvm: &Path, setup: &Setup, mode: Mode) -> Option<usize> {
    match mode {
        Mode::Unreplicated => Some(0),
        Mode::PrimaryBackup | Mode::PrimaryBackupWhole => Some(1),
        Mode::Vsmr | Mode::VsmrBlocks | Mode::VsmrB => {
            (0..2).find(|&i| setup.replicas[i].1.as_deref().is_some_and(|s| status(ftvm, s).contains("role: leader")))
        }
    }
}

/// Kill the serving VMM under clients sending SETs; with VSMR, restart it
/// and wait until the new leader is protected again.
fn failover(topo: &Topology, ftvm: &Path, setup: &mut Setup, mode: Mode) -> Result<Failover, BoxError> {
    let clients = Clients::start(topo)?;
    std::thread::sleep(Duration::from_millis(500));
    let vsmr = matches!(mode, Mode::Vsmr | Mode::VsmrBlocks | Mode::VsmrB);
    let victim = serving(ftvm, setup, mode).ok_or("no VSMR leader to kill")?;
    let t0 = Instant::now();
    setup.procs[victim].kill();
    let outages = clients.outages(t0);
    drop(clients);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ended: Vec<f64> = outages.iter().flatten().map(|o| ms(o.ended)).collect();
    if ended.len() != outages.len() {
        return Err(format!("{}: {} connections did not answer again", mode.name(), outages.len() - ended.len()).into());
    }
    let mut f = Failover {
        first_reply_ms: ended.iter().copied().fold(f64::INFINITY, f64::min),
        all_replied_ms: ended.iter().copied().fold(0.0, f64::max),
        ..Failover::default()
    };
    if vsmr {
        let survivor = 1 - victim;
        let socket = setup.replicas[survivor].1.clone().ok_or("no socket")?;
        // `elected: term T, <what started it>, leading N us later`.
        let st = status(ftvm, &socket);
        let elected = st.lines().find_map(|l| l.strip_prefix("elected: ")).unwrap_or("unknown").to_string();
        eprintln!("{}: the new leader was elected: {elected}", mode.name());
        f.started_by = if elected.contains("link closed") || elected.contains("silent") {
            "the failure detected"
        } else if elected.contains("handed over") {
            "a hand-over"
        } else {
            "the election timeout"
        };
        f.election_ms = elected
            .rsplit_once("leading ")
            .and_then(|(_, us)| us.split(' ').next())
            .and_then(|us| us.parse::<f64>().ok())
            .map_or(f64::NAN, |us| us / 1e3);
        let lines_before = std::fs::read_to_string(&setup.metrics[survivor]).unwrap_or_default().lines().count();
        let t1 = Instant::now();
        let (cmd, socket) = &mut setup.replicas[victim];
        if let Some(socket) = socket {
            // A killed VMM leaves its control socket behind.
            let _ = std::fs::remove_file(socket);
        }
        setup.procs[victim] = Process::spawn_collected(&format!("ftvm replica {} (restarted)", victim + 1), cmd)?;
        let socket = setup.replicas[survivor].1.clone().ok_or("no socket")?;
        loop {
            setup.check_alive()?;
            let st = status(ftvm, &socket);
            if st.contains("role: leader") && st.contains("protected: yes") {
                break;
            }
            if t1.elapsed() > Duration::from_secs(60) {
                return Err(format!("{}: not protected again 60 s after the restart: {st}", mode.name()).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        f.rejoin_ms = ms(t1.elapsed());
        let text = std::fs::read_to_string(&setup.metrics[survivor]).unwrap_or_default();
        for line in text.lines().skip(lines_before) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            if let Some(r) = v.get("rejoin") {
                f.precopy_pages += r.get("pages").and_then(|x| x.as_f64()).unwrap_or(0.0);
            } else if v["role"] == "leader" && v["full"] == true && v["ok"] == true {
                f.rejoin_pause_ms = v["pause_us"].as_f64().unwrap_or(0.0) / 1e3;
                f.full_sync_pages = v["divergent_pages"].as_f64().unwrap_or(0.0);
            }
        }
    }
    // The client's ARP entry may point at the VM that is gone.
    topo.forget_guest()?;
    Ok(f)
}

fn measure(
    topo: &Topology,
    ftvm: &Path,
    dir: &Scratch,
    mode: Mode,
    opts: &Options,
    cores: Option<&Cores>,
) -> Result<(Vec<Measured>, Option<Failover>), BoxError> {
    let mut setup = start(topo, ftvm, dir, mode, opts)?;
    if let Some(cores) = cores {
        let i = serving(ftvm, &setup, mode).ok_or("no VSMR leader to give the serving core")?;
        cores.serve(setup.procs[i].id()).map_err(|e| format!("pinning {}: {e}", setup.procs[i].name()))?;
    }
    let mut out = Vec::new();
    for &p in &opts.pipeline {
        let (_, from) = read_sums(&setup.metrics, &[]);
        let pids: Vec<u32> = setup.procs.iter().map(Process::id).collect();
        let names = parts(ftvm, &setup, mode);
        let by_thread = || pids.iter().map(|&pid| threads::cpu_ns_by_thread(pid).unwrap_or_default()).collect::<Vec<_>>();
        let threads_before = by_thread();
        let cpu_before = cpu_us(&pids);
        let (set, get) = benchmark(topo, opts, p)?;
        let cpu_us = cpu_us(&pids) - cpu_before;
        let threads = names.into_iter().zip(threads_before.iter().zip(by_thread())).map(|(n, (b, a))| (n, threads::spent(b, &a))).collect();
        setup.check_alive()?;
        // The last syncvm or checkpoint of the run lands shortly after it.
        std::thread::sleep(Duration::from_millis(300));
        let (sums, _) = read_sums(&setup.metrics, &from);
        out.push(Measured { set, get, sums, cpu_us, threads });
    }
    let failover = if mode == Mode::Unreplicated || opts.no_failover { None } else { Some(failover(topo, ftvm, &mut setup, mode)?) };
    Ok((out, failover))
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let ftvm = opts.ftvm.clone().unwrap_or_else(|| sibling_binary("ftvm"));
    if !ftvm.exists() {
        return Err(format!("{} missing: build with cargo build --release (or pass --ftvm)", ftvm.display()).into());
    }
    if opts.pipeline.is_empty() {
        return Err("--pipeline needs at least one depth".into());
    }
    let cores = opts.serving_core.map(Cores::split).transpose()?;
    let topo = Topology::new("vsmb")?;
    let dir = Scratch::new("bench-vsmr")?;
    let mut results = Vec::new();
    let mut failovers = Vec::new();
    let modes = modes(opts);
    for &mode in &modes {
        let (r, f) = measure(&topo, &ftvm, &dir, mode, opts, cores.as_ref())?;
        results.push(r);
        failovers.push(f);
    }
    let mut rows = Vec::new();
    let group = "failover: serving VMM killed, 8 clients sending SETs".to_string();
    let pb = failovers[1].map(|f| f.first_reply_ms);
    for (m, &mode) in modes.iter().enumerate() {
        let Some(f) = failovers[m] else { continue };
        let row = |case: String, value: f64, unit: &'static str, reference: Option<f64>| Row {
            group: group.clone(),
            case,
            value,
            unit,
            reference,
        };
        rows.push(row(format!("first reply after the kill, {} (ref: primary-backup)", mode.name()), f.first_reply_ms, "ms", pb));
        rows.push(row(format!("every connection answered again, {}", mode.name()), f.all_replied_ms, "ms", None));
        if matches!(mode, Mode::Vsmr | Mode::VsmrBlocks | Mode::VsmrB) {
            rows.push(row(format!("new leader: from {} to leading, {}", f.started_by, mode.name()), f.election_ms, "ms", None));
            rows.push(row(format!("restarted replica: protected again after, {}", mode.name()), f.rejoin_ms, "ms", None));
            rows.push(row(format!("restarted replica: leader's pause in its full syncvm, {}", mode.name()), f.rejoin_pause_ms, "ms", None));
            rows.push(row(format!("restarted replica: pages pre-copied, {}", mode.name()), f.precopy_pages, "pages", None));
            rows.push(row(format!("restarted replica: pages its full syncvm sent, {}", mode.name()), f.full_sync_pages, "pages", None));
        }
    }
    let mut chart = Vec::new();
    for (i, &p) in opts.pipeline.iter().enumerate() {
        let group = format!("kv -P {p} -c {}", opts.clients);
        let unrep = &results[0][i];
        let requests = 2.0 * opts.requests as f64;
        let mut per_request = vec![0.0; modes.len()];
        for (m, &mode) in modes.iter().enumerate() {
            let r = &results[m][i];
            for (test, f, base) in [("SET", &r.set, &unrep.set), ("GET", &r.get, &unrep.get)] {
                for (what, unit, v, b) in
                    [("throughput", "req/s", f.rps, base.rps), ("p50", "ms", f.p50_ms, base.p50_ms), ("p99", "ms", f.p99_ms, base.p99_ms)]
                {
                    rows.push(Row {
                        group: group.clone(),
                        case: format!("{test} {what}, {} (ref: unreplicated)", mode.name()),
                        value: v,
                        unit,
                        reference: Some(b),
                    });
                }
                chart.push((format!("{test} -P {p}: {}", mode.name()), f.rps));
            }
            per_request[m] = r.sums.bytes / requests;
        }
        for (m, &mode) in modes.iter().enumerate() {
            rows.push(Row {
                group: group.clone(),
                case: format!("VMM CPU time per request, {} (ref: unreplicated)", mode.name()),
                value: results[m][i].cpu_us / requests,
                unit: "us",
                reference: Some(unrep.cpu_us / requests),
            });
        }
        // Where it goes: each process's kinds of thread that used at least
        // 0.5 µs per request.
        for (m, &mode) in modes.iter().enumerate() {
            for (part, threads) in &results[m][i].threads {
                for (kind, &ns) in threads {
                    let us = ns as f64 / 1e3 / requests;
                    if us >= 0.5 {
                        rows.push(Row {
                            group: group.clone(),
                            case: format!("VMM CPU time per request by thread, {}: {part} {kind}", mode.name()),
                            value: us,
                            unit: "us",
                            reference: None,
                        });
                    }
                }
            }
        }
        for (m, &mode) in modes.iter().enumerate().skip(1) {
            rows.push(Row {
                group: group.clone(),
                case: format!("replication bytes per request, {} (ref: primary-backup)", mode.name()),
                value: per_request[m],
                unit: "B",
                reference: Some(per_request[1]),
            });
        }
        for (m, &mode) in modes.iter().enumerate().skip(3) {
            let v = &results[m][i].sums;
            rows.push(Row {
                group: group.clone(),
                case: format!("messages on replication links per request, {}", mode.name()),
                value: v.messages / requests,
                unit: "messages",
                reference: None,
            });
            for (sum, step) in v.steps.iter().zip(STEPS) {
                rows.push(Row {
                    group: group.clone(),
                    case: format!("{} leader's mean syncvm {}", mode.name(), step.trim_end_matches("_us")),
                    value: if v.syncs > 0.0 { sum / v.syncs } else { 0.0 },
                    unit: "us",
                    reference: None,
                });
            }
            rows.push(Row {
                group: group.clone(),
                case: format!("{} divergent pages (ref: dirty pages)", mode.name()),
                value: v.divergent,
                unit: "pages",
                reference: Some(v.dirty),
            });
            rows.push(Row {
                group: group.clone(),
                case: format!("{} pages repaired after a block-hash collision (ref: patched pages)", mode.name()),
                value: v.repaired,
                unit: "pages",
                reference: Some(v.patched),
            });
            rows.push(Row {
                group: group.clone(),
                case: format!("{} mean syncvm interval", mode.name()),
                value: if v.syncs > 0.0 { v.interval_us / v.syncs / 1000.0 } else { 0.0 },
                unit: "ms",
                reference: None,
            });
            // From start to start (the interval above runs from one's end
            // to the next one's start, none when they overlap): the SET and
            // GET runs' time over the leader's syncvms.
            let r = &results[m][i];
            let seconds = opts.requests as f64 / r.set.rps + opts.requests as f64 / r.get.rps;
            rows.push(Row {
                group: group.clone(),
                case: format!("{} syncvm period (start to start)", mode.name()),
                value: if v.syncs > 0.0 { seconds * 1000.0 / v.syncs } else { 0.0 },
                unit: "ms",
                reference: None,
            });
            rows.push(Row {
                group: group.clone(),
                case: format!("{} syncvms proposed before the previous one's acknowledgement (ref: all)", mode.name()),
                value: v.overlapped,
                unit: "syncvms",
                reference: Some(v.syncs),
            });
        }
    }
    report::publish(
        out,
        "vsmr",
        &rows,
        &report::BarChart {
            title: &format!("redis-benchmark -n {} -c {}: kv unreplicated, primary-backup, VSMR", opts.requests, opts.clients),
            category: "test, pipeline depth; replication",
            quantity: "throughput (requests/s)",
            bars: chart,
            reference: None,
        },
    )?;
    Ok(())
}
