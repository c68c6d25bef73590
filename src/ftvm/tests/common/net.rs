//! Network topologies for end-to-end tests: each `Topology` is one private
//! LAN (client, two VMM hosts, replication link) built by `scripts/netns.sh`
//! from network namespaces, so tests can run in parallel. Needs root.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The client's address on the LAN; the guest is 10.0.0.2 by convention.
pub const CLIENT_ADDR: &str = "10.0.0.1";
pub const GUEST_ADDR: &str = "10.0.0.2";
pub const GUEST_MAC: &str = "52:54:00:12:34:56";
/// The hosts' addresses on the replication link.
pub const H1_REPL_ADDR: &str = "192.168.100.1";
pub const H2_REPL_ADDR: &str = "192.168.100.2";
/// Interface names inside every host namespace.
pub const TAP: &str = "tap0";
pub const BRIDGE: &str = "br0";

/// Roles of the namespaces of a topology (`NAME-ROLE`).
pub const ROLES: [&str; 4] = ["lan", "client", "h1", "h2"];

/// One isolated topology (scripts/netns.sh up NAME on creation, down on
/// Drop, also if the test panics). `down` SIGKILLs whatever still runs inside
/// its namespaces, so a VMM leaked by a failing test does not outlive it.
pub struct Topology {
    pub name: String,
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/netns.sh")
}

pub fn netns_exists(ns: &str) -> bool {
    std::path::Path::new("/run/netns").join(ns).exists()
}

impl Topology {
    /// NAME is the first 4 alphanumerics of `tag` and 4 hex digits. The
    /// digits mix the pid (tests in other processes) with a counter (tests on
    /// other threads of this one); a name whose namespaces already exist, left
    /// by a concurrent test or a killed run, is skipped.
    pub fn new(tag: &str) -> Topology {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let prefix: String = tag.chars().filter(char::is_ascii_alphanumeric).take(4).collect();
        let prefix = if prefix.is_empty() { "t".to_owned() } else { prefix };
        let pid = std::process::id();
        let name = loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            // Hashing spreads neighbouring pids apart; adding the counter keeps
            // names distinct within this process.
            let digits = (pid.wrapping_mul(0x9e37_79b1) >> 16).wrapping_add(n) & 0xffff;
            let name = format!("{prefix}{digits:04x}");
            if ROLES.iter().all(|r| !netns_exists(&format!("{name}-{r}"))) {
                break name;
            }
        };
        // Owned before `up` so that Drop cleans a half-built topology.
        let topo = Topology { name };
        let out = Command::new(script()).arg("up").arg(&topo.name).output().expect("scripts/netns.sh runs");
        assert!(
            out.status.success(),
            "scripts/netns.sh up {} failed ({}): {}",
            topo.name,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        topo
    }

    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.name)
    }

    /// A Command that runs `program` inside netns NAME-role (via `ip netns exec`).
    pub fn command(&self, role: &str, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.arg("netns").arg("exec").arg(self.ns(role)).arg(program);
        cmd
    }

    /// Wait until `addr` answers ping from the client (timeout) -> bool.
    pub fn wait_for_ping(&self, addr: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = self
                .command("client", "ping")
                .args(["-n", "-q", "-c", "1", "-W", "1", addr])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Run redis-cli in the client namespace against addr:6379 with args,
    /// return (status, stdout). Status is false on connection failures and on
    /// error replies (`-e`; their text goes to stderr, not the returned
    /// string), and after 10 s without an answer, since a stalled guest would
    /// otherwise hang the test forever.
    pub fn redis_cli(&self, addr: &str, args: &[&str]) -> (bool, String) {
        let out = self
            .command("client", "timeout")
            .args(["10", "redis-cli", "-e", "-h", addr, "-p", "6379"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("timeout/redis-cli run (scripts/setup.sh installs redis-tools)");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Never panic here: a panic during unwinding aborts the test binary.
        match Command::new(script()).arg("down").arg(&self.name).output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!("scripts/netns.sh down {} failed ({}): {}", self.name, out.status, String::from_utf8_lossy(&out.stderr)),
            Err(e) => eprintln!("scripts/netns.sh down {}: {e}", self.name),
        }
    }
}
