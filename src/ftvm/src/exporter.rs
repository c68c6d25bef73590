//! `--metrics-listen ADDR`: `GET /metrics` in the Prometheus exposition
//! format, served from a thread of its own: OpenMetrics text to a client
//! that accepts it (Prometheus asks for it first), the classic text format
//! (0.0.4) to others (curl, `promtool check metrics`).
//!
//! What it serves is the process's replication telemetry
//! (`ftvm_replication::telemetry`) and, read from the side's status at each
//! scrape, its role, protection and epoch. One request per connection, each
//! with a deadline, so a stuck scraper delays the next by at most
//! [`CLIENT_TIMEOUT`] and never the VM.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use ftvm_replication::{Role, StatusCell};
use ftvm_vmm::sync::Lock;

/// How long one scrape may take to send its request and read the reply.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest request head read.
const MAX_REQUEST: usize = 8192;
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, thiserror::Error)]
#[error("cannot serve metrics on {addr}: {err}")]
pub struct ExporterError {
    addr: String,
    err: std::io::Error,
}

/// The side whose state is reported (none for a VM that is not replicated).
type Followed = Arc<Mutex<Option<StatusCell>>>;

pub struct Exporter {
    followed: Followed,
}

impl Exporter {
    /// Listen on `addr` (host:port) and serve scrapes until the process exits.
    pub fn start(addr: &str) -> Result<Exporter, ExporterError> {
        let followed = Followed::default();
        let gauges = StatusGauges::default();
        let mut registry = Registry::with_prefix("ftvm");
        ftvm_replication::telemetry::telemetry().register(&mut registry);
        gauges.register(&mut registry);
        let state = followed.clone();
        serve_registry(addr, registry, move || gauges.update(state.locked().as_ref()))?;
        Ok(Exporter { followed })
    }

    /// Report this side's status from now on.
    pub fn follow(&self, status: Option<&StatusCell>) {
        *self.followed.locked() = status.cloned();
    }
}

/// Serve `registry` on `addr` (host:port) from a thread of its own until the
/// process exits, calling `before_scrape` before each scrape is answered.
pub fn serve_registry(addr: &str, registry: Registry, before_scrape: impl Fn() + Send + 'static) -> Result<SocketAddr, ExporterError> {
    let error = |err| ExporterError { addr: addr.to_owned(), err };
    let listener = TcpListener::bind(addr).map_err(error)?;
    let local = listener.local_addr().map_err(error)?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Api);
            for conn in listener.incoming() {
                match conn {
                    Ok(conn) => {
                        before_scrape();
                        if let Err(e) = serve(conn, &registry) {
                            tracing::debug!("metrics scrape: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("metrics listener: {e}"),
                }
            }
        })
        .map_err(error)?;
    tracing::info!(addr = %local, "serving Prometheus metrics on /metrics");
    Ok(local)
}

/// What is read from the status cell at each scrape.
#[derive(Default)]
struct StatusGauges {
    role: Family<Vec<(&'static str, &'static str)>, Gauge>,
    protected: Gauge,
    epoch: Gauge,
    /// Counted by the VMM's console sink; brought up to date at each scrape.
    console_write_errors: Counter,
    /// What the adaptive mechanisms weigh, per step (`--tuning auto`).
    cost_per_page: Family<Vec<(&'static str, &'static str)>, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Regions write prediction keeps writable after the last checkpoint.
    regions_kept: Gauge,
    /// Flows the fake-ACK proxy has in bulk mode at the last checkpoint.
    fake_ack_bulk_flows: Gauge,
}

impl StatusGauges {
    fn register(&self, r: &mut Registry) {
        r.register("role", "1 for the role this side has now (primary or backup), 0 for the other", self.role.clone());
        r.register("protected", "1 while a backup holds an acknowledged checkpoint of this VM", self.protected.clone());
        r.register("epoch", "Last epoch checkpointed (primary) or applied (backup)", self.epoch.clone());
        r.register(
            "console_write_errors",
            "Writes of guest console output to stdout that failed (a closed or full stdout) and were dropped",
            self.console_write_errors.clone(),
        );
        r.register(
            "cost_per_page_seconds",
            "Per-page cost the adaptive mechanisms weigh, by step (first_write, copy, hash, encode, protect; 0: not measured): measured at start with --tuning auto",
            self.cost_per_page.clone(),
        );
        r.register(
            "regions_kept_writable",
            "Regions of 512 pages whose pages write prediction keeps writable, after the last checkpoint",
            self.regions_kept.clone(),
        );
        r.register(
            "fake_ack_bulk_flows",
            "TCP flows the fake-ACK proxy found carrying bulk data and acknowledges early (--fake-ack bulk), at the last checkpoint",
            self.fake_ack_bulk_flows.clone(),
        );
    }

    fn update(&self, status: Option<&StatusCell>) {
        // A VM that is not replicated runs as its own primary.
        let st = status.map(StatusCell::get).unwrap_or_default();
        for role in [Role::Primary, Role::Backup] {
            let name = if role == Role::Primary { "primary" } else { "backup" };
            self.role.get_or_create(&vec![("role", name)]).set(i64::from(st.role == role));
        }
        self.protected.set(i64::from(st.protected));
        self.epoch.set(st.epoch as i64);
        if let Some(c) = st.costs {
            let steps = [
                ("first_write", c.first_write_ns),
                ("copy", c.copy_ns),
                ("hash", c.hash_ns),
                ("encode", c.encode_ns),
                ("protect", c.protect_ns),
            ];
            for (step, ns) in steps {
                self.cost_per_page.get_or_create(&vec![("step", step)]).set(f64::from(ns) / 1e9);
            }
        }
        self.regions_kept.set(st.last.map_or(0, |m| i64::from(m.regions_kept)));
        self.fake_ack_bulk_flows.set(st.last.map_or(0, |m| m.fake_ack_bulk_flows as i64));
        let console = ftvm_vmm::hooks::console_write_errors();
        self.console_write_errors.inc_by(console.saturating_sub(self.console_write_errors.get()));
    }
}

/// Answer one HTTP/1.x request on `conn` and close it.
fn serve(mut conn: TcpStream, registry: &Registry) -> std::io::Result<()> {
    conn.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    conn.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 || head.len() + n > MAX_REQUEST {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, target) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    let (status, content_type, body) = match (method, path) {
        (b"GET", b"/metrics") => {
            let mut body = String::new();
            encode(&mut body, registry).map_err(std::io::Error::other)?;
            let accept = head.windows(20).any(|w| w.eq_ignore_ascii_case(b"application/openmetr"));
            if accept {
                ("200 OK", OPENMETRICS, body)
            } else {
                ("200 OK", CLASSIC, classic(&body))
            }
        }
        (b"GET", _) => ("404 Not Found", "text/plain", "only /metrics is served here\n".to_owned()),
        _ => ("405 Method Not Allowed", "text/plain", "GET /metrics\n".to_owned()),
    };
    let reply =
        format!("HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    conn.write_all(reply.as_bytes())
}

/// OpenMetrics text as the classic text format: a counter family is named
/// after its samples (`x_total`), and there are no `# UNIT` or `# EOF` lines
/// (units are in the names already).
fn classic(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(&name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_format_names_counters_after_their_samples() {
        let om = "# HELP ftvm_c Things.\n# TYPE ftvm_c counter\nftvm_c_total 3\n# HELP ftvm_h T.\n# TYPE ftvm_h_seconds histogram\n# UNIT ftvm_h_seconds seconds\nftvm_h_seconds_sum 1.0\n# TYPE ftvm_g gauge\nftvm_g 2\n# EOF\n";
        let want = "# HELP ftvm_c_total Things.\n# TYPE ftvm_c_total counter\nftvm_c_total 3\n# HELP ftvm_h T.\n# TYPE ftvm_h_seconds histogram\nftvm_h_seconds_sum 1.0\n# TYPE ftvm_g gauge\nftvm_g 2\n";
        assert_eq!(classic(om), want);
    }
}
