//! Replication end to end on loopback: real primaries and backups (separate
//! processes), real checkpoints, failover by SIGKILL.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ftvm_replication::bounds::{checkpoint_limit, JOURNAL_MAX};
use ftvm_replication::pipeline::prefetch::ROUNDS;
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::tmpfs::Tmpfs;
use ftvm_workloads::memtouch;

/// A VMM process, SIGKILLed on drop so a failing test leaves none behind.
fn spawn(cmd: &mut Command) -> Process {
    Process::spawn("ftvm", cmd).unwrap()
}

fn backup(addr: &str, extra: &[&str]) -> Process {
    let b = spawn(
        ftvm()
            .args(["backup", "--insecure", "--listen", addr])
            .args(extra)
            .env("FTVM_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    listening(b, addr)
}

fn primary(addr: &str, vcpus: u32, cmdline: &str, extra: &[&str]) -> Command {
    primary_of("memtouch", addr, vcpus, cmdline, extra)
}

fn primary_of(image_name: &str, addr: &str, vcpus: u32, cmdline: &str, extra: &[&str]) -> Command {
    let mut cmd = ftvm();
    cmd.args(["run", "--vcpus", &vcpus.to_string(), "--cmdline", cmdline, "--insecure", "--replicate-to", addr])
        .arg("--image")
        .arg(image(image_name))
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

/// Long enough (seconds even unreplicated) that every kill below lands
/// while the guest still works.
const LONG_WORK: &str = "ws=16M pattern=random writes=500000000 report=100ms";

/// For `--prefetch`: random writes at 100,000 a second per writer, a
/// third of the working set per 10 ms epoch with two, so epochs end on
/// time and most pages a round finds dirty were not written in the
/// epochs before (cold: rounds send those). At full speed the guest
/// rewrites every page each epoch and a loaded host overruns epoch after
/// epoch, which leaves the rounds nothing to send, rightly. Four seconds
/// of writes: every kill below lands while the guest still works.
const PREFETCH_WORK: &str = "ws=16M pattern=random writes=400000 rate=100000 report=100ms";

/// Kill a primary (with `extra` options) after each delay; the backup's
/// memory must be exactly the primary's at its last checkpoint, which the
/// guest's final checksum proves. Each run is (vCPUs, memtouch writers,
/// delay): with fewer writers than vCPUs the rest idle. Returns the mean
/// of `key` over the primary's epochs of each run.
fn memory_survives_failover_with(extra: &[&str], runs: &[(u32, u32, u64)], key: &str) -> Vec<f64> {
    memory_survives_failover_epochs(LONG_WORK, extra, runs)
        .iter()
        .map(|epochs| {
            let values: Vec<u64> = epochs.iter().map(|e| e[key].as_u64().unwrap()).collect();
            values.iter().sum::<u64>() as f64 / values.len() as f64
        })
        .collect()
}

/// As `memory_survives_failover_with`, returning each run's epoch metrics.
fn memory_survives_failover_epochs(work: &str, extra: &[&str], runs: &[(u32, u32, u64)]) -> Vec<Vec<serde_json::Value>> {
    let dir = Scratch::new("failover-memory").unwrap().keep_on_panic();
    let mut all = Vec::new();
    for &(vcpus, writers, delay_ms) in runs {
        let addr = free_addr();
        let metrics = dir.join(format!("{vcpus}-{writers}-{delay_ms}.jsonl"));
        let work = format!("{work} vcpus={writers}");
        let b = backup(&addr, &[]);
        let mut cmd = primary(&addr, vcpus, &work, &["--epoch-ms", "10"]);
        let mut p =
            Process::spawn_collected("ftvm run", cmd.args(extra).args(["--metrics-every-epoch", "--metrics"]).arg(&metrics)).unwrap();
        // The delay runs from the first checkpoint: pre-copy takes as long
        // as it takes on a loaded host.
        wait_for(&mut p, "primary", "the VM is protected", Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(delay_ms));
        kill(&mut p);
        let out = finish(b);
        let err = stderr(&out);
        assert!(out.status.success(), "backup failed: {err}");
        assert!(took_over_at(&err).is_some(), "no takeover: {err}");
        let what = format!("{vcpus} vCPUs, {writers} writing, {extra:?}, killed after {delay_ms} ms");
        assert_eq!(checksum_of(&out), Some(expected_memtouch_checksum(&work, writers)), "{what}");
        let epochs = json_lines(&metrics);
        assert!(!epochs.is_empty(), "{what}: no epoch metrics");
        all.push(epochs);
    }
    all
}

/// Epochs that give `--prefetch` rounds a chance: a run with at least
/// this many of them and no page sent ahead fails.
const PREFETCH_CHANCES: usize = 3;

/// Each of `runs` (epoch metrics; `what` names the switches) sent pages
/// ahead of their checkpoints if it gave the rounds a chance. On a loaded
/// host a run may give them none and rightly send nothing (seen once on
/// CI: two vCPUs, killed after 1 s, no page ahead in any epoch):
///
/// - the replication thread back at an epoch only after its planned end
///   (the last checkpoint took that long to send, or the thread woke late
///   for the round due at half the epoch) takes the checkpoint at once,
///   without the round (`trigger::Plan::decide` before `Schedule::next`);
///   that epoch ran long, the guest rewrote its whole working set, and the
///   next checkpoint is as slow to send, so such epochs come in streaks;
/// - after two checkpoints that both carried the whole working set every
///   page is hot, and rounds send write-cold pages only;
/// - with `adaptive`, the gate may hold the rounds back.
///
/// So an epoch counts as a chance if it ended on time (from half its
/// maximum, when the first round is due, to a quarter past it), its rounds
/// were allowed (`prefetch_start` at most `ROUNDS`), and one of the two
/// checkpoints before it carried less than nine tenths of the working set.
/// Rounds send pages in nearly all such epochs (about 14 in 15 measured,
/// idle host or loaded); a run with `PREFETCH_CHANCES` of them and nothing
/// sent ahead means the rounds are broken, not crowded out. Returns how
/// many runs were judged: each test needs one at least, so a test whose
/// every run was crowded out fails rather than passing unchecked.
fn assert_prefetched(what: &str, runs: &[Vec<serde_json::Value>]) -> usize {
    let mut judged = 0;
    let ws = memtouch::Config::parse(PREFETCH_WORK).expect("valid memtouch cmdline").ws_pages;
    let n = |e: &serde_json::Value, key: &str| e[key].as_u64().unwrap();
    for epochs in runs {
        let chance = |w: &[serde_json::Value]| {
            let (len, max) = (n(&w[2], "epoch_us"), n(&w[2], "max_epoch_us"));
            let on_time = max > 0 && max / 2 <= len && len <= max * 5 / 4;
            let cold = n(&w[0], "dirty_pages").min(n(&w[1], "dirty_pages")) < ws * 9 / 10;
            on_time && cold && n(&w[2], "prefetch_start") <= u64::from(ROUNDS)
        };
        let chances = epochs.windows(3).filter(|w| chance(w)).count();
        let ahead: Vec<u64> = epochs.iter().map(|e| n(e, "prefetched_pages")).collect();
        let lengths_ms: Vec<u64> = epochs.iter().map(|e| n(e, "epoch_us") / 1000).collect();
        if chances < PREFETCH_CHANCES {
            eprintln!(
                "{what}: rounds had {chances} chances in {} epochs (lengths in ms {lengths_ms:?}); pages ahead not required",
                epochs.len()
            );
            continue;
        }
        assert!(
            ahead.iter().any(|&p| p > 0),
            "{what}: no page went ahead in {chances} epochs that gave the rounds a chance: pages ahead {ahead:?}, lengths in ms {lengths_ms:?}"
        );
        eprintln!("{what}: {} pages ahead in {} epochs, {chances} of them chances", ahead.iter().sum::<u64>(), epochs.len());
        judged += 1;
    }
    judged
}

#[test]
fn memory_survives_failover() {
    let saved = memory_survives_failover_with(&[], &[(1, 1, 400), (2, 2, 700), (2, 2, 1100)], "diff_bytes_saved");
    assert!(saved.iter().all(|&s| s > 0.0), "pages go as diffs by default (--diff lz4): {saved:?}");
}

#[test]
fn memory_survives_failover_with_each_diff_setting() {
    for (diff, runs) in [("off", &[(1, 1, 700)][..]), ("xor", &[(2, 2, 1100)])] {
        let saved = memory_survives_failover_with(&["--diff", diff], runs, "diff_bytes_saved");
        if diff == "off" {
            assert!(saved.iter().all(|&s| s == 0.0), "--diff off: whole pages only: {saved:?}");
        } else {
            assert!(saved.iter().all(|&s| s > 0.0), "--diff {diff}: pages went as diffs: {saved:?}");
        }
    }
}

/// With only changed vCPU and device state sent (one vCPU idles, so its
/// state mostly stays behind), the backup still resumes the whole VM.
#[test]
fn memory_survives_failover_with_only_changed_state_sent() {
    let runs = [(2, 1, 800)];
    let all = memory_survives_failover_with(&["--device-state", "all"], &runs, "state_bytes")[0];
    let changed = memory_survives_failover_with(&["--device-state", "changed", "--diff", "lz4"], &runs, "state_bytes")[0];
    assert!(changed < all * 0.8, "an idle vCPU's state is left out: {changed:.0} state bytes per epoch against {all:.0}");
}

/// Both ways of stopping a vCPU idle in its wait (one of the two vCPUs
/// idles throughout, so every checkpoint saves it there) leave a backup that
/// resumes the whole VM: with `park` its wait was never made as far as the
/// saved state goes, and the restored vCPU makes it again.
#[test]
fn memory_survives_failover_with_each_idle_pause() {
    // Kicked with the checkpoint thread and acknowledgement reader at
    // real-time priority, to run that switch through a failover too.
    for args in [&["--idle-pause", "park"][..], &["--idle-pause", "kick", "--priority", "realtime"]] {
        let mode = args[1];
        let pauses = memory_survives_failover_with(args, &[(2, 1, 800)], "pause_us");
        assert!(pauses.iter().all(|&p| p > 0.0), "--idle-pause {mode}: checkpoints were taken: {pauses:?}");
    }
}

/// With `--prefetch on` (alone, and with every other checkpoint switch it
/// combines with) pages go ahead of their checkpoints, and a kill at any
/// point of an epoch (staged pages or not) leaves the backup exactly at
/// the primary's last checkpoint. (`--tuning static`: prefetch alone,
/// without write prediction, which on this writer keeps pages the rounds
/// would send; the two together are `the_default_predicts_and_prefetches`.)
#[test]
fn memory_survives_failover_with_prefetch() {
    let runs = [(1, 1, 600), (2, 2, 1000)];
    let on = ["--tuning", "static", "--prefetch", "on"];
    let mut judged = assert_prefetched("--prefetch on", &memory_survives_failover_epochs(PREFETCH_WORK, &on, &runs));
    // The ring re-protects every page a round harvests, hot ones too.
    let ring = ["--prefetch", "on", "--dirty-backend", "ring"];
    judged += assert_prefetched("with the dirty ring", &memory_survives_failover_epochs(PREFETCH_WORK, &ring, &[(1, 1, 700)]));
    let all = ["--tuning", "static", "--prefetch", "on", "--diff", "lz4", "--device-state", "changed", "--capture", "cow"];
    judged += assert_prefetched("with every switch", &memory_survives_failover_epochs(PREFETCH_WORK, &all, &[(2, 2, 900)]));
    assert!(judged > 0, "no run gave the prefetch rounds a chance");
}

/// With default flags (`--tuning auto`) write prediction and prefetch run
/// together: on a writer with a hot set (a tenth of its pages take nine
/// tenths of its writes, each hot page about once an epoch) and cold
/// writes scattered over the rest, prediction keeps the hot pages writable
/// and the rounds send cold pages ahead, in the same epochs. The hot pages
/// move on every half second: prediction lets the regions they left go and
/// keeps the ones they reach (mechanisms flipping mid-run), and a kill
/// still leaves the backup exactly at the last checkpoint.
#[test]
fn the_default_predicts_and_prefetches() {
    let work = "ws=16M pattern=hotcold shift=25000 rate=50000 writes=400000 report=100ms";
    let runs = memory_survives_failover_epochs(work, &[], &[(1, 1, 1500), (2, 1, 1800)]);
    let n = |e: &serde_json::Value, key: &str| e[key].as_u64().unwrap();
    for epochs in &runs {
        let both = epochs.iter().filter(|e| n(e, "predicted") > 0 && n(e, "prefetched_pages") > 0).count();
        let kept: u64 = epochs.iter().map(|e| n(e, "predicted")).sum();
        let ahead: u64 = epochs.iter().map(|e| n(e, "prefetched_pages")).sum();
        let flips: Vec<u64> = epochs.iter().map(|e| n(e, "regions_flipped")).filter(|&f| f > 0).collect();
        eprintln!("{both} of {} epochs with pages both left writable and sent ahead ({kept} left writable, {ahead} ahead); regions flipped {flips:?}", epochs.len());
        assert!(
            both > 0,
            "no epoch had pages both left writable and sent ahead: {kept} left writable, {ahead} ahead in {} epochs",
            epochs.len()
        );
        assert!(epochs.iter().any(|e| n(e, "regions_kept") > 0), "the adaptive predictor reports the regions it keeps");
        let flipped: u64 = epochs.iter().map(|e| n(e, "regions_flipped")).sum();
        assert!(flipped >= 3, "the hot pages moved at least twice, but only {flipped} regions were kept or let go");
    }
}

/// With `--prefetch-by pull` the backup reads the rounds' pages itself,
/// from a read-only mapping of the primary's guest memory (both run on
/// this host), and a kill at any point of an epoch still leaves it exactly
/// at the primary's last checkpoint: with diffs (the default), and with
/// whole pages, the dirty ring and adaptive rounds.
#[test]
fn memory_survives_failover_with_pulled_prefetch() {
    let pull = ["--tuning", "static", "--prefetch", "on", "--prefetch-by", "pull"];
    let mut judged = assert_prefetched(
        "the backup read pages ahead",
        &memory_survives_failover_epochs(PREFETCH_WORK, &pull, &[(1, 1, 600), (2, 2, 1000)]),
    );
    let others = ["--prefetch", "adaptive", "--prefetch-by", "pull", "--diff", "off", "--dirty-backend", "ring"];
    judged += assert_prefetched(
        "adaptive, whole pages, the dirty ring",
        &memory_survives_failover_epochs(PREFETCH_WORK, &others, &[(1, 1, 700)]),
    );
    assert!(judged > 0, "no run gave the pulled prefetch rounds a chance");
}

/// `--prefetch adaptive` follows the guest. Unthrottled random writes over
/// 16 MiB rewrite many pages a round sends before the freeze (each such
/// send a wasted tracked first write): after an epoch that wasted more
/// than one send in seven, the next one's rounds start later in the epoch
/// or stop (`prefetch_start` grows), and a kill still leaves the backup
/// exactly at the last checkpoint. Slow random writes over 64 MiB are
/// almost never written twice in an epoch: every round runs and their
/// pages go ahead. (`--tuning static`: prefetch alone, weighing the costs
/// assumed, which put the break-even point at one send in seven.)
#[test]
fn adaptive_prefetch_starts_later_when_sends_are_wasted() {
    let alone = ["--tuning", "static", "--prefetch", "adaptive"];
    let epochs = &memory_survives_failover_epochs(LONG_WORK, &alone, &[(1, 1, 1200)])[0];
    let n = |e: &serde_json::Value, key: &str| e[key].as_u64().unwrap();
    let wasteful = |e: &serde_json::Value| n(e, "prefetched_pages") >= 32 && n(e, "prefetch_wasted") * 7 > n(e, "prefetched_pages");
    let after_waste: Vec<(u64, u64)> =
        epochs.windows(2).filter(|w| wasteful(&w[0])).map(|w| (n(&w[0], "prefetch_start"), n(&w[1], "prefetch_start"))).collect();
    assert!(!after_waste.is_empty(), "rounds wasted sends on a writer that rewrites its pages");
    // From 7 (the last round alone) the next step is 8: no rounds.
    assert!(
        after_waste.iter().all(|&(before, next)| next > before),
        "after a wasteful epoch the rounds start later: (start, next start) {after_waste:?}"
    );

    let dir = Scratch::new("adaptive-prefetch").unwrap();
    let metrics = dir.join("cold.jsonl");
    let addr = free_addr();
    let b = backup(&addr, &[]);
    let work = "ws=64M pattern=random rate=10000 writes=15000 report=0";
    let p = spawn(
        primary(&addr, 1, work, &["--epoch-ms", "20", "--tuning", "static", "--prefetch", "adaptive", "--metrics-every-epoch"])
            .arg("--metrics")
            .arg(&metrics),
    );
    let (p, b) = (finish(p), finish(b));
    assert!(p.status.success(), "{}", stderr(&p));
    assert!(b.status.success(), "{}", stderr(&b));
    let epochs: Vec<serde_json::Value> = json_lines(&metrics);
    let n = |key: &str| epochs.iter().map(|e| e[key].as_u64().unwrap()).collect::<Vec<_>>();
    let (start, ahead, wasted) = (n("prefetch_start"), n("prefetched_pages"), n("prefetch_wasted"));
    let all_rounds = start.iter().filter(|&&s| s == 0).count();
    assert!(all_rounds * 10 >= epochs.len() * 9, "cold writes: every round ran in most epochs: {start:?}");
    let (ahead, wasted): (u64, u64) = (ahead.iter().sum(), wasted.iter().sum());
    assert!(ahead > 1000 && wasted * 7 < ahead, "cold pages went ahead, few wasted: {ahead} sent, {wasted} wasted");
}

/// A primary that dies right after a prefetch round (its pages staged on
/// the backup, their checkpoint never sent) leaves the backup at the
/// checkpoint before (or the one before that, if the crash also cut that
/// one's transfer): it takes over from there, and the guest's result is
/// exact. With `--prefetch-by pull` the backup may still be reading the
/// dead primary's memory (its mapping keeps it) when the stream breaks.
#[test]
fn a_failure_mid_prefetch_leaves_the_last_checkpoint() {
    for by in ["push", "pull"] {
        a_failure_mid_prefetch_with(by);
    }
}

fn a_failure_mid_prefetch_with(by: &str) {
    let addr = free_addr();
    let b = backup(&addr, &[]);
    let args = ["--epoch-ms", "20", "--tuning", "static", "--prefetch", "on", "--prefetch-by", by];
    let p = spawn(primary(&addr, 1, WORK, &args).env("FTVM_TEST_FAULT", "die-after-prefetch:6"));
    let (p, b) = (finish(p), finish(b));
    let perr = stderr(&p);
    assert_eq!(p.status.code(), Some(137), "the primary 'crashed' after a prefetch round: {perr}");
    let line = perr.lines().find(|l| l.contains("dies after a prefetch round")).unwrap_or_else(|| panic!("no fault logged: {perr}"));
    let died_in: u64 =
        line.split_whitespace().find_map(|w| w.strip_prefix("epoch=")).and_then(|e| e.parse().ok()).expect("the epoch it died in");
    assert!(died_in >= 6, "{perr}");
    let err = stderr(&b);
    assert!(b.status.success(), "{err}");
    // Never the epoch whose prefetch round was staged. Usually the one
    // before; one earlier still when the crash also cut that checkpoint's
    // transfer (with pull the backup was still reading its pages from the
    // primary's memory; seen on a loaded host), which the primary cannot
    // have had acknowledged.
    let at = took_over_at(&err).unwrap_or_else(|| panic!("{by}: no takeover: {err}"));
    assert!((died_in - 2..died_in).contains(&at), "{by}: took over at {at}, the primary died in epoch {died_in}: {err}");
    assert_eq!(err.contains("mapped the primary's guest memory"), by == "pull", "{by}: {err}");
    assert_eq!(checksum_of(&b), Some(expected_memtouch_checksum(WORK, 1)), "{by}");
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

/// A backup whose host cannot restore the primary's vCPUs (here: its XSAVE
/// area said to be smaller, a test-only fault) refuses the primary at the
/// handshake, with one line on each side, before anything is copied; it
/// is never found out at failover.
#[test]
fn an_incompatible_host_refuses_the_primary_at_connect() {
    let addr = free_addr();
    let mut b = Process::spawn_collected(
        "backup",
        ftvm().args(["backup", "--insecure", "--listen", &addr]).env("FTVM_LOG", "warn").env("FTVM_TEST_FAULT", "xsave-size:64"),
    )
    .unwrap();
    let p = primary(&addr, 1, WORK, &[]).output().unwrap();
    assert_eq!(p.status.code(), Some(1), "{}", stderr(&p));
    let err = stderr(&p);
    let line = err.lines().find(|l| l.starts_with("ftvm: error:")).unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("the backup refused this primary: this host cannot run the primary's vCPUs: its XSAVE area has")
            && line.ends_with("bytes, this host's 64"),
        "{err}"
    );
    assert!(!err.contains("protected") && !stdout(&p).contains("memtouch: done"), "the primary got further than the handshake:\n{err}");
    // The backup says why on one line and keeps waiting for a primary it can follow.
    b.wait_until(Duration::from_secs(10), |b| b.stderr().contains("refused a primary")).unwrap();
    assert!(b.running(), "the backup stopped after refusing");
    let refusals: Vec<_> = b.stderr().lines().filter(|l| l.contains("refused a primary")).map(str::to_owned).collect();
    assert_eq!(refusals.len(), 1, "{}", b.stderr());
    assert!(refusals[0].contains("this host cannot run the primary's vCPUs: its XSAVE area has"), "{}", refusals[0]);
    kill(&mut b);
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

/// A primary whose backup cannot be reached, or whose metrics file cannot
/// be written, ends with one clear line and lets nothing of its guest out
/// (the probe prints a tick every 20 ms from its start).
#[test]
fn unreachable_backup_is_a_clear_error() {
    let addr = free_addr(); // nobody listens here
    let t0 = Instant::now();
    let out = primary_of("probe", &addr, 1, "ticker=20", &["--connect-timeout-ms", "1500"]).output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.lines().last().unwrap().starts_with(&format!("ftvm: error: cannot reach the backup at {addr}")), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(!stdout(&out).contains("probe:"), "the guest's output left before a backup had it: {}", stdout(&out));
    let out = primary_of("probe", &addr, 1, "ticker=20", &["--metrics", "/nonexistent-ftvm-dir/m.jsonl"]).output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.lines().last().unwrap().contains("cannot write metrics: /nonexistent-ftvm-dir/m.jsonl: No such file"), "{err}");
    assert!(!stdout(&out).contains("probe:"), "{}", stdout(&out));
}

#[test]
fn primary_survives_backup_loss_and_is_protected_again() {
    backup_loss_then_reprotect("continue", "UNPROTECTED", "running", &[]);
}

/// The new backup has none of the page versions the primary kept for diffs
/// against the old one: it must get whole pages first.
#[test]
fn a_new_backup_is_not_sent_diffs_against_the_old_ones_pages() {
    backup_loss_then_reprotect("continue", "UNPROTECTED", "running", &["--diff", "xor"]);
}

#[test]
fn primary_pauses_on_backup_loss_by_policy_until_protected_again() {
    backup_loss_then_reprotect("pause", "PAUSED", "paused", &[]);
}

fn backup_loss_then_reprotect(policy: &str, detail: &str, state: &str, extra: &[&str]) {
    let dir = Scratch::new(&format!("reprotect-{policy}")).unwrap().keep_on_panic();
    let socket = dir.join("api.sock");
    // Seconds of work even unreplicated: the kill below must land while the
    // guest still works, after a backup loss, its detection and a new
    // backup's pre-copy, which a loaded host stretches.
    let long = "ws=16M pattern=random writes=1000000000 report=100ms";
    // Running on unprotected (continue) needs an arbiter, on both sides.
    let etcd = (policy == "continue").then(|| Etcd::start(dir.path()).unwrap());
    let arbiter: Vec<&str> = etcd.iter().flat_map(|e| ["--arbiter", e.endpoint()]).collect();
    let addr1 = free_addr();
    let mut b1 = backup(&addr1, &arbiter);
    let mut p = spawn(
        primary(&addr1, 1, long, &["--epoch-ms", "10", "--failure-timeout-ms", "300", "--on-backup-loss", policy])
            .args(extra)
            .args(&arbiter)
            .arg("--api-socket")
            .arg(&socket),
    );
    let _lines = wait_for_progress(&mut p);
    // Protected from the backup's first acknowledgement on.
    wait_for_status(&socket, "protected: yes");
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
    let b2 = backup(&addr2, &arbiter);
    let out = ftvm().args(["protect", "--api-socket"]).arg(&socket).args(["--backup", &addr2]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let t0 = Instant::now();
    while !status(&socket).contains("protected: yes") {
        assert!(t0.elapsed() < Duration::from_secs(10), "not re-protected: {}", status(&socket));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(status(&socket).contains("state: running"), "runs again once protected: {}", status(&socket));
    std::thread::sleep(Duration::from_millis(300));
    assert!(p.running(), "the guest finished before the kill: the test took over nothing");
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
        cmd.args(["run", "--cmdline", &format!("exit={status}"), "--insecure", "--replicate-to", &addr]).arg("--image").arg(image("probe"));
        let p = cmd.output().unwrap();
        assert_eq!(p.status.code(), Some(status), "{}", stderr(&p));
        let out = finish(b);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(status), "the backup ends with the guest's status: {err}");
        assert!(err.contains("backup done") && !err.contains("PRIMARY LOST"), "no takeover: {err}");
    }
}

/// What a disk of `size` bytes holds after `netprobe blk=fill`: each sector
/// its number (8 bytes, little-endian), then the number's low byte xor 0xa5.
fn filled(size: u64) -> Vec<u8> {
    let mut v = vec![0u8; size as usize];
    for (n, sector) in v.chunks_exact_mut(512).enumerate() {
        sector[..8].copy_from_slice(&(n as u64).to_le_bytes());
        sector[8..].fill(n as u8 ^ 0xa5);
    }
    v
}

/// A primary's arguments to run on unprotected when its backup is lost
/// (which needs the arbiter `etcd`), with a 10 s failure timeout.
fn continue_on_backup_loss(etcd: &Etcd) -> [&str; 6] {
    ["--failure-timeout-ms", "10000", "--on-backup-loss", "continue", "--arbiter", etcd.endpoint()]
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

// The disk tests below give both sides long failure timeouts: a checkpoint
// of tens of MiB on a loaded machine must not pass for a dead peer (without
// an arbiter both sides would then run: issue 8, items 1-3), and pre-copy
// reads a sparse disk without sending anything (item 7).

#[test]
fn a_full_replica_disk_stops_the_backup_which_never_takes_over() {
    // The backup fails after 8 MiB; the guest writes on for most of its 128 MiB.
    const DISK: u64 = 128 << 20;
    // Disks in memory: no writeback stalls for the tests running beside this one.
    let primary_fs = Tmpfs::mount("fullprimary", "160M").unwrap();
    let disk = primary_fs.sparse_file("primary.img", DISK).unwrap();
    // 8 MiB of space under the backup's 128 MiB replica.
    let fs = Tmpfs::mount("fullreplica", "8M").unwrap();
    let replica = fs.sparse_file("replica.img", DISK).unwrap();
    // Running on unprotected (continue) needs an arbiter, on both sides
    // (its data out of the tmpfs: its log alone preallocates 64 MiB).
    let etcd_dir = Scratch::new("replication-etcd").unwrap();
    let etcd = Etcd::start(etcd_dir.path()).unwrap();
    let addr = free_addr();
    let b = backup(&addr, &["--disk", path_str(&replica), "--failure-timeout-ms", "5000", "--arbiter", etcd.endpoint()]);
    // The guest starts writing once it is protected (pre-copy of an empty disk is quick).
    let extra = [&["--memory", "64", "--disk", path_str(&disk)][..], &continue_on_backup_loss(&etcd)].concat();
    let p = spawn(&mut primary_of("netprobe", &addr, 1, "blk=fill delay=1000", &extra));
    let (p, b) = (finish(p), finish(b));
    let (p_err, b_err) = (stderr(&p), stderr(&b));
    let b_err = format!("{b_err}\n(primary: {p_err})");

    // The backup said why, in one line, and stopped without taking over.
    assert_eq!(b.status.code(), Some(1), "{b_err}");
    let last = stderr(&b).lines().last().unwrap_or_default().to_owned();
    assert!(last.starts_with("ftvm: error: this backup cannot apply the primary's stream (checkpoint "), "{b_err}");
    assert!(last.contains("No space left on device") && last.contains("its writes were undone"), "{b_err}");
    assert!(last.ends_with("it told the primary and stops without taking over"), "{b_err}");
    assert!(!b_err.contains("PRIMARY LOST") && !b_err.contains("took over"), "{b_err}");

    // The primary was protected, then lost its backup for that reason and ran on (--on-backup-loss continue).
    let synchronized = p_err.find("backup synchronized").unwrap_or_else(|| panic!("never protected: {p_err}"));
    let lost = p_err.find("BACKUP LOST (the backup cannot apply the primary's stream and stops: checkpoint ").expect(&p_err);
    assert!(synchronized < lost && p_err[lost..].contains("No space left on device"), "{p_err}");
    assert!(p_err.contains("the VM now runs UNPROTECTED"), "{p_err}");
    assert_eq!(p.status.code(), Some(0), "{p_err}");
    assert!(stdout(&p).contains(&format!("netprobe: blk fill wrote={} result=ok", DISK / 512)), "{}", stdout(&p));
    // Nothing the guest wrote is lost: it is all on the primary's disk.
    assert!(std::fs::read(&disk).unwrap() == filled(DISK), "the primary's disk lacks data its guest wrote");
}

#[test]
fn fast_disk_writes_give_bounded_checkpoints_and_an_equal_replica() {
    // Three times the journal's bound in one long epoch.
    const DISK: u64 = 192 << 20;
    const MEM: u64 = 64 << 20;
    let fs = Tmpfs::mount("bounded", "400M").unwrap();
    let disk = fs.sparse_file("primary.img", DISK).unwrap();
    let replica = fs.sparse_file("replica.img", DISK).unwrap();
    let metrics = fs.path().join("metrics.jsonl");
    let addr = free_addr();
    let b = backup(&addr, &["--disk", path_str(&replica), "--failure-timeout-ms", "5000"]);
    let extra = [
        "--memory",
        "64",
        "--disk",
        path_str(&disk),
        "--epoch-ms",
        "5000",
        // Epochs of exactly 5 s (output-triggered ones may be shorter).
        "--trigger",
        "periodic",
        "--metrics-every-epoch",
        "--metrics",
        path_str(&metrics),
        "--failure-timeout-ms",
        "10000",
    ];
    let p = spawn(&mut primary_of("netprobe", &addr, 1, "blk=fill", &extra));
    let (p, b) = (finish(p), finish(b));
    assert_eq!(p.status.code(), Some(0), "{}", stderr(&p));
    assert!(stdout(&p).contains(&format!("netprobe: blk fill wrote={} result=ok", DISK / 512)), "{}", stdout(&p));
    let b_err = stderr(&b);
    assert_eq!(b.status.code(), Some(0), "the backup stops with the guest: {b_err}");
    assert!(b_err.contains("backup done") && !b_err.contains("PRIMARY LOST"), "{b_err}");

    // Every checkpoint stayed within the bound, so some ended their epoch early.
    let epochs: Vec<serde_json::Value> = json_lines(&metrics);
    let field = |e: &serde_json::Value, k: &str| e[k].as_u64().unwrap_or_else(|| panic!("no {k} in {e}"));
    let limit = checkpoint_limit(MEM, 1);
    for e in &epochs {
        assert!(field(e, "bytes") <= limit, "checkpoint over the backup's limit: {e}");
        assert!(field(e, "disk_bytes") <= JOURNAL_MAX, "journal over its bound: {e}");
    }
    let early = epochs.iter().filter(|e| e["trigger"] == "journal").count();
    let journaled: u64 = epochs.iter().map(|e| field(e, "disk_bytes")).sum();
    assert!(early >= 1 && journaled > JOURNAL_MAX, "{early} early checkpoints carried {journaled} bytes: {epochs:?}");

    // The replica is the primary's disk, byte for byte.
    let expected = filled(DISK);
    assert!(std::fs::read(&disk).unwrap() == expected);
    assert!(std::fs::read(&replica).unwrap() == expected, "the replica differs from the primary's disk");
}

#[test]
fn a_replica_disk_smaller_than_the_primarys_is_refused_untouched() {
    let scratch = Scratch::new("replicasize").unwrap();
    let disk = scratch.sparse_file("primary.img", 4 << 20).unwrap();
    let replica = scratch.join("replica.img");
    let junk = vec![0x5a; 1 << 20];
    std::fs::write(&replica, &junk).unwrap();
    let addr = free_addr();
    let mut b =
        Process::spawn_collected("backup", ftvm().args(["backup", "--insecure", "--listen", &addr, "--disk", path_str(&replica)])).unwrap();
    let p = primary_of("netprobe", &addr, 1, "blk=selftest", &["--disk", path_str(&disk)]).output().unwrap();
    // The backup logs the refusal and goes on waiting for its primary.
    b.wait_until(Duration::from_secs(10), |b| b.stderr().contains("refused a primary")).unwrap();
    assert!(b.running(), "the backup stopped after refusing a primary");
    b.kill();
    let expected = format!(
        "ftvm: error: the backup refused this primary: the primary's disk has {} bytes, this backup's --disk {} only {}",
        4 << 20,
        replica.display(),
        1 << 20
    );
    assert_eq!(p.status.code(), Some(1), "{}", stderr(&p));
    assert!(stderr(&p).contains(&expected), "{}", stderr(&p));
    assert!(std::fs::read(&replica).unwrap() == junk, "the refused replica was changed");

    // A larger one is emptied and sized to the primary's disk, and follows it.
    std::fs::write(&replica, vec![0x5a; 8 << 20]).unwrap();
    let addr = free_addr();
    let b = backup(&addr, &["--disk", path_str(&replica)]);
    let p = primary_of("netprobe", &addr, 1, "blk=selftest", &["--disk", path_str(&disk)]).output().unwrap();
    let b = finish(b);
    assert_eq!(p.status.code(), Some(0), "{}", stderr(&p));
    assert_eq!(b.status.code(), Some(0), "{}", stderr(&b));
    assert!(std::fs::read(&replica).unwrap() == std::fs::read(&disk).unwrap(), "the replica differs from the primary's disk");
}

/// Wait for `vmm` to end, at most `limit` (then kill it and fail).
fn finish_within(vmm: Process, limit: Duration, what: &str) -> Output {
    vmm.wait_with_output_within(limit).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Poll `ftvm status` until it contains `text`.
fn wait_for_status(socket: &Path, text: &str) -> String {
    let t0 = Instant::now();
    loop {
        let st = status(socket);
        if st.contains(text) {
            return st;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "status never showed {text:?}: {st}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_failed_reprotection_leaves_the_vm_running_unprotected() {
    const DISK: u64 = 128 << 20;
    let primary_fs = Tmpfs::mount("reprotect", "320M").unwrap();
    let disk = primary_fs.sparse_file("primary.img", DISK).unwrap();
    // Data for pre-copy to send: far more than the second backup has room for
    // (and than socket buffers hold, so its refusal stops pre-copy).
    std::fs::OpenOptions::new().write(true).open(&disk).unwrap().write_all(&vec![0x77; 64 << 20]).unwrap();
    let replica1 = primary_fs.sparse_file("replica1.img", DISK).unwrap();
    let small_fs = Tmpfs::mount("reprotectsmall", "4M").unwrap();
    let replica2 = small_fs.sparse_file("replica2.img", DISK).unwrap();
    let socket = primary_fs.path().join("api.sock");

    // Running on unprotected (continue) needs an arbiter, on both sides
    // (its data out of the tmpfs: its log alone preallocates 64 MiB).
    let etcd_dir = Scratch::new("replication-etcd").unwrap();
    let etcd = Etcd::start(etcd_dir.path()).unwrap();
    let addr1 = free_addr();
    let mut b1 = backup(&addr1, &["--disk", path_str(&replica1), "--failure-timeout-ms", "5000", "--arbiter", etcd.endpoint()]);
    // The guest writes its disk (the whole of it) only once all this happened.
    let extra =
        [&["--memory", "64", "--disk", path_str(&disk), "--api-socket", path_str(&socket)][..], &continue_on_backup_loss(&etcd)].concat();
    let p = spawn(&mut primary_of("netprobe", &addr1, 1, "blk=fill delay=8000", &extra));
    wait_for_status(&socket, "protected: yes");
    kill(&mut b1);
    wait_for_status(&socket, "protected: no");

    // The new backup's disk fills during pre-copy: it refuses, and the primary runs on as before.
    let addr2 = free_addr();
    let b2 = backup(&addr2, &["--disk", path_str(&replica2), "--failure-timeout-ms", "5000", "--arbiter", etcd.endpoint()]);
    let out = ftvm().args(["protect", "--api-socket", path_str(&socket), "--backup", &addr2]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let st = wait_for_status(&socket, "re-protection failed");
    assert!(
        st.contains(&format!(
            "UNPROTECTED: re-protection failed: the backup refused this primary: the backup cannot apply the primary's stream and stops: pre-copy: cannot write the disk replica {}: No space left on device",
            replica2.display()
        )),
        "{st}"
    );
    assert!(st.contains("protected: no") && st.contains("state: running"), "{st}");
    let b2 = finish_within(b2, Duration::from_secs(30), "the refusing backup");
    assert_eq!(b2.status.code(), Some(1), "{}", stderr(&b2));
    assert!(!stderr(&b2).contains("PRIMARY LOST"), "{}", stderr(&b2));

    // What the attempt started was undone: the disk journal it began does not
    // hold the guest's disk once full, and the guest writes all of it.
    let p = finish_within(p, Duration::from_secs(120), "the primary");
    assert_eq!(p.status.code(), Some(0), "{}", stderr(&p));
    assert!(stdout(&p).contains(&format!("netprobe: blk fill wrote={} result=ok", DISK / 512)), "{}", stdout(&p));
    assert!(std::fs::read(&disk).unwrap() == filled(DISK));
}

/// A backup on `addr` that never finishes applying the first checkpoint, so
/// never acknowledges one.
fn stalled_backup(addr: &str) -> Process {
    spawn(
        ftvm()
            .args(["backup", "--insecure", "--listen", addr])
            .env("FTVM_TEST_FAULT", "stall-apply:0")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
}

/// `ftvm status` says protected only once the backup acknowledged a
/// checkpoint: a backup stuck applying the first one leaves it unprotected.
#[test]
fn protected_only_from_the_first_acknowledgement() {
    let dir = Scratch::new("firstack").unwrap();
    let socket = dir.join("api.sock");
    let addr = free_addr();
    let mut b = stalled_backup(&addr);
    let mut p =
        spawn(&mut primary(&addr, 1, LONG_WORK, &["--epoch-ms", "10", "--ack-timeout-ms", "60000", "--api-socket", path_str(&socket)]));
    let st = wait_for_status(&socket, "waiting for its first acknowledgement");
    assert!(st.contains("protected: no"), "{st}");
    std::thread::sleep(Duration::from_millis(300));
    let st = status(&socket);
    assert!(st.contains("protected: no"), "still unacknowledged: {st}");
    kill(&mut p);
    kill(&mut b);
}

/// A backup that took over is protected again by `ftvm protect`: it
/// becomes a primary, brings a new backup up to date, and that backup takes
/// the guest over in turn with its memory intact.
#[test]
fn a_promoted_backup_is_protected_again() {
    let dir = Scratch::new("promote").unwrap();
    let socket = dir.join("b1.sock");
    let (addr1, addr2) = (free_addr(), free_addr());
    let mut b1 = Process::spawn_collected(
        "backup 1",
        ftvm().args(["backup", "--insecure", "--listen", &addr1, "--api-socket", path_str(&socket)]).env("FTVM_LOG", "info"),
    )
    .unwrap();
    let mut p = Process::spawn_collected("primary", &mut primary(&addr1, 1, LONG_WORK, &["--epoch-ms", "10"])).unwrap();
    // Killed once protected: a primary lost during pre-copy (when its guest
    // prints already) leaves its backup nothing to take over.
    wait_for(&mut p, "primary", "the VM is protected", Duration::from_secs(60));
    kill(&mut p);
    wait_status(&socket, "role: primary", &mut b1, Duration::from_secs(30));
    let b2 = backup(&addr2, &[]);
    let out = ftvm().args(["protect", "--api-socket", path_str(&socket), "--backup", &addr2]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    wait_status(&socket, "protected: yes", &mut b1, Duration::from_secs(30));
    kill(&mut b1);
    let out = finish(b2);
    let err = stderr(&out);
    assert!(out.status.success(), "second backup failed: {err}");
    assert!(took_over_at(&err).is_some(), "no second takeover: {err}");
    assert_eq!(checksum_of(&out), Some(expected_memtouch_checksum(LONG_WORK, 1)), "{err}");
}

/// Console output is output too: once protected, a primary whose backup
/// never acknowledges prints nothing more of its guest's (the progress
/// lines stay held).
#[test]
fn console_output_waits_for_the_acknowledgement() {
    let addr = free_addr();
    let mut b = stalled_backup(&addr);
    let mut p =
        Process::spawn_collected("primary", &mut primary(&addr, 1, LONG_WORK, &["--epoch-ms", "10", "--ack-timeout-ms", "60000"])).unwrap();
    p.wait_until(Duration::from_secs(20), |p| p.stderr().contains("synchronized")).unwrap();
    // Lines printed during the live pre-copy (before protection, 0.1 s
    // apart) leave unheld; give those in the pipe a moment to arrive.
    std::thread::sleep(Duration::from_millis(300));
    let before = p.stdout().matches("t=").count();
    std::thread::sleep(Duration::from_millis(1000));
    assert!(p.running(), "{}", p.output());
    assert_eq!(
        p.stdout().matches("t=").count(),
        before,
        "console output left after protection began, before its checkpoint was acknowledged:\n{}",
        p.output()
    );
    p.kill();
    b.kill();
}

/// `--trigger output`: a guest that prints a line and then waits (a
/// ticker) is checkpointed as soon as it is idle with the line held, long
/// before its epoch would end, and its maximum epoch adapts below
/// `--epoch-ms` (its checkpoints are cheap); `--trigger periodic` waits for
/// the end of every epoch. The metrics and `ftvm status` say what started
/// each checkpoint and how long its epoch ran.
#[test]
fn held_output_and_an_idle_guest_start_a_checkpoint() {
    const EPOCH_US: u64 = 500_000;
    for trigger in ["output", "periodic"] {
        let dir = Scratch::new(&format!("trigger-{trigger}")).unwrap();
        let (socket, metrics) = (dir.join("api.sock"), dir.join("epochs.jsonl"));
        let addr = free_addr();
        let b = backup(&addr, &[]);
        let extra = [
            "--epoch-ms",
            "500",
            "--trigger",
            trigger,
            "--metrics-every-epoch",
            "--metrics",
            path_str(&metrics),
            "--api-socket",
            path_str(&socket),
        ];
        let p = spawn(&mut primary_of("probe", &addr, 1, "ticker=20,count=60", &extra));
        // Counts, not the last epoch's trigger: a poll can miss that
        // between two ticks on a loaded host (a CI run did).
        let st = wait_for_status(&socket, if trigger == "output" { "checkpoints started by: idle " } else { "started by: epoch " });
        assert!(st.contains("(at most "), "{st}");
        let out = finish(p);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stdout(&out).contains("probe: ticker done n=60"), "{}", stdout(&out));
        finish(b);
        let epochs: Vec<serde_json::Value> = json_lines(&metrics);
        let by = |reason: &str| epochs.iter().filter(|e| e["trigger"] == reason).collect::<Vec<_>>();
        let us = |e: &serde_json::Value, k: &str| e[k].as_u64().unwrap();
        assert_eq!((by("sync").len(), by("stop").len()), (1, 1), "{trigger}: {epochs:?}");
        eprintln!(
            "{trigger}: {} checkpoints: {} idle, {} hold, {} epoch; maximum epoch {:?} to {:?} us",
            epochs.len(),
            by("idle").len(),
            by("hold").len(),
            by("epoch").len(),
            epochs.iter().map(|e| us(e, "max_epoch_us")).filter(|&m| m > 0).min(),
            epochs.iter().map(|e| us(e, "max_epoch_us")).max(),
        );
        if trigger == "output" {
            let idle = by("idle");
            assert!(idle.len() >= 30, "only {} of 60 ticks started a checkpoint: {epochs:?}", idle.len());
            assert!(idle.iter().all(|e| us(e, "epoch_us") < us(e, "max_epoch_us")), "idle epochs end early: {idle:?}");
            let max: Vec<u64> = epochs.iter().map(|e| us(e, "max_epoch_us")).filter(|&m| m > 0).collect();
            assert!(max.iter().all(|&m| (5000..=EPOCH_US).contains(&m)), "within [5 ms, --epoch-ms]: {max:?}");
            assert!(max.iter().any(|&m| m < EPOCH_US), "a cheap guest's maximum epoch adapts below --epoch-ms: {max:?}");
        } else {
            let epoch = by("epoch");
            assert_eq!(epoch.len() + 2, epochs.len(), "only the end of an epoch starts a periodic checkpoint: {epochs:?}");
            assert!(
                !epoch.is_empty() && epoch.iter().all(|e| us(e, "max_epoch_us") == EPOCH_US && us(e, "epoch_us") >= EPOCH_US),
                "{epoch:?}"
            );
        }
    }
}

/// Issue 29: a backup whose disk fills says so and stops; the primary
/// (default `--on-backup-loss pause`, no arbiter) keeps its guest paused
/// with its output held: the guest never runs on to its exit, its last
/// console line never appears. Stopped with SIGTERM, the primary says that
/// held output was never acknowledged and exits non-zero.
#[test]
fn a_full_replica_disk_leaves_the_primary_paused_with_its_output_held() {
    // The backup fails after 8 MiB, while the guest writes on.
    full_replica_disk_pauses(128 << 20, &[]);
}

/// The same when the checkpoint the backup cannot apply is the last one,
/// taken as the guest exits: the guest's exit and its last line are held
/// output like any other, never released without an acknowledgement.
#[test]
fn a_full_replica_disk_at_the_guests_exit_holds_its_last_output() {
    // 16 MiB written in one long epoch: the guest has exited when the
    // backup fails on the last checkpoint, which carries all of them.
    full_replica_disk_pauses(16 << 20, &["--epoch-ms", "20000", "--trigger", "periodic"]);
}

fn full_replica_disk_pauses(size: u64, epochs: &[&str]) {
    let primary_fs = Tmpfs::mount("pausedprimary", "160M").unwrap();
    let disk = primary_fs.sparse_file("primary.img", size).unwrap();
    let fs = Tmpfs::mount("pausedreplica", "8M").unwrap();
    let replica = fs.sparse_file("replica.img", size).unwrap();
    let addr = free_addr();
    let b = backup(&addr, &["--disk", path_str(&replica), "--failure-timeout-ms", "5000"]);
    let extra = [&["--memory", "64", "--disk", path_str(&disk), "--failure-timeout-ms", "10000"], epochs].concat();
    let mut p = Process::spawn_collected("ftvm run", &mut primary_of("netprobe", &addr, 1, "blk=fill delay=1000", &extra)).unwrap();
    let b = finish(b);
    let b_err = stderr(&b);
    assert_eq!(b.status.code(), Some(1), "{b_err}");
    let last = b_err.lines().last().unwrap_or_default().to_owned();
    assert!(last.contains("No space left on device") && last.contains(path_str(&replica)), "{b_err}");

    let p_err = wait_log(&mut p, "BACKUP LOST", Duration::from_secs(60));
    assert!(p_err.contains("No space left on device"), "the primary names the backup's reason: {p_err}");
    // Long enough for the guest to finish its writes if it were running.
    std::thread::sleep(Duration::from_secs(5));
    assert!(p.running(), "the paused primary exited: {}", p.output());
    assert!(!p.stdout().contains("blk fill wrote="), "the guest ran on or its held line went out: {}", p.output());

    p.signal(libc::SIGTERM).unwrap();
    let status = exit_status(&mut p, Duration::from_secs(30));
    let out = p.output();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(!p.stdout().contains("blk fill wrote="), "held output released at stop: {out}");
    let last = p.stderr().lines().last().unwrap_or_default().to_owned();
    assert!(last.starts_with("ftvm: error: ") && last.contains("never acknowledged"), "{out}");
}

/// Copy-on-write faults live through a failover: parent and children of a
/// Linux program take them without pause (a good part of the time inside
/// the VMM's ring-0 #PF stub or the runtime's CPL3 handler, where many of
/// the checkpoints land), the primary is killed, and on the backup every
/// process still reads its own writes alone.
#[test]
fn copy_on_write_faults_survive_failover() {
    let fork = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/images/linux-fork");
    assert!(fork.exists(), "{} missing: run scripts/build-images.sh", fork.display());
    let addr = free_addr();
    let b = backup(&addr, &[]);
    let mut cmd = ftvm();
    cmd.args(["run", "--memory", "512", "--insecure", "--replicate-to", &addr, "--epoch-ms", "5", "--trigger", "periodic"])
        .args(["--cmdline=-- fork cowloop 3000", "--image"])
        .arg(&fork)
        .env("FTVM_LOG", "info");
    let mut p = Process::spawn_collected("ftvm run", &mut cmd).unwrap();
    wait_for(&mut p, "primary", "fork: cowloop started", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(1000));
    kill(&mut p);
    assert!(!p.output().contains("cowloop done"), "the loop finished before the primary was killed:\n{}", p.output());
    let out = finish(b);
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "backup failed: {text}{err}");
    assert!(took_over_at(&err).is_some(), "no takeover: {err}");
    assert!(text.contains("fork: cowloop done rounds=1 bad=0\n"), "{text}{err}");
    assert!(!text.contains("fork: cowloop started"), "{text}");
}

/// A Linux program's forked child lives through a failover: the primary is
/// killed while the child works (its address space is page tables and
/// frames in guest RAM, its registers saved with the parent's thread), the
/// backup takes over, the child finishes with its own copy of memory and
/// the parent reaps it with its exit status.
#[test]
fn a_forked_child_survives_failover_and_is_reaped() {
    let fork = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/images/linux-fork");
    assert!(fork.exists(), "{} missing: run scripts/build-images.sh", fork.display());
    let addr = free_addr();
    let b = backup(&addr, &[]);
    let mut cmd = ftvm();
    cmd.args(["run", "--memory", "512", "--insecure", "--replicate-to", &addr, "--epoch-ms", "10"])
        .args(["--cmdline", "rtmem=128 -- fork slow 3000", "--image"])
        .arg(&fork)
        .env("FTVM_LOG", "info");
    let mut p = Process::spawn_collected("ftvm run", &mut cmd).unwrap();
    // Console output leaves the primary once checkpointed: the child runs
    // protected from here on, for three seconds.
    wait_for(&mut p, "primary", "fork: slow child started", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(1000));
    kill(&mut p);
    assert!(!p.output().contains("slow child done"), "the child finished before the primary was killed:\n{}", p.output());
    let out = finish(b);
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "backup failed: {text}{err}");
    assert!(took_over_at(&err).is_some(), "no takeover: {err}");
    assert!(text.contains("fork: slow child done steps=1 status=42\n"), "{text}{err}");
    // Continued from a checkpoint, not started again.
    assert!(!text.contains("fork: slow child started"), "{text}");
}
