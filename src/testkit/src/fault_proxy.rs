//! A fault proxy on the replication link of a [`Topology`]: the link's two
//! ends become TAP devices (`repl` in h1 and in h2, same addresses as the
//! veth pair they replace) whose frames this process forwards, one thread
//! per direction, delaying, holding, dropping or cutting them as the test
//! says, each direction on its own.
//!
//! Why frames and not a TCP proxy: the VMMs keep their real path. Their TCP
//! stream runs end to end between the two hosts' kernels (retransmission,
//! timers and windows as on a real link), every UDP datagram (heartbeats,
//! mirrored frames, to ports chosen at the handshake) and the arbiter's
//! traffic cross it with their own addresses, and nothing in ftvm knows it
//! is being tested. A TCP proxy would terminate the stream, show the backup
//! the proxy's address (where it would send its heartbeats) and need to
//! parse Hello and Welcome for the UDP ports, impossible with `--encrypt`.
//! Kernel tools cannot do it here: this host has no `netem` qdisc (no
//! delay, no hold; PLATFORM.md), and iptables can drop but not hold.
//!
//! The TAPs use the virtio-net header with checksum and segmentation
//! offloads, so a checkpoint crosses as 64 KiB segments, not 1500-byte
//! frames (a frame is forwarded with its header, unchanged). They vanish
//! when the proxy is dropped; [`Topology::up`] builds the veth pair again.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns;
use crate::topology::{Topology, H1_REPL_ADDR, H2_REPL_ADDR};

/// The interface name of the replication link in both hosts.
const LINK: &str = "repl";
/// virtio_net_hdr, as the TAPs are opened (the kernel's default size).
const VNET_HDR: usize = 10;
/// Largest frame a TAP with segmentation offload hands out, with its header.
const MAX_FRAME: usize = VNET_HDR + 65_536 + 14;
/// How long a direction sleeps at most between looks at its fault.
const IDLE: Duration = Duration::from_millis(20);

/// A direction of the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    H1ToH2 = 0,
    H2ToH1 = 1,
}

/// What happens to the frames of one direction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// Forwarded as they come (the default).
    None,
    /// Forwarded this long after they came, in order.
    Delay(Duration),
    /// Kept, in order, until the fault changes (a stalled link): then
    /// forwarded as the new fault says (all at once for `None`, dropped for
    /// `Cut`).
    Hold,
    /// Each dropped with this probability (0 to 1), the rest forwarded.
    Loss(f64),
    /// Every frame dropped, including any held (a cut link).
    Cut,
}

/// What one direction did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub forwarded: u64,
    pub dropped: u64,
    /// Forwarded under the spare rule ([`FaultProxy::spare_tcp_port`]).
    pub spared: u64,
    /// Kept on arrival, held or delayed (then forwarded or dropped).
    pub queued: u64,
}

#[derive(Default)]
struct Direction {
    forwarded: AtomicU64,
    dropped: AtomicU64,
    spared: AtomicU64,
    queued: AtomicU64,
}

struct Shared {
    faults: Mutex<[Fault; 2]>,
    /// TCP port whose segments (and ARP) are never faulted (0: none).
    spare: AtomicU64,
    stop: AtomicBool,
    ways: [Direction; 2],
    /// Written to wake both directions when a fault changes.
    wake: [OwnedFd; 2],
}

/// The proxy; dropping it stops forwarding and removes its TAPs.
pub struct FaultProxy {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

fn failed(what: &str, out: &std::process::Output) -> io::Error {
    io::Error::other(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
}

fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if !out.status.success() {
        return Err(failed(&format!("ip {}", args.join(" ")), &out));
    }
    Ok(())
}

/// `struct ifreq` with the name and the flags, as TUNSETIFF takes it.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Open TAP `name` in the calling thread's namespace (created if absent,
/// gone with the last descriptor), non-blocking, with the virtio-net header
/// and checksum and TCP segmentation offloads.
fn open_tap(name: &str) -> io::Result<File> {
    let file = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC).open("/dev/net/tun")?;
    let mut req =
        IfReq { name: [0; libc::IFNAMSIZ], flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short, _pad: [0; 22] };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid out as.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let offloads = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6;
    // SAFETY: TUNSETOFFLOAD takes its flags by value.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETOFFLOAD, offloads as libc::c_ulong) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain eventfd(2); the fd is owned right away.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is fresh and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl FaultProxy {
    /// Put a proxy in the replication link of `topo`: its veth pair is
    /// replaced by a TAP in each host with the same address, joined by this
    /// proxy, which forwards everything until told otherwise ([`FaultProxy::set`]).
    pub fn insert(topo: &Topology) -> io::Result<FaultProxy> {
        let (h1, h2) = (topo.ns("h1"), topo.ns("h2"));
        // Deleting one end of a veth pair deletes both.
        if Command::new("ip").args(["-n", &h1, "link", "show", "dev", LINK]).output()?.status.success() {
            ip(&["-n", &h1, "link", "del", LINK])?;
        }
        let _ = Command::new("ip").args(["-n", &h2, "link", "del", LINK]).output();
        let tap1 = netns::run_in(&h1, || open_tap(LINK))??;
        let tap2 = netns::run_in(&h2, || open_tap(LINK))??;
        for (ns, addr) in [(&h1, H1_REPL_ADDR), (&h2, H2_REPL_ADDR)] {
            ip(&["-n", ns, "addr", "replace", &format!("{addr}/24"), "dev", LINK])?;
            ip(&["-n", ns, "link", "set", LINK, "up"])?;
        }
        let shared = Arc::new(Shared {
            faults: Mutex::new([Fault::None; 2]),
            spare: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            ways: Default::default(),
            wake: [eventfd()?, eventfd()?],
        });
        let mut threads = Vec::new();
        for (way, from, to) in [(Way::H1ToH2, tap1.try_clone()?, tap2.try_clone()?), (Way::H2ToH1, tap2, tap1)] {
            let shared = shared.clone();
            let name = format!("proxy-{way:?}");
            threads.push(std::thread::Builder::new().name(name).spawn(move || forward(&shared, way, from, to))?);
        }
        Ok(FaultProxy { shared, threads })
    }

    /// From now on, treat the frames going `way` as `fault` says.
    pub fn set(&self, way: Way, fault: Fault) {
        self.shared.faults.lock().unwrap_or_else(|p| p.into_inner())[way as usize] = fault;
        for fd in &self.shared.wake {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }

    /// Both directions at once.
    pub fn set_both(&self, fault: Fault) {
        self.set(Way::H1ToH2, fault);
        self.set(Way::H2ToH1, fault);
    }

    /// Never fault TCP segments from or to `port`, nor ARP: a service that
    /// both hosts reach over another path in real life (the arbiter, say).
    pub fn spare_tcp_port(&self, port: u16) {
        self.shared.spare.store(port as u64, Ordering::SeqCst);
    }

    pub fn counts(&self, way: Way) -> Counts {
        let d = &self.shared.ways[way as usize];
        Counts {
            forwarded: d.forwarded.load(Ordering::SeqCst),
            dropped: d.dropped.load(Ordering::SeqCst),
            spared: d.spared.load(Ordering::SeqCst),
            queued: d.queued.load(Ordering::SeqCst),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.set_both(Fault::Cut);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Whether `frame` (virtio-net header first) is ARP, or TCP from or to `port`.
fn spared(frame: &[u8], port: u16) -> bool {
    let Some(eth) = frame.get(VNET_HDR..) else { return false };
    match eth.get(12..14) {
        Some([0x08, 0x06]) => true,
        Some([0x08, 0x00]) => {
            let ip = &eth[14..];
            let Some(&first) = ip.first() else { return false };
            let ihl = (first & 0x0f) as usize * 4;
            if ip.get(9) != Some(&6) {
                return false;
            }
            let Some(tcp) = ip.get(ihl..ihl + 4) else { return false };
            u16::from_be_bytes([tcp[0], tcp[1]]) == port || u16::from_be_bytes([tcp[2], tcp[3]]) == port
        }
        _ => false,
    }
}

/// Deterministic loss decisions (xorshift64).
struct Rng(u64);

impl Rng {
    fn chance(&mut self, p: f64) -> bool {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// One direction: frames read from `from` go to `to` as the fault says.
fn forward(shared: &Shared, way: Way, mut from: File, mut to: File) {
    let stats = &shared.ways[way as usize];
    let wake = &shared.wake[way as usize];
    let mut queue: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ way as u64);
    let mut buf = vec![0u8; MAX_FRAME];
    let send = |to: &mut File, frame: &[u8]| {
        // A full or vanished device drops the frame, as a link would.
        if to.write(frame).is_ok() {
            stats.forwarded.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    };
    while !shared.stop.load(Ordering::SeqCst) {
        let fault = shared.faults.lock().unwrap_or_else(|p| p.into_inner())[way as usize];
        // What is queued goes out, or waits, as the fault now says.
        let now = Instant::now();
        match fault {
            Fault::None | Fault::Loss(_) => queue.drain(..).for_each(|(_, f)| send(&mut to, &f)),
            Fault::Delay(d) => {
                while queue.front().is_some_and(|(at, _)| *at + d <= now) {
                    let (_, f) = queue.pop_front().expect("non-empty");
                    send(&mut to, &f);
                }
            }
            Fault::Hold => {}
            Fault::Cut => {
                stats.dropped.fetch_add(queue.len() as u64, Ordering::Relaxed);
                queue.clear();
            }
        }
        let timeout = match (fault, queue.front()) {
            (Fault::Delay(d), Some((at, _))) => (*at + d).saturating_duration_since(now).max(Duration::from_micros(100)),
            _ => IDLE,
        };
        let mut fds = [
            libc::pollfd { fd: from.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
        // SAFETY: two valid pollfds, a valid timespec, no signal mask.
        let n = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if n < 0 {
            continue; // EINTR
        }
        if fds[1].revents != 0 {
            let mut v = [0u8; 8];
            // SAFETY: reads 8 bytes into a live buffer from an eventfd we own.
            unsafe { libc::read(wake.as_raw_fd(), v.as_mut_ptr().cast(), v.len()) };
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            // The device was deleted (a test cut the host off): nothing more comes.
            return;
        }
        if fds[0].revents & libc::POLLIN == 0 {
            continue;
        }
        let spare = shared.spare.load(Ordering::SeqCst) as u16;
        loop {
            let len = match from.read(&mut buf) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return,
            };
            let frame = &buf[..len];
            if spare != 0 && spared(frame, spare) {
                if to.write(frame).is_ok() {
                    stats.spared.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            let fault = shared.faults.lock().unwrap_or_else(|p| p.into_inner())[way as usize];
            match fault {
                Fault::Cut => {
                    stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Fault::Loss(p) if rng.chance(p) => {
                    stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Fault::None | Fault::Loss(_) if queue.is_empty() => send(&mut to, frame),
                _ => {
                    queue.push_back((Instant::now(), frame.to_vec()));
                    stats.queued.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp_frame(sport: u16, dport: u16) -> Vec<u8> {
        let mut f = vec![0u8; VNET_HDR];
        f.extend_from_slice(&[0; 12]);
        f.extend_from_slice(&[0x08, 0x00]);
        let mut ip = vec![0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        ip.extend_from_slice(&sport.to_be_bytes());
        ip.extend_from_slice(&dport.to_be_bytes());
        ip.extend_from_slice(&[0; 16]);
        f.extend_from_slice(&ip);
        f
    }

    #[test]
    fn the_spare_rule_picks_arp_and_one_tcp_port() {
        assert!(spared(&tcp_frame(2379, 40000), 2379));
        assert!(spared(&tcp_frame(40000, 2379), 2379));
        assert!(!spared(&tcp_frame(7000, 40000), 2379));
        let mut arp = vec![0u8; VNET_HDR + 12];
        arp.extend_from_slice(&[0x08, 0x06]);
        arp.extend_from_slice(&[0; 28]);
        assert!(spared(&arp, 2379));
        let mut udp = tcp_frame(2379, 2379);
        udp[VNET_HDR + 14 + 9] = 17;
        assert!(!spared(&udp, 2379), "UDP is never spared");
        assert!(!spared(&[0; 4], 2379));
    }

    #[test]
    fn loss_follows_its_probability() {
        let mut rng = Rng(12345);
        let lost = (0..10_000).filter(|_| rng.chance(0.3)).count();
        assert!((2700..3300).contains(&lost), "{lost}");
        assert_eq!((0..1000).filter(|_| rng.chance(0.0)).count(), 0);
    }
}
