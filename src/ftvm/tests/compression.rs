//! `--diff auto`: a checkpoint's diffs go LZ4-compressed only
//! while the replication link is busy, end to end over the test topology's
//! replication link, throttled with a token bucket in the middle of a run
//! and freed again, and a takeover after the flips still resumes the guest
//! exactly.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::topology::{Topology, H2_REPL_ADDR};

const REPL_PORT: u16 = 7000;
/// Both sides' failure timeout: above the throttled link's queue (`tc`'s latency).
const SLOW_LINK_TIMEOUT_MS: &str = "3000";

/// Random writes at a steady 20,000 a second over 16 MiB: some 200 pages
/// an epoch, a few tens of KB of diffs, which a veth moves in well under
/// a millisecond and a 4 Mbit/s link not at all. 35 seconds of them, so
/// the guest still writes through every phase; after the kill the backup
/// finishes them.
const WORK: &str = "ws=16M pattern=random writes=700000 rate=20000 report=100ms vcpus=1";

fn tc(topo: &Topology, args: &[&str]) {
    let out = topo.command("h1", "tc").args(args).output().expect("tc runs");
    assert!(out.status.success(), "tc {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The epochs the primary's metrics hold now, from the `skip`-th on.
fn compressed_since(metrics: &Path, skip: usize) -> (usize, usize) {
    let epochs = json_lines(metrics);
    let recent = &epochs[skip.min(epochs.len())..];
    (recent.iter().filter(|e| e["diffs_compressed"].as_bool() == Some(true)).count(), recent.len())
}

/// Wait until at least `n` more epochs than `skip` were acknowledged.
fn wait_epochs(p: &mut Process, metrics: &Path, skip: usize, n: usize, what: &str) {
    let done = |_: &Process| std::fs::read_to_string(metrics).is_ok_and(|t| t.lines().count() >= skip + n);
    if let Err(e) = p.wait_until(Duration::from_secs(60), done) {
        panic!("{what}: fewer than {n} epochs ({e}):\n{}", p.stderr());
    }
}

#[test]
fn diffs_are_compressed_only_while_the_link_is_busy() {
    let topo = Topology::new("lz4").unwrap();
    let dir = scratch_for("compression", "link");
    let metrics = dir.join("primary.epochs.jsonl");
    let addr = format!("{H2_REPL_ADDR}:{REPL_PORT}");
    let mut backup = topo.command("h2", env!("CARGO_BIN_EXE_ftvm"));
    // Heartbeats cross the throttled link too, behind the checkpoints: a
    // slow link needs a failure timeout longer than its queue.
    backup
        .args(["backup", "--insecure", "--listen", &addr, "--failure-timeout-ms", SLOW_LINK_TIMEOUT_MS])
        .env("FTVM_LOG", "info,ftvm_replication::pipeline::encode::link_load=debug");
    let backup = spawn_logged(backup, "backup", &dir, "backup");
    let mut primary = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    primary
        .args(["run", "--cmdline", WORK, "--insecure", "--replicate-to", &addr, "--diff", "auto"])
        .args(["--failure-timeout-ms", SLOW_LINK_TIMEOUT_MS])
        .args(["--metrics-every-epoch", "--metrics"])
        .arg(&metrics)
        .arg("--image")
        .arg(image("memtouch"))
        .env("FTVM_LOG", "info,ftvm_replication::pipeline::encode::link_load=debug");
    let mut primary = spawn_logged(primary, "primary", &dir, "primary");

    // The link has room: plain diffs.
    wait_epochs(&mut primary, &metrics, 0, 60, "unthrottled");
    let start = json_lines(&metrics).len();
    wait_epochs(&mut primary, &metrics, start, 60, "unthrottled");
    let (plain_on, plain_of) = compressed_since(&metrics, start);
    assert!(plain_on * 10 <= plain_of, "a link with room: {plain_on} of {plain_of} epochs compressed");

    // 4 Mbit/s: the stream fills it, and diffs go compressed. (Much
    // slower, and a checkpoint that grew while the last one crawled over
    // the link outlasts the acknowledgement timeout.)
    tc(&topo, &["qdisc", "replace", "dev", "repl", "root", "tbf", "rate", "4mbit", "burst", "32kb", "latency", "200ms"]);
    let throttled = json_lines(&metrics).len();
    let t0 = Instant::now();
    while compressed_since(&metrics, throttled).0 == 0 {
        assert!(primary.running(), "the primary ended: {}", primary.stderr());
        assert!(t0.elapsed() < Duration::from_secs(40), "no epoch compressed on a saturated link: {}", primary.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(primary.stderr().contains("diff compression follows the link's load"), "the switch is logged");

    // Free again: back to plain diffs.
    tc(&topo, &["qdisc", "del", "dev", "repl", "root"]);
    let freed = json_lines(&metrics).len();
    let t0 = Instant::now();
    loop {
        let epochs = json_lines(&metrics);
        if epochs.len() > freed + 5 && epochs.last().is_some_and(|e| e["diffs_compressed"].as_bool() == Some(false)) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "still compressing on a free link: {}", primary.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }

    // A takeover after the flips: the guest's memory is exactly its own.
    primary.kill();
    let out = backup.wait_with_output_within(Duration::from_secs(120)).unwrap();
    let err = std::fs::read_to_string(dir.join("backup.err")).unwrap_or_default();
    assert!(out.status.success(), "backup failed: {err}");
    let stdout = std::fs::read_to_string(dir.join("backup.out")).unwrap_or_default();
    assert_eq!(field(&stdout, "memtouch: done", "checksum"), Some(expected_memtouch_checksum(WORK, 1)), "backup: {err}");
}

/// `--diff auto`: a checkpoint of 1024 pages or more goes compressed on a
/// loopback link with room, and a small one plain: a writer rewriting 4096 pages in page order, then one
/// writing 20,000 random words a second (some 200 pages an epoch). Both
/// guests end on the backup after a takeover with their exact memory.
#[test]
fn big_checkpoints_are_compressed_on_a_link_with_room() {
    const BIG: u64 = 1024;
    let dir = scratch_for("compression", "size");
    let cases = [
        ("big", "ws=16M pattern=seq writes=3000000000 report=100ms vcpus=1", true),
        ("small", "ws=16M pattern=random writes=100000 rate=20000 report=100ms vcpus=1", false),
    ];
    for (tag, work, big) in cases {
        let metrics = dir.join(format!("{tag}.jsonl"));
        let addr = free_addr();
        let mut backup = ftvm();
        backup.args(["backup", "--insecure", "--listen", &addr]).env("FTVM_LOG", "info");
        let backup = listening(spawn_logged(backup, "backup", &dir, &format!("{tag}-backup")), &addr);
        let mut primary = ftvm();
        primary
            .args(["run", "--cmdline", work, "--insecure", "--replicate-to", &addr, "--diff", "auto", "--metrics-every-epoch", "--metrics"])
            .arg(&metrics)
            .arg("--image")
            .arg(image("memtouch"))
            .env("FTVM_LOG", "info");
        let mut primary = spawn_logged(primary, "primary", &dir, tag);
        wait_epochs(&mut primary, &metrics, 0, 40, tag);
        primary.kill();
        let out = backup.wait_with_output_within(Duration::from_secs(120)).unwrap();
        let stdout = std::fs::read_to_string(dir.join(format!("{tag}-backup.out"))).unwrap_or_default();
        let err = std::fs::read_to_string(dir.join(format!("{tag}-backup.err"))).unwrap_or_default();
        assert!(out.status.success(), "{tag}: backup failed: {err}");
        assert_eq!(field(&stdout, "memtouch: done", "checksum"), Some(expected_memtouch_checksum(work, 1)), "{tag}: {err}");

        let epochs = json_lines(&metrics);
        let pages = |e: &serde_json::Value| e["commit_pages"].as_u64().unwrap();
        let compressed = |e: &serde_json::Value| e["diffs_compressed"].as_bool() == Some(true);
        let large: Vec<_> = epochs.iter().filter(|e| pages(e) >= BIG).collect();
        assert!(large.iter().all(|e| compressed(e)), "{tag}: a big checkpoint went plain");
        if big {
            assert!(large.len() >= 10, "{tag}: only {} checkpoints of {BIG} pages or more", large.len());
        } else {
            // Only the first checkpoint may be big: it carries what the
            // guest wrote during pre-copy (its working set's first touch).
            assert!(large.iter().all(|e| e["trigger"] == "sync"), "{tag}: {} big checkpoints", large.len());
            let plain = epochs.iter().filter(|e| !compressed(e)).count();
            assert!(plain * 10 >= epochs.len() * 9, "{tag}: {plain} of {} small checkpoints plain", epochs.len());
        }
    }
}
