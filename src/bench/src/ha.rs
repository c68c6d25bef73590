//! What users would pick instead of ftvm, measured: redis-server with its
//! own asynchronous replication against ftvm protecting the kv guest, under
//! the same client, the same cut and the same promotion delay.
//!
//! On the test topology (`scripts/netns.sh`: a client and hosts h1 and h2
//! on one LAN, a replication link between the hosts), per system and trial:
//!
//! - **Redis**: redis-server on h1 serving the service address 10.0.0.2
//!   (on h1's bridge), its replica on h2 (`--replicaof` over the
//!   replication link). After the cut, once `--detect-ms` passed (what a
//!   failure detector such as Sentinel would take at the very least), the
//!   replica is promoted (`REPLICAOF NO ONE`) and takes the service address
//!   (a floating IP, as keepalived would move it).
//! - **ftvm**: the kv guest on h1 (10.0.0.2 behind its TAP) replicating to
//!   a backup on h2 with `--failure-timeout-ms` `--detect-ms`; the backup
//!   takes over by itself.
//!
//! Each is first measured without its replica (Redis alone; the kv guest
//! unreplicated) as the reference for throughput and latency. Then, with
//! replication: redis-benchmark SET (latency and throughput), then writers
//! sending SETs of unique keys and remembering every acknowledged one for
//! `--seconds`; then the primary's host is cut (its links deleted, its
//! process killed); when writes are acknowledged again, every remembered
//! key is read back from the new primary: the acknowledged writes lost.
//! All of it once per `--repl-delay-ms`: the replication link as it is, and
//! delayed in each direction by the fault proxy (this host has no netem).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use ftvm_testkit::fault_proxy::{Fault, FaultProxy};
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC, H1_REPL_ADDR, H2_REPL_ADDR};
use ftvm_testkit::writers::{self, Writers};

use crate::paths;
use crate::redis_benchmark::{self, Figures};
use crate::report::{self, BarChart, Row};

type BoxError = Box<dyn std::error::Error>;

#[derive(clap::Args)]
pub struct Options {
    /// Cuts of the primary's host per system.
    #[arg(long, default_value_t = 3)]
    trials: u32,
    /// Seconds of writing before each cut.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Writer connections.
    #[arg(long, default_value_t = 8)]
    connections: u32,
    /// SETs each writer sends before reading their replies.
    #[arg(long, default_value_t = 1)]
    pipeline: u32,
    /// Bytes per value.
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// From the cut to the promotion of Redis's replica, and ftvm's backup
    /// failure timeout, in milliseconds.
    #[arg(long, default_value_t = 200)]
    detect_ms: u64,
    /// Requests per redis-benchmark run (SET, 50 connections).
    #[arg(long, default_value_t = 20000)]
    requests: u64,
    /// One-way delays of the replication link to measure, in milliseconds
    /// (0: the bare veth; more through ftvm-testkit's fault proxy, each
    /// direction delayed, as a link between racks or sites would be).
    #[arg(long, value_delimiter = ',', default_values_t = [0, 2])]
    repl_delay_ms: Vec<u64>,
}

const PORT: u16 = 6379;
/// h2's own address on the LAN, before its replica takes the service address.
const H2_LAN_ADDR: &str = "10.0.0.3";
/// How long writes may take to be acknowledged again after the cut.
const RECOVERY_LIMIT: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum System {
    Redis,
    Ftvm,
}

impl System {
    fn name(self) -> &'static str {
        match self {
            System::Redis => "redis async replication",
            System::Ftvm => "ftvm (kv guest)",
        }
    }
}

/// What one cut of the primary's host came to.
#[derive(Debug, Default)]
struct Trial {
    acked: usize,
    lost: usize,
    /// Acknowledged writes per second before the cut.
    writes_per_s: f64,
    /// From the cut to the first write acknowledged by the new primary.
    recovery_ms: f64,
}

/// Per system: the reference (no replication) and the replicated
/// redis-benchmark SET figures, and the trials.
struct Measured {
    alone: Figures,
    replicated: Figures,
    trials: Vec<Trial>,
}

fn output_text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Run `program args` in `role`'s namespace; an error unless it succeeds.
fn sh(topo: &Topology, role: &str, program: &str, args: &[&str]) -> Result<String, BoxError> {
    let out = topo.command(role, program).args(args).stdin(Stdio::null()).output()?;
    if !out.status.success() {
        return Err(format!("{program} {args:?} in {role}: {}", output_text(&out)).into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> Result<bool, BoxError>) -> Result<(), BoxError> {
    let t0 = Instant::now();
    while !done()? {
        if t0.elapsed() > timeout {
            return Err(format!("{what}: not within {timeout:?}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn alive(p: &mut Process) -> Result<(), BoxError> {
    match p.try_wait() {
        Some(status) => Err(format!("{} exited ({status}): {}", p.name(), p.output()).into()),
        None => Ok(()),
    }
}

/// The service answers PING at 10.0.0.2.
fn wait_serving(topo: &Topology, server: &mut Process) -> Result<(), BoxError> {
    wait_until("the service at 10.0.0.2 answers PING", Duration::from_secs(20), || {
        alive(server)?;
        Ok(topo.redis_cli(GUEST_ADDR, &["PING"]).1.trim() == "PONG")
    })
}

/// redis-benchmark SET against the service address, from the client.
fn benchmark(topo: &Topology, opts: &Options) -> Result<Figures, BoxError> {
    let out = topo
        .command("client", "timeout")
        .args(["300", "redis-benchmark", "-h", GUEST_ADDR, "-t", "set", "-c", "50", "--csv"])
        .args(["-n", &opts.requests.to_string(), "-d", &opts.value_bytes.to_string()])
        .stdin(Stdio::null())
        .output()?;
    let rows = redis_benchmark::parse(&String::from_utf8_lossy(&out.stdout)).map_err(|e| format!("{e}: {}", output_text(&out)))?;
    rows.into_iter().find(|f| f.test == "SET").ok_or_else(|| format!("no SET line: {}", output_text(&out)).into())
}

/// redis-server in `role`'s namespace, bound to every address there.
fn redis_server(topo: &Topology, role: &str, dir: &Path, log: &str, extra: &[&str]) -> Result<Process, BoxError> {
    let mut cmd = topo.command(role, "redis-server");
    cmd.args(["--port", &PORT.to_string(), "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--logfile", "", "--dir"])
        .arg(dir)
        .args(extra);
    Ok(Process::spawn_logged("redis-server", &mut cmd, dir, log).map_err(|e| format!("{e} (scripts/setup.sh installs redis-server)"))?)
}

/// A replicated service ready to take writes, and how to fail it over.
struct Service {
    primary: Process,
    replica: Process,
}

fn start_redis(topo: &Topology, dir: &Path, trial: u32) -> Result<Service, BoxError> {
    let mut primary = redis_server(topo, "h1", dir, &format!("redis-{trial}.primary"), &[])?;
    wait_serving(topo, &mut primary)?;
    let mut replica = redis_server(topo, "h2", dir, &format!("redis-{trial}.replica"), &["--replicaof", H1_REPL_ADDR, &PORT.to_string()])?;
    wait_until("the replica is in sync", Duration::from_secs(20), || {
        alive(&mut replica)?;
        let info = topo.command("h2", "redis-cli").args(["-h", "127.0.0.1", "info", "replication"]).output()?;
        Ok(String::from_utf8_lossy(&info.stdout).contains("master_link_status:up"))
    })?;
    Ok(Service { primary, replica })
}

fn ftvm_bin() -> PathBuf {
    paths::sibling_binary("ftvm")
}

/// The kv guest on h1; with `backup`, replicating to a backup on h2.
fn start_ftvm(topo: &Topology, dir: &Path, log: &str, opts: &Options, replicated: bool) -> Result<Service, BoxError> {
    let net = format!("tap=tap0,mac={GUEST_MAC}");
    let backup_addr = format!("{H2_REPL_ADDR}:7000");
    let mut backup = topo.command("h2", ftvm_bin());
    backup.args(["backup", "--insecure", "--listen", &backup_addr, "--net", &net, "--failure-timeout-ms", &opts.detect_ms.to_string()]);
    let backup = match replicated {
        true => Process::spawn_logged("ftvm backup", backup.env("FTVM_LOG", "warn"), dir, &format!("{log}.backup"))?,
        // Unreplicated: a stand-in that does nothing, so both cases have the same shape.
        false => Process::spawn_logged("sleep", topo.command("h2", "sleep").arg("3600"), dir, &format!("{log}.idle"))?,
    };
    let mut cmd = topo.command("h1", ftvm_bin());
    cmd.args(["run", "--net", &net, "--cmdline", &format!("ip={GUEST_ADDR}/24"), "--image"]).arg(paths::images().join("kv.elf"));
    if replicated {
        cmd.args(["--insecure", "--replicate-to", &backup_addr, "--epoch-ms", "20", "--api-socket"]).arg(dir.join(format!("{log}.sock")));
    }
    let mut primary = Process::spawn_logged("ftvm run", cmd.env("FTVM_LOG", "warn"), dir, &format!("{log}.primary"))?;
    wait_serving(topo, &mut primary)?;
    if replicated {
        let socket = dir.join(format!("{log}.sock"));
        wait_until("the kv guest is protected", Duration::from_secs(30), || {
            alive(&mut primary)?;
            let out = std::process::Command::new(ftvm_bin()).args(["status", "--api-socket"]).arg(&socket).output()?;
            Ok(String::from_utf8_lossy(&out.stdout).contains("protected: yes"))
        })?;
    }
    Ok(Service { primary, replica: backup })
}

fn writers_config(topo: &Topology, opts: &Options, prefix: &str) -> writers::Config {
    writers::Config {
        addr: SocketAddr::new(GUEST_ADDR.parse().expect("an address"), PORT),
        netns: Some(topo.ns("client")),
        connections: opts.connections,
        pipeline: opts.pipeline,
        value_len: opts.value_bytes,
        prefix: prefix.into(),
        timeout: Duration::from_secs(2),
    }
}

/// Write for `--seconds`, cut the primary's host, fail over, write until
/// the new primary acknowledges, then check every acknowledged write.
fn cut_and_count(
    topo: &Topology,
    proxy: Option<&FaultProxy>,
    system: System,
    mut service: Service,
    opts: &Options,
    trial: u32,
) -> Result<Trial, BoxError> {
    let w = Writers::start(writers_config(topo, opts, &format!("t{trial}")))?;
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(opts.seconds));
    let before = w.acked();
    let writes_per_s = before as f64 / started.elapsed().as_secs_f64();
    // The cut: h1's links, then its process.
    match proxy {
        Some(proxy) => {
            proxy.set_both(Fault::Cut);
            sh(topo, "h1", "ip", &["link", "del", "uplink"])?;
        }
        None => topo.cut_host("h1")?,
    }
    let cut = Instant::now();
    w.mark(cut);
    service.primary.kill();
    match system {
        System::Redis => {
            std::thread::sleep(Duration::from_millis(opts.detect_ms));
            sh(topo, "h2", "redis-cli", &["-h", "127.0.0.1", "replicaof", "no", "one"])?;
            sh(topo, "h2", "ip", &["addr", "add", &format!("{GUEST_ADDR}/24"), "dev", "br0"])?;
        }
        System::Ftvm => wait_until("the backup takes over", RECOVERY_LIMIT, || {
            alive(&mut service.replica)?;
            Ok(service.replica.stderr().contains("PRIMARY LOST"))
        })?,
    }
    // Both: the client forgets where 10.0.0.2 was (a gratuitous ARP would).
    topo.forget_guest()?;
    wait_until("a write is acknowledged after the cut", RECOVERY_LIMIT, || Ok(w.first_ack_after_mark().is_some()))?;
    let recovery_ms = w.first_ack_after_mark().map_or(0.0, |t| (t - cut).as_secs_f64() * 1000.0);
    std::thread::sleep(Duration::from_millis(500));
    let acked = w.stop().acked;
    let verified = writers::verify(
        SocketAddr::new(GUEST_ADDR.parse()?, PORT),
        Some(&topo.ns("client")),
        &acked,
        opts.value_bytes,
        Instant::now() + Duration::from_secs(30),
    )?;
    alive(&mut service.replica)?;
    Ok(Trial { acked: acked.len(), lost: verified.lost(), writes_per_s, recovery_ms })
}

/// The service without replication: its redis-benchmark SET figures.
fn reference(system: System, opts: &Options, dir: &Path) -> Result<Figures, BoxError> {
    let topo = Topology::new("har")?;
    topo.restore()?;
    let service = match system {
        System::Redis => {
            sh(&topo, "h1", "ip", &["addr", "add", &format!("{GUEST_ADDR}/24"), "dev", "br0"])?;
            let mut primary = redis_server(&topo, "h1", dir, "redis-alone", &[])?;
            wait_serving(&topo, &mut primary)?;
            primary
        }
        System::Ftvm => start_ftvm(&topo, dir, "kv-alone", opts, false)?.primary,
    };
    let figures = benchmark(&topo, opts)?;
    drop(service);
    Ok(figures)
}

fn measure(system: System, delay_ms: u64, alone: &Figures, opts: &Options, dir: &Path) -> Result<Measured, BoxError> {
    let mut replicated = None;
    let mut trials = Vec::new();
    for trial in 0..opts.trials {
        // A fresh topology per trial: the cut deletes h1's links.
        let topo = Topology::new("ha")?;
        topo.restore()?;
        let proxy = match delay_ms {
            0 => None,
            ms => {
                let proxy = FaultProxy::insert(&topo)?;
                proxy.set_both(Fault::Delay(Duration::from_millis(ms)));
                Some(proxy)
            }
        };
        let service = match system {
            System::Redis => {
                sh(&topo, "h1", "ip", &["addr", "add", &format!("{GUEST_ADDR}/24"), "dev", "br0"])?;
                sh(&topo, "h2", "ip", &["addr", "add", &format!("{H2_LAN_ADDR}/24"), "dev", "br0"])?;
                start_redis(&topo, dir, trial)?
            }
            System::Ftvm => start_ftvm(&topo, dir, &format!("kv-{trial}"), opts, true)?,
        };
        if replicated.is_none() {
            replicated = Some(benchmark(&topo, opts)?);
        }
        let t = cut_and_count(&topo, proxy.as_ref(), system, service, opts, trial)?;
        eprintln!(
            "{}, link delay {delay_ms} ms: trial {trial}: acknowledged {}, lost {}, {:.0} writes/s before the cut, writes again {:.0} ms after it",
            system.name(),
            t.acked,
            t.lost,
            t.writes_per_s,
            t.recovery_ms
        );
        trials.push(t);
    }
    Ok(Measured { alone: alone.clone(), replicated: replicated.ok_or("--trials must be at least 1")?, trials })
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    if opts.trials == 0 || opts.repl_delay_ms.is_empty() {
        return Err("--trials and --repl-delay-ms need at least one value".into());
    }
    if !ftvm_bin().exists() {
        return Err(format!("{} missing: cargo build --release", ftvm_bin().display()).into());
    }
    let dir = Scratch::new("bench-ha")?;
    let mut rows = Vec::new();
    let mut bars = Vec::new();
    let alone = [reference(System::Redis, opts, dir.path())?, reference(System::Ftvm, opts, dir.path())?];
    for &delay_ms in &opts.repl_delay_ms {
        for (system, alone) in [System::Redis, System::Ftvm].into_iter().zip(&alone) {
            let m = measure(system, delay_ms, alone, opts, dir.path())?;
            let group = format!("{}, link delay {delay_ms} ms", system.name());
            let n = m.trials.len() as f64;
            let sum = |f: fn(&Trial) -> f64| m.trials.iter().map(f).sum::<f64>();
            let (acked, lost) = (sum(|t| t.acked as f64), sum(|t| t.lost as f64));
            let row = |case: &str, value: f64, unit: &'static str, reference: Option<f64>| Row {
                group: group.clone(),
                case: case.to_string(),
                value,
                unit,
                reference,
            };
            rows.push(row(&format!("acknowledged writes lost ({} cuts)", m.trials.len()), lost, "writes", Some(acked)));
            rows.push(row("acknowledged writes", acked, "writes", None));
            rows.push(row("writers: acknowledged writes/s before the cut", sum(|t| t.writes_per_s) / n, "writes/s", None));
            rows.push(row("writes acknowledged again after the cut", sum(|t| t.recovery_ms) / n, "ms", None));
            rows.push(row("SET throughput (vs. without replication)", m.replicated.rps, "req/s", Some(m.alone.rps)));
            rows.push(row("SET p50 latency (vs. without replication)", m.replicated.p50_ms, "ms", Some(m.alone.p50_ms)));
            rows.push(row("SET p99 latency (vs. without replication)", m.replicated.p99_ms, "ms", Some(m.alone.p99_ms)));
            bars.push((group, lost));
        }
    }
    let title = format!(
        "acknowledged writes lost when the primary's host is cut ({} cuts each, promotion after {} ms), per one-way link delay",
        opts.trials, opts.detect_ms
    );
    let chart = BarChart { title: &title, category: "system", quantity: "acknowledged writes lost", bars, reference: None };
    report::publish(out, "ha", &rows, &chart)
}
