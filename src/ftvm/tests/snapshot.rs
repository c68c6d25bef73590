//! `ftvm snapshot` / `ftvm restore` end to end, across processes.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

/// A VMM with a control socket in a scratch directory (the VMM dies
/// first: a failing test must not leave it behind).
struct Running {
    vmm: Process,
    socket: PathBuf,
    _dir: Scratch,
}

fn start(tag: &str, image_name: &str, vcpus: u32, cmdline: &str) -> (Running, PathBuf) {
    let dir = Scratch::new(&format!("snapshot-{tag}")).unwrap();
    let socket = dir.join("api.sock");
    let snap = dir.join("vm.snap");
    let mut cmd = ftvm();
    cmd.args(["run", "--vcpus", &vcpus.to_string(), "--cmdline", cmdline, "--api-socket"])
        .arg(&socket)
        .arg("--image")
        .arg(image(image_name))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let vmm = Process::spawn("ftvm", &mut cmd).unwrap();
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "control socket never appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
    (Running { vmm, socket, _dir: dir }, snap)
}

fn snapshot(vm: &Running, snap: &std::path::Path, stop: bool) {
    let mut cmd = ftvm();
    cmd.args(["snapshot", "--api-socket"]).arg(&vm.socket).arg("--output").arg(snap);
    if stop {
        cmd.arg("--stop");
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "snapshot failed: {}", stderr(&out));
}

#[test]
fn restored_memtouch_finishes_with_the_uninterrupted_checksum() {
    for vcpus in [1, 2] {
        // Long enough (a few seconds) that the snapshot lands mid-run.
        let cmdline = "ws=32M pattern=random writes=150000000 report=200ms";
        let (mut vm, snap) = start(&format!("mt{vcpus}"), "memtouch", vcpus, cmdline);
        // Wait for a progress line so the snapshot is taken mid-run.
        let mut lines = BufReader::new(vm.vmm.child_mut().stdout.take().unwrap()).lines();
        let mut before = String::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            before += &line;
            before.push('\n');
            if line.contains("t=0.") {
                break;
            }
        }
        snapshot(&vm, &snap, true);
        let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
        let status = vm.vmm.wait().unwrap();
        assert!(status.success());
        assert!(!rest.iter().any(|l| l.contains("done checksum")), "snapshot came too late: the first run finished");

        let out = ftvm().arg("restore").arg("--snapshot").arg(&snap).output().unwrap();
        let text = stdout(&out);
        assert!(out.status.success(), "restore failed: {}{}", text, stderr(&out));
        assert!(text.contains(&format!("writes={}", 150_000_000u64 * vcpus as u64)), "{text}");
        let got = field(&text, "memtouch: done", "checksum").expect("checksum after restore");
        assert_eq!(got, expected_memtouch_checksum(cmdline, vcpus), "restored run, {vcpus} vCPUs");
    }
}

#[test]
fn restored_guest_time_is_monotonic_and_counter_continues() {
    let (mut vm, snap) = start("ticker", "probe", 1, "ticker=20,count=40");
    let mut lines = BufReader::new(vm.vmm.child_mut().stdout.take().unwrap()).lines();
    let mut last = (0u64, 0u64);
    for line in lines.by_ref() {
        let line = line.unwrap();
        let n: u64 = field(&line, "probe: tick", "n").unwrap().parse().unwrap();
        let t: u64 = field(&line, "probe: tick", "t_ns").unwrap().parse().unwrap();
        last = (n, t);
        if n == 5 {
            break;
        }
    }
    snapshot(&vm, &snap, true);
    for line in lines {
        let line = line.unwrap();
        if let Some(n) = field(&line, "probe: tick", "n") {
            last = (n.parse().unwrap(), field(&line, "probe: tick", "t_ns").unwrap().parse().unwrap());
        }
    }
    assert!(vm.vmm.wait().unwrap().success());
    // Let host time run on: the guest clock must not jump by this gap.
    std::thread::sleep(Duration::from_millis(300));
    let out = ftvm().arg("restore").arg("--snapshot").arg(&snap).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let ticks: Vec<(u64, u64)> = text
        .lines()
        .filter_map(|l| Some((field(l, "probe: tick", "n")?.parse().ok()?, field(l, "probe: tick", "t_ns")?.parse().ok()?)))
        .collect();
    assert_eq!(ticks.first().map(|t| t.0), Some(last.0 + 1), "counter continues: {text}");
    assert_eq!(ticks.last().map(|t| t.0), Some(40));
    let first_t = ticks[0].1;
    assert!(first_t > last.1, "time went back across restore: {} then {first_t}", last.1);
    assert!(first_t - last.1 < 250_000_000, "guest time jumped by the host gap: {} ns", first_t - last.1);
    assert!(ticks.windows(2).all(|w| w[1].1 > w[0].1), "monotonic: {text}");
}

#[test]
fn snapshot_without_stop_keeps_the_vm_running() {
    let (mut vm, snap) = start("keep", "probe", 2, "ticker=10,count=60");
    std::thread::sleep(Duration::from_millis(100));
    snapshot(&vm, &snap, false);
    let mut text = String::new();
    vm.vmm.child_mut().stdout.take().unwrap().read_to_string(&mut text).unwrap();
    assert!(vm.vmm.wait().unwrap().success());
    assert!(text.contains("n=60 "), "VM ran to the end after the snapshot: {text}");
    assert!(std::fs::metadata(&snap).unwrap().len() > 0);
}

#[test]
fn corrupted_or_truncated_snapshots_are_refused() {
    let (vm, snap) = start("bad", "probe", 1, "ticker=10");
    std::thread::sleep(Duration::from_millis(50));
    snapshot(&vm, &snap, true);
    let mut vm = vm;
    vm.vmm.wait().unwrap();
    let good = std::fs::read(&snap).unwrap();
    let bad = snap.with_extension("bad");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("truncated", good[..good.len() / 2].to_vec(), "truncated"),
        (
            "bit flip",
            {
                let mut b = good.clone();
                let i = b.len() - 100;
                b[i] ^= 0x10;
                b
            },
            "checksum mismatch",
        ),
        ("not a snapshot", b"hello world, not a snapshot".to_vec(), "not an ftvm snapshot"),
        (
            "wrong version",
            {
                let mut b = good.clone();
                b[8] = 99;
                b
            },
            "format version 99",
        ),
    ];
    for (what, bytes, msg) in cases {
        std::fs::write(&bad, bytes).unwrap();
        let out = ftvm().arg("restore").arg("--snapshot").arg(&bad).output().unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains(msg), "{what}: {err}");
        assert_eq!(err.lines().count(), 1, "{what}: one line: {err}");
        assert!(stdout(&out).is_empty(), "{what}: guest must not run: {}", stdout(&out));
    }
}

/// `--output` may replace an earlier snapshot, nothing else: not a file of
/// the operator's, not the VM's own control socket (which still answers).
#[test]
fn a_snapshot_never_replaces_what_is_not_one() {
    let (vm, snap) = start("noclobber", "probe", 1, "ticker=10");
    let other = snap.with_file_name("notes.txt");
    std::fs::write(&other, "the operator's").unwrap();
    for target in [&other, &vm.socket] {
        let out = ftvm().args(["snapshot", "--api-socket"]).arg(&vm.socket).arg("--output").arg(target).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{}: {}", target.display(), stderr(&out));
        assert!(stderr(&out).contains("is not an ftvm snapshot: not replaced"), "{}", stderr(&out));
    }
    assert_eq!(std::fs::read_to_string(&other).unwrap(), "the operator's");
    assert!(status(&vm.socket).contains("state: running"), "the control socket still answers");
    snapshot(&vm, &snap, false);
    snapshot(&vm, &snap, true);
}
