//! Ownership through a real etcd arbiter, end to end on loopback: a primary
//! stalled (SIGSTOP) long enough for its backup to take over is fenced when
//! it resumes; without an arbiter it pauses instead of running on; an
//! arbiter that cannot be reached holds the takeover back.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

/// About 4 s of guest work at full speed, bounded so its checksum is known.
const WORK: &str = "ws=16M pattern=random writes=900000000 report=100ms";

fn vmm(cmd: &mut Command) -> Process {
    Process::spawn_collected("ftvm", cmd.env("FTVM_LOG", "info").stdin(Stdio::null())).unwrap()
}

fn backup(addr: &str, extra: &[&str]) -> Process {
    listening(vmm(ftvm().args(["backup", "--insecure", "--listen", addr, "--failure-timeout-ms", "200"]).args(extra)), addr)
}

fn primary(addr: &str, extra: &[&str]) -> Process {
    vmm(ftvm()
        .args(["run", "--cmdline", WORK, "--insecure", "--replicate-to", addr, "--epoch-ms", "10"])
        .arg("--image")
        .arg(image("memtouch"))
        .args(extra))
}

fn protected(p: &mut Process) {
    wait_for(p, "primary", "the VM is protected", Duration::from_secs(20));
    wait_for(p, "primary", "t=", Duration::from_secs(10));
}

fn checksum(p: &Process) -> Option<String> {
    field(&p.stdout(), "memtouch: done", "checksum")
}

fn stall(p: &mut Process, how_long: Duration) {
    p.signal(libc::SIGSTOP).unwrap();
    std::thread::sleep(how_long);
    p.signal(libc::SIGCONT).unwrap();
}

#[test]
fn a_stalled_primary_is_fenced_when_its_backup_took_over() {
    let dir = Scratch::new("arbiter-fence").unwrap().keep_on_panic();
    let etcd = Etcd::start(dir.path()).unwrap();
    let addr = free_addr();
    let arbiter = ["--arbiter", etcd.endpoint()];
    let mut b = backup(&addr, &arbiter);
    let mut p = primary(&addr, &arbiter);
    protected(&mut p);
    stall(&mut p, Duration::from_secs(1));
    wait_for(&mut b, "backup", "this backup owns the VM now", Duration::from_secs(5));
    // The resumed primary finds its backup gone, loses the claim and stops
    // without running on: one line, a non-zero exit.
    let status = exit_status(&mut p, Duration::from_secs(10));
    assert_eq!(status.code(), Some(1), "{}", p.output());
    assert!(p.stderr().contains("lost ownership of the VM"), "{}", p.output());
    assert!(!p.stdout().contains("memtouch: done"), "the fenced primary finished its guest:\n{}", p.output());
    // The backup's VM carries on from the last checkpoint to the right result.
    assert!(exit_status(&mut b, Duration::from_secs(60)).success(), "{}", b.output());
    assert_eq!(checksum(&b), Some(expected_memtouch_checksum(WORK, 1)), "{}", b.output());
}

#[test]
fn without_an_arbiter_a_stalled_primary_pauses_instead_of_running_on() {
    let dir = Scratch::new("arbiter-none").unwrap().keep_on_panic();
    let socket = dir.join("primary.sock");
    let addr = free_addr();
    let mut b = backup(&addr, &[]);
    let mut p = primary(&addr, &["--api-socket", socket.to_str().unwrap()]);
    protected(&mut p);
    stall(&mut p, Duration::from_secs(1));
    wait_for(&mut b, "backup", "PRIMARY LOST", Duration::from_secs(5));
    wait_for(&mut p, "primary", "BACKUP LOST", Duration::from_secs(10));
    let status = |socket: &std::path::Path| -> Output { ftvm().args(["status", "--api-socket"]).arg(socket).output().unwrap() };
    let out = String::from_utf8_lossy(&status(&socket).stdout).into_owned();
    assert!(out.contains("state: paused") && out.contains("PAUSED"), "{out}");
    std::thread::sleep(Duration::from_millis(500));
    assert!(p.running(), "the paused primary stays paused");
    assert!(!p.stdout().contains("memtouch: done"), "{}", p.output());
    p.kill();
    assert!(exit_status(&mut b, Duration::from_secs(60)).success(), "{}", b.output());
    assert_eq!(checksum(&b), Some(expected_memtouch_checksum(WORK, 1)), "{}", b.output());
}

#[test]
fn an_unreachable_arbiter_holds_the_takeover_back() {
    let dir = Scratch::new("arbiter-down").unwrap().keep_on_panic();
    let mut etcd = Etcd::start(dir.path()).unwrap();
    let addr = free_addr();
    let arbiter = ["--arbiter", etcd.endpoint()];
    let mut b = backup(&addr, &arbiter);
    let mut p = primary(&addr, &arbiter);
    protected(&mut p);
    // The arbiter goes silent once the backup knows whom to take the VM
    // from (before that it never takes over: a different refusal).
    wait_for(&mut b, "backup", "read the VM's ownership from the arbiter", Duration::from_secs(10));
    etcd.process().signal(libc::SIGSTOP).unwrap();
    p.kill();
    wait_for(&mut b, "backup", "not taking over until the arbiter answers", Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(1));
    assert!(!b.output().contains("owns the VM now"), "took over without the arbiter:\n{}", b.output());
    etcd.process().signal(libc::SIGCONT).unwrap();
    wait_for(&mut b, "backup", "this backup owns the VM now", Duration::from_secs(10));
    assert!(exit_status(&mut b, Duration::from_secs(60)).success(), "{}", b.output());
    assert_eq!(checksum(&b), Some(expected_memtouch_checksum(WORK, 1)), "{}", b.output());
}
