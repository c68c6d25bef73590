//! `--metrics-listen`: a real Prometheus server (Debian's `prometheus`,
//! installed by scripts/setup.sh) scrapes a replicated primary and its
//! backup, and its query API returns their figures; the figures move as
//! epochs run, and the backup's count a failover. `promtool check metrics`
//! accepts what a plain client (no OpenMetrics) is served.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

/// Long enough that only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(60);

/// Writes at a bounded rate (until killed): every epoch has dirty pages.
const WORK: &str = "ws=8M pattern=random rate=200000 duration=600s report=1s";

fn get(url: &str) -> Result<String, String> {
    let mut reply = ureq::get(url).call().map_err(|e| e.to_string())?;
    reply.body_mut().read_to_string().map_err(|e| e.to_string())
}

/// The samples of a scrape in the classic text format: `name{labels}` → value.
fn scrape(addr: &str) -> BTreeMap<String, f64> {
    try_scrape(addr).unwrap_or_else(|e| panic!("scrape {addr}: {e}"))
}

fn try_scrape(addr: &str) -> Result<BTreeMap<String, f64>, String> {
    let text = get(&format!("http://{addr}/metrics"))?;
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect())
}

fn value(samples: &BTreeMap<String, f64>, name: &str) -> f64 {
    *samples.get(name).unwrap_or_else(|| panic!("no {name} in {samples:?}"))
}

fn logged(cmd: &mut Command) -> &mut Command {
    cmd.env("FTVM_LOG", "info").stdout(Stdio::piped()).stderr(Stdio::piped())
}

/// Poll `f` every 100 ms until it returns Some, for at most [`PATIENCE`].
fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            eprintln!("{what}: {:?}", t0.elapsed());
            return v;
        }
        assert!(t0.elapsed() < PATIENCE, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A Prometheus server scraping `targets` every second.
struct Prometheus {
    _server: Process,
    web: String,
}

impl Prometheus {
    fn start(dir: &Scratch, targets: &[&str]) -> Prometheus {
        let web = free_addr();
        let config = dir.join("prometheus.yml");
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: ftvm\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ),
        )
        .unwrap();
        let mut cmd = Command::new("prometheus");
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let server = Process::spawn("prometheus", &mut cmd).expect("prometheus runs (scripts/setup.sh installs it)");
        let p = Prometheus { _server: server, web };
        eventually("prometheus to be ready", || get(&format!("http://{}/-/ready", p.web)).ok());
        p
    }

    /// The value of `query` (an instant vector of one series), once it has one.
    fn query(&self, query: &str) -> Option<f64> {
        let url = format!("http://{}/api/v1/query?query={}", self.web, encode(query));
        let reply: serde_json::Value = serde_json::from_str(&get(&url).ok()?).ok()?;
        assert_eq!(reply["status"], "success", "{query}: {reply}");
        let result = reply["data"]["result"].as_array()?;
        assert!(result.len() <= 1, "{query}: one series, got {result:?}");
        result.first()?["value"][1].as_str()?.parse().ok()
    }
}

/// Percent-encoding for a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"_.-".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

#[test]
fn prometheus_scrapes_replication_metrics_that_move_with_epochs_and_failover() {
    let dir = Scratch::new("metrics").unwrap().keep_on_panic();
    let (repl, primary_metrics, backup_metrics) = (free_addr(), free_addr(), free_addr());
    let mut backup = Process::spawn_collected(
        "backup",
        logged(ftvm().args(["backup", "--insecure", "--listen", &repl, "--metrics-listen", &backup_metrics])),
    )
    .unwrap();
    let mut primary = Process::spawn_collected(
        "primary",
        logged(ftvm().args(["run", "--cmdline", WORK, "--insecure", "--replicate-to", &repl, "--epoch-ms", "20"]).args([
            "--metrics-listen",
            &primary_metrics,
            "--image",
            image("memtouch").to_str().unwrap(),
        ])),
    )
    .unwrap();

    // The figures move as epochs run.
    // (The VMM serves metrics once it started.)
    let first = eventually("a first acknowledged checkpoint", || {
        let s = try_scrape(&primary_metrics).ok()?;
        (value(&s, "ftvm_checkpoints_total") > 0.0).then_some(s)
    });
    let later = eventually("ten more checkpoints", || {
        let s = scrape(&primary_metrics);
        (value(&s, "ftvm_checkpoints_total") >= value(&first, "ftvm_checkpoints_total") + 10.0).then_some(s)
    });
    let grow = [
        "ftvm_epoch",
        "ftvm_dirty_pages_total",
        "ftvm_checkpoint_bytes_total",
        "ftvm_checkpoint_pause_seconds_count",
        "ftvm_checkpoint_stop_seconds_count",
    ];
    for grows in grow {
        assert!(value(&later, grows) > value(&first, grows), "{grows}: {} then {}", value(&first, grows), value(&later, grows));
    }
    assert!(value(&later, "ftvm_checkpoint_pause_seconds_sum") > 0.0);
    assert_eq!(value(&later, "ftvm_role{role=\"primary\"}"), 1.0);
    assert_eq!(value(&later, "ftvm_protected"), 1.0);
    let b = scrape(&backup_metrics);
    assert_eq!(value(&b, "ftvm_role{role=\"backup\"}"), 1.0);
    assert!(value(&b, "ftvm_checkpoints_applied_total") > 0.0);
    assert_eq!(value(&b, "ftvm_takeovers_total"), 0.0);

    // The classic text format passes Prometheus' own linter.
    let text = get(&format!("http://{primary_metrics}/metrics")).unwrap();
    let promtool = Command::new("promtool").args(["check", "metrics"]).stdin(Stdio::piped()).output_with(&text);
    assert!(promtool.status.success(), "promtool: {}{}", stdout(&promtool), stderr(&promtool));

    // A real Prometheus scrapes both sides and returns their figures.
    let prometheus = Prometheus::start(&dir, &[&primary_metrics, &backup_metrics]);
    let on = |addr: &str, metric: &str| format!("{metric}{{instance=\"{addr}\"}}");
    let scraped = eventually("Prometheus to have the primary's checkpoints", || {
        prometheus.query(&on(&primary_metrics, "ftvm_checkpoints_total")).filter(|&v| v > 0.0)
    });
    eventually("the count to grow in Prometheus", || {
        prometheus.query(&on(&primary_metrics, "ftvm_checkpoints_total")).filter(|&v| v > scraped)
    });
    eventually("Prometheus to have the backup's applied checkpoints", || {
        prometheus.query(&on(&backup_metrics, "ftvm_checkpoints_applied_total")).filter(|&v| v > 0.0)
    });
    eventually("a pause-time quantile from the histogram", || {
        let q = format!("histogram_quantile(0.5, rate(ftvm_checkpoint_pause_seconds_bucket{{instance=\"{primary_metrics}\"}}[5s]))");
        prometheus.query(&q).filter(|v| v.is_finite() && *v > 0.0)
    });

    // Failover: the backup counts it and reports itself primary.
    primary.kill();
    wait_for(&mut backup, "backup", "PRIMARY LOST", PATIENCE);
    let b = scrape(&backup_metrics);
    assert_eq!(value(&b, "ftvm_takeovers_total"), 1.0);
    assert_eq!(value(&b, "ftvm_role{role=\"primary\"}"), 1.0);
    assert_eq!(value(&b, "ftvm_protected"), 0.0);
    eventually("Prometheus to see the failover", || prometheus.query(&on(&backup_metrics, "ftvm_takeovers_total")).filter(|&v| v == 1.0));
    eventually("Prometheus to see the backup's new role", || {
        prometheus.query(&format!("ftvm_role{{instance=\"{backup_metrics}\",role=\"primary\"}}")).filter(|&v| v == 1.0)
    });
    backup.kill();
}

/// `Command::output` with `input` on its stdin.
trait OutputWith {
    fn output_with(&mut self, input: &str) -> std::process::Output;
}

impl OutputWith for Command {
    fn output_with(&mut self, input: &str) -> std::process::Output {
        let mut child =
            self.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("promtool runs (scripts/setup.sh installs prometheus)");
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    }
}

#[test]
fn metrics_listen_on_a_busy_address_is_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run_image("probe", &["--cmdline", "exit=0", "--metrics-listen", &addr]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains(&format!("cannot serve metrics on {addr}")), "{err}");
}
