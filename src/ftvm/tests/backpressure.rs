//! Backpressure through a protected VM: when a client stops reading and its
//! kernel closes its receive window, the guest's TCP stops sending, its send
//! buffer fills and the server's own output buffer for that client grows,
//! as if no output were held. Redis's unit/obuf-limits relies on it: a
//! subscriber that never reads is disconnected once the server's output
//! buffer for it passes `client-output-buffer-limit`. What could defeat it
//! is ftvm's own: held output the guest believes gone, or the fake ACK
//! proxy acknowledging data the client's window has no room for.
//!
//! The client's namespace runs with `net.ipv4.tcp_shrink_window=1`: with
//! this host's 32 MiB `tcp_rmem` maximum (window scale 10), a Linux
//! receiver that never reads keeps re-offering its window, rounded up to
//! 1 KiB at every ACK, while the messages come slower than about 1 KiB
//! per delayed ACK, which one checkpoint per command makes them (RFC 7323
//! appendix F; scripts/window-repro.py shows it without ftvm). The setting
//! lets the client's kernel retract its window at its memory limit, so the
//! test is about ftvm's part, not about that rate.

mod common;

use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC, H2_REPL_ADDR, TAP};

/// The server's limit for pub/sub clients (unit/obuf-limits' own).
const LIMIT: u64 = 100_000;
/// Messages published per redis-cli run, one command and reply at a time
/// as the suite's client does.
const ROUND: usize = 500;
/// What the subscriber may take before it must be gone: the limit, the
/// guest's 64 KiB send buffer, what the client's kernel queues at its
/// memory limit (tens of KiB) and slack. Without backpressure the client's
/// kernel takes it all and the subscriber stays.
const MESSAGES_BOUND: usize = 20_000;

fn start_protected(topo: &Topology, dir: &Scratch, fake_ack: &str) -> (Process, Process) {
    let repl = format!("{H2_REPL_ADDR}:7000");
    let net = format!("tap={TAP},mac={GUEST_MAC}");
    let mut backup_cmd = topo.command("h2", env!("CARGO_BIN_EXE_ftvm"));
    backup_cmd.args(["backup", "--insecure", "--listen", &repl, "--net", &net]).env("FTVM_LOG", "info");
    let backup = Process::spawn_collected("backup", &mut backup_cmd).expect("backup spawns");
    let program = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/images/redis-server");
    assert!(program.exists(), "{} missing: run scripts/build-redis.sh", program.display());
    let socket = dir.join("primary.sock");
    let mut cmd = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    cmd.arg("run").arg("--image").arg(&program).args(["--memory", "512", "--net", &net]);
    cmd.args(["--insecure", "--replicate-to", &repl, "--fake-ack", fake_ack, "--api-socket"]).arg(&socket);
    cmd.arg(format!("--cmdline=ip={GUEST_ADDR}/24 -- redis-server --port 6379 --save '' --protected-mode no"));
    cmd.env("FTVM_LOG", "info");
    let mut primary = Process::spawn_collected("primary", &mut cmd).expect("primary spawns");
    wait_status(&socket, "protected: yes", &mut primary, Duration::from_secs(30));
    (backup, primary)
}

/// The `CLIENT LIST` line of the subscriber, if it is still connected.
fn subscriber(topo: &Topology) -> Option<String> {
    redis_cli(topo, &["CLIENT", "LIST"]).lines().find(|l| l.contains("cmd=subscribe")).map(str::to_owned)
}

fn omem(line: &str) -> u64 {
    line.split_whitespace().find_map(|w| w.strip_prefix("omem=")).and_then(|v| v.parse().ok()).expect("CLIENT LIST has omem")
}

/// `ROUND` PUBLISHes through one redis-cli reading them from its stdin.
fn publish_round(topo: &Topology) {
    let mut cli = topo
        .command("client", "redis-cli")
        .args(["-h", GUEST_ADDR, "-p", "6379"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-cli runs");
    let commands = "PUBLISH foo bar\n".repeat(ROUND);
    cli.stdin.take().expect("stdin").write_all(commands.as_bytes()).expect("commands to redis-cli");
    assert!(cli.wait().expect("redis-cli ends").success());
}

fn a_subscriber_that_never_reads_is_disconnected_at_its_output_limit(tag: &str, fake_ack: &str) {
    let topo = Topology::new(tag).unwrap();
    let dir = scratch_for("backpressure", tag);
    let set = topo.command("client", "sysctl").args(["-qw", "net.ipv4.tcp_shrink_window=1"]).output().expect("sysctl runs");
    assert!(set.status.success(), "tcp_shrink_window: {}", stderr(&set));
    let (mut backup, mut primary) = start_protected(&topo, &dir, fake_ack);
    assert_eq!(redis_cli(&topo, &["CONFIG", "SET", "client-output-buffer-limit", &format!("pubsub {LIMIT} 0 0")]).trim(), "OK");
    // bash subscribes on fd 3 and never reads it.
    let mut sub_cmd = topo.command("client", "bash");
    sub_cmd.args(["-c", &format!("exec 3<>/dev/tcp/{GUEST_ADDR}/6379 && printf 'SUBSCRIBE foo\\r\\n' >&3 && sleep 600")]);
    let mut sub = Process::spawn_collected("subscriber", &mut sub_cmd).expect("bash spawns");
    let t0 = std::time::Instant::now();
    while subscriber(&topo).is_none() {
        assert!(sub.running(), "subscriber: {}", sub.output());
        assert!(t0.elapsed() < Duration::from_secs(10), "no subscriber in CLIENT LIST");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut published = 0;
    let mut most_omem = 0;
    while let Some(line) = subscriber(&topo) {
        most_omem = most_omem.max(omem(&line));
        assert!(
            published < MESSAGES_BOUND,
            "the subscriber is still connected after {published} messages (output buffer at most {most_omem} bytes): no backpressure reached the server"
        );
        publish_round(&topo);
        published += ROUND;
    }
    // Gone because its output buffer passed the limit: Redis says so.
    primary
        .wait_until(Duration::from_secs(5), |p| p.output().contains("for overcoming of output buffer limits"))
        .unwrap_or_else(|e| panic!("no output-buffer-limit disconnection in the server's log ({e}):\n{}", primary.output()));
    // The server's output buffer for the subscriber grew before that (it
    // is what the limit counts): a round adds 17.5 KB of messages, so the
    // samples between rounds see it on its way to the limit.
    assert!(most_omem > 0, "the subscriber's output buffer never seen growing");
    eprintln!("{tag}: subscriber disconnected after {published} messages; its output buffer seen at {most_omem} bytes");
    assert_eq!(redis_cli(&topo, &["PING"]).trim(), "PONG");
    assert!(primary.running() && backup.running(), "{}\n{}", primary.output(), backup.output());
    sub.kill();
    primary.kill();
    backup.kill();
}

#[test]
fn protected_subscriber_that_never_reads_is_disconnected_at_its_output_limit() {
    a_subscriber_that_never_reads_is_disconnected_at_its_output_limit("bpdflt", "bulk");
}

/// The fake ACK proxy on every flow: it acknowledges held data to the
/// guest, but not beyond what the client's window lets through.
#[test]
fn protected_subscriber_is_disconnected_at_its_output_limit_with_fake_ack_on_every_flow() {
    a_subscriber_that_never_reads_is_disconnected_at_its_output_limit("bpfack", "on");
}
