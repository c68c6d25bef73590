//! The kv guest under redis-benchmark, against redis-server run natively
//! in the same run as the ceiling.
//!
//! One private topology (scripts/netns.sh): the VMM runs kv.elf in
//! `NAME-h1` (guest 10.0.0.2 behind tap0 on br0), redis-server runs in
//! `NAME-h2` with 10.0.0.3 on that host's br0, and redis-benchmark runs in
//! `NAME-client`. Both servers are reached over the same path (client veth,
//! LAN bridge, host veth, host bridge); the guest adds the TAP and the VMM.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::report::{self, Row};
use crate::topology::{sibling_binary, Topology};

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

/// One redis-benchmark CSV line.
#[derive(Clone, Copy, Debug)]
struct Figures {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// A server process, SIGKILLed and reaped on Drop.
struct Server {
    child: Child,
    output: Arc<Mutex<String>>,
}

impl Server {
    fn spawn(mut cmd: Command) -> Result<Server, BoxError> {
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        let output = Arc::new(Mutex::new(String::new()));
        for pipe in [Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>, Box::new(child.stderr.take().unwrap())] {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut o = output.lock().unwrap();
                    o.push_str(&line);
                    o.push('\n');
                }
            });
        }
        Ok(Server { child, output })
    }

    fn check_alive(&mut self, what: &str) -> Result<(), BoxError> {
        match self.child.try_wait()? {
            Some(status) => Err(format!("{what} exited ({status}): {}", self.output.lock().unwrap()).into()),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Wait until redis-cli PING at `addr` answers PONG.
fn wait_serving(topo: &Topology, addr: &str, server: &mut Server, what: &str) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        server.check_alive(what)?;
        let out = topo.command("client", "timeout").args(["2", "redis-cli", "-h", addr, "-p", PORT, "PING"]).output()?;
        if String::from_utf8_lossy(&out.stdout).trim() == "PONG" {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{what} at {addr} does not answer PING: {}", server.output.lock().unwrap()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Parse redis-benchmark --csv: a header naming the columns, then one line
/// per test. Returns (test, figures) in order.
fn parse_csv(csv: &str) -> Result<Vec<(String, Figures)>, BoxError> {
    let unquote = |s: &str| s.trim().trim_matches('"').to_owned();
    let mut lines = csv.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<String> = lines.next().ok_or("redis-benchmark printed nothing")?.split(',').map(unquote).collect();
    let col = |name: &str| header.iter().position(|h| h == name).ok_or_else(|| format!("no {name} column in {header:?}"));
    let (rps, p50, p99) = (col("rps")?, col("p50_latency_ms")?, col("p99_latency_ms")?);
    let mut rows = Vec::new();
    for line in lines {
        let cols: Vec<String> = line.split(',').map(unquote).collect();
        let num = |i: usize| -> Result<f64, BoxError> {
            cols.get(i).and_then(|v| v.parse().ok()).ok_or_else(|| format!("bad redis-benchmark line {line:?}").into())
        };
        rows.push((cols[0].clone(), Figures { rps: num(rps)?, p50_ms: num(p50)?, p99_ms: num(p99)? }));
    }
    Ok(rows)
}

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
    let rows = parse_csv(&String::from_utf8_lossy(&out.stdout))?;
    let find = |t: &str| rows.iter().find(|(n, _)| n == t).map(|(_, f)| *f).ok_or_else(|| format!("no {t} line: {all}"));
    Ok((find("SET")?, find("GET")?))
}

/// The run with the median rps of `runs`.
fn median(mut runs: Vec<Figures>) -> Figures {
    runs.sort_by(|a, b| a.rps.total_cmp(&b.rps));
    runs[runs.len() / 2]
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
    let topo = Topology::up("kvb")?;

    // The reference: redis-server on h2's bridge, no persistence.
    let addr = topo.command("h2", "ip").args(["addr", "add", &format!("{NATIVE_ADDR}/24"), "dev", "br0"]).output()?;
    if !addr.status.success() {
        return Err(format!("cannot give h2's br0 {NATIVE_ADDR}: {}", text(&addr)).into());
    }
    let mut redis = topo.command("h2", "redis-server");
    redis.args(["--port", PORT, "--bind", NATIVE_ADDR, "--save", "", "--appendonly", "no", "--protected-mode", "no"]);
    redis.args(["--daemonize", "no", "--dir", "/tmp", "--logfile", ""]);
    let mut native = Server::spawn(redis).map_err(|e| format!("redis-server (scripts/setup.sh installs it): {e}"))?;

    // The guest: kv without persistence, one vCPU (the default).
    let mut vmm = topo.command("h1", &ftvm);
    vmm.arg("run").arg("--image").arg(&image);
    vmm.args(["--net", &format!("tap=tap0,mac={GUEST_MAC}"), "--cmdline", &format!("ip={GUEST_ADDR}/24")]);
    let mut guest = Server::spawn(vmm)?;

    wait_serving(&topo, NATIVE_ADDR, &mut native, "redis-server")?;
    wait_serving(&topo, GUEST_ADDR, &mut guest, "ftvm (kv.elf)")?;

    let mut rows = Vec::new();
    let mut chart = Vec::new();
    for &p in &opts.pipeline {
        let (mut g_set, mut g_get, mut n_set, mut n_get) = (vec![], vec![], vec![], vec![]);
        // Alternate the servers so drift on the host hits both alike.
        for _ in 0..opts.repeat {
            let (s, g) = benchmark(&topo, GUEST_ADDR, opts, p)?;
            g_set.push(s);
            g_get.push(g);
            guest.check_alive("ftvm (kv.elf)")?;
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
            chart.push(Row { group: group.clone(), case: "ftvm guest".into(), value: guest_f.rps, unit: "req/s", reference: None });
            chart.push(Row { group, case: "native redis-server".into(), value: native_f.rps, unit: "req/s", reference: None });
        }
    }
    drop(guest);
    drop(native);
    drop(topo);

    report::print_table(&rows);
    let csv = out.join("kv.csv");
    report::write_csv(&csv, &rows)?;
    let svg = out.join("kv.svg");
    let bars: Vec<&Row> = chart.iter().collect();
    report::write_bar_chart(&svg, &format!("redis-benchmark requests/s, -n {} (kv in ftvm vs native redis-server)", opts.requests), &bars)?;
    println!("\nwrote {} and {}", csv.display(), svg.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_7_csv() {
        let csv = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                   \"SET\",\"714285.69\",\"0.795\",\"0.312\",\"0.815\",\"1.127\",\"1.375\",\"24.191\"\n\
                   \"GET\",\"746268.62\",\"0.768\",\"0.336\",\"0.799\",\"1.103\",\"1.679\",\"2.063\"\n";
        let rows = parse_csv(csv).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].0, "SET");
        assert_eq!(rows[1].1.rps, 746268.62);
        assert_eq!(rows[0].1.p50_ms, 0.815);
        assert_eq!(rows[1].1.p99_ms, 1.679);
        assert!(parse_csv("\"test\",\"rps\"\n").is_err());
    }
}
