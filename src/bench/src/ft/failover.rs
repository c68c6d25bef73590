//! Failover as clients see it, per kind of failure: the kv guest replicated
//! from h1 to h2 with an etcd arbiter, clients on the LAN sending SETs back
//! to back on open connections, then the primary fails:
//!
//! - **VMM killed**: `kill -9` of the primary's VMM (its kernel closes the
//!   replication stream, so the backup knows at once);
//! - **host cut**: h1's links deleted, then its VMM killed (the backup hears
//!   nothing and decides after its failure timeout);
//! - **primary stalled**: the primary's VMM SIGSTOPped (its links stay up;
//!   the backup decides after its failure timeout; the old primary is
//!   resumed a second later and is fenced by the arbiter).
//!
//! Per trial: *detection*, from the failure to the backup's verdict (its
//! `PRIMARY LOST` line); *first reply*, from the failure to the first reply
//! any client got from the new VM; the *client-seen gap* of every
//! connection, from the failure to its first reply from the new VM; and its
//! longest *silence*, from its last reply before the failure (or one
//! already on the wire) to that one. Before the failure replies come every
//! epoch or so (output is held until the checkpoint is acknowledged), so a
//! silence includes up to one epoch of normal waiting.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::netns;
use ftvm_testkit::process::Process;
use ftvm_testkit::resp::{encode, Client};
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC, H2_REPL_ADDR};

use ftvm_testkit::scratch::Scratch;

use super::runs::{self, BoxError};
use super::Options;
use crate::paths;
use crate::report::{self, Row};

/// Client connections sending during a failover.
const CONNECTIONS: u32 = 8;
/// How long a stalled primary stays stopped.
const STALL: Duration = Duration::from_secs(1);
/// A connection that has no reply this long after the failure counts as broken.
const GIVE_UP: Duration = Duration::from_secs(10);
/// A reply this long after the failure is the new VM's (frames on the wire
/// when the primary failed have arrived by then).
const RECOVERED: Duration = Duration::from_millis(1);
/// Replies collected after every connection answered again, so a later,
/// longer outage would show too.
const SETTLE: Duration = Duration::from_millis(300);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    Killed,
    HostCut,
    Stalled,
}

impl Failure {
    pub const ALL: [Failure; 3] = [Failure::Killed, Failure::HostCut, Failure::Stalled];

    pub fn name(self) -> &'static str {
        match self {
            Failure::Killed => "VMM killed",
            Failure::HostCut => "host cut",
            Failure::Stalled => "primary stalled",
        }
    }
}

/// One failover, in milliseconds.
#[derive(Debug, Default)]
pub struct Trial {
    /// From the failure to the backup's verdict.
    pub detection_ms: f64,
    /// From the failure to the first reply from the new VM (the end of the
    /// first connection's outage).
    pub first_reply_ms: f64,
    /// Per connection that answered again: from the failure to its first
    /// reply from the new VM.
    pub next_reply_ms: Vec<f64>,
    /// Per connection that answered again: its longest time without a
    /// reply (from its last reply before the failure).
    pub silence_ms: Vec<f64>,
    /// Connections that never answered again (reset or silent for 10 s).
    pub broken: usize,
}

/// Clients that send SETs back to back, each on its own connection, and
/// note when each reply arrived (also `ftvm-bench vsmr`'s failover).
pub(crate) struct Clients {
    stop: Arc<AtomicBool>,
    replies: Arc<Vec<Mutex<Vec<Instant>>>>,
    threads: Vec<JoinHandle<std::io::Result<std::io::Result<()>>>>,
}

impl Clients {
    pub(crate) fn start(topo: &Topology) -> Result<Clients, BoxError> {
        let stop = Arc::new(AtomicBool::new(false));
        let replies: Arc<Vec<Mutex<Vec<Instant>>>> = Arc::new((0..CONNECTIONS).map(|_| Mutex::new(Vec::new())).collect());
        let addr = format!("{GUEST_ADDR}:6379").parse()?;
        let mut threads = Vec::new();
        for conn in 0..CONNECTIONS {
            let (stop, replies) = (stop.clone(), replies.clone());
            let t = netns::spawn_in(&topo.ns("client"), &format!("client-{conn}"), move || -> std::io::Result<()> {
                // Long timeouts: the point is to see how long the reply takes.
                let mut c = Client::connect(addr, GIVE_UP)?;
                let mut i = 0u64;
                let mut req = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    req.clear();
                    let (k, v) = (format!("probe:{conn}"), i.to_string());
                    encode(&mut req, &[b"SET", k.as_bytes(), v.as_bytes()]);
                    c.send(&req)?;
                    if !c.read()?.is_ok() {
                        return Err(std::io::Error::other("SET refused"));
                    }
                    replies[conn as usize].lock().expect("not poisoned").push(Instant::now());
                    i += 1;
                }
                Ok(())
            })?;
            threads.push(t);
        }
        let clients = Clients { stop, replies, threads };
        // Every connection answered once: they are all in the VM's state.
        let t0 = Instant::now();
        while clients.replies.iter().any(|r| r.lock().expect("not poisoned").is_empty()) {
            if t0.elapsed() > Duration::from_secs(10) {
                return Err("the clients could not connect".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(clients)
    }

    /// Each connection's outage around a failure at `t0`: the longest time
    /// between two of its replies, the later one after `t0` (the earlier may
    /// be before it: a client waits from its last reply). Waits until every
    /// connection answered again and then [`SETTLE`] more; `None` for a
    /// connection that did not answer again within [`GIVE_UP`].
    pub(crate) fn outages(&self, t0: Instant) -> Vec<Option<Outage>> {
        let answered = |r: &Mutex<Vec<Instant>>| r.lock().expect("not poisoned").last().is_some_and(|&at| at > t0 + RECOVERED);
        while !self.replies.iter().all(answered) && t0.elapsed() < GIVE_UP {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(SETTLE);
        self.replies
            .iter()
            .map(|r| {
                if !answered(r) {
                    return None;
                }
                let r = r.lock().expect("not poisoned");
                r.windows(2).filter(|w| w[1] > t0).map(|w| Outage { gap: w[1] - w[0], ended: w[1] - t0 }).max_by_key(|o| o.gap)
            })
            .collect()
    }
}

/// One connection's outage: the longest time without a reply, and when it
/// ended (after the failure).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Outage {
    pub gap: Duration,
    pub ended: Duration,
}

impl Drop for Clients {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// How the primary is run: `--mirror` on or off, epochs and the failure
/// timeout of both sides.
#[derive(Clone, Copy)]
pub struct Setup {
    pub mirror: &'static str,
    pub epoch_ms: u64,
    pub timeout_ms: u64,
    /// The clients' minimum retransmission timeout, if not Linux's default.
    pub client_rto_min_ms: Option<u64>,
}

/// One failover of kind `failure`.
pub fn trial(topo: &Topology, etcd: &Etcd, failure: Failure, setup: Setup, dir: &Path) -> Result<Trial, BoxError> {
    let Setup { mirror, epoch_ms, timeout_ms, client_rto_min_ms } = setup;
    if let Some(ms) = client_rto_min_ms {
        let client = topo.ns("client");
        let route = ["-n", &client, "route", "replace", "10.0.0.0/24", "dev", "eth0", "rto_min", &format!("{ms}ms")];
        if !Command::new("ip").args(route).status()?.success() {
            return Err(format!("cannot set rto_min {ms}ms on the clients' route").into());
        }
    }
    let ftvm = paths::sibling_binary("ftvm");
    let net = format!("tap=tap0,mac={GUEST_MAC}");
    let backup_addr = format!("{H2_REPL_ADDR}:7000");
    let timeout = timeout_ms.to_string();
    // Each trial owns the VM under a fresh name at the arbiter.
    let name = format!("bench-{}", unix_us());
    let mut b = topo.command("h2", &ftvm);
    b.args(["backup", "--insecure", "--listen", &backup_addr, "--net", &net, "--failure-timeout-ms", &timeout])
        .args(["--arbiter", &etcd.endpoint_on("127.0.0.1"), "--name", &name])
        .env("FTVM_LOG", "info");
    let mut backup = Process::spawn_logged("ftvm backup", &mut b, dir, "failover.backup")?;
    let mut p = topo.command("h1", &ftvm);
    p.env("FTVM_LOG", "info");
    p.args(["run", "--net", &net, "--cmdline", &format!("ip={GUEST_ADDR}/24"), "--image"])
        .arg(paths::images().join("kv.elf"))
        .args(["--insecure", "--replicate-to", &backup_addr, "--epoch-ms", &epoch_ms.to_string(), "--failure-timeout-ms", &timeout])
        .args(["--arbiter", etcd.endpoint(), "--name", &name, "--mirror", mirror]);
    let mut primary = Process::spawn_logged("ftvm run", &mut p, dir, "failover.primary")?;
    runs::wait_for_kv(topo, &[&primary, &backup])?;
    // The guest serves during pre-copy already: wait for protection.
    if primary.wait_until(Duration::from_secs(20), |p| p.stderr().contains("the VM is protected")).is_err() {
        return Err(format!("the primary was never protected: {}\nthe backup said: {}", primary.stderr(), backup.stderr()).into());
    }
    let clients = Clients::start(topo)?;
    // Protected operation under load for a while.
    std::thread::sleep(Duration::from_millis(500));
    let (t0, t0_unix) = match failure {
        Failure::Killed => {
            let t0 = (Instant::now(), unix_us());
            primary.kill();
            t0
        }
        Failure::HostCut => {
            // Its replication link goes dark (down on h1's side only: the
            // backup keeps its address and hears silence, as when a host
            // dies; from then on no output is released), then its LAN link
            // is deleted. Timed from the start.
            let t0 = (Instant::now(), unix_us());
            let down = Command::new("ip").args(["-n", &topo.ns("h1"), "link", "set", "repl", "down"]).status()?;
            if !down.success() {
                return Err("cannot take h1's replication link down".into());
            }
            netns::run_in(&topo.ns("h1"), || netns::del_link("uplink"))??;
            primary.kill();
            t0
        }
        Failure::Stalled => {
            let t0 = (Instant::now(), unix_us());
            primary.signal(libc::SIGSTOP)?;
            t0
        }
    };
    let outages = clients.outages(t0);
    if failure == Failure::Stalled {
        let left = STALL.saturating_sub(t0.elapsed());
        std::thread::sleep(left);
        primary.signal(libc::SIGCONT)?;
    }
    drop(clients);
    let lost = runs::logged_value::<u64>(&backup.stderr(), "PRIMARY LOST", "lost_unix_us")
        .ok_or_else(|| format!("the backup did not take over: {}\nthe primary said: {}", backup.stderr(), primary.stderr()))?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let trial = Trial {
        detection_ms: lost as f64 / 1e3 - t0_unix as f64 / 1e3,
        first_reply_ms: outages.iter().flatten().map(|o| ms(o.ended)).fold(f64::INFINITY, f64::min),
        next_reply_ms: outages.iter().flatten().map(|o| ms(o.ended)).collect(),
        silence_ms: outages.iter().flatten().map(|o| ms(o.gap)).collect(),
        broken: outages.iter().filter(|o| o.is_none()).count(),
    };
    primary.kill();
    backup.kill();
    if failure == Failure::HostCut {
        topo.restore()?;
    }
    // The client's ARP entry pointed at a VM that is gone.
    topo.forget_guest()?;
    Ok(trial)
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `trials` failovers of every kind with `epoch_ms` epochs, with and
/// without `--mirror`: the table rows (medians over trials; gaps over every
/// connection of every trial).
pub fn measure(topo: &Topology, dir: &Path, epoch_ms: u64, opts: &Options) -> Result<Vec<Row>, BoxError> {
    let (timeout_ms, trials, client_rto_min_ms) = (opts.failure_timeout_ms, opts.failovers, opts.client_rto_min_ms);
    let etcd = Etcd::start_in(dir, &topo.ns("h2"), &[H2_REPL_ADDR, "127.0.0.1"])?;
    let mut rows = Vec::new();
    for failure in Failure::ALL {
        for mirror in ["on", "off"] {
            let setup = Setup { mirror, epoch_ms, timeout_ms, client_rto_min_ms };
            let (mut detection, mut first, mut next, mut silence, mut broken) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0);
            for _ in 0..trials {
                let t = trial(topo, &etcd, failure, setup, dir)?;
                detection.push(t.detection_ms);
                first.push(t.first_reply_ms);
                next.extend(t.next_reply_ms);
                silence.extend(t.silence_ms);
                broken += t.broken;
            }
            let worst = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
            let (worst_next, worst_silence) = (worst(&next), worst(&silence));
            let row = |case: &str, value, unit| Row {
                group: match client_rto_min_ms {
                    None => format!("failover: {} (epoch {epoch_ms} ms, failure timeout {timeout_ms} ms)", failure.name()),
                    Some(rto) => format!(
                        "failover: {} (epoch {epoch_ms} ms, failure timeout {timeout_ms} ms, clients' rto_min {rto} ms)",
                        failure.name()
                    ),
                },
                case: format!("--mirror {mirror}: {case}"),
                value,
                unit,
                reference: None,
            };
            rows.push(row("detection (median)", median(&mut detection), "ms"));
            rows.push(row("first reply (median)", median(&mut first), "ms"));
            rows.push(row("client-seen gap: failure to next reply (median)", median(&mut next), "ms"));
            rows.push(row("client-seen gap: failure to next reply (worst)", worst_next, "ms"));
            rows.push(row("longest silence of a connection (median)", median(&mut silence), "ms"));
            rows.push(row("longest silence of a connection (worst)", worst_silence, "ms"));
            rows.push(row("connections broken", broken as f64, "conns"));
        }
    }
    Ok(rows)
}

/// `ftvm-bench ft --failover`: the failovers alone, for each epoch length
/// (default 20 ms).
pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let scratch = Scratch::new("bench-failover")?;
    let topo = Topology::new("ftf")?;
    let mut rows = Vec::new();
    for e in opts.epochs.clone().unwrap_or(vec![20]) {
        rows.extend(measure(&topo, scratch.path(), e, opts)?);
    }
    let bars = rows
        .iter()
        .filter(|r| r.case.contains("failure to next reply (median)"))
        .map(|r| (format!("{}: {}", r.group, r.case), r.value))
        .collect();
    report::publish(
        out,
        "failover",
        &rows,
        &report::BarChart {
            title: "what a client waits when the primary fails (median)",
            category: "kind of failure, --mirror",
            quantity: "failure to the client's next reply (ms)",
            bars,
            reference: None,
        },
    )
}
