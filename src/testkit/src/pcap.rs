//! Captures by tcpdump inside a namespace of a [`Topology`], and the frames
//! of a pcap file (Ethernet, micro- or nanosecond timestamps).

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::process::Process;
use crate::topology::Topology;

/// A tcpdump running in a namespace, writing a pcap file.
pub struct Tcpdump {
    process: Process,
    file: PathBuf,
}

impl Tcpdump {
    /// Capture in the namespace of `role` into `dir/name` with tcpdump's
    /// `args` (interface, direction, filter); returns once it listens.
    /// Timestamps are in nanoseconds of CLOCK_REALTIME.
    pub fn start(topo: &Topology, role: &str, dir: &Path, name: &str, args: &[&str]) -> io::Result<Tcpdump> {
        let file = dir.join(name);
        let mut cmd = topo.command(role, "tcpdump");
        cmd.args(["-U", "--immediate-mode", "-n", "-Z", "root", "--time-stamp-precision=nano", "-w"]).arg(&file).args(args);
        let mut process = Process::spawn_logged("tcpdump", &mut cmd, dir, name)?;
        let t0 = Instant::now();
        while !process.stderr().contains("listening on") {
            if !process.running() || t0.elapsed() > Duration::from_secs(10) {
                return Err(io::Error::other(format!("tcpdump does not listen: {}", process.stderr())));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Tcpdump { process, file })
    }

    /// Stop it cleanly (SIGTERM: it writes what it has) and read its frames.
    pub fn finish(mut self) -> io::Result<Vec<Frame>> {
        self.process.signal(libc::SIGTERM)?;
        let t0 = Instant::now();
        while self.process.running() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        read(&self.file)
    }

    pub fn file(&self) -> &Path {
        &self.file
    }
}

/// One captured frame.
#[derive(Clone, Debug)]
pub struct Frame {
    /// CLOCK_REALTIME, nanoseconds.
    pub ts_ns: u64,
    /// The captured bytes (as many as the snap length kept).
    pub data: Vec<u8>,
}

impl Frame {
    pub fn src_mac(&self) -> Option<[u8; 6]> {
        self.data.get(6..12).map(|m| m.try_into().expect("6 bytes"))
    }

    pub fn ethertype(&self) -> Option<u16> {
        self.data.get(12..14).map(|t| u16::from_be_bytes([t[0], t[1]]))
    }
}

/// The frames of the pcap file at `path`, in file order.
pub fn read(path: &Path) -> io::Result<Vec<Frame>> {
    let bytes = std::fs::read(path)?;
    if bytes.len() < 24 {
        return Ok(Vec::new()); // nothing captured yet
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let nano = match u32_at(0) {
        0xa1b2_c3d4 => false,
        0xa1b2_3c4d => true,
        m => return Err(io::Error::other(format!("{}: not a little-endian pcap file (magic {m:#x})", path.display()))),
    };
    if u32_at(20) != 1 {
        return Err(io::Error::other(format!("{}: not an Ethernet capture", path.display())));
    }
    let mut out = Vec::new();
    let mut at = 24;
    while at + 16 <= bytes.len() {
        let (sec, frac, incl) = (u32_at(at) as u64, u32_at(at + 4) as u64, u32_at(at + 8) as usize);
        let Some(data) = bytes.get(at + 16..at + 16 + incl) else { break };
        out.push(Frame { ts_ns: sec * 1_000_000_000 + if nano { frac } else { frac * 1000 }, data: data.to_vec() });
        at += 16 + incl;
    }
    Ok(out)
}

/// Now on CLOCK_REALTIME in nanoseconds, to compare with capture times.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_read_back_with_their_times() {
        let dir = std::env::temp_dir().join(format!("ftvm-pcap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.pcap");
        let mut b = Vec::new();
        for v in [0xa1b2_3c4du32, 0x0004_0002, 0, 0, 65535, 1] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for (sec, ns, frame) in [(1u32, 5u32, vec![0xffu8; 14]), (2, 7, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0x08, 0x06])] {
            for v in [sec, ns, frame.len() as u32, frame.len() as u32] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            b.extend_from_slice(&frame);
        }
        std::fs::write(&path, &b).unwrap();
        let frames = read(&path).unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].ts_ns, 1_000_000_005);
        assert_eq!(frames[1].ts_ns, 2_000_000_007);
        assert_eq!(frames[1].src_mac(), Some([7, 8, 9, 10, 11, 12]));
        assert_eq!(frames[1].ethertype(), Some(0x0806));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
