//! The benchmark's own network topology (scripts/netns.sh) and a Redis
//! client that runs inside the client namespace.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// A binary next to this one (target/release/NAME).
pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent().expect("in a directory").join(name)
}

/// target/images, two levels above the binaries.
pub fn images() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent().and_then(|p| p.parent()).expect("inside target/").join("images")
}

fn netns_script() -> PathBuf {
    images().join("../../scripts/netns.sh")
}

pub struct Topology {
    name: String,
}

impl Topology {
    pub fn up(tag: &str) -> Result<Topology, Box<dyn std::error::Error>> {
        let t = Topology { name: format!("{tag}{}", std::process::id() % 10000) };
        t.script("up")?;
        Ok(t)
    }

    fn script(&self, verb: &str) -> Result<(), Box<dyn std::error::Error>> {
        let out = Command::new(netns_script()).args([verb, &self.name]).output()?;
        if !out.status.success() {
            return Err(format!("netns.sh {verb} {} failed: {}", self.name, String::from_utf8_lossy(&out.stderr)).into());
        }
        Ok(())
    }

    /// Rebuild the topology (after a host was cut off).
    pub fn reset(&mut self) -> Result<(), Box<dyn std::error::Error>> {
        self.script("down")?;
        self.script("up")
    }

    pub fn command(&self, role: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &format!("{}-{role}", self.name)]).arg(program);
        c
    }

    /// Cut a host off the LAN and the replication link, as if it died.
    pub fn cut_host(&self, role: &str) {
        for link in ["uplink", "repl"] {
            let _ = Command::new("ip").args(["-n", &format!("{}-{role}", self.name), "link", "del", link]).status();
        }
    }

    /// Run `f` on a thread that lives in the client namespace.
    fn in_client<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let path = format!("/var/run/netns/{}-client", self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(path).ok()?;
            // SAFETY: setns on a namespace fd we opened; it changes only
            // this thread's network namespace.
            if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0 {
                return None;
            }
            Some(f())
        })
        .join()
        .ok()
        .flatten()
    }

    fn request(&self, args: Vec<String>) -> Option<Vec<u8>> {
        self.in_client(move || {
            let addr = "10.0.0.2:6379".parse().expect("valid address");
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(100)).ok()?;
            s.set_read_timeout(Some(Duration::from_millis(200))).ok()?;
            let mut req = format!("*{}\r\n", args.len());
            for a in &args {
                req += &format!("${}\r\n{a}\r\n", a.len());
            }
            s.write_all(req.as_bytes()).ok()?;
            let mut buf = [0u8; 512];
            let n = s.read(&mut buf).ok()?;
            Some(buf[..n].to_vec())
        })
        .flatten()
    }

    /// A one-word command got a `+` status reply.
    pub fn redis_ok(&self, command: &str) -> bool {
        let args = command.split_whitespace().map(str::to_owned).collect();
        self.request(args).is_some_and(|r| r.first() == Some(&b'+'))
    }

    pub fn redis_get_is(&self, key: &str, value: &str) -> bool {
        let want = format!("${}\r\n{value}\r\n", value.len());
        self.request(vec!["GET".into(), key.into()]).is_some_and(|r| r == want.as_bytes())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let _ = self.script("down");
    }
}
