//! One measured run each: memtouch in a VM, the kv guest under
//! redis-benchmark, a failover; alone or replicated with extra `ftvm run`
//! arguments.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ftvm_testkit::netns;
use ftvm_testkit::process::Process;
use ftvm_testkit::resp::{Client, Reply};
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC, H2_REPL_ADDR};
use ftvm_vmm::memory::PAGE;

use crate::paths;
use crate::redis_benchmark::{self, Figures};
use crate::redis_guest::App;
use crate::report::Row;

pub type BoxError = Box<dyn std::error::Error>;

/// How a run is protected: replicated to a backup every `epoch_ms`, the
/// primary's `ftvm run` given `args` on top (the switches under test).
#[derive(Clone, Copy)]
pub struct Replicated<'a> {
    pub epoch_ms: u64,
    pub args: &'a [&'a str],
}

/// Per-epoch figures of a replicated run: means over its metrics file.
#[derive(Clone, Copy, Debug, Default)]
pub struct EpochMeans {
    pub pause_us: f64,
    pub dirty_pages: f64,
    /// Every byte of the checkpoint's frame.
    pub bytes: f64,
    /// How long output was held for its checkpoint.
    pub hold_us: f64,
    /// How long epochs ran (from one checkpoint's resume to the next pause).
    pub epoch_us: f64,
    /// A held output's way out, step by step: waiting for the trigger
    /// (first held output to pause), stopping the VM, the pause, from the
    /// resume to the acknowledgement, releasing the frames.
    pub wait_us: f64,
    pub stop_us: f64,
    pub ack_us: f64,
    pub release_us: f64,
    /// Share of the checkpoints that held output started (`idle` or `hold`).
    pub output_share: f64,
    /// 99th percentile of the pause.
    pub pause_p99_us: f64,
    /// 99th percentile of stopping the VM before the pause (`stop_us`).
    pub stop_p99_us: f64,
    /// Write prediction (`--predict-writes`): pages left writable, tracked
    /// first writes (dirty pages not left writable), predicted pages not
    /// sent because unchanged.
    pub predicted: f64,
    pub first_writes: f64,
    pub fake_dirty: f64,
    /// Pages the checkpoint carried.
    pub commit_pages: f64,
    pub diff_bytes_saved: f64,
    /// Bytes of vCPU, device and clock state (and disk writes).
    pub state_bytes: f64,
    /// Time encoding the checkpoint's pages.
    pub encode_ns: f64,
    /// Pages sent ahead of the checkpoint while the guest ran (`--prefetch`).
    pub prefetched_pages: f64,
    /// Of those, sends of pages written again before the freeze.
    pub prefetch_wasted: f64,
    /// Frame bytes the fake-ACK proxy stored at the freeze (`--fake-ack`).
    pub fake_ack_bytes: f64,
    /// Of those, the frame bytes the checkpoint carried (`--fake-ack-state`).
    pub fake_ack_sent_bytes: f64,
    /// Disk requests in flight at the freeze (`--disk-io async`).
    pub disk_pending: f64,
}

impl EpochMeans {
    /// Bytes on the wire per byte of dirty page (1.0 would be the dirty
    /// pages whole with no framing or state).
    pub fn bytes_per_dirty_byte(&self) -> f64 {
        self.bytes / (self.dirty_pages * PAGE as f64).max(1.0)
    }

    /// From the checkpoint's pause to its acknowledgement (what held output waits).
    pub fn pause_to_ack_us(&self) -> f64 {
        self.pause_us + self.ack_us
    }

    /// Mean time encoding one page.
    pub fn encode_ns_per_page(&self) -> f64 {
        self.encode_ns / self.commit_pages.max(1.0)
    }
}

/// One per-epoch figure of a replicated run: its name in the table, its
/// value among the means, its unit.
pub type Figure = (&'static str, fn(&EpochMeans) -> f64, &'static str);

/// Where the dirty pages went: reported by the ablation and its matrix alike.
pub const COPY_FIGURES: [Figure; 4] = [
    ("dirty pages/epoch", |m| m.dirty_pages, "pages"),
    ("stop-and-copy pages/epoch", |m| m.commit_pages, "pages"),
    ("prefetched pages/epoch", |m| m.prefetched_pages, "pages"),
    ("prefetch wasted/epoch", |m| m.prefetch_wasted, "pages"),
];

/// `figures` of `m` as rows of `group`, each named "`case`: figure", with
/// no reference (per-epoch figures have no unreplicated counterpart).
pub fn figure_rows(group: &str, case: &str, m: &EpochMeans, figures: &[Figure]) -> Vec<Row> {
    figures
        .iter()
        .map(|(figure, value, unit)| Row {
            group: group.to_owned(),
            case: format!("{case}: {figure}"),
            value: value(m),
            unit,
            reference: None,
        })
        .collect()
}

fn ftvm_bin() -> PathBuf {
    paths::sibling_binary("ftvm")
}

fn free_port() -> u16 {
    ftvm_testkit::ports::free_port().unwrap_or(7700)
}

/// Switches that both sides take: a setting measured is given to the
/// backup too.
const BOTH_SIDES: [&str; 3] = ["--idle-pause", "--priority", "--net-offload"];

/// The `BOTH_SIDES` flags of `args`, with their values.
fn backup_side<'a>(args: &[&'a str]) -> Vec<&'a str> {
    args.windows(2).filter(|w| BOTH_SIDES.contains(&w[0])).flat_map(|w| [w[0], w[1]]).collect()
}

/// Means over the JSON-lines metrics file, skipping the first epochs
/// (pre-copy aftermath).
pub fn epoch_means(path: &Path) -> EpochMeans {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).skip(3).collect();
    let mean = |f: &str| {
        let v: Vec<f64> = lines.iter().filter_map(|l| l[f].as_f64()).collect();
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let by_output = lines.iter().filter(|l| matches!(l["trigger"].as_str(), Some("idle" | "hold"))).count();
    let p99 = |f: &str| {
        let mut v: Vec<f64> = lines.iter().filter_map(|l| l[f].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        v.get(((v.len() as f64 - 1.0) * 0.99).round().max(0.0) as usize).copied().unwrap_or(0.0)
    };
    EpochMeans {
        pause_us: mean("pause_us"),
        dirty_pages: mean("dirty_pages"),
        bytes: mean("bytes"),
        hold_us: mean("hold_us"),
        epoch_us: mean("epoch_us"),
        wait_us: mean("wait_us"),
        stop_us: mean("stop_us"),
        ack_us: mean("ack_us"),
        release_us: mean("release_us"),
        output_share: if lines.is_empty() { 0.0 } else { by_output as f64 / lines.len() as f64 },
        pause_p99_us: p99("pause_us"),
        stop_p99_us: p99("stop_us"),
        predicted: mean("predicted"),
        first_writes: mean("first_writes"),
        fake_dirty: mean("fake_dirty"),
        commit_pages: mean("commit_pages"),
        diff_bytes_saved: mean("diff_bytes_saved"),
        state_bytes: mean("state_bytes"),
        encode_ns: mean("encode_ns"),
        prefetched_pages: mean("prefetched_pages"),
        prefetch_wasted: mean("prefetch_wasted"),
        fake_ack_bytes: mean("fake_ack_bytes"),
        fake_ack_sent_bytes: mean("fake_ack_sent_bytes"),
        disk_pending: mean("disk_pending"),
    }
}

fn memtouch_rate(out: &str) -> Option<f64> {
    logged_value(out, "memtouch: writes=", "writes/s")
}

/// The value of `key=VALUE` in the first line of `text` that contains
/// `mark` and has one that parses.
pub fn logged_value<T: std::str::FromStr>(text: &str, mark: &str, key: &str) -> Option<T> {
    text.lines()
        .filter(|l| l.contains(mark))
        .find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))?.parse().ok())
}

/// memtouch with `cmdline`, alone or as a primary replicating to a backup
/// on loopback: its writes/s, and the epoch figures when replicated.
pub fn memtouch(cmdline: &str, ft: Option<Replicated>, dir: &Path) -> Result<(f64, Option<EpochMeans>), BoxError> {
    memtouch_on(1, cmdline, ft, dir)
}

/// `memtouch` on a VM of `vcpus` vCPUs (memtouch writes from all of them).
pub fn memtouch_on(vcpus: u32, cmdline: &str, ft: Option<Replicated>, dir: &Path) -> Result<(f64, Option<EpochMeans>), BoxError> {
    let image = paths::images().join("memtouch.elf");
    let metrics = dir.join("memtouch.jsonl");
    let _ = std::fs::remove_file(&metrics);
    let mut _backup = None;
    let mut cmd = Command::new(ftvm_bin());
    cmd.args(["run", "--memory", "512", "--vcpus", &vcpus.to_string(), "--cmdline", cmdline]).arg("--image").arg(&image);
    if let Some(ft) = ft {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut b = Command::new(ftvm_bin());
        b.args(["backup", "--insecure", "--listen", &addr])
            .args(backup_side(ft.args))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("backup.log"))?);
        _backup = Some(Process::spawn("ftvm backup", &mut b)?);
        cmd.args(["--insecure", "--replicate-to", &addr, "--epoch-ms", &ft.epoch_ms.to_string()])
            .args(["--metrics-every-epoch", "--metrics"])
            .arg(&metrics)
            .args(ft.args);
    }
    let out = cmd.output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = memtouch_rate(&text).ok_or_else(|| {
        let backup = if ft.is_some() { std::fs::read_to_string(dir.join("backup.log")).unwrap_or_default() } else { String::new() };
        format!("memtouch printed no rate: {text}{}{backup}", String::from_utf8_lossy(&out.stderr))
    })?;
    Ok((rate, ft.map(|_| epoch_means(&metrics))))
}

/// redis-benchmark SET and GET against the guest, 50 connections, values
/// of `value_bytes` (redis-benchmark's default is 3).
pub fn redis_benchmark(topo: &Topology, pipeline: u32, requests: u64, value_bytes: u32) -> Result<Vec<Figures>, BoxError> {
    let out = topo
        .command("client", "redis-benchmark")
        .args(["-h", GUEST_ADDR, "-t", "set,get", "-c", "50", "--csv"])
        .args(["-P", &pipeline.to_string(), "-n", &requests.to_string(), "-d", &value_bytes.to_string()])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rows = redis_benchmark::parse(&text).unwrap_or_default();
    if rows.len() < 2 {
        return Err(format!("redis-benchmark failed: {text}{}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(rows)
}

/// The bulk read: one value of `BULK_BYTES`, read back whole again and again.
pub const BULK_BYTES: usize = 4 << 20;

/// SET one `BULK_BYTES` value in the guest, then GET it `reads` times over
/// one connection from the client namespace: the read throughput in MB/s
/// (every reply checked against the value).
pub fn bulk_read(topo: &Topology, reads: usize) -> Result<f64, BoxError> {
    let addr = format!("{GUEST_ADDR}:6379").parse().expect("valid address");
    let value: Vec<u8> = (0..BULK_BYTES).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let result = netns::run_in(&topo.ns("client"), move || -> Result<f64, String> {
        let mut c = Client::connect(addr, Duration::from_secs(30)).map_err(|e| format!("cannot reach the kv guest: {e}"))?;
        match c.call(&[b"SET", b"bulk", &value]) {
            Ok(r) if r.is_ok() => {}
            other => return Err(format!("SET of the bulk value: {other:?}")),
        }
        let t0 = Instant::now();
        for _ in 0..reads {
            match c.call(&[b"GET", b"bulk"]) {
                Ok(Reply::Bulk(Some(v))) if v == value => {}
                Ok(Reply::Bulk(Some(v))) => return Err(format!("GET returned {} other bytes", v.len())),
                other => return Err(format!("GET of the bulk value: {other:?}")),
            }
        }
        Ok((reads * BULK_BYTES) as f64 / t0.elapsed().as_secs_f64() / 1e6)
    })?;
    Ok(result?)
}

/// A Redis-protocol guest (the kv guest or redis-server) and, when
/// replicated, its backup; both killed when dropped.
pub struct Kv {
    _backup: Option<Process>,
    primary: Process,
}

/// Send one command from the client namespace with short timeouts (a dead
/// or silent guest is an answer here too): its reply, if one came.
fn redis(topo: &Topology, args: &[&str]) -> Option<Reply> {
    let args: Vec<Vec<u8>> = args.iter().map(|a| a.as_bytes().to_vec()).collect();
    let addr = format!("{GUEST_ADDR}:6379").parse().expect("valid address");
    netns::run_in(&topo.ns("client"), move || {
        let mut c = Client::connect(addr, Duration::from_millis(100)).ok()?;
        c.set_timeout(Duration::from_millis(200)).ok()?;
        c.call(&args.iter().map(Vec::as_slice).collect::<Vec<_>>()).ok()
    })
    .ok()
    .flatten()
}

/// kv in h1 (replicating to h2 when `ft` is set, epoch figures into
/// `metrics`), ready to serve; stderr goes to `LOG.primary.err` and
/// `LOG.backup.err` in `dir`.
pub fn start_kv(topo: &Topology, ft: Option<Replicated>, dir: &Path, log: &str, metrics: &Path) -> Result<Kv, BoxError> {
    start_kv_on(topo, ft, dir, log, metrics, None)
}

/// The disk of a kv run: the guest logs every write to it (`aof=on`);
/// `fault` is the primary's `FTVM_TEST_FAULT` (a slow disk).
pub struct KvDisk<'a> {
    pub fault: &'a str,
}

/// `start_kv`, with a fresh 64 MiB disk on each side in `dir` if `disk`.
pub fn start_kv_on(
    topo: &Topology,
    ft: Option<Replicated>,
    dir: &Path,
    log: &str,
    metrics: &Path,
    disk: Option<&KvDisk>,
) -> Result<Kv, BoxError> {
    let aof = if disk.is_some() { " aof=on" } else { "" };
    let args = ["--cmdline".to_owned(), format!("ip={GUEST_ADDR}/24{aof}")];
    start_guest(topo, App::Kv, &args, ft, dir, log, metrics, disk)
}

/// `start_kv` for either Redis-protocol guest: the kv guest, or
/// redis-server on the Linux personality.
pub fn start_server(topo: &Topology, app: App, ft: Option<Replicated>, dir: &Path, log: &str, metrics: &Path) -> Result<Kv, BoxError> {
    start_guest(topo, app, &app.run_args(""), ft, dir, log, metrics, None)
}

/// `app`'s guest with `ftvm run` arguments `args` (after the image), as
/// `start_kv_on` describes.
#[allow(clippy::too_many_arguments)]
fn start_guest(
    topo: &Topology,
    app: App,
    args: &[String],
    ft: Option<Replicated>,
    dir: &Path,
    log: &str,
    metrics: &Path,
    disk: Option<&KvDisk>,
) -> Result<Kv, BoxError> {
    let net = format!("tap=tap0,mac={GUEST_MAC}");
    let backup_addr = format!("{H2_REPL_ADDR}:7000");
    let image = app.existing_image(&paths::images())?;
    let mut backup = None;
    let mut cmd = topo.command("h1", ftvm_bin());
    cmd.args(["run", "--net", &net]).args(args).arg("--image").arg(&image);
    let fresh_disk = |name: &str| -> Result<std::path::PathBuf, BoxError> {
        let path = dir.join(name);
        std::fs::File::create(&path)?.set_len(64 << 20)?;
        Ok(path)
    };
    if let Some(d) = disk {
        cmd.arg("--disk").arg(fresh_disk("kv-primary.img")?).env("FTVM_TEST_FAULT", d.fault);
    }
    if let Some(ft) = ft {
        let _ = std::fs::remove_file(metrics);
        let mut b = topo.command("h2", ftvm_bin());
        b.args(["backup", "--insecure", "--listen", &backup_addr, "--net", &net]).args(backup_side(ft.args)).env("FTVM_LOG", "warn");
        if disk.is_some() {
            b.arg("--disk").arg(fresh_disk("kv-backup.img")?);
        }
        backup = Some(Process::spawn_logged("ftvm backup", &mut b, dir, &format!("{log}.backup"))?);
        cmd.args(["--insecure", "--replicate-to", &backup_addr, "--epoch-ms", &ft.epoch_ms.to_string()])
            .args(["--metrics-every-epoch", "--metrics"])
            .arg(metrics)
            .args(ft.args);
    }
    let primary = Process::spawn_logged("ftvm run", &mut cmd, dir, &format!("{log}.primary"))?;
    let kv = Kv { _backup: backup, primary };
    let vmms: Vec<&Process> = std::iter::once(&kv.primary).chain(&kv._backup).collect();
    wait_for_kv(topo, &vmms)?;
    Ok(kv)
}

/// Wait until the kv guest answers PING (at most 15 s; the error quotes
/// what `vmms` wrote to stderr).
pub fn wait_for_kv(topo: &Topology, vmms: &[&Process]) -> Result<(), BoxError> {
    let t0 = Instant::now();
    while !matches!(redis(topo, &["PING"]), Some(Reply::Simple(_))) {
        if t0.elapsed() > Duration::from_secs(15) {
            let said: Vec<String> = vmms.iter().map(|p| format!("{}: {}", p.name(), p.stderr())).collect();
            return Err(format!("kv guest never answered; {}", said.join("; ")).into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_logged_values() {
        let out = "memtouch: t=1.0s writes/s=9000 pages/s=9000\nmemtouch: writes=30000 elapsed_ms=3000 writes/s=10001.5\nmemtouch: done checksum=00\n";
        assert_eq!(memtouch_rate(out), Some(10001.5));
        assert_eq!(memtouch_rate("nothing"), None);
        let err = "2025-01-01T00:00:00Z  WARN ftvm_primary_backup::backup: PRIMARY LOST: took over from the last committed checkpoint epoch=7 reason=\"x y\" lost_unix_us=1700000000123456 resume_us=812\n";
        assert_eq!(logged_value(err, "PRIMARY LOST", "lost_unix_us"), Some(1_700_000_000_123_456u64));
        assert_eq!(logged_value::<u64>(err, "PRIMARY LOST", "lost_unix"), None, "whole keys only");
    }
}
