//! One private network per [`Topology`], built from network namespaces by
//! `scripts/netns.sh` (see the script for the picture): a client and two
//! VMM hosts h1 and h2 on one LAN, and a replication link between the
//! hosts. Each has its own name, so tests, benchmarks and the demo can run
//! at once. Needs root and iproute2.

use std::ffi::OsStr;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The client's address on the LAN.
pub const CLIENT_ADDR: &str = "10.0.0.1";
/// The guest's address and MAC, by convention, whichever host runs it.
pub const GUEST_ADDR: &str = "10.0.0.2";
pub const GUEST_MAC: &str = "52:54:00:12:34:56";
/// The hosts' addresses on the replication link.
pub const H1_REPL_ADDR: &str = "192.168.100.1";
pub const H2_REPL_ADDR: &str = "192.168.100.2";
/// Interface names inside every host namespace: the VMM's TAP and the
/// bridge joining it to the LAN.
pub const TAP: &str = "tap0";
pub const BRIDGE: &str = "br0";
/// Where a fleet topology's etcd serves: the lan namespace on the replication network.
pub const FLEET_ETCD_ADDR: &str = "192.168.100.254";
/// Roles of the namespaces of a topology (`NAME-ROLE`).
pub const ROLES: [&str; 4] = ["lan", "client", "h1", "h2"];

/// Whether network namespace `ns` exists (`ip netns add` made it).
pub fn netns_exists(ns: &str) -> bool {
    std::path::Path::new("/run/netns").join(ns).exists()
}

/// The `n`-th topology name of process `pid` for `tag`: the first 4
/// alphanumerics of `tag` and 4 hex digits. The digits mix the pid
/// (hashed, so neighbouring pids land far apart) with the counter, so
/// names differ between the processes and the threads of a run.
pub fn topology_name(tag: &str, pid: u32, n: u32) -> String {
    let prefix = crate::name_prefix(tag, 4, |c| c.is_ascii_alphanumeric(), "t");
    let digits = (pid.wrapping_mul(0x9e37_79b1) >> 16).wrapping_add(n) & 0xffff;
    format!("{prefix}{digits:04x}")
}

/// One topology: `scripts/netns.sh up NAME` on creation, `down NAME` on
/// drop, also when a test panics. `down` SIGKILLs whatever still runs in
/// its namespaces, so a leaked VMM does not outlive it.
pub struct Topology {
    name: String,
    script: PathBuf,
}

fn failed(what: String, out: &std::process::Output) -> io::Error {
    io::Error::other(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
}

impl Topology {
    /// Build a topology with a fresh name for `tag` ([`topology_name`]; a
    /// name whose namespaces exist, left by another run, is skipped).
    pub fn new(tag: &str) -> io::Result<Topology> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let script = crate::repo_root()?.join("scripts/netns.sh");
        let name = loop {
            let name = topology_name(tag, std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
            if ROLES.iter().all(|r| !netns_exists(&format!("{name}-{r}"))) {
                break name;
            }
        };
        // Owned before `up`, so that drop cleans up a half-built one.
        let topo = Topology { name, script };
        topo.up()?;
        Ok(topo)
    }

    /// A fleet's topology with `hosts` hosts h1..hN (`scripts/netns.sh
    /// up-fleet`): VM TAPs are the agents' to make, and the replication
    /// network is a bridge that the lan namespace is on too, at
    /// [`FLEET_ETCD_ADDR`].
    pub fn fleet(tag: &str, hosts: u32) -> io::Result<Topology> {
        static NEXT: AtomicU32 = AtomicU32::new(0x8000);
        let script = crate::repo_root()?.join("scripts/netns.sh");
        let name = loop {
            let name = topology_name(tag, std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
            if !netns_exists(&format!("{name}-lan")) {
                break name;
            }
        };
        let topo = Topology { name, script };
        topo.up_fleet(hosts)?;
        Ok(topo)
    }

    /// Build what is missing of a fleet's topology of `hosts` hosts
    /// (idempotent): the links [`Topology::cut_host`] deleted come back.
    pub fn up_fleet(&self, hosts: u32) -> io::Result<()> {
        let out = Command::new(&self.script).args(["up-fleet", &self.name, &hosts.to_string()]).output()?;
        if !out.status.success() {
            return Err(failed(format!("scripts/netns.sh up-fleet {} {hosts}", self.name), &out));
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace of `role` (one of [`ROLES`]).
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.name)
    }

    /// A command running `program` in the namespace of `role` (through
    /// `ip netns exec`, which execs it: its pid is the program's).
    pub fn command(&self, role: &str, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.arg("netns").arg("exec").arg(self.ns(role)).arg(program);
        cmd
    }

    fn script(&self, verb: &str) -> io::Result<()> {
        let out = Command::new(&self.script).arg(verb).arg(&self.name).output()?;
        if !out.status.success() {
            return Err(failed(format!("scripts/netns.sh {verb} {}", self.name), &out));
        }
        Ok(())
    }

    /// Build what is missing (idempotent).
    pub fn up(&self) -> io::Result<()> {
        self.script("up")
    }

    /// Build it again from scratch.
    pub fn reset(&self) -> io::Result<()> {
        self.script("down")?;
        self.script("up")
    }

    /// Recreate the links a host death deleted and wait until every bridge
    /// port forwards: a new port forwards only once the kernel has seen its
    /// carrier (linkwatch, up to a second later), and until then frames to
    /// it are silently dropped. (Linkwatch waits for the kernel's rtnl lock:
    /// under two busy loops and other tests' namespace teardowns a port
    /// was still without carrier after 5 s.)
    pub fn restore(&self) -> io::Result<()> {
        self.up()?;
        let deadline = Instant::now() + Duration::from_secs(20);
        for (role, dev) in [("lan", "client"), ("lan", "h1"), ("lan", "h2"), ("h1", "uplink"), ("h2", "uplink")] {
            loop {
                let out = Command::new("bridge").args(["-n", &self.ns(role), "link", "show", "dev", dev]).output()?;
                let state = String::from_utf8_lossy(&out.stdout);
                if state.contains("state forwarding") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(io::Error::other(format!("bridge port {dev} in {} does not forward: {state}", self.ns(role))));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Cut host `role` off the LAN and the replication link, as if it died
    /// (`ip link del`; [`Topology::restore`] brings the links back).
    pub fn cut_host(&self, role: &str) -> io::Result<()> {
        for link in ["uplink", "repl"] {
            let out = Command::new("ip").args(["-n", &self.ns(role), "link", "del", link]).output()?;
            if !out.status.success() {
                return Err(failed(format!("ip link del {link} in {}", self.ns(role)), &out));
            }
        }
        Ok(())
    }

    /// Make the client forget where the guest was. Done once a new guest
    /// runs: connections from before still retransmit, and an ARP request
    /// they send while no guest answers holds the client's next connection
    /// for a whole ARP retry (1 s).
    pub fn forget_guest(&self) -> io::Result<()> {
        let out = Command::new("ip").args(["-n", &self.ns("client"), "neigh", "flush", "all"]).output()?;
        if !out.status.success() {
            return Err(failed(format!("ip neigh flush in {}", self.ns("client")), &out));
        }
        Ok(())
    }

    /// Whether `addr` answers ping from the client within `timeout`.
    pub fn wait_for_ping(&self, addr: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = self
                .command("client", "ping")
                .args(["-n", "-q", "-c", "1", "-W", "1", addr])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis-cli -e` in the client namespace against `addr`:6379 with
    /// `args`: (success, stdout). Not a success: connection failures, error
    /// replies (their text goes to stderr) and no answer within 10 s (a
    /// stalled guest must not hang the caller).
    pub fn redis_cli(&self, addr: &str, args: &[&str]) -> (bool, String) {
        let out = self
            .command("client", "timeout")
            .args(["10", "redis-cli", "-e", "-h", addr, "-p", "6379"])
            .args(args)
            .stdin(Stdio::null())
            .output();
        match out {
            Ok(out) => (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned()),
            Err(e) => (false, format!("(cannot run timeout/redis-cli: {e}; scripts/setup.sh installs redis-tools)")),
        }
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Never panic here: a panic while unwinding aborts a test binary.
        if let Err(e) = self.script("down") {
            // Nor on a closed stderr (eprintln! would).
            let _ = writeln!(io::stderr(), "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_netns_sh_and_differ() {
        let valid = |n: &str| {
            (1..=16).contains(&n.len())
                && n.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        let a = topology_name("net-full", 1234, 0);
        assert!(a.starts_with("netf") && a.len() == 8 && valid(&a), "{a}");
        assert!(valid(&topology_name("", 1, 0)) && topology_name("", 1, 0).starts_with('t'));
        assert!(valid(&topology_name("???", 1, 0)));
        // Threads of one process, and neighbouring processes, get other names.
        let mut seen = std::collections::HashSet::new();
        for pid in 1000..1016 {
            for n in 0..16 {
                assert!(seen.insert(topology_name("ping", pid, n)), "pid {pid}, n {n} repeats a name");
            }
        }
    }
}
