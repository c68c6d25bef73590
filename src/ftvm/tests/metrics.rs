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

// Issue 29: nothing dropped in silence.

/// A primary and a backup whose `--metrics` files cannot be written
/// (`/dev/full`: every write fails with ENOSPC) and a primary whose stdout
/// (the guest's console) is `/dev/full` too: each side warns once per
/// kind, counts every dropped line in `ftvm status` and Prometheus, and
/// the pair runs the guest to its end.
#[test]
fn unwritable_metrics_and_console_are_counted_and_warned_once() {
    let dir = Scratch::new("metrics-full").unwrap().keep_on_panic();
    let (socket, b_socket) = (dir.join("p.sock"), dir.join("b.sock"));
    let (p_listen, b_listen) = (free_addr(), free_addr());
    let addr = free_addr();
    let mut b = Process::spawn_collected(
        "ftvm backup",
        ftvm()
            .args(["backup", "--insecure", "--listen", &addr, "--metrics", "/dev/full", "--metrics-listen", &b_listen, "--api-socket"])
            .arg(&b_socket),
    )
    .unwrap();
    let mut cmd = ftvm();
    cmd.args(["run", "--image"])
        .arg(image("memtouch"))
        .args(["--cmdline", "ws=4M pattern=seq duration=4s report=100ms", "--insecure", "--replicate-to", &addr, "--epoch-ms", "20"])
        .args(["--metrics-every-epoch", "--metrics", "/dev/full", "--metrics-listen", &p_listen, "--api-socket"])
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap())
        .stderr(std::fs::File::create(dir.join("p.err")).unwrap());
    let mut p = Process::spawn("ftvm run", &mut cmd).unwrap();
    // Errors of both kinds pile up while the guest runs.
    let errors = |socket: &std::path::Path| -> serde_json::Value {
        let out = ftvm().args(["status", "--json", "--api-socket"]).arg(socket).output().unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).map(|v| v["write_errors"].clone()).unwrap_or_default()
    };
    let counted = eventually("primary's errors counted", || {
        let e = errors(&socket);
        (e["metrics"].as_u64()? >= 5 && e["console"].as_u64()? >= 5).then_some(e)
    });
    let text = status(&socket);
    assert!(text.contains("write errors: ") && text.contains("metrics lines") && text.contains("console writes dropped"), "{text}");
    let samples = scrape(&p_listen);
    assert!(value(&samples, "ftvm_metrics_write_errors_total") >= counted["metrics"].as_f64().unwrap(), "{samples:?}");
    assert!(value(&samples, "ftvm_console_write_errors_total") >= counted["console"].as_f64().unwrap(), "{samples:?}");
    // The backup's per-second lines fail too, once a second.
    eventually("backup's errors counted", || (errors(&b_socket)["metrics"].as_u64()? >= 2).then_some(()));
    assert!(value(&scrape(&b_listen), "ftvm_metrics_write_errors_total") >= 2.0);

    // The VM went on: the guest ran to its end, both sides stopped as usual.
    let status = exit_status(&mut p, PATIENCE);
    let p_err = std::fs::read_to_string(dir.join("p.err")).unwrap();
    assert!(status.success(), "{p_err}");
    assert!(exit_status(&mut b, PATIENCE).success(), "{}", b.output());
    // One warning of each kind, not one per line.
    assert_eq!(p_err.matches("cannot write metrics: No space left on device").count(), 1, "{p_err}");
    assert_eq!(p_err.matches("cannot write the guest's console output to stdout").count(), 1, "{p_err}");
    assert_eq!(b.stderr().matches("cannot write metrics: No space left on device").count(), 1, "{}", b.stderr());
}

/// By default a metrics line sums a second of epochs; the file is
/// rotated at `--metrics-max-bytes` into `FILE.1`.
#[test]
fn metrics_lines_sum_each_second_and_the_file_rotates() {
    let dir = Scratch::new("metrics-second").unwrap().keep_on_panic();
    let (primary_m, backup_m) = (dir.join("p.jsonl"), dir.join("b.jsonl"));
    let addr = free_addr();
    let b = Process::spawn_collected("ftvm backup", ftvm().args(["backup", "--insecure", "--listen", &addr, "--metrics"]).arg(&backup_m))
        .unwrap();
    let p = Process::spawn_collected(
        "ftvm run",
        ftvm()
            .args(["run", "--image"])
            .arg(image("memtouch"))
            .args(["--cmdline", "ws=4M pattern=seq duration=4s report=1s", "--insecure", "--replicate-to", &addr, "--epoch-ms", "20"])
            .args(["--trigger", "periodic", "--metrics-max-bytes", "1500", "--metrics"])
            .arg(&primary_m),
    )
    .unwrap();
    let (mut p, mut b) = (p, b);
    let (p_status, b_status) = (exit_status(&mut p, PATIENCE), exit_status(&mut b, PATIENCE));
    assert!(p_status.success() && b_status.success(), "{p_status} {b_status}\n{}\n{}", p.output(), b.output());
    let rotated = dir.join("p.jsonl.1");
    assert!(rotated.exists(), "no rotation at 1500 bytes");
    // The owner's alone, new and rotated alike, whatever the umask.
    for path in [&rotated, &primary_m, &backup_m] {
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).unwrap().permissions()) & 0o777;
        assert_eq!(mode, 0o600, "{}", path.display());
    }
    let mut seconds = Vec::new();
    for path in [&rotated, &primary_m] {
        let size = std::fs::metadata(path).unwrap().len();
        let lines = json_lines(path);
        assert!(!lines.is_empty() && (size <= 1500 || lines.len() == 1), "{}: {size} bytes in {} lines", path.display(), lines.len());
        for l in lines {
            let (count, sum, max) = (l["count"].as_u64().unwrap(), &l["sum"], &l["max"]);
            assert!(count >= 1 && l["first_epoch"].as_u64() <= l["last_epoch"].as_u64(), "{l}");
            assert!(sum["pause_us"].as_u64() >= max["pause_us"].as_u64() && max["pause_us"].as_u64().is_some(), "{l}");
            let triggers: u64 = l["trigger"].as_object().unwrap().values().map(|n| n.as_u64().unwrap()).sum();
            assert_eq!(triggers, count, "{l}");
            seconds.push((l["second"].as_u64().unwrap(), count));
        }
    }
    // Each line a distinct second, in order; 20 ms epochs: many an epoch per line.
    assert!(seconds.windows(2).all(|w| w[0].0 < w[1].0), "{seconds:?}");
    assert!(seconds.iter().any(|&(_, n)| n >= 10), "{seconds:?}");
    // The backup's lines sum its applied checkpoints the same way.
    let applied = json_lines(&backup_m);
    assert!(!applied.is_empty() && applied.iter().all(|l| l["count"].as_u64() >= Some(1) && l["max"]["apply_us"].is_u64()), "{applied:?}");
}

/// Issue 30: with default flags (`--tuning auto`) a primary measures this
/// host's per-page costs at start and shows them (`ftvm status`, its JSON
/// and Prometheus) with the thresholds they set; with `--tuning static`
/// they are the costs assumed.
#[test]
fn the_costs_weighed_are_measured_at_start_and_shown() {
    let dir = Scratch::new("metrics-costs").unwrap().keep_on_panic();
    for (tuning, how) in [("auto", "measured at start"), ("static", "assumed")] {
        let (repl, listen, socket) = (free_addr(), free_addr(), dir.join(format!("{tuning}.sock")));
        let mut backup = Process::spawn_collected("backup", logged(ftvm().args(["backup", "--insecure", "--listen", &repl]))).unwrap();
        let mut primary = Process::spawn_collected(
            "primary",
            logged(
                ftvm()
                    .args([
                        "run",
                        "--cmdline",
                        WORK,
                        "--insecure",
                        "--replicate-to",
                        &repl,
                        "--tuning",
                        tuning,
                        "--metrics-listen",
                        &listen,
                    ])
                    .args(["--predict-writes", "adaptive", "--image", image("memtouch").to_str().unwrap(), "--api-socket"])
                    .arg(&socket),
            ),
        )
        .unwrap();
        let text = eventually("a status with its costs", || Some(status(&socket)).filter(|t| t.contains("costs per page")));
        assert!(text.contains(&format!("costs per page ({how}): tracked first write ")), "{tuning}: {text}");
        assert!(text.contains("a region is kept writable from ") && text.contains("prefetch rounds run while at most "), "{text}");
        let json = ftvm().args(["status", "--json", "--api-socket"]).arg(&socket).output().unwrap();
        let costs = serde_json::from_slice::<serde_json::Value>(&json.stdout).unwrap()["replication"]["costs"].clone();
        assert_eq!(costs["measured"], serde_json::Value::Bool(tuning == "auto"), "{costs}");
        let samples = scrape(&listen);
        for step in ["first_write", "copy", "hash", "encode"] {
            let ns = (value(&samples, &format!("ftvm_cost_per_page_seconds{{step=\"{step}\"}}")) * 1e9).round();
            // The copy cost follows the stop-and-copy (it may move between the two reads).
            if step != "copy" {
                assert_eq!(ns, costs[format!("{step}_ns")].as_f64().unwrap(), "{tuning}: {step}");
            }
            assert!(ns > 0.0, "{tuning}: {step} costs {ns} ns");
        }
        primary.kill();
        backup.kill();
    }
}
