//! Fault tolerance costs: for several epoch lengths and for the unreplicated
//! VM in the same run, memtouch throughput at several dirty rates, kv
//! throughput and latency under redis-benchmark, per-epoch pause, dirty pages
//! and bytes, and failover time.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::report::{self, Row};
use crate::topology::{self, Topology};

type BoxError = Box<dyn std::error::Error>;

#[derive(clap::Args)]
pub struct Options {
    /// Epoch lengths to measure, in milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "5,10,20,50")]
    epochs: Vec<u64>,
    /// Seconds per memtouch run.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Requests per redis-benchmark run.
    #[arg(long, default_value_t = 20000)]
    requests: u64,
    /// Failover trials per epoch length.
    #[arg(long, default_value_t = 3)]
    failovers: usize,
    /// Skip the network (kv and failover) measurements.
    #[arg(long)]
    no_network: bool,
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn ftvm_bin() -> PathBuf {
    topology::sibling_binary("ftvm")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_or(7700, |a| a.port())
}

/// Mean of a field over the JSON-lines metrics file, skipping the first
/// epochs (pre-copy aftermath).
fn metric_means(path: &Path, fields: &[&str]) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).skip(3).collect();
    fields
        .iter()
        .map(|f| {
            let v: Vec<f64> = lines.iter().filter_map(|l| l[*f].as_f64()).collect();
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        })
        .collect()
}

fn memtouch_rate(out: &str) -> Option<f64> {
    out.lines().find_map(|l| {
        let rest = l.strip_prefix("memtouch: writes=")?;
        rest.split_whitespace().find_map(|w| w.strip_prefix("writes/s=")).and_then(|v| v.parse().ok())
    })
}

/// memtouch alone or as a primary replicating to a backup on loopback.
fn memtouch_run(cmdline: &str, epoch_ms: Option<u64>, dir: &Path) -> Result<(f64, Vec<f64>), BoxError> {
    let image = topology::images().join("memtouch.elf");
    let metrics = dir.join(format!("memtouch-{}.jsonl", epoch_ms.unwrap_or(0)));
    let mut _backup = None;
    let mut cmd = Command::new(ftvm_bin());
    cmd.args(["run", "--memory", "512", "--cmdline", cmdline]).arg("--image").arg(&image);
    if let Some(e) = epoch_ms {
        let addr = format!("127.0.0.1:{}", free_port());
        let b = Command::new(ftvm_bin()).args(["backup", "--listen", &addr]).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        _backup = Some(Proc(b));
        cmd.args(["--replicate-to", &addr, "--epoch-ms", &e.to_string()]).arg("--metrics").arg(&metrics);
    }
    let out = cmd.output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = memtouch_rate(&text).ok_or_else(|| format!("memtouch printed no rate: {text}{}", String::from_utf8_lossy(&out.stderr)))?;
    let means = if epoch_ms.is_some() { metric_means(&metrics, &["pause_us", "dirty_pages", "bytes"]) } else { vec![] };
    Ok((rate, means))
}

/// redis-benchmark's CSV: "test","rps","avg_latency_ms","min","p50","p95","p99","max".
fn redis_benchmark(topo: &Topology, pipeline: u32, requests: u64) -> Result<Vec<(String, f64, f64, f64)>, BoxError> {
    let out = topo
        .command("client", "redis-benchmark")
        .args(["-h", "10.0.0.2", "-t", "set,get", "-c", "50", "--csv"])
        .args(["-P", &pipeline.to_string(), "-n", &requests.to_string()])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rows = text
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<String> = l.split(',').map(|s| s.trim_matches('"').to_string()).collect();
            Some((f.first()?.clone(), f.get(1)?.parse().ok()?, f.get(4)?.parse().ok()?, f.get(6)?.parse().ok()?))
        })
        .collect::<Vec<_>>();
    if rows.len() < 2 {
        return Err(format!("redis-benchmark failed: {text}{}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(rows)
}

struct Pair {
    _backup: Option<Proc>,
    primary: Proc,
}

/// kv in h1 (replicating to h2 when `epoch_ms` is set), ready to serve.
fn start_kv(topo: &Topology, epoch_ms: Option<u64>, metrics: &Path) -> Result<Pair, BoxError> {
    let net = "tap=tap0,mac=52:54:00:12:34:56";
    let image = topology::images().join("kv.elf");
    let mut backup = None;
    let mut cmd = topo.command("h1", ftvm_bin());
    cmd.args(["run", "--net", net, "--cmdline", "ip=10.0.0.2/24", "--image"]).arg(&image);
    if let Some(e) = epoch_ms {
        let b = topo
            .command("h2", ftvm_bin())
            .args(["backup", "--listen", "192.168.100.2:7000", "--net", net])
            .env("FTVM_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(metrics.with_extension("backup.log"))?)
            .spawn()?;
        backup = Some(Proc(b));
        cmd.args(["--replicate-to", "192.168.100.2:7000", "--epoch-ms", &e.to_string()]).arg("--metrics").arg(metrics);
    }
    let primary = Proc(cmd.stdout(Stdio::null()).stderr(std::fs::File::create(metrics.with_extension("primary.log"))?).spawn()?);
    let t0 = Instant::now();
    while !topo.redis_ok("PING") {
        if t0.elapsed() > Duration::from_secs(15) {
            let log = |side| std::fs::read_to_string(metrics.with_extension(side)).unwrap_or_default();
            return Err(format!("kv guest never answered; primary: {} backup: {}", log("primary.log"), log("backup.log")).into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Pair { _backup: backup, primary })
}

/// Kill the primary's host and time until the backup answers a client.
fn failover_once(topo: &mut Topology, epoch_ms: u64, cut_links: bool, dir: &Path) -> Result<f64, BoxError> {
    let metrics = dir.join("failover.jsonl");
    let mut pair = start_kv(topo, Some(epoch_ms), &metrics)?;
    // Let it settle into protected operation.
    std::thread::sleep(Duration::from_millis(500));
    if !topo.redis_ok("SET failover-key v") {
        return Err("write before failover failed".into());
    }
    let t0 = Instant::now();
    if cut_links {
        topo.cut_host("h1");
    }
    let _ = pair.primary.0.kill();
    let _ = pair.primary.0.wait();
    while !topo.redis_get_is("failover-key", "v") {
        if t0.elapsed() > Duration::from_secs(20) {
            return Err("the backup never answered".into());
        }
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    drop(pair);
    if cut_links {
        topo.reset()?;
    }
    Ok(ms)
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let mut rows = Vec::new();
    let scratch = std::env::temp_dir().join(format!("ftvm-bench-ft-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let secs = opts.seconds;
    // Dirty rates: writes per second into random pages of a 64 MiB set
    // (almost every write dirties a new page), and an unthrottled sweep.
    let loads = [
        ("1k pages/s", format!("ws=64M pattern=random rate=1000 duration={secs}s report=0")),
        ("10k pages/s", format!("ws=64M pattern=random rate=10000 duration={secs}s report=0")),
        ("50k pages/s", format!("ws=64M pattern=random rate=50000 duration={secs}s report=0")),
        ("unthrottled 4 MiB hot set", format!("ws=4M pattern=random duration={secs}s report=0")),
    ];
    for (name, cmdline) in &loads {
        let (base, _) = memtouch_run(cmdline, None, &scratch)?;
        for &e in &opts.epochs {
            let (rate, m) = memtouch_run(cmdline, Some(e), &scratch)?;
            let group = format!("memtouch {name}");
            rows.push(Row {
                group: group.clone(),
                case: format!("epoch {e} ms: writes/s"),
                value: rate,
                unit: "writes/s",
                reference: Some(base),
            });
            rows.push(Row { group: group.clone(), case: format!("epoch {e} ms: pause"), value: m[0], unit: "us", reference: None });
            rows.push(Row {
                group: group.clone(),
                case: format!("epoch {e} ms: dirty pages/epoch"),
                value: m[1],
                unit: "pages",
                reference: None,
            });
            rows.push(Row { group, case: format!("epoch {e} ms: bytes/epoch"), value: m[2], unit: "bytes", reference: None });
        }
    }
    if !opts.no_network {
        let mut topo = Topology::up("ftb")?;
        let metrics = scratch.join("kv.jsonl");
        for pipeline in [1, 16] {
            let base = {
                let _vm = start_kv(&topo, None, &metrics)?;
                redis_benchmark(&topo, pipeline, opts.requests)?
            };
            for &e in &opts.epochs {
                let ft = {
                    let _vm = start_kv(&topo, Some(e), &metrics)?;
                    redis_benchmark(&topo, pipeline, opts.requests)?
                };
                let m = metric_means(&metrics, &["pause_us", "dirty_pages", "bytes", "hold_us"]);
                for ((test, rps, p50, p99), (_, brps, bp50, bp99)) in ft.iter().zip(&base) {
                    let group = format!("kv {test} -P {pipeline} -c 50");
                    rows.push(Row {
                        group: group.clone(),
                        case: format!("epoch {e} ms: requests/s"),
                        value: *rps,
                        unit: "req/s",
                        reference: Some(*brps),
                    });
                    rows.push(Row {
                        group: group.clone(),
                        case: format!("epoch {e} ms: p50"),
                        value: *p50,
                        unit: "ms",
                        reference: Some(*bp50),
                    });
                    rows.push(Row { group, case: format!("epoch {e} ms: p99"), value: *p99, unit: "ms", reference: Some(*bp99) });
                }
                let group = format!("kv epochs -P {pipeline}");
                rows.push(Row { group: group.clone(), case: format!("epoch {e} ms: pause"), value: m[0], unit: "us", reference: None });
                rows.push(Row {
                    group: group.clone(),
                    case: format!("epoch {e} ms: dirty pages/epoch"),
                    value: m[1],
                    unit: "pages",
                    reference: None,
                });
                rows.push(Row {
                    group: group.clone(),
                    case: format!("epoch {e} ms: bytes/epoch"),
                    value: m[2],
                    unit: "bytes",
                    reference: None,
                });
                rows.push(Row { group, case: format!("epoch {e} ms: output hold"), value: m[3] / 1e3, unit: "ms", reference: None });
            }
        }
        for &e in &opts.epochs {
            for cut in [false, true] {
                let mut times = Vec::new();
                for _ in 0..opts.failovers {
                    times.push(failover_once(&mut topo, e, cut, &scratch)?);
                }
                times.sort_by(f64::total_cmp);
                let how = if cut { "host cut (detected by timeout)" } else { "VMM killed (socket closed)" };
                rows.push(Row {
                    group: "failover".into(),
                    case: format!("epoch {e} ms, {how}: median"),
                    value: times[times.len() / 2],
                    unit: "ms",
                    reference: None,
                });
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    report::print_table(&rows);
    let csv = out.join("ft.csv");
    report::write_csv(&csv, &rows)?;
    let ratios: Vec<Row> = rows
        .iter()
        .filter_map(|r| {
            r.ratio().filter(|_| r.unit == "writes/s" || r.unit == "req/s").map(|ratio| Row {
                group: r.group.clone(),
                case: r.case.clone(),
                value: ratio,
                unit: "ratio",
                reference: None,
            })
        })
        .collect();
    let svg = out.join("ft.svg");
    report::write_bar_chart(&svg, "throughput under FT relative to the unreplicated VM", &ratios.iter().collect::<Vec<_>>())?;
    println!("\nwrote {} and {}", csv.display(), svg.display());
    Ok(())
}
