//! The kv guest under redis-benchmark, against redis-server run natively
//! in the same run as the ceiling.
//!
//! One private topology (scripts/netns.sh): the VMM runs kv.elf in
//! `NAME-h1` (guest 10.0.0.2 behind tap0 on br0), redis-server runs in
//! `NAME-h2` with 10.0.0.3 on that host's br0, and redis-benchmark runs in
//! `NAME-client`. Both servers are reached over the same path (client veth,
//! LAN bridge, host veth, host bridge); the guest adds the TAP and the VMM.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use ftvm_testkit::process::Process;
use ftvm_testkit::topology::Topology;

use crate::paths::sibling_binary;
use crate::redis_benchmark::{self, Figures};
use crate::report::{self, Row};

type BoxError = Box<dyn std::error::Error>;

const GUEST_ADDR: &str = "10.0.0.2";
const GUEST_MAC: &str = "52:54:00:12:34:56";
const NATIVE_ADDR: &str = "10.0.0.3";
const PORT: &str = "6379";

#[derive(clap::Args)]
pub struct Options {
    /// Requests per redis-benchmark run (-n).
    #[arg(long, default_value_t = 200_000)]
    requests: u64,
    /// Parallel connections (-c).
    #[arg(long, default_value_t = 50)]
    clients: u32,
    /// Pipeline depths to measure (-P), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 16])]
    pipeline: Vec<u32>,
    /// Runs per configuration and server; the median run (by rps) is kept.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Directory holding kv.elf.
    #[arg(long, default_value = "target/images")]
    images: PathBuf,
    /// The ftvm binary (default: next to ftvm-bench).
    #[arg(long)]
    ftvm: Option<PathBuf>,
}

/// Fails if `server` has exited.
fn check_alive(server: &mut Process) -> Result<(), BoxError> {
    match server.try_wait() {
        Some(status) => Err(format!("{} exited ({status}): {}", server.name(), server.output()).into()),
        None => Ok(()),
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Wait until redis-cli PING at `addr` answers PONG.
fn wait_serving(topo: &Topology, addr: &str, server: &mut Process) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        check_alive(server)?;
        if topo.redis_cli(addr, &["PING"]).1.trim() == "PONG" {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{} at {addr} does not answer PING: {}", server.name(), server.output()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Parse redis-benchmark --csv: a header naming the columns, then one line
/// per test. Returns (test, figures) in order.
/// One redis-benchmark run of SET and GET against `addr`.
fn benchmark(topo: &Topology, addr: &str, opts: &Options, pipeline: u32) -> Result<(Figures, Figures), BoxError> {
    let out = topo
        .command("client", "timeout")
        .args(["300", "redis-benchmark", "-h", addr, "-p", PORT, "-t", "set,get", "--csv"])
        .args(["-n", &opts.requests.to_string(), "-c", &opts.clients.to_string(), "-P", &pipeline.to_string()])
        .stdin(Stdio::null())
        .output()?;
    let all = text(&out);
    if !out.status.success() || all.to_lowercase().contains("error") {
        return Err(format!("redis-benchmark against {addr} failed ({}): {all}", out.status).into());
    }
    let rows = redis_benchmark::parse(&String::from_utf8_lossy(&out.stdout))?;
    let find = |t: &str| rows.iter().find(|f| f.test == t).cloned().ok_or_else(|| format!("no {t} line: {all}"));
    Ok((find("SET")?, find("GET")?))
}

/// The run with the median rps of `runs`.
fn median(mut runs: Vec<Figures>) -> Figures {
    runs.sort_by(|a, b| a.rps.total_cmp(&b.rps));
    runs.swap_remove(runs.len() / 2)
}

fn ftvm_path(opts: &Options) -> Result<PathBuf, BoxError> {
    let path = match &opts.ftvm {
        Some(p) => p.clone(),
        None => sibling_binary("ftvm"),
    };
    if !path.exists() {
        return Err(format!("{} missing: build with cargo build --release (or pass --ftvm)", path.display()).into());
    }
    Ok(path)
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let image = opts.images.join("kv.elf");
    if !image.exists() {
        return Err(format!("{} missing: run scripts/build-images.sh", image.display()).into());
    }
    let ftvm = ftvm_path(opts)?;
    if opts.repeat == 0 || opts.pipeline.is_empty() {
        return Err("--repeat and --pipeline need at least one run".into());
    }
    let topo = Topology::new("kvb")?;

    // The reference: redis-server on h2's bridge, no persistence.
    let addr = topo.command("h2", "ip").args(["addr", "add", &format!("{NATIVE_ADDR}/24"), "dev", "br0"]).output()?;
    if !addr.status.success() {
        return Err(format!("cannot give h2's br0 {NATIVE_ADDR}: {}", text(&addr)).into());
    }
    let mut redis = topo.command("h2", "redis-server");
    redis.args(["--port", PORT, "--bind", NATIVE_ADDR, "--save", "", "--appendonly", "no", "--protected-mode", "no"]);
    redis.args(["--daemonize", "no", "--dir", "/tmp", "--logfile", ""]);
    let mut native = Process::spawn_collected("redis-server", &mut redis).map_err(|e| format!("{e} (scripts/setup.sh installs it)"))?;

    // The guest: kv without persistence, one vCPU (the default).
    let mut vmm = topo.command("h1", &ftvm);
    vmm.arg("run").arg("--image").arg(&image);
    vmm.args(["--net", &format!("tap=tap0,mac={GUEST_MAC}"), "--cmdline", &format!("ip={GUEST_ADDR}/24")]);
    let mut guest = Process::spawn_collected("ftvm (kv.elf)", &mut vmm)?;

    wait_serving(&topo, NATIVE_ADDR, &mut native)?;
    wait_serving(&topo, GUEST_ADDR, &mut guest)?;

    let mut rows = Vec::new();
    let mut chart = Vec::new();
    for &p in &opts.pipeline {
        let (mut g_set, mut g_get, mut n_set, mut n_get) = (vec![], vec![], vec![], vec![]);
        // Alternate the servers so drift on the host hits both alike.
        for _ in 0..opts.repeat {
            let (s, g) = benchmark(&topo, GUEST_ADDR, opts, p)?;
            g_set.push(s);
            g_get.push(g);
            check_alive(&mut guest)?;
            let (s, g) = benchmark(&topo, NATIVE_ADDR, opts, p)?;
            n_set.push(s);
            n_get.push(g);
        }
        for (test, guest_f, native_f) in [("SET", median(g_set), median(n_set)), ("GET", median(g_get), median(n_get))] {
            let group = format!("kv {test} -P {p} -c {}", opts.clients);
            rows.push(Row {
                group: group.clone(),
                case: "throughput (ref: native redis)".into(),
                value: guest_f.rps,
                unit: "req/s",
                reference: Some(native_f.rps),
            });
            rows.push(Row {
                group: group.clone(),
                case: "latency p50 (ref: native redis)".into(),
                value: guest_f.p50_ms,
                unit: "ms",
                reference: Some(native_f.p50_ms),
            });
            rows.push(Row {
                group: group.clone(),
                case: "latency p99 (ref: native redis)".into(),
                value: guest_f.p99_ms,
                unit: "ms",
                reference: Some(native_f.p99_ms),
            });
            chart.push((format!("{group}: ftvm guest"), guest_f.rps));
            chart.push((format!("{group}: native redis-server"), native_f.rps));
        }
    }
    drop(guest);
    drop(native);
    drop(topo);

    report::publish(
        out,
        "kv",
        &rows,
        &report::BarChart {
            title: &format!("redis-benchmark, -n {}: kv in ftvm vs native redis-server", opts.requests),
            category: "test, pipeline depth, connections; server",
            quantity: "throughput (requests/s)",
            bars: chart,
            reference: None,
        },
    )?;
    Ok(())
}
