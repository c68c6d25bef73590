//! Liveness end to end on loopback: heartbeats both ways on their own path
//! (`docs/replication.md`, Liveness). With failure timeouts of 30 ms on both
//! sides, a guest that dirties thousands of pages every epoch is never
//! taken for dead; a primary that is killed or stalled is found lost fast,
//! also while a stranger sends it heartbeats of its own; a pre-copy that
//! sends nothing for far longer than the failure timeout (a sparse disk)
//! keeps its backup; and a stop signal ends a pre-copy at once.
//!
//! The soak (`heartbeat_soak`, ignored) runs the first test for 10 minutes:
//! `cargo test --release -p ftvm --test liveness -- --ignored` (or
//! `FTVM_SOAK_SECS=N` for another length).

mod common;

use std::net::UdpSocket;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::tmpfs::Tmpfs;

/// The failure timeout every test here gives both sides.
const TIMEOUT_MS: u64 = 30;
const TIMEOUT: &str = "30";

fn vmm(cmd: &mut Command) -> Process {
    Process::spawn_collected("ftvm", cmd.env("FTVM_LOG", "info")).unwrap()
}

fn backup(addr: &str, extra: &[&str]) -> Process {
    listening(
        vmm(ftvm().args(["backup", "--listen", addr, "--failure-timeout-ms", TIMEOUT]).args(extra).args(insecure_unless_secret(extra))),
        addr,
    )
}

fn primary(addr: &str, cmdline: &str, extra: &[&str]) -> Process {
    vmm(ftvm()
        .args(["run", "--cmdline", cmdline, "--replicate-to", addr, "--failure-timeout-ms", TIMEOUT])
        .arg("--image")
        .arg(image("memtouch"))
        .args(extra)
        .args(insecure_unless_secret(extra)))
}

fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

/// The value of `key=` on the first log line containing `text`.
fn log_field(log: &str, text: &str, key: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.contains(text))?;
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// The longest gap between two heartbeats a side received, from its log.
fn longest_gap_ms(log: &str) -> f64 {
    log_field(log, "heartbeats ended", "longest_gap_us").map_or(f64::NAN, |us| us as f64 / 1000.0)
}

fn secret(dir: &Path) -> PathBuf {
    let path = dir.join("secret");
    std::fs::write(&path, [0x5au8; 32]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// A primary whose guest dirties thousands of pages every epoch for
/// `secs`, both sides with 30 ms failure timeouts and an authenticated
/// channel (so heartbeats are tagged): no side ever gives the other up.
/// While it runs the primary says it is protected and the backup follows;
/// at the end the guest's exit ends both, without a takeover. With `hogs`,
/// that many busy loops compete for the CPUs all along (a saturated host).
fn no_false_failures(tag: &str, secs: u64, hogs: usize) {
    let stop_hogs = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hog_threads: Vec<_> = (0..hogs)
        .map(|_| {
            let stop = stop_hogs.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let dir = Scratch::new(tag).unwrap().keep_on_panic();
    let (socket, metrics, secret) = (dir.join("api.sock"), dir.join("metrics.jsonl"), secret(dir.path()));
    let addr = free_addr();
    let auth = ["--secret-file", secret.to_str().unwrap()];
    let mut b = backup(&addr, &auth);
    // 4096 pages, written at random as fast as the guest can: every 20 ms
    // epoch dirties (nearly) all of them, a 16 MiB checkpoint.
    let cmdline = format!("ws=16M pattern=random duration={secs}s report=1s");
    let extra =
        [&auth[..], &["--api-socket", socket.to_str().unwrap(), "--metrics-every-epoch", "--metrics", metrics.to_str().unwrap()]].concat();
    let mut p = primary(&addr, &cmdline, &extra);
    wait_for(&mut p, "primary", "the VM is protected", Duration::from_secs(30));
    let t0 = Instant::now();
    let mut checks = 0;
    while t0.elapsed() < Duration::from_secs(secs.saturating_sub(3)) {
        std::thread::sleep(Duration::from_secs(1));
        let st = ftvm().args(["status", "--api-socket"]).arg(&socket).output().unwrap();
        let st = String::from_utf8_lossy(&st.stdout).into_owned();
        if !(st.contains("protected: yes") && st.contains("state: running")) {
            let _ = b.wait_until(Duration::from_secs(2), |b| b.stderr().contains("heartbeats ended"));
            panic!("after {:?}: {st}\nprimary: {}\nbackup: {}", t0.elapsed(), p.output(), b.output());
        }
        assert!(b.running() && !b.output().contains("PRIMARY LOST"), "the backup stopped following:\n{}", b.output());
        checks += 1;
    }
    assert!(p.stdout().contains("t="), "no guest progress:\n{}", p.output());

    let status = exit_status(&mut p, Duration::from_secs(secs + 120));
    assert!(status.success(), "{}", p.output());
    let b_status = exit_status(&mut b, Duration::from_secs(60));
    let (p_err, b_err) = (p.stderr(), b.stderr());
    assert!(!p_err.contains("BACKUP LOST"), "the primary gave its live backup up:\n{p_err}");
    assert!(b_status.success() && b_err.contains("backup done"), "{b_err}");
    assert!(!b_err.contains("PRIMARY LOST"), "the backup took a live primary over:\n{b_err}");

    stop_hogs.store(true, std::sync::atomic::Ordering::Relaxed);
    hog_threads.into_iter().for_each(|h| h.join().unwrap());

    let epochs: Vec<serde_json::Value> = json_lines(&metrics);
    let mut dirty: Vec<u64> = epochs.iter().map(|e| e["dirty_pages"].as_u64().unwrap()).collect();
    dirty.sort_unstable();
    let median = dirty[dirty.len() / 2];
    let largest = epochs.iter().map(|e| e["bytes"].as_u64().unwrap()).max().unwrap();
    let slowest_ack = epochs.iter().map(|e| e["ack_us"].as_u64().unwrap()).max().unwrap();
    println!(
        "{secs} s, {} epochs, median {median} dirty pages, largest checkpoint {largest} bytes, slowest acknowledgement {} ms, \
         {checks} status checks; longest heartbeat gap: primary saw {:.1} ms, backup saw {:.1} ms (failure timeouts {TIMEOUT_MS} ms)",
        epochs.len(),
        slowest_ack / 1000,
        longest_gap_ms(&p_err),
        longest_gap_ms(&b_err),
    );
    // The load was real: thousands of dirty pages per epoch (hundreds with
    // busy loops taking the guest's CPU).
    let least = if hogs == 0 { 1000 } else { 100 };
    assert!(median >= least, "median {median} dirty pages per epoch over {} epochs", epochs.len());
}

#[test]
fn thousands_of_dirty_pages_per_epoch_with_30ms_timeouts_cause_no_takeover() {
    no_false_failures("liveness-load", 20, 0);
}

/// `cargo test --release -p ftvm --test liveness -- --ignored`: the same for
/// 10 minutes (`FTVM_SOAK_SECS` for another length), with
/// `FTVM_SOAK_HOGS` busy loops beside it (default 2: both CPUs of this host
/// saturated).
#[test]
#[ignore]
fn heartbeat_soak() {
    let secs = std::env::var("FTVM_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(600);
    let hogs = std::env::var("FTVM_SOAK_HOGS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    no_false_failures("liveness-soak", secs, hogs);
}

/// About 4 s of guest work at full speed, bounded so its checksum is known.
const WORK: &str = "ws=16M pattern=random writes=900000000 report=100ms";

/// A protected primary and its backup, the guest at work.
fn protected_pair(addr: &str) -> (Process, Process) {
    let b = backup(addr, &[]);
    let mut p = primary(addr, WORK, &["--epoch-ms", "10"]);
    wait_for(&mut p, "primary", "the VM is protected", Duration::from_secs(30));
    wait_for(&mut p, "primary", "t=", Duration::from_secs(10));
    (p, b)
}

/// The backup takes over, at the right memory, and says when it found its
/// primary lost (`lost_unix_us`) and why.
fn takeover(b: &mut Process) -> (u64, String) {
    wait_for(b, "backup", "PRIMARY LOST", Duration::from_secs(10));
    let log = b.stderr();
    let lost = log_field(&log, "PRIMARY LOST", "lost_unix_us").unwrap_or_else(|| panic!("no detection time:\n{log}"));
    let reason = log.lines().find(|l| l.contains("PRIMARY LOST")).unwrap().to_owned();
    assert!(exit_status(b, Duration::from_secs(60)).success(), "{}", b.output());
    assert_eq!(field(&b.stdout(), "memtouch: done", "checksum"), Some(expected_memtouch_checksum(WORK, 1)), "{}", b.output());
    (lost, reason)
}

/// A killed primary's stream closes at once (the kernel closes its socket),
/// so the backup finds it lost without waiting for its failure timeout. On
/// this 2-core machine, loaded by the test suite, a second is a generous
/// bound: the closed stream reaches the backup within milliseconds, and
/// the heartbeat path alone would take the 30 ms timeout plus a 5 ms
/// heartbeat interval plus scheduling delays of real-time threads.
#[test]
fn a_killed_primary_is_found_lost_at_once() {
    let addr = free_addr();
    let (mut p, mut b) = protected_pair(&addr);
    let killed = unix_us();
    p.kill();
    let (lost, reason) = takeover(&mut b);
    let detection_ms = lost.saturating_sub(killed) as f64 / 1000.0;
    println!("SIGKILL: the backup found the primary lost after {detection_ms:.1} ms");
    assert!(detection_ms < 1000.0, "{detection_ms} ms: {reason}");
}

/// Heartbeats of the right shape but another session, as a stranger (or an
/// old primary) sends them, to `to` every 2 ms until `stop`.
fn stranger(to: String, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut sent = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let mut d = b"FTVH".to_vec();
            d.extend_from_slice(&ftvm_replication::PROTOCOL_VERSION.to_le_bytes());
            d.extend_from_slice(&[1, 0]); // from the primary, untagged
            d.extend_from_slice(&[0x77; 16]); // a session id that is not this one
            d.extend_from_slice(&(1_000_000 + sent).to_le_bytes());
            let _ = s.send_to(&d, &to);
            sent += 1;
            std::thread::sleep(Duration::from_millis(2));
        }
        sent
    })
}

/// A stalled primary (SIGSTOP: its stream stays open) is found lost by its
/// silence, with heartbeats of another session arriving all the while.
/// Found within the 30 ms failure timeout plus the heartbeat interval and
/// scheduling; asserted within a generous second.
#[test]
fn a_stalled_primary_is_found_lost_by_its_silence_whatever_strangers_send() {
    let addr = free_addr();
    let (mut p, mut b) = protected_pair(&addr);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fake = stranger(addr.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(100));
    let stalled = unix_us();
    p.signal(libc::SIGSTOP).unwrap();
    let (lost, reason) = takeover(&mut b);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = fake.join().unwrap();
    p.kill();
    let detection_ms = lost.saturating_sub(stalled) as f64 / 1000.0;
    println!("SIGSTOP: the backup found the primary lost after {detection_ms:.1} ms ({sent} strangers' heartbeats)");
    assert!(reason.contains("nothing heard from the primary for"), "{reason}");
    assert!(b.stderr().contains("ignored a datagram: heartbeat of another session"), "{}", b.stderr());
    assert!(detection_ms < 1000.0, "{detection_ms} ms: {reason}");
}

/// A backup and a primary running `cmdline` (64 MiB), each with a disk of
/// `size` sparse bytes on a tmpfs (reading its holes costs no memory); the
/// tmpfs first, so that it outlives them.
fn on_sparse_disks(tag: &str, size: u64, cmdline: &str) -> (Tmpfs, Process, Process) {
    let fs = Tmpfs::mount(tag, "16M").unwrap();
    let disk = fs.sparse_file("primary.img", size).unwrap();
    let replica = fs.sparse_file("replica.img", size).unwrap();
    let addr = free_addr();
    let b = backup(&addr, &["--disk", replica.to_str().unwrap()]);
    let p = primary(&addr, cmdline, &["--memory", "64", "--disk", disk.to_str().unwrap()]);
    (fs, b, p)
}

/// Pre-copy reads a 16 GiB disk of holes and sends nothing for it, for
/// far longer than the 30 ms failure timeouts: the backup's heartbeats
/// and the primary's keep both sides sure of each other.
#[test]
fn a_long_silent_precopy_of_a_sparse_disk_keeps_its_backup() {
    const DISK: u64 = 16 << 30;
    let short = "ws=4M pattern=seq writes=2000000 report=100ms";
    let (_fs, mut b, mut p) = on_sparse_disks("liveness-sparse", DISK, short);
    let status = exit_status(&mut p, Duration::from_secs(120));
    assert!(status.success(), "{}", p.output());
    let log = p.stderr();
    let precopy_ms = log_field(&log, "backup synchronized", "precopy_ms").unwrap_or_else(|| panic!("never synchronized:\n{log}"));
    println!("pre-copy of a {} GiB sparse disk: {precopy_ms} ms, failure timeouts {TIMEOUT_MS} ms", DISK >> 30);
    assert!(precopy_ms > 10 * TIMEOUT_MS, "pre-copy took only {precopy_ms} ms: it proves nothing");
    assert!(!log.contains("BACKUP LOST"), "{log}");
    assert!(exit_status(&mut b, Duration::from_secs(60)).success(), "{}", b.output());
    let b_log = b.stderr();
    assert!(b_log.contains("backup done") && !b_log.contains("PRIMARY LOST"), "{b_log}");
}

/// SIGTERM to primary `p` while `during` (before its backup protects it):
/// it exits 0 within 10 s, saying it stopped before protection. `timeout`
/// bounds the wait so a hang fails the test instead of stalling it.
fn sigterm_stops_before_protection(p: &mut Process, during: &str, timeout: Duration) {
    let t0 = Instant::now();
    p.signal(libc::SIGTERM).unwrap();
    let status = exit_status(p, timeout);
    let stopped_after = t0.elapsed();
    println!("SIGTERM during {during}: the primary exited after {} ms", stopped_after.as_millis());
    assert_eq!(status.code(), Some(0), "{}", p.output());
    assert!(p.stderr().contains("ftvm: VM stopped while its backup was being brought up to date"), "{}", p.output());
    assert!(stopped_after < Duration::from_secs(10), "{stopped_after:?}");
}

/// SIGTERM while pre-copy reads a 1 TiB disk of holes (many seconds of
/// work) stops the primary at once: it exits 0 saying so, and tells its
/// backup, which stops too instead of waiting or taking over.
#[test]
fn sigterm_during_precopy_stops_the_primary_promptly() {
    const DISK: u64 = 1 << 40;
    let (_fs, mut b, mut p) = on_sparse_disks("liveness-sigterm", DISK, WORK);
    wait_for(&mut p, "primary", "bringing the backup up to date", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(300));
    sigterm_stops_before_protection(&mut p, "pre-copy", Duration::from_secs(30));
    assert!(exit_status(&mut b, Duration::from_secs(30)).success(), "{}", b.output());
    assert!(b.stderr().contains("backup done") && !b.stderr().contains("PRIMARY LOST"), "{}", b.output());
}

/// A "backup" that accepts the connection and then says nothing (no
/// Welcome) would hold the handshake for its 30 s timeout: SIGTERM stops the
/// primary at once all the same, as during pre-copy.
#[test]
fn sigterm_while_a_silent_backup_holds_the_handshake_stops_the_primary() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (accepted, connected) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Accepted and kept open, never written to.
        let (stream, _) = listener.accept().unwrap();
        accepted.send(()).unwrap();
        std::thread::sleep(Duration::from_secs(120));
        drop(stream);
    });
    let mut p = primary(&addr, WORK, &["--memory", "64"]);
    connected.recv_timeout(Duration::from_secs(30)).expect("the primary never connected");
    std::thread::sleep(Duration::from_millis(500));
    sigterm_stops_before_protection(&mut p, "a silent handshake", Duration::from_secs(60));
    assert!(!p.stderr().contains("timed out"), "{}", p.output());
}

/// A backup whose apply hangs (a test fault) still sends heartbeats, so its
/// silence never shows it; the primary finds it lost when a checkpoint stays
/// unacknowledged for the acknowledgement timeout, and runs on.
#[test]
fn a_backup_whose_apply_hangs_is_lost_after_the_acknowledgement_timeout() {
    // Running on unprotected (continue) needs an arbiter, on both sides.
    let dir = Scratch::new("liveness-hang").unwrap();
    let etcd = Etcd::start(dir.path()).unwrap();
    let arbiter = ["--arbiter", etcd.endpoint()];
    let addr = free_addr();
    let mut b = vmm(ftvm()
        .args(["backup", "--insecure", "--listen", &addr, "--failure-timeout-ms", TIMEOUT])
        .args(arbiter)
        .env("FTVM_TEST_FAULT", "stall-apply:30"));
    let mut p = primary(
        &addr,
        WORK,
        &["--epoch-ms", "10", "--ack-timeout-ms", "500", "--on-backup-loss", "continue", "--arbiter", etcd.endpoint()],
    );
    wait_for(&mut b, "backup", "this backup's apply hangs", Duration::from_secs(30));
    wait_for(&mut p, "primary", "BACKUP LOST", Duration::from_secs(10));
    let log = p.stderr();
    let lost = log.lines().find(|l| l.contains("BACKUP LOST")).unwrap();
    assert!(lost.contains("BACKUP LOST (checkpoint 30 still unacknowledged"), "{log}");
    assert!(lost.contains("the VM now runs UNPROTECTED"), "{log}");
    assert!(exit_status(&mut p, Duration::from_secs(60)).success(), "{}", p.output());
    assert_eq!(field(&p.stdout(), "memtouch: done", "checksum"), Some(expected_memtouch_checksum(WORK, 1)), "{}", p.output());
    assert!(!b.stderr().contains("PRIMARY LOST"), "{}", b.output());
}
