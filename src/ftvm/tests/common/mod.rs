//! Helpers for end-to-end tests that run the real `ftvm` binary on real KVM
//! (processes, scratch directories, topologies and the Redis client come
//! from `ftvm-testkit`).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use ftvm_testkit::process::{Process, WaitError};
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC};
use ftvm_workloads::memtouch::{self, Config, Writer};

/// A guest image built by `scripts/build-images.sh`. Missing images are a
/// test failure, not a skip: the README's test command builds them.
pub fn image(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join("target/images").join(format!("{name}.elf"));
    assert!(path.exists(), "guest image {} missing: run scripts/build-images.sh", path.display());
    path
}

/// The port the kv guest and redis-server serve on.
pub const KV_PORT: u16 = 6379;

/// The guest's kv service in the test topology.
pub fn guest_kv() -> SocketAddr {
    SocketAddr::new(GUEST_ADDR.parse().unwrap(), KV_PORT)
}

/// `--net` for TAP `tap` with the topology's guest MAC.
pub fn net_on(tap: &str) -> String {
    format!("tap={tap},mac={GUEST_MAC}")
}

/// A scratch directory named after the test file and the test, kept if
/// the test panics.
pub fn scratch_for(file: &str, tag: &str) -> Scratch {
    Scratch::new(&format!("{file}-{tag}")).unwrap().keep_on_panic()
}

/// `cmd` with its stdout and stderr in `dir` (`LOG.out`, `LOG.err`),
/// killed when dropped.
pub fn spawn_logged(mut cmd: Command, what: &str, dir: &Scratch, log: &str) -> Process {
    Process::spawn_logged(what, &mut cmd, dir.path(), log).unwrap_or_else(|e| panic!("{e}"))
}

pub fn ftvm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ftvm"))
}

pub fn run_image(name: &str, args: &[&str]) -> Output {
    let mut cmd = ftvm();
    cmd.arg("run").arg("--image").arg(image(name)).args(args);
    cmd.output().expect("ftvm runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The value of `key=` on the line starting with `prefix`.
pub fn field(output: &str, prefix: &str, key: &str) -> Option<String> {
    output
        .lines()
        .filter(|l| l.starts_with(prefix))
        .find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')).map(str::to_owned)))
}

/// The checksum memtouch prints for `cmdline` when every writer does
/// `config.writes` writes, recomputed on the host.
pub fn expected_memtouch_checksum(cmdline: &str, writers: u32) -> String {
    let config = Config::parse(cmdline).expect("valid memtouch cmdline");
    assert!(config.writes > 0, "only write-bounded runs are deterministic");
    let mut ws = vec![0u64; (config.ws_pages * 512) as usize];
    for w in 0..writers {
        let mut writer = Writer::new(&config, w, writers);
        // SAFETY: `ws` is the whole working set; writers run one at a time.
        unsafe { writer.run(ws.as_mut_ptr(), config.writes, |_| {}) };
    }
    // SAFETY: viewing initialized u64s as bytes.
    let bytes = unsafe { std::slice::from_raw_parts(ws.as_ptr() as *const u8, ws.len() * 8) };
    format!("{:016x}", memtouch::checksum(bytes))
}

/// A free loopback port for a backup to listen on.
pub fn free_addr() -> String {
    format!("127.0.0.1:{}", ftvm_testkit::ports::free_port().unwrap())
}

/// `p`, a server started to listen on `addr`, once it listens (or has
/// ended, or 10 s passed: the test's own checks then say what went wrong).
/// A primary started next connects at once instead of retrying while its
/// guest runs unprotected (on a loaded host, maybe through all its work).
pub fn listening(mut p: Process, addr: &str) -> Process {
    let port: u16 = addr.rsplit_once(':').and_then(|(_, port)| port.parse().ok()).expect("HOST:PORT");
    let _ = p.wait_until(Duration::from_secs(10), |_| ftvm_testkit::ports::listening(port));
    p
}

/// `read()` again every 50 ms until `done` holds for what it read or
/// `timeout` passed: the last reading, which the caller's assertion then
/// judges (and shows). For what another process updates on its own time
/// (its metrics file, its view of a store).
pub fn poll_until<T>(timeout: Duration, mut read: impl FnMut() -> T, done: impl Fn(&T) -> bool) -> T {
    let t0 = Instant::now();
    let mut value = read();
    while !done(&value) && t0.elapsed() < timeout {
        std::thread::sleep(Duration::from_millis(50));
        value = read();
    }
    value
}

/// Wait until `p`'s output contains `text`; panics with the output (naming
/// `what`) if it exits first or `timeout` passes.
pub fn wait_for(p: &mut Process, what: &str, text: &str, timeout: Duration) {
    if let Err(e) = p.wait_until(timeout, |p| p.output().contains(text)) {
        panic!("{what}: no {text:?} ({e}):\n{}", p.output());
    }
}

/// Wait for `p` to exit by itself within `timeout`.
pub fn exit_status(p: &mut Process, timeout: Duration) -> ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(status) = p.try_wait() {
            // Let the output readers catch up with its last lines.
            let _ = p.wait_until(Duration::from_secs(2), |_| false);
            return status;
        }
        assert!(t0.elapsed() < timeout, "still running after {timeout:?}:\n{}", p.output());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// redis-cli against the guest (GUEST_ADDR:6379) from the client namespace
/// (not `-e`: error replies are printed on stdout like any other). Panics if
/// it cannot run or talk to the server; returns its stdout.
pub fn redis_cli(topo: &Topology, args: &[&str]) -> String {
    let out = topo
        .command("client", "timeout")
        .args(["10", "redis-cli", "-h", GUEST_ADDR, "-p", "6379"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli runs (scripts/setup.sh installs redis-tools)");
    let text = stdout(&out);
    assert!(out.status.success() && !text.contains("Could not connect"), "redis-cli {args:?}: {}{text}{}", out.status, stderr(&out));
    text
}

pub fn status(socket: &Path) -> String {
    let out = ftvm().args(["status", "--api-socket"]).arg(socket).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Wait until `ftvm status` shows `want`, failing early if `vmm` dies.
pub fn wait_status(socket: &Path, want: &str, vmm: &mut Process, timeout: Duration) -> String {
    let t0 = Instant::now();
    loop {
        let s = status(socket);
        if s.contains(want) {
            return s;
        }
        assert!(vmm.running(), "{} exited while waiting for '{want}': {}", vmm.name(), vmm.stderr());
        assert!(t0.elapsed() < timeout, "no '{want}' after {timeout:?}: {s}\n{}", vmm.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn wait_log(vmm: &mut Process, want: &str, timeout: Duration) -> String {
    match vmm.wait_until(timeout, |p| p.stderr().contains(want)) {
        Ok(()) => vmm.stderr(),
        Err(WaitError::Exited(_)) => panic!("{} exited without '{want}': {}", vmm.name(), vmm.stderr()),
        Err(WaitError::TimedOut(_)) => panic!("no '{want}' from {} after {timeout:?}: {}", vmm.name(), vmm.stderr()),
    }
}

/// Every SET in the kv guest's append-only log at the start of `disk`,
/// the last value of each key.
pub fn logged_sets(disk: &Path) -> std::collections::HashMap<String, Vec<u8>> {
    use ftvm_testkit::resp::{self, Reply};
    let bytes = std::fs::read(disk).unwrap();
    let mut sets = std::collections::HashMap::new();
    for (payload, _) in ftvm_kv::aof::records(&bytes) {
        let mut r = payload;
        if let Ok(Reply::Array(Some(args))) = resp::read_reply(&mut r) {
            if let [Reply::Bulk(Some(cmd)), Reply::Bulk(Some(k)), Reply::Bulk(Some(v)), ..] = &args[..] {
                if cmd.eq_ignore_ascii_case(b"SET") {
                    sets.insert(String::from_utf8_lossy(k).into_owned(), v.clone());
                }
            }
        }
    }
    sets
}

/// The JSON lines of a metrics file. A last line without its newline is
/// left out: a VMM killed in the middle of writing it (a write to a file
/// can stop between two pages when the process is killed) leaves it cut
/// short. Every complete line must parse.
pub fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", path.display()))).collect()
}

/// `--insecure` unless `args` give the replication channel a secret
/// (`--secret-file`): the tests' replication links are loopback or their
/// own namespaces', which nobody else reaches.
pub fn insecure_unless_secret(args: &[&str]) -> &'static [&'static str] {
    if args.iter().any(|a| a.starts_with("--secret-file")) {
        &[]
    } else {
        &["--insecure"]
    }
}

/// A table of cases of one scenario: one `#[test]` per line, named and
/// documented there, each calling `$run` with its own arguments, so every
/// case still passes, fails and is filtered by its own name.
#[allow(unused_macros)]
macro_rules! cases {
    ($run:ident { $($(#[$meta:meta])* $name:ident($($arg:expr),* $(,)?);)* }) => {
        $(
            $(#[$meta])*
            #[test]
            fn $name() {
                $run($($arg),*);
            }
        )*
    };
}
#[allow(unused_imports)]
pub(crate) use cases;
