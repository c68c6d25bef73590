//! A private etcd (Debian `etcd-server`, installed by scripts/setup.sh) on
//! free loopback ports, for tests and the demo's arbiter; killed on drop.

use std::io;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::Process;

pub struct Etcd {
    process: Process,
    endpoint: String,
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Etcd {
    /// Start etcd with its data in `dir` and wait until it answers.
    pub fn start(dir: &Path) -> io::Result<Etcd> {
        let (client, peer) = (free_port()?, free_port()?);
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "arbiter", "--data-dir"])
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("arbiter={peer_url}")])
            .stdin(Stdio::null());
        let process = Process::spawn_logged("etcd", &mut cmd, dir, "etcd")
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start etcd ({e}); scripts/setup.sh installs etcd-server")))?;
        let mut etcd = Etcd { process, endpoint };
        etcd.wait_ready(Duration::from_secs(20))?;
        Ok(etcd)
    }

    /// `http://127.0.0.1:PORT`, for `--arbiter`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn process(&mut self) -> &mut Process {
        &mut self.process
    }

    fn wait_ready(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        let addr = self.endpoint.trim_start_matches("http://").to_string();
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let req = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
                let mut reply = String::new();
                if s.write_all(req.as_bytes()).is_ok() && s.read_to_string(&mut reply).is_ok() && reply.contains("\"health\":\"true\"") {
                    return Ok(());
                }
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
