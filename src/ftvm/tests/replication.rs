//! Replication end to end on loopback: real primaries and backups (separate
//! processes), real checkpoints, failover by SIGKILL.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

/// A free loopback port for a backup to listen on.
fn free_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", l.local_addr().unwrap().port())
}

/// A VMM process, SIGKILLed on drop so a failing test leaves none behind.
fn spawn(cmd: &mut Command) -> Process {
    Process::spawn("ftvm", cmd).unwrap()
}

fn backup(addr: &str, extra: &[&str]) -> Process {
    spawn(ftvm().args(["backup", "--listen", addr]).args(extra).env("FTVM_LOG", "info").stdout(Stdio::piped()).stderr(Stdio::piped()))
}

fn primary(addr: &str, vcpus: u32, cmdline: &str, extra: &[&str]) -> Command {
    let mut cmd = ftvm();
    cmd.args(["run", "--vcpus", &vcpus.to_string(), "--cmdline", cmdline, "--replicate-to", addr])
        .arg("--image")
        .arg(image("memtouch"))
        .args(extra)
        .env("FTVM_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Wait until the primary's stdout shows memtouch progress (it runs protected by then).
fn wait_for_progress(p: &mut Process) -> std::io::Lines<BufReader<std::process::ChildStdout>> {
    let mut lines = BufReader::new(p.child_mut().stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().contains("t=") {
            break;
        }
    }
    lines
}

/// Wait for a VMM to end by itself; one that is still running after two
/// minutes is a failure, not a hung suite.
fn finish(vmm: Process) -> Output {
    vmm.wait_with_output_within(Duration::from_secs(120)).unwrap()
}

fn kill(vmm: &mut Process) {
    vmm.kill();
}

fn checksum_of(out: &Output) -> Option<String> {
    field(&stdout(out), "memtouch: done", "checksum")
}

fn took_over_at(err: &str) -> Option<u64> {
    let line = err.lines().find(|l| l.contains("PRIMARY LOST"))?;
    let at = line.split("epoch").nth(1)?;
    at.trim_start_matches(|c: char| !c.is_ascii_digit()).split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

const WORK: &str = "ws=16M pattern=random writes=60000000 report=100ms";

#[test]
fn memory_survives_failover() {
    for (vcpus, delay_ms) in [(1, 400), (2, 700), (2, 1100)] {
        let addr = free_addr();
        let b = backup(&addr, &[]);
        let mut p = spawn(&mut primary(&addr, vcpus, WORK, &["--epoch-ms", "10"]));
        let _lines = wait_for_progress(&mut p);
        std::thread::sleep(Duration::from_millis(delay_ms));
        kill(&mut p);
        let out = finish(b);
        let err = stderr(&out);
        assert!(out.status.success(), "backup failed: {err}");
        assert!(took_over_at(&err).is_some(), "no takeover: {err}");
        assert_eq!(checksum_of(&out), Some(expected_memtouch_checksum(WORK, vcpus)), "{vcpus} vCPUs, killed after {delay_ms} ms");
    }
}

fn run_with_fault(fault: &str) -> (Output, Output) {
    let addr = free_addr();
    let b = backup(&addr, &[]);
    let p = spawn(primary(&addr, 1, WORK, &["--epoch-ms", "10"]).env("FTVM_TEST_FAULT", fault));
    let p_out = finish(p);
    (p_out, finish(b))
}

#[test]
fn truncated_checkpoint_is_discarded() {
    let (p, b) = run_with_fault("truncate:6");
    assert_eq!(p.status.code(), Some(137), "the primary 'crashed' mid-transfer: {}", stderr(&p));
    let err = stderr(&b);
    assert!(b.status.success(), "{err}");
    assert_eq!(took_over_at(&err), Some(5), "stays at the last whole checkpoint: {err}");
    assert_eq!(checksum_of(&b), Some(expected_memtouch_checksum(WORK, 1)));
}

#[test]
fn corrupted_checkpoint_is_rejected() {
    let (p, b) = run_with_fault("flip:6");
    assert_eq!(p.status.code(), Some(137), "{}", stderr(&p));
    let err = stderr(&b);
    assert!(err.contains("rejected replication data") && err.contains("checksum mismatch"), "{err}");
    assert_eq!(took_over_at(&err), Some(5), "stays at the last good checkpoint: {err}");
    assert_eq!(checksum_of(&b), Some(expected_memtouch_checksum(WORK, 1)));
}

#[test]
fn backup_refuses_other_versions_and_shapes_and_keeps_waiting() {
    let addr = free_addr();
    let mut b = backup(&addr, &["--memory", "128", "--vcpus", "1"]);
    // A primary speaking protocol version 99 is told so, in words.
    let mut s = loop {
        if let Ok(s) = std::net::TcpStream::connect(&addr) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut frame = b"FTVR".to_vec();
    frame.extend_from_slice(&99u16.to_le_bytes());
    frame.extend_from_slice(&1u16.to_le_bytes());
    frame.extend_from_slice(&0u64.to_le_bytes());
    let crc = crc32c_of(&frame);
    frame.extend_from_slice(&crc.to_le_bytes());
    s.write_all(&frame).unwrap();
    let mut answer = Vec::new();
    std::io::Read::read_to_end(&mut s, &mut answer).unwrap();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("the peer speaks replication protocol version 99"), "{text}");

    // A primary of another shape than the backup was given.
    let p = primary(&addr, 2, WORK, &[]).output().unwrap();
    assert_eq!(p.status.code(), Some(1));
    assert!(
        stderr(&p).contains(
            "the backup refused this primary: the primary's VM has 256 MiB and 2 vCPUs, this backup was started for 128 MiB and 1 vCPUs"
        ),
        "{}",
        stderr(&p)
    );

    // The backup is still waiting, and follows the primary it was meant for.
    assert!(b.running(), "the backup stopped after refusing");
    let short = "ws=4M pattern=seq writes=100000 report=100ms";
    let p = primary(&addr, 1, short, &["--memory", "128"]).output().unwrap();
    assert!(p.status.success(), "{}", stderr(&p));
    let out = finish(b);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("refused a connection") && err.contains("version 99"), "{err}");
    assert!(err.contains("refused a primary") && err.contains("256 MiB and 2 vCPUs"), "{err}");
    assert!(err.contains("the primary's guest exited with status 0"), "{err}");
}

fn crc32c_of(bytes: &[u8]) -> u32 {
    // Castagnoli, bitwise: small and independent of the code under test.
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn unreachable_backup_is_a_clear_error() {
    let addr = free_addr(); // nobody listens here
    let t0 = Instant::now();
    let out = primary(&addr, 1, WORK, &["--connect-timeout-ms", "500"]).output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.lines().last().unwrap().starts_with(&format!("ftvm: error: cannot reach the backup at {addr}")), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

fn status(socket: &Path) -> String {
    let out = ftvm().args(["status", "--api-socket"]).arg(socket).output().unwrap();
    stdout(&out)
}

#[test]
fn primary_survives_backup_loss_and_is_protected_again() {
    backup_loss_then_reprotect("continue", "UNPROTECTED", "running");
}

#[test]
fn primary_pauses_on_backup_loss_by_policy_until_protected_again() {
    backup_loss_then_reprotect("pause", "PAUSED", "paused");
}

fn backup_loss_then_reprotect(policy: &str, detail: &str, state: &str) {
    let dir = Scratch::new(&format!("reprotect-{policy}")).unwrap().keep_on_panic();
    let socket = dir.join("api.sock");
    let long = "ws=16M pattern=random writes=150000000 report=100ms";
    let addr1 = free_addr();
    let mut b1 = backup(&addr1, &[]);
    let mut p = spawn(
        primary(&addr1, 1, long, &["--epoch-ms", "10", "--failure-timeout-ms", "300", "--on-backup-loss", policy, "--api-socket"])
            .arg(&socket),
    );
    let _lines = wait_for_progress(&mut p);
    assert!(status(&socket).contains("protected: yes"), "{}", status(&socket));
    kill(&mut b1);
    let t0 = Instant::now();
    while !status(&socket).contains("protected: no") {
        assert!(t0.elapsed() < Duration::from_secs(5), "backup loss not noticed: {}", status(&socket));
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = status(&socket);
    assert!(st.contains(detail) && st.contains(&format!("state: {state}")), "{st}");

    // A new backup protects it again; then the primary dies and the new
    // backup finishes the job with the right memory.
    let addr2 = free_addr();
    let b2 = backup(&addr2, &[]);
    let out = ftvm().args(["protect", "--api-socket"]).arg(&socket).args(["--backup", &addr2]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let t0 = Instant::now();
    while !status(&socket).contains("protected: yes") {
        assert!(t0.elapsed() < Duration::from_secs(10), "not re-protected: {}", status(&socket));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(status(&socket).contains("state: running"), "runs again once protected: {}", status(&socket));
    std::thread::sleep(Duration::from_millis(300));
    kill(&mut p);
    let out = finish(b2);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(checksum_of(&out), Some(expected_memtouch_checksum(long, 1)));
}

#[test]
fn guest_exit_on_the_primary_ends_the_backup_too() {
    for status in [0, 3] {
        let addr = free_addr();
        let b = backup(&addr, &[]);
        let mut cmd = ftvm();
        cmd.args(["run", "--cmdline", &format!("exit={status}"), "--replicate-to", &addr]).arg("--image").arg(image("probe"));
        let p = cmd.output().unwrap();
        assert_eq!(p.status.code(), Some(status), "{}", stderr(&p));
        let out = finish(b);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(status), "the backup ends with the guest's status: {err}");
        assert!(err.contains("backup done") && !err.contains("PRIMARY LOST"), "no takeover: {err}");
    }
}
