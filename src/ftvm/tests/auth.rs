//! The replication port as an operator and an attacker see it: strangers
//! connecting first, primaries with the wrong secret or none, an encrypted
//! channel, a header claiming a huge length; all through the real `ftvm`
//! binary on real KVM, on loopback.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use ftvm_replication::protocol::{self, Heartbeat, Hello, Kind};
use ftvm_testkit::process::Process;

/// Long enough (seconds) that the primary is still running when it is killed.
const WORK: &str = "ws=16M pattern=random writes=250000000 report=100ms";

/// Resident memory of a process in KiB (VmRSS).
fn rss_kib(p: &Process) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.id())).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn finish(p: Process) -> Output {
    p.wait_with_output_within(Duration::from_secs(120)).unwrap()
}

/// A backup, SIGKILLed on drop so a failing test leaves none behind.
fn backup(addr: &str, extra: &[&str]) -> Process {
    let mut cmd = ftvm();
    cmd.args(["backup", "--listen", addr]).args(extra).env("FTVM_LOG", "info").stdout(Stdio::piped()).stderr(Stdio::piped());
    listening(Process::spawn("backup", &mut cmd).unwrap(), addr)
}

fn primary(addr: &str, extra: &[&str]) -> Command {
    let mut cmd = ftvm();
    cmd.args(["run", "--cmdline", WORK, "--replicate-to", addr, "--epoch-ms", "10"])
        .arg("--image")
        .arg(image("memtouch"))
        .args(extra)
        .env("FTVM_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Run a primary until it is protected and its guest makes progress, kill
/// it, and check that the backup took over with the guest's memory whole.
fn protect_then_fail_over(addr: &str, extra: &[&str], backup: Process) -> String {
    let mut p = Process::spawn_collected("primary", &mut primary(addr, extra)).unwrap();
    // Protected, not just running: the guest prints during pre-copy too, and
    // a primary lost then leaves its backup nothing to take over.
    wait_for(&mut p, "primary", "the VM is protected", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(400));
    p.kill();
    let out = finish(backup);
    let err = stderr(&out);
    assert!(out.status.success(), "backup failed: {err}");
    assert!(err.contains("PRIMARY LOST"), "no takeover: {err}");
    let checksum = field(&stdout(&out), "memtouch: done", "checksum");
    assert_eq!(checksum, Some(expected_memtouch_checksum(WORK, 1)), "{err}");
    err
}

/// A scratch directory for secret files.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ftvm-auth-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn secret_file(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

fn connect(addr: &str) -> TcpStream {
    for _ in 0..250 {
        if let Ok(s) = TcpStream::connect(addr) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("nothing listens on {addr}");
}

/// Whether the backup closed `s` (within a generous bound).
fn closed_by_backup(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut sink = Vec::new();
    match s.read_to_end(&mut sink) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

fn header(kind: u16, len: u64) -> Vec<u8> {
    let mut h = b"FTVR".to_vec();
    h.extend_from_slice(&protocol::PROTOCOL_VERSION.to_le_bytes());
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

fn last_line(out: &Output) -> String {
    stderr(out).lines().last().unwrap_or_default().to_string()
}

#[test]
fn strangers_and_wrong_secrets_do_not_keep_the_primary_out() {
    let dir = scratch("strangers");
    let secret = secret_file(&dir, "secret", b"the replication secret of this test\n", 0o600);
    let wrong = secret_file(&dir, "wrong", b"another secret entirely\n", 0o600);
    let addr = free_addr();
    let mut b = backup(&addr, &["--secret-file", &secret, "--handshake-timeout-ms", "1000"]);

    // Strangers first: garbage, an HTTP request, a header claiming a
    // terabyte, and a socket that never says anything.
    let mut garbage = connect(&addr);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    garbage.write_all(&noise).unwrap();
    let mut http = connect(&addr);
    http.write_all(b"GET / HTTP/1.1\r\nHost: backup\r\nUser-Agent: probe\r\n\r\n").unwrap();
    let mut huge = connect(&addr);
    huge.write_all(&header(Kind::Hello as u16, 1 << 40)).unwrap();
    let mut idle = connect(&addr);
    let peers: Vec<String> = [&garbage, &http, &huge, &idle].iter().map(|s| s.local_addr().unwrap().to_string()).collect();
    for (name, s) in [("garbage", &mut garbage), ("http", &mut http), ("huge length", &mut huge)] {
        assert!(closed_by_backup(s), "the backup kept the {name} connection open");
    }
    let rss = rss_kib(&b);
    assert!(rss < 64 << 10, "backup resident memory after the strangers: {rss} KiB");

    // Primaries with the wrong secret, or none, are refused with one clear line.
    let out = primary(&addr, &["--secret-file", &wrong]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(last_line(&out), "ftvm: error: the backup refused this primary: authentication failed");
    let out = primary(&addr, &["--insecure"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(last_line(&out).starts_with("ftvm: error: the backup refused this primary: authentication required"), "{}", stderr(&out));
    assert!(b.running(), "the backup stopped waiting");

    // The idle socket is dropped once its handshake time is up.
    assert!(closed_by_backup(&mut idle), "the idle connection was never dropped");

    // The primary with the right secret is protected and fails over.
    let err = protect_then_fail_over(&addr, &["--secret-file", &secret], b);
    let refusal = |peer: &str| err.lines().find(|l| l.contains("refused a connection") && l.contains(peer)).unwrap_or_default().to_string();
    assert!(refusal(&peers[0]).contains("bad frame magic"), "{err}");
    assert!(refusal(&peers[1]).contains("bad frame magic"), "{err}");
    assert!(refusal(&peers[2]).contains("exceeds the 1048576-byte limit"), "{err}");
    assert!(refusal(&peers[3]).contains("no complete handshake within 1000 ms"), "{err}");
    assert!(err.contains("wrong secret"), "{err}");
    assert!(err.contains("the peer did not authenticate"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_encrypted_channel_carries_the_vm_to_a_failover() {
    let dir = scratch("encrypt");
    let secret = secret_file(&dir, "secret", &[0x42; 32], 0o400);
    let addr = free_addr();
    let b = backup(&addr, &["--secret-file", &secret, "--encrypt"]);
    let out = primary(&addr, &["--secret-file", &secret]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(last_line(&out).ends_with("this backup requires an encrypted channel: start the primary with --encrypt"), "{}", stderr(&out));
    protect_then_fail_over(&addr, &["--secret-file", &secret, "--encrypt"], b);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without a secret anyone who speaks the protocol is a primary; even then
/// a checkpoint header claiming hundreds of MiB costs the backup only the
/// bytes that really arrive.
#[test]
fn a_claimed_length_costs_the_backup_only_what_arrives() {
    let addr = free_addr();
    // It sends no heartbeats: a long failure timeout keeps the backup waiting.
    let b = backup(&addr, &["--insecure", "--failure-timeout-ms", "10000"]);
    let mut s = connect(&addr);
    let heartbeat = Heartbeat { session: [0; 8], port: 0, interval_ms: 5 };
    // The vCPUs of this very host: the backup accepts them.
    let cpu = ftvm_vmm::vm::host_cpu_profile().unwrap();
    let hello = Hello {
        mem_size: 256 << 20,
        vcpus: 1,
        devices: vec![],
        mac: None,
        disk_size: None,
        epoch_ms: 2000,
        first_epoch: 0,
        heartbeat,
        cpu,
    };
    s.write_all(&protocol::message(Kind::Hello, &hello)).unwrap();
    let mut buf = Vec::new();
    assert_eq!(protocol::read_frame(&mut s, 1 << 20, &mut buf).unwrap(), Kind::Welcome);
    let before = rss_kib(&b);
    // The largest length the backup accepts for this VM: it reads on.
    let claim = ftvm_replication::bounds::checkpoint_limit(256 << 20, 1);
    assert!(claim > 256 << 20);
    s.write_all(&header(Kind::Checkpoint as u16, claim)).unwrap();
    s.write_all(&vec![0u8; 1 << 20]).unwrap();
    // The backup has read the megabyte once it answers nothing more and is
    // still waiting for the rest; give it a moment, then measure.
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_kib(&b);
    assert!(after < before + (16 << 10), "resident memory {before} KiB before, {after} KiB after a {} MiB claim", claim >> 20);
    drop(s);
    let out = finish(b);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("before the backup had a complete checkpoint"), "{}", stderr(&out));
}

#[test]
fn secret_files_are_checked() {
    let dir = scratch("files");
    let shared = secret_file(&dir, "shared", b"secret", 0o644);
    let empty = secret_file(&dir, "empty", b"", 0o600);
    let missing = dir.join("missing").display().to_string();
    let good = secret_file(&dir, "good", b"secret", 0o600);
    let cases: [(&[&str], String); 3] = [
        (
            &["backup", "--listen", "127.0.0.1:0", "--secret-file", &shared],
            format!("secret file {shared} is accessible by group or others (mode 644)"),
        ),
        (&["backup", "--listen", "127.0.0.1:0", "--secret-file", &empty], format!("secret file {empty} is empty")),
        (&["backup", "--listen", "127.0.0.1:0", "--secret-file", &missing], format!("cannot read secret file {missing}")),
    ];
    for (args, expected) in cases {
        let out = ftvm().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with(&format!("ftvm: error: {expected}")), "{args:?}: {err}");
    }
    // A usage error: the option means nothing without replication.
    let out = ftvm().args(["run", "--image", "/nonexistent", "--secret-file", &good]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--secret-file applies only to a replicating primary"), "{}", stderr(&out));
    let out = ftvm().args(["backup", "--listen", "127.0.0.1:0", "--encrypt"]).output().unwrap();
    assert!(!out.status.success() && stderr(&out).contains("--secret-file"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Strangers that hold every handshake slot (idle sockets, with a deadline
/// far off) do not turn the primary away: a newcomer ends the oldest.
#[test]
fn idle_strangers_in_every_handshake_slot_do_not_keep_the_primary_out() {
    let dir = scratch("slots");
    let secret = secret_file(&dir, "secret", b"a secret both sides hold\n", 0o600);
    let addr = free_addr();
    let b = backup(&addr, &["--secret-file", &secret, "--handshake-timeout-ms", "60000"]);
    let idle: Vec<TcpStream> = (0..24).map(|_| connect(&addr)).collect();
    let err = protect_then_fail_over(&addr, &["--secret-file", &secret], b);
    assert!(err.contains("connections were in their handshake: ended the oldest for this one"), "{err}");
    drop(idle);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Strangers flooding the backup's port are not one line each: the first
/// 10 refusals are logged one by one, then one line counts the rest.
#[test]
fn a_flood_of_strangers_is_a_few_lines_and_a_count() {
    let addr = free_addr();
    let mut cmd = ftvm();
    cmd.args(["backup", "--listen", &addr, "--insecure"]).env("FTVM_LOG", "info");
    let mut b = Process::spawn_collected("backup", &mut cmd).unwrap();
    const STRANGERS: usize = 40;
    for _ in 0..STRANGERS {
        let mut s = connect(&addr);
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(closed_by_backup(&mut s), "the backup kept a stranger's connection open");
    }
    let log = wait_log(&mut b, "more connections in the last 10 s", Duration::from_secs(30));
    let one_by_one = log.lines().filter(|l| l.contains("refused a connection")).count();
    assert_eq!(one_by_one, 10, "{log}");
    let summary = log.lines().find(|l| l.contains("more connections in the last 10 s")).unwrap();
    assert!(summary.contains(&format!("refused {} more connections", STRANGERS - 10)), "{log}");
    assert!(b.running(), "{log}");
}
