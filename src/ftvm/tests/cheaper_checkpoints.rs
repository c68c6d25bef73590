//! The switches that make checkpoints cheaper (`--predict-writes`,
//! `--capture cow`), end to end on loopback: the backup's memory after a
//! failover is exactly what the guest wrote, with each switch and with all
//! of them, on 1 and 2 vCPUs.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

fn backup(addr: &str) -> Process {
    let mut cmd = ftvm();
    cmd.args(["backup", "--insecure", "--listen", addr]).env("FTVM_LOG", "info").stdout(Stdio::piped()).stderr(Stdio::piped());
    listening(Process::spawn("ftvm backup", &mut cmd).unwrap(), addr)
}

fn primary(addr: &str, vcpus: u32, cmdline: &str, metrics: &Path, switches: &[&str]) -> Process {
    let mut cmd = ftvm();
    cmd.args(["run", "--vcpus", &vcpus.to_string(), "--cmdline", cmdline, "--insecure", "--replicate-to", addr, "--epoch-ms", "10"])
        .arg("--image")
        .arg(image("memtouch"))
        .args(["--metrics-every-epoch", "--metrics"])
        .arg(metrics)
        .args(switches)
        .env("FTVM_LOG", "info");
    // Collected, so that a primary that fails says why.
    Process::spawn_collected("ftvm run", &mut cmd).unwrap()
}

/// Wait until the backup acknowledged `epochs` checkpoints (the primary
/// records an epoch's metrics on its acknowledgement): the VM is protected.
fn wait_for_acks(p: &mut Process, metrics: &Path, epochs: usize) {
    let acked = |_: &Process| std::fs::read_to_string(metrics).is_ok_and(|t| t.lines().count() >= epochs);
    if let Err(e) = p.wait_until(Duration::from_secs(60), acked) {
        panic!("never protected ({e}):\n{}", p.output());
    }
}

fn checksum_of(out: &Output) -> Option<String> {
    field(&stdout(out), "memtouch: done", "checksum")
}

/// The primary's per-epoch metrics, summed per field.
fn totals(metrics: &Path, fields: &[&str]) -> Vec<u64> {
    let epochs = json_lines(metrics);
    fields.iter().map(|f| epochs.iter().map(|e| e[f].as_u64().unwrap_or_else(|| panic!("no {f} in {e}"))).sum()).collect()
}

/// Kill the primary `after` it was protected; the backup takes over and
/// finishes the guest's writes. Returns the backup's output.
fn fail_over(vcpus: u32, cmdline: &str, after: Duration, switches: &[&str], metrics: &Path) -> Output {
    let addr = free_addr();
    let b = backup(&addr);
    let mut p = primary(&addr, vcpus, cmdline, metrics, switches);
    wait_for_acks(&mut p, metrics, 3);
    std::thread::sleep(after);
    p.kill();
    let out = b.wait_with_output_within(Duration::from_secs(120)).unwrap();
    let err = stderr(&out);
    assert!(out.status.success() && err.contains("PRIMARY LOST"), "{switches:?}, {vcpus} vCPUs: no takeover: {err}");
    out
}

/// Hot and cold pages at a modest rate: some pages left writable are
/// written again in the next epoch and some are not, so the filter both
/// sends and drops pages.
const MIXED: &str = "ws=16M pattern=hotcold hot=0.1 hotprob=0.9 rate=40000 writes=120000 report=100ms";

/// Every switch value alone, and all together.
const SWITCHES: [&[&str]; 4] = [
    &["--predict-writes", "histase"],
    &["--predict-writes", "adaptive"],
    &["--capture", "cow"],
    &["--capture", "cow", "--predict-writes", "adaptive"],
];

/// Fails over `work` after `after` with each of `switches` on 1 and 2
/// vCPUs, and checks the memory survived; hands each run with write
/// prediction on to `check_prediction`, with what it ran and its metrics.
fn survives_failover_with_each(tag: &str, switches: &[&[&str]], work: &str, after: Duration, check_prediction: impl Fn(&str, &Path)) {
    let dir = Scratch::new(tag).unwrap().keep_on_panic();
    for (n, switches) in switches.iter().enumerate() {
        for vcpus in [1, 2] {
            let metrics = dir.path().join(format!("{n}-{vcpus}.jsonl"));
            let out = fail_over(vcpus, work, after, switches, &metrics);
            let what = format!("{switches:?}, {vcpus} vCPUs");
            assert_eq!(checksum_of(&out), Some(expected_memtouch_checksum(work, vcpus)), "{what}");
            if switches.contains(&"--predict-writes") {
                check_prediction(&what, &metrics);
            }
        }
    }
}

#[test]
fn memory_survives_failover_with_each_switch() {
    survives_failover_with_each("cheaper-failover", &SWITCHES, MIXED, Duration::from_millis(300), |what, metrics| {
        // The run exercised both outcomes of the filter.
        let [predicted, written, fake] = totals(metrics, &["predicted", "predicted_written", "fake_dirty"])[..] else { unreachable!() };
        assert!(written > 0 && fake > 0 && written + fake <= predicted, "{what}: {predicted} predicted, {written} written, {fake} fake");
    });
}

/// The guest rewrites its whole working set continuously, right after
/// every resume: every page left writable is written again, and with
/// copy-on-write every protected page is written before the copier gets
/// to most of them (the worst case).
#[test]
fn memory_survives_failover_when_every_page_is_rewritten() {
    let work = "ws=4M pattern=seq writes=600000000 report=100ms";
    survives_failover_with_each("cheaper-rewrite", &SWITCHES[1..], work, Duration::from_millis(100), |what, metrics| {
        let [predicted, written, faults] = totals(metrics, &["predicted", "predicted_written", "first_writes"])[..] else { unreachable!() };
        assert!(
            written > faults,
            "{what}: most rewrites need no tracked first write: {written} predicted and written, {faults} not predicted"
        );
        assert!(written <= predicted);
    });
}

/// Unless told otherwise a primary predicts writes (adaptive): a guest
/// rewriting its working set takes few tracked first writes. With the dirty
/// ring, which excludes prediction, it predicts nothing (and is not
/// refused); both fail over exactly.
#[test]
fn write_prediction_is_the_default_and_steps_aside_for_the_ring() {
    let dir = Scratch::new("predict-default").unwrap().keep_on_panic();
    let work = "ws=4M pattern=seq writes=600000000 report=100ms";
    for (switches, predicts) in [(&[][..], true), (&["--dirty-backend", "ring"][..], false)] {
        let metrics = dir.path().join(format!("{predicts}.jsonl"));
        let out = fail_over(1, work, Duration::from_millis(100), switches, &metrics);
        assert_eq!(checksum_of(&out), Some(expected_memtouch_checksum(work, 1)), "{switches:?}");
        let [predicted, written, faults] = totals(&metrics, &["predicted", "predicted_written", "first_writes"])[..] else {
            unreachable!()
        };
        if predicts {
            assert!(
                written > faults,
                "by default most rewrites need no tracked first write: {written} predicted and written, {faults} not"
            );
        } else {
            assert_eq!(predicted, 0, "{switches:?}: nothing left writable");
        }
    }
}

#[test]
fn write_prediction_needs_the_bitmap_backend() {
    let peers = format!("1={},2={},3={}", free_addr(), free_addr(), free_addr());
    let replica = ["replica", "--insecure", "--id", "1", "--peers", &peers];
    let replicate = ["run", "--insecure", "--replicate-to", &free_addr()];
    for (command, mode) in [(&replicate[..], "histase"), (&replica[..], "adaptive")] {
        let mut cmd: Command = ftvm();
        let out = cmd
            .args(command)
            .args(["--predict-writes", mode, "--dirty-backend", "ring", "--image"])
            .arg(image("memtouch"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{command:?}");
        assert_eq!(stderr(&out).trim(), "ftvm: error: --predict-writes needs --dirty-backend bitmap", "{command:?}");
    }
}
