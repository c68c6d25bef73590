//! A private etcd (Debian `etcd-server`, installed by scripts/setup.sh) on
//! free ports, for tests and the demo's arbiter; killed on drop. It runs in
//! this process's network namespace on loopback ([`Etcd::start`]), or in
//! another namespace on addresses of that namespace ([`Etcd::start_in`]).

use std::io;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::Process;
use crate::{netns, ports};

pub struct Etcd {
    process: Process,
    /// The namespace it runs in (`None`: this process's).
    netns: Option<String>,
    port: u16,
    endpoint: String,
}

/// `f` in namespace `ns`, or here.
fn within<T: Send + 'static>(ns: Option<&str>, f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    match ns {
        Some(ns) => netns::run_in(ns, f),
        None => Ok(f()),
    }
}

impl Etcd {
    /// Start etcd on loopback with its data in `dir` and wait until it answers.
    pub fn start(dir: &Path) -> io::Result<Etcd> {
        Etcd::launch(dir, None, &["127.0.0.1"])
    }

    /// Start etcd inside network namespace `ns` (through `ip netns exec`),
    /// serving clients on one port at each of `hosts` (addresses of that
    /// namespace; loopback is the one that no link can take away), with its
    /// data in `dir`, and wait until it answers. [`Etcd::endpoint`] is on
    /// the first host, [`Etcd::endpoint_on`] names the others.
    pub fn start_in(dir: &Path, ns: &str, hosts: &[&str]) -> io::Result<Etcd> {
        Etcd::launch(dir, Some(ns), hosts)
    }

    fn launch(dir: &Path, ns: Option<&str>, hosts: &[&str]) -> io::Result<Etcd> {
        let first = *hosts.first().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "etcd: no address to serve on"))?;
        // Ports free in the namespace etcd runs in (peers on loopback: one member).
        let (client, peer) = within(ns, || -> io::Result<(u16, u16)> { Ok((ports::free_port()?, ports::free_port()?)) })??;
        let clients = hosts.iter().map(|h| format!("http://{h}:{client}")).collect::<Vec<_>>().join(",");
        let endpoint = format!("http://{first}:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        cmd.args(["--name", "arbiter", "--data-dir"])
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &clients, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("arbiter={peer_url}")])
            .stdin(Stdio::null());
        let process = Process::spawn_logged("etcd", &mut cmd, dir, "etcd")
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start etcd ({e}); scripts/setup.sh installs etcd-server")))?;
        let mut etcd = Etcd { process, netns: ns.map(str::to_owned), port: client, endpoint };
        etcd.wait_ready(Duration::from_secs(20))?;
        Ok(etcd)
    }

    /// `http://HOST:PORT` on the first address it serves, for `--arbiter`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// `http://HOST:PORT` on another address it serves.
    pub fn endpoint_on(&self, host: &str) -> String {
        format!("http://{host}:{}", self.port)
    }

    /// The client port it serves on, at every address.
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn process(&mut self) -> &mut Process {
        &mut self.process
    }

    fn wait_ready(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        let addr = self.endpoint.trim_start_matches("http://").to_string();
        loop {
            let a = addr.clone();
            let healthy = within(self.netns.as_deref(), move || {
                use std::io::{Read, Write};
                let Ok(mut s) = std::net::TcpStream::connect(&a) else { return false };
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let req = format!("GET /health HTTP/1.0\r\nHost: {a}\r\n\r\n");
                let mut reply = String::new();
                s.write_all(req.as_bytes()).is_ok() && s.read_to_string(&mut reply).is_ok() && reply.contains("\"health\":\"true\"")
            })?;
            if healthy {
                return Ok(());
            }
            if !self.process.running() {
                return Err(io::Error::other(format!("etcd exited:\n{}", self.process.output())));
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "etcd did not become healthy"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
