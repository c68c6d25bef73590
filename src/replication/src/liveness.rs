//! Liveness: heartbeats both ways on their own path, and failure detection.
//!
//! Each side sends the other a heartbeat every `--heartbeat-ms` from
//! dedicated threads, as a UDP datagram between the two hosts (the backup
//! receives on its `--listen` address, the same port over UDP; the primary
//! on the address its stream leaves from), so no checkpoint, pre-copy or
//! stalled stream ever queues one behind it, and a lost datagram is
//! superseded by the next one instead of holding later ones back. The same
//! thread declares the peer lost when neither a heartbeat nor a byte of the
//! stream arrived for the failure timeout ([`Pulse`] records both).
//!
//! Datagram (little-endian), 32 bytes, 64 with a tag:
//!
//! ```text
//!  "FTVH" | version u16 | from u8 (1 primary, 2 backup) | flags u8 (bit 0: tagged) | session [16] | seq u64 | tag [32]
//! ```
//!
//! The session id is the primary's random half (in Hello) followed by the
//! backup's (in Welcome), so a heartbeat of an earlier session, of an old
//! primary, or of a stranger that never completed the handshake does not
//! count. `seq` counts the sender's heartbeats; only a newer one counts, so
//! a replayed datagram is worthless. With `--secret-file` the tag is
//! BLAKE3-keyed(K_hb_dir, the 32 bytes before it) with a key per direction
//! derived from the connection's authenticated handshake
//! (`pipeline::transport::auth`), and untagged or wrongly tagged datagrams
//! are refused: nobody without the secret keeps a dead primary alive.
//!
//! The threads run at real-time priority when the host allows it (ftvm runs
//! as root for KVM and TAP), so a busy host does not delay heartbeats; with
//! two CPUs a second sending thread on the other CPU covers a CPU that
//! stalls. The judging thread does not count time it was itself held up as
//! the peer's silence, and before it declares the peer lost it reads every
//! datagram already queued on its socket.

use ftvm_vmm::switch;
use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ftvm_vmm::seccomp;

use crate::protocol::PROTOCOL_VERSION;
use crate::role::Role;
use crate::sockopt;

/// Default of `--heartbeat-ms`.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(5);
/// Default of the backup's `--failure-timeout-ms`: six heartbeat intervals.
/// Heartbeats go on real-time threads of their own, apart from checkpoints
/// and pre-copy, and the judge does not count time it was itself held up,
/// so this holds on a host whose cores are saturated (the heartbeat soak,
/// README) while a cut host is found lost within tens of milliseconds.
pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_millis(30);

const MAGIC: &[u8; 4] = b"FTVH";
const FROM_PRIMARY: u8 = 1;
const FROM_BACKUP: u8 = 2;
const FLAG_TAGGED: u8 = 1;
/// Everything before the tag.
const BODY: usize = 4 + 2 + 1 + 1 + 16 + 8;
const TAG: usize = 32;
/// No heartbeat this long after the session began: say so (UDP blocked?).
const FIRST_WARNING: Duration = Duration::from_secs(1);
/// Until the peer's first heartbeat arrives, silence counts against at
/// least this, not the failure timeout: a session's start (the primary
/// setting up pre-copy, its heartbeat threads starting) may keep a live
/// peer quiet for tens of milliseconds on a loaded host, and a 30 ms
/// timeout then took a primary that had just connected for dead. A peer
/// whose heartbeats have begun is judged by the failure timeout alone.
const START_GRACE: Duration = Duration::from_secs(1);
/// SCHED_FIFO priority of heartbeat threads: above every normal thread.
const RT_PRIORITY: i32 = 10;
/// Shortest wait for a datagram (the socket timeout cannot be zero).
const MIN_WAIT: Duration = Duration::from_micros(100);

/// One side's half of a session id.
pub type SessionHalf = [u8; 8];
/// The primary's half, then the backup's.
pub type SessionId = [u8; 16];

/// A fresh random half of a session id.
pub fn session_half() -> io::Result<SessionHalf> {
    let mut half = [0u8; 8];
    getrandom::fill(&mut half).map_err(|e| io::Error::other(format!("no random numbers for a session id: {e}")))?;
    Ok(half)
}

pub fn session_id(primary: SessionHalf, backup: SessionHalf) -> SessionId {
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&primary);
    id[8..].copy_from_slice(&backup);
    id
}

/// Keys that tag heartbeats of one authenticated connection, as seen from
/// one end.
#[derive(Clone)]
pub struct Keys {
    pub send: [u8; 32],
    pub recv: [u8; 32],
}

/// When the peer was last heard from, by any path: a valid heartbeat, or
/// bytes of the stream; and when the newest valid heartbeat reached this
/// host's kernel.
#[derive(Debug)]
pub struct Pulse {
    base: Instant,
    /// Nanoseconds after `base`.
    last: AtomicU64,
    /// CLOCK_REALTIME nanoseconds at which the newest valid heartbeat
    /// arrived, as the kernel stamped it (0: none yet).
    arrived: AtomicU64,
}

impl Pulse {
    /// A pulse that counts its creation as the first sign of life.
    pub fn new() -> Arc<Pulse> {
        Arc::new(Pulse { base: Instant::now(), last: AtomicU64::new(0), arrived: AtomicU64::new(0) })
    }

    /// A valid heartbeat that the kernel received at `unix_ns` was read.
    fn heartbeat_arrived(&self, unix_ns: u64) {
        self.arrived.fetch_max(unix_ns, Ordering::Relaxed);
    }

    /// Whether the newest heartbeat reached this host less than `window`
    /// ago, by the kernel's arrival stamp (not when this process got to
    /// read it), or none has arrived yet (UDP blocked: nothing to judge
    /// by). A process that was stopped for a while finds on waking that its
    /// peer's heartbeats ended long ago, if they did, before anything it
    /// read meanwhile (an acknowledgement, say) makes it act.
    pub fn heard_within(&self, window: Duration) -> bool {
        let arrived = self.arrived.load(Ordering::Relaxed);
        arrived == 0 || unix_ns().saturating_sub(arrived) < window.as_nanos() as u64
    }

    /// The peer was heard from just now.
    pub fn beat(&self) {
        self.last.fetch_max(self.base.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// When the peer was last heard from (nanoseconds after the pulse began).
    fn last(&self) -> u64 {
        self.last.load(Ordering::Relaxed)
    }

    /// How long ago the peer was last heard from.
    pub fn silence(&self) -> Duration {
        self.base.elapsed().saturating_sub(Duration::from_nanos(self.last.load(Ordering::Relaxed)))
    }
}

/// What a side does with what its heartbeat thread finds. Both calls come
/// from that thread; after either declares the peer lost it stops.
pub trait Observer: Send + 'static {
    /// Checked at least every heartbeat interval: whether the peer is lost
    /// for a reason of this side's own (then recorded by the observer).
    fn lost_otherwise(&mut self) -> bool {
        false
    }

    /// Nothing was heard from the peer for `silence` (at least `timeout`):
    /// it is lost.
    fn silent(&mut self, silence: Duration, timeout: Duration);
}

/// The heartbeat path of one session.
pub struct Path {
    /// This side's socket.
    pub socket: UdpSocket,
    /// Where the peer receives heartbeats.
    pub peer: SocketAddr,
    pub session: SessionId,
    /// This side.
    pub role: Role,
    /// With an authenticated channel: tag heartbeats, and accept only tagged ones.
    pub keys: Option<Keys>,
}

/// How often to send, and how much silence means the peer is lost.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub interval: Duration,
    pub timeout: Duration,
}

/// Warn when the peer (`peer`) sends heartbeats so rarely (every
/// `interval_ms`) that fewer than three fit in this side's failure timeout:
/// then one or two lost datagrams pass for a failure.
pub fn check_interval(peer: Role, interval_ms: u64, timeout: Duration) {
    if interval_ms.saturating_mul(3) > timeout.as_millis() as u64 {
        tracing::warn!(
            "the {peer} sends heartbeats every {interval_ms} ms, fewer than three within this side's failure timeout of {} ms: lower its --heartbeat-ms",
            timeout.as_millis()
        );
    }
}

/// The primary's heartbeat socket: on the address its stream leaves from,
/// any free port (told to the backup in Hello).
pub fn bind_primary(local: IpAddr) -> io::Result<UdpSocket> {
    let socket = UdpSocket::bind((local, 0))?;
    prioritize(&socket);
    Ok(socket)
}

/// The backup's heartbeat socket: on its listening address, the same port
/// over UDP; another port if that one is taken (told to the primary in
/// Welcome, so heartbeats work either way).
pub fn bind_backup(listen: SocketAddr) -> io::Result<UdpSocket> {
    let socket = match UdpSocket::bind(listen) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let s = UdpSocket::bind((listen.ip(), 0))?;
            tracing::warn!(
                port = s.local_addr()?.port(),
                "UDP port {} is taken: heartbeats use another port (allow it through firewalls)",
                listen.port()
            );
            s
        }
        Err(e) => return Err(e),
    };
    prioritize(&socket);
    Ok(socket)
}

/// Mark heartbeats urgent: the host's highest unprivileged queueing
/// priority, and DSCP EF (expedited forwarding) on the network. Best effort.
fn prioritize(socket: &UdpSocket) {
    let set = |level, name, value| sockopt::set(socket.as_raw_fd(), level, name, value);
    let _ = set(libc::SOL_SOCKET, libc::SO_PRIORITY, 6);
    let _ = match socket.local_addr() {
        Ok(SocketAddr::V4(_)) => set(libc::IPPROTO_IP, libc::IP_TOS, 0xb8),
        Ok(SocketAddr::V6(_)) => set(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, 0xb8),
        Err(_) => Ok(()),
    };
}

/// Why a datagram does not count as a heartbeat.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
enum Reject {
    #[error("not a heartbeat ({0} bytes)")]
    Malformed(usize),
    #[error("heartbeat of protocol version {0}")]
    Version(u16),
    #[error("heartbeat from the wrong side (reflected?)")]
    WrongSide,
    #[error("heartbeat of another session")]
    OtherSession,
    #[error("untagged heartbeat on an authenticated channel")]
    Untagged,
    #[error("tagged heartbeat on an unauthenticated channel")]
    Tagged,
    #[error("heartbeat failed authentication")]
    BadTag,
    #[error("heartbeat {0} is not newer than the last one (replayed or reordered)")]
    Stale(u64),
}

fn side_byte(role: Role) -> u8 {
    match role {
        Role::Backup => FROM_BACKUP,
        // Heartbeats are the primary-backup pair's: the primary's side.
        _ => FROM_PRIMARY,
    }
}

fn peer_role(role: Role) -> Role {
    match role {
        Role::Backup => Role::Primary,
        _ => Role::Backup,
    }
}

/// Heartbeat number `seq` of this side of `path`, into `out`; returns its length.
fn encode(path: &Path, seq: u64, out: &mut [u8; BODY + TAG]) -> usize {
    out[..4].copy_from_slice(MAGIC);
    out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out[6] = side_byte(path.role);
    out[7] = if path.keys.is_some() { FLAG_TAGGED } else { 0 };
    out[8..24].copy_from_slice(&path.session);
    out[24..32].copy_from_slice(&seq.to_le_bytes());
    match &path.keys {
        Some(keys) => {
            let tag = blake3::keyed_hash(&keys.send, &out[..BODY]);
            out[BODY..].copy_from_slice(tag.as_bytes());
            BODY + TAG
        }
        None => BODY,
    }
}

/// The sequence number of `d` if it is a heartbeat of the peer in this
/// session (its freshness is checked by the caller).
fn decode(path: &Path, d: &[u8]) -> Result<u64, Reject> {
    if (d.len() != BODY && d.len() != BODY + TAG) || &d[..4] != MAGIC {
        return Err(Reject::Malformed(d.len()));
    }
    let version = u16::from_le_bytes([d[4], d[5]]);
    if version != PROTOCOL_VERSION {
        return Err(Reject::Version(version));
    }
    if d[6] != side_byte(peer_role(path.role)) {
        return Err(Reject::WrongSide);
    }
    let tagged = d[7] & FLAG_TAGGED != 0;
    if tagged != (d.len() == BODY + TAG) {
        return Err(Reject::Malformed(d.len()));
    }
    match (&path.keys, tagged) {
        (Some(_), false) => return Err(Reject::Untagged),
        (None, true) => return Err(Reject::Tagged),
        (Some(keys), true) => {
            let tag: [u8; TAG] = d[BODY..].try_into().expect("tag length");
            // Constant-time comparison (blake3::Hash's PartialEq).
            if blake3::keyed_hash(&keys.recv, &d[..BODY]) != blake3::Hash::from(tag) {
                return Err(Reject::BadTag);
            }
        }
        (None, false) => {}
    }
    if d[8..24] != path.session {
        return Err(Reject::OtherSession);
    }
    Ok(u64::from_le_bytes(d[24..32].try_into().expect("8 bytes")))
}

/// Running heartbeat threads; stopped (and joined) on drop.
pub struct Heartbeats {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Heartbeats {
    /// Start sending heartbeats on `path` and watching `pulse` (which valid
    /// heartbeats beat) for the peer's silence. One thread sends, receives
    /// and judges; with two CPUs or more a second one, on another CPU, sends
    /// too (half an interval later), so a CPU that stops for a while (a
    /// hypervisor that runs something else on it, say) does not silence
    /// this side.
    pub fn start(path: Path, timing: Timing, pulse: Arc<Pulse>, observer: impl Observer) -> io::Result<Heartbeats> {
        path.socket.set_nonblocking(true)?;
        stamp_arrivals(&path.socket);
        let stop = Arc::new(AtomicBool::new(false));
        let sender = Sender { path: Arc::new(path), seq: Arc::new(AtomicU64::new(0)), stats: Arc::new(SendStats::default()) };
        let (first, second) = match two_cpus() {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        };
        let mut threads = Vec::new();
        if let Some(cpu) = second {
            let (sender, stop, interval) = (sender.clone(), stop.clone(), timing.interval);
            threads.push(std::thread::Builder::new().name("heartbeat-send".into()).spawn(move || {
                seccomp::install_or_exit(seccomp::ThreadKind::Replication);
                sender.run(interval, cpu, &stop)
            })?);
        }
        let beat = Beat {
            sender,
            timing,
            pulse,
            observer,
            stop: stop.clone(),
            cpu: first,
            last_seen: None,
            stats: Stats::default(),
            last_heartbeat: None,
            rejected_logged: false,
        };
        match std::thread::Builder::new().name("heartbeat".into()).spawn(move || {
            seccomp::install_or_exit(seccomp::ThreadKind::Replication);
            beat.run()
        }) {
            Ok(t) => threads.push(t),
            Err(e) => {
                // Do not leave the other sender behind.
                drop(Heartbeats { stop, threads });
                return Err(e);
            }
        }
        Ok(Heartbeats { stop, threads })
    }
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What every sending thread counts.
#[derive(Default)]
struct SendStats {
    sent: AtomicU64,
    /// Longest delay of a heartbeat after its time, in µs (its thread was late).
    latest_us: AtomicU64,
    failed: AtomicBool,
}

/// One side's heartbeats out, from any of its threads: numbered in one
/// sequence.
#[derive(Clone)]
struct Sender {
    path: Arc<Path>,
    seq: Arc<AtomicU64>,
    stats: Arc<SendStats>,
}

impl Sender {
    /// Send the heartbeat due at `due`.
    fn send(&self, due: Instant) {
        let late = Instant::now().saturating_duration_since(due).as_micros() as u64;
        self.stats.latest_us.fetch_max(late, Ordering::Relaxed);
        let mut out = [0u8; BODY + TAG];
        let n = encode(&self.path, self.seq.fetch_add(1, Ordering::Relaxed), &mut out);
        match self.path.socket.send_to(&out[..n], self.path.peer) {
            Ok(_) => {
                self.stats.sent.fetch_add(1, Ordering::Relaxed);
                self.stats.failed.store(false, Ordering::Relaxed);
            }
            Err(e) => {
                if !self.stats.failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(peer = %self.path.peer, "cannot send a heartbeat: {e}");
                }
            }
        }
    }

    /// The second sender: every `interval`, half an interval after the
    /// first, on `cpu`, until `stop`.
    fn run(self, interval: Duration, cpu: usize, stop: &AtomicBool) {
        pin(cpu);
        raise_priority();
        let mut next = Instant::now() + interval / 2;
        while !stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            if now >= next {
                self.send(next);
                next += interval;
                if next <= now {
                    next = now + interval;
                }
            }
            std::thread::sleep(next.saturating_duration_since(Instant::now()).max(MIN_WAIT));
        }
    }
}

#[derive(Default)]
struct Stats {
    received: u64,
    /// Datagrams that are not heartbeats of this session's peer.
    rejected: u64,
    /// Heartbeats older than one already counted (reordered, or replayed).
    stale: u64,
    /// Longest time between two heartbeats received.
    longest_gap: Duration,
    /// Longest time this thread itself was held up (not counted as the peer's silence).
    longest_stall: Duration,
}

/// The sending, receiving and judging thread.
struct Beat<O> {
    sender: Sender,
    timing: Timing,
    pulse: Arc<Pulse>,
    observer: O,
    stop: Arc<AtomicBool>,
    cpu: Option<usize>,
    /// The newest heartbeat number received.
    last_seen: Option<u64>,
    stats: Stats,
    last_heartbeat: Option<Instant>,
    rejected_logged: bool,
}

impl<O: Observer> Beat<O> {
    fn run(mut self) {
        if let Some(cpu) = self.cpu {
            pin(cpu);
        }
        raise_priority();
        let peer = peer_role(self.sender.path.role);
        let started = Instant::now();
        let mut next_send = started;
        let mut warned = false;
        let mut buf = [0u8; 256];
        // Time this thread was held up beyond what it asked to wait (its CPU
        // taken away, the host stalled) does not count as the peer's
        // silence: what the peer sent meanwhile may not have been processed
        // yet. Reset whenever the peer is heard from.
        let tolerance = self.timing.interval.max(Duration::from_millis(2));
        let (mut excused, mut excused_since) = (Duration::ZERO, self.pulse.last());
        let (mut woke, mut asked) = (started, Duration::ZERO);
        let ended = loop {
            if self.stop.load(Ordering::SeqCst) {
                break "stopped";
            }
            let now = Instant::now();
            let held = (now - woke).saturating_sub(asked);
            if self.pulse.last() != excused_since {
                (excused, excused_since) = (Duration::ZERO, self.pulse.last());
            }
            if held > tolerance {
                excused += held;
                self.stats.longest_stall = self.stats.longest_stall.max(held);
            }
            if now >= next_send {
                self.sender.send(next_send);
                next_send += self.timing.interval;
                if next_send <= now {
                    // Woken late: keep the interval from now on.
                    next_send = now + self.timing.interval;
                }
            }
            if self.observer.lost_otherwise() {
                break "the peer was lost";
            }
            let limit = if self.stats.received == 0 { self.timing.timeout.max(START_GRACE) } else { self.timing.timeout };
            if self.pulse.silence().saturating_sub(excused) >= limit {
                // What already arrived counts first.
                self.drain(&mut buf);
                let silence = self.pulse.silence();
                if self.pulse.last() == excused_since && silence.saturating_sub(excused) >= limit {
                    tracing::debug!(silence_us = silence.as_micros() as u64, "nothing heard from the {peer}");
                    self.observer.silent(silence, self.timing.timeout);
                    break "the peer fell silent";
                }
            }
            if !warned && self.stats.received == 0 && started.elapsed() >= FIRST_WARNING {
                warned = true;
                tracing::warn!(
                    "no heartbeat from the {peer} after {} ms (UDP to {} or back blocked?): until one arrives, only its stream shows it alive",
                    FIRST_WARNING.as_millis(),
                    self.sender.path.peer
                );
            }
            let deadline = (limit + excused).saturating_sub(self.pulse.silence());
            asked = next_send.saturating_duration_since(Instant::now()).min(deadline).max(MIN_WAIT);
            woke = Instant::now();
            wait_readable(&self.sender.path.socket, asked);
            self.drain(&mut buf);
        };
        self.stop.store(true, Ordering::SeqCst);
        let sent = &self.sender.stats;
        tracing::info!(
            peer = %self.sender.path.peer,
            sent = sent.sent.load(Ordering::Relaxed),
            received = self.stats.received,
            rejected = self.stats.rejected,
            stale = self.stats.stale,
            longest_gap_us = self.stats.longest_gap.as_micros() as u64,
            latest_send_us = sent.latest_us.load(Ordering::Relaxed),
            longest_stall_us = self.stats.longest_stall.as_micros() as u64,
            "heartbeats ended: {ended}"
        );
    }

    /// Everything queued on the (non-blocking) socket, without waiting.
    fn drain(&mut self, buf: &mut [u8]) {
        loop {
            match self.sender.path.socket.recv_from(buf) {
                Ok((n, from)) => {
                    let arrived = arrival_of_last(&self.sender.path.socket);
                    self.received(&buf[..n], from, arrived);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // An ICMP error for an earlier datagram, say: the next one decides.
                Err(e) => {
                    tracing::debug!("heartbeat receive: {e}");
                    return;
                }
            }
        }
    }

    /// Datagram `d` from `from` arrived at `arrived` (CLOCK_REALTIME ns, 0 if unknown).
    fn received(&mut self, d: &[u8], from: SocketAddr, arrived: u64) {
        let result = decode(&self.sender.path, d).and_then(|seq| match self.last_seen {
            Some(last) if seq <= last => Err(Reject::Stale(seq)),
            _ => Ok(seq),
        });
        match result {
            Ok(seq) => {
                self.last_seen = Some(seq);
                self.pulse.beat();
                self.pulse.heartbeat_arrived(arrived);
                let now = Instant::now();
                if let Some(prev) = self.last_heartbeat.replace(now) {
                    self.stats.longest_gap = self.stats.longest_gap.max(now - prev);
                } else {
                    tracing::debug!(%from, "first heartbeat from the {}", peer_role(self.sender.path.role));
                }
                self.stats.received += 1;
            }
            // The peer's two senders overtake each other; a replay is no news either.
            Err(Reject::Stale(_)) => self.stats.stale += 1,
            Err(e) => {
                self.stats.rejected += 1;
                if self.rejected_logged {
                    tracing::debug!(%from, "ignored a datagram: {e}");
                } else {
                    tracing::warn!(%from, "ignored a datagram: {e} (further ones are counted, not logged)");
                    self.rejected_logged = true;
                }
            }
        }
    }
}

/// SIOCGSTAMPNS (asm-generic/sockios.h, the `_OLD` one with a native
/// `timespec`): when the last datagram read from a socket arrived.
const SIOCGSTAMPNS: libc::c_ulong = 0x8907;

/// Have the kernel note when each datagram arrives: the first SIOCGSTAMPNS
/// on a socket turns its stamps on (and finds none yet); SO_TIMESTAMPNS
/// would deliver them as control messages instead, which `recv_from`
/// discards.
fn stamp_arrivals(socket: &UdpSocket) {
    let _ = arrival_of_last(socket);
}

/// When the datagram just read from `socket` reached the kernel
/// (CLOCK_REALTIME ns), or 0 if the kernel cannot tell.
fn arrival_of_last(socket: &UdpSocket) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: SIOCGSTAMPNS writes one timespec, which `ts` is.
    if unsafe { libc::ioctl(socket.as_raw_fd(), SIOCGSTAMPNS, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Two different CPUs this process may run on, if it has two: where the
/// two sending threads go (spread over the host by process id).
fn two_cpus() -> Option<(usize, usize)> {
    // SAFETY: a cpu_set_t is plain data; all zeros is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the calling thread's mask into a cpu_set_t of the size given.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return None;
    }
    // SAFETY: CPU_ISSET only reads the set, for CPUs within its size.
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect();
    if cpus.len() < 2 {
        return None;
    }
    let i = std::process::id() as usize % cpus.len();
    Some((cpus[i], cpus[(i + 1) % cpus.len()]))
}

/// Keep the calling thread on `cpu` (best effort).
fn pin(cpu: usize) {
    // SAFETY: a cpu_set_t is plain data; all zeros is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes one bit of the set; `cpu` is below CPU_SETSIZE (it came from CPU_ISSET).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: sets the calling thread's mask from a valid cpu_set_t of the size given.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        tracing::debug!(cpu, "heartbeats not pinned: {}", io::Error::last_os_error());
    }
}

/// Sleep until a datagram arrives on `socket` or `wait` passes, to the
/// microsecond (a socket receive timeout counts in scheduler ticks, up to
/// 10 ms: too coarse for heartbeats every few ms).
fn wait_readable(socket: &UdpSocket, wait: Duration) {
    let mut fd = libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ts = libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
    // SAFETY: one valid pollfd and a timespec that outlive the call; ppoll
    // only writes `revents`. No signal mask is passed.
    unsafe { libc::ppoll(&mut fd, 1, &ts, std::ptr::null()) };
}

switch! {
    /// How the threads a held reply waits for are scheduled: the primary's
    /// checkpoint thread while it protects, its acknowledgement reader, and
    /// the backup's thread that receives and applies checkpoints.
    pub enum Priority {
        Normal = "normal",
        /// Real-time (SCHED_FIFO, as the heartbeats): woken ahead of every
        /// normal thread of the host, if the process may.
        Realtime = "realtime",
    }
}

impl Priority {
    /// Apply to the calling thread.
    pub fn apply(self) {
        match self {
            Priority::Realtime => raise_priority(),
            Priority::Normal => normal_priority(),
        }
    }

    /// Run `work` on the calling thread at this priority, then go back to
    /// normal: threads the caller creates afterwards inherit its policy.
    pub fn during<T>(self, work: impl FnOnce() -> T) -> T {
        self.apply();
        let result = work();
        Priority::Normal.apply();
        result
    }
}

/// Run the calling thread at normal priority again (threads it creates
/// inherit its policy).
pub fn normal_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as in `raise_priority`.
    unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_OTHER, &param) };
}

/// Run this thread above every normal thread of the host, if allowed.
pub fn raise_priority() {
    let param = libc::sched_param { sched_priority: RT_PRIORITY };
    // SAFETY: changes only the calling thread's scheduling, with a valid
    // parameter struct that outlives the call.
    let err = unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) };
    if err != 0 {
        tracing::debug!("heartbeats at normal priority: {}", io::Error::from_raw_os_error(err));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn path(role: Role, socket: UdpSocket, peer: SocketAddr, session: SessionId, keys: Option<Keys>) -> Path {
        Path { socket, peer, session, role, keys }
    }

    fn pair(keys: bool) -> (Path, Path) {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        let (aa, ba) = (a.local_addr().unwrap(), b.local_addr().unwrap());
        let id = session_id(session_half().unwrap(), session_half().unwrap());
        let (pk, bk) =
            if keys { (Some(Keys { send: [1; 32], recv: [2; 32] }), Some(Keys { send: [2; 32], recv: [1; 32] })) } else { (None, None) };
        (path(Role::Primary, a, ba, id, pk), path(Role::Backup, b, aa, id, bk))
    }

    fn datagram(p: &Path, seq: u64) -> Vec<u8> {
        let mut out = [0u8; BODY + TAG];
        let n = encode(p, seq, &mut out);
        out[..n].to_vec()
    }

    #[test]
    fn heartbeats_count_only_from_the_peer_of_this_session() {
        for keys in [false, true] {
            let (p, b) = pair(keys);
            let d = datagram(&p, 7);
            assert_eq!(decode(&b, &d), Ok(7));
            // Reflected back to its sender.
            assert_eq!(decode(&p, &d), Err(Reject::WrongSide));
            // Another session (an old primary, a stranger).
            let mut other = path(Role::Primary, UdpSocket::bind("127.0.0.1:0").unwrap(), p.peer, [9; 16], p.keys.clone());
            assert_eq!(decode(&b, &datagram(&other, 8)), Err(Reject::OtherSession));
            other.session = p.session;
            assert_eq!(decode(&b, &datagram(&other, 8)), Ok(8));
            assert!(matches!(decode(&b, &d[..20]), Err(Reject::Malformed(20))));
            let mut v = d.clone();
            v[4] = 99;
            assert_eq!(decode(&b, &v), Err(Reject::Version(99)));
        }
    }

    #[test]
    fn authenticated_heartbeats_need_the_sessions_key() {
        let (p, b) = pair(true);
        let mut d = datagram(&p, 3);
        assert_eq!(decode(&b, &d), Ok(3));
        d[30] ^= 1; // the sequence number, changed
        assert_eq!(decode(&b, &d), Err(Reject::BadTag));
        // Somebody who knows the session id but not the key.
        let forger =
            path(Role::Primary, UdpSocket::bind("127.0.0.1:0").unwrap(), p.peer, p.session, Some(Keys { send: [5; 32], recv: [5; 32] }));
        assert_eq!(decode(&b, &datagram(&forger, 4)), Err(Reject::BadTag));
        let clear = path(Role::Primary, UdpSocket::bind("127.0.0.1:0").unwrap(), p.peer, p.session, None);
        assert_eq!(decode(&b, &datagram(&clear, 4)), Err(Reject::Untagged));
        let (_, b_clear) = pair(false);
        let tagged = Path { session: b_clear.session, ..pair(true).0 };
        assert_eq!(decode(&b_clear, &datagram(&tagged, 1)), Err(Reject::Tagged));
    }

    /// Records what the heartbeat thread decided.
    #[derive(Clone, Default)]
    struct Verdict(Arc<Mutex<Option<Duration>>>);

    impl Observer for Verdict {
        fn silent(&mut self, silence: Duration, _: Duration) {
            *self.0.lock().unwrap() = Some(silence);
        }
    }

    impl Verdict {
        /// Waits (up to 10 s) until the thread judges the peer lost; the
        /// silence it judged by.
        fn awaited(&self) -> Duration {
            let t0 = Instant::now();
            loop {
                if let Some(silence) = *self.0.lock().unwrap() {
                    return silence;
                }
                assert!(t0.elapsed() < Duration::from_secs(10), "silence never noticed");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// The primary's heartbeat thread alone (2 ms interval), what it
    /// decides, and the backup's path, which sends nothing.
    fn primary_side(timeout: Duration, keys: bool, pulse: Arc<Pulse>) -> (Heartbeats, Verdict, Path) {
        let (p, b) = pair(keys);
        let v = Verdict::default();
        let h = Heartbeats::start(p, Timing { interval: Duration::from_millis(2), timeout }, pulse, v.clone()).unwrap();
        (h, v, b)
    }

    #[test]
    fn peers_that_beat_stay_alive_and_a_silent_one_is_lost() {
        let timing = Timing { interval: Duration::from_millis(2), timeout: Duration::from_millis(300) };
        let (p, b) = pair(true);
        let (pv, bv) = (Verdict::default(), Verdict::default());
        let (pp, bp) = (Pulse::new(), Pulse::new());
        let ph = Heartbeats::start(p, timing, pp.clone(), pv.clone()).unwrap();
        let bh = Heartbeats::start(b, timing, bp.clone(), bv.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(800));
        assert_eq!(*pv.0.lock().unwrap(), None, "the primary lost a live backup");
        assert_eq!(*bv.0.lock().unwrap(), None, "the backup lost a live primary");
        assert!(bp.silence() < timing.timeout);
        assert!(pp.heard_within(Duration::from_millis(100)) && bp.heard_within(Duration::from_millis(100)));
        // The primary stops: the backup notices its silence, and by the
        // kernel's arrival stamps nothing was heard from the primary lately.
        drop(ph);
        assert!(bv.awaited() >= timing.timeout);
        assert!(!bp.heard_within(Duration::from_millis(100)));
        assert!(Pulse::new().heard_within(Duration::ZERO), "no heartbeat yet: nothing to judge by");
        drop(bh);
    }

    /// A session's first moments: a peer not heard from yet (the primary
    /// still setting up its pre-copy) is not lost at a 30 ms timeout.
    #[test]
    fn a_peer_not_heard_from_yet_has_the_start_grace() {
        let (h, v, _backup) = primary_side(Duration::from_millis(30), true, Pulse::new());
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(*v.0.lock().unwrap(), None, "lost before its first heartbeat, within the start grace");
        assert!(v.awaited() >= START_GRACE);
        drop(h);
    }

    #[test]
    fn the_stream_counts_as_a_sign_of_life() {
        // Heartbeats go nowhere and none arrive; only the stream beats.
        let pulse = Pulse::new();
        let (h, v, _backup) = primary_side(Duration::from_millis(100), false, pulse.clone());
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(500) {
            pulse.beat();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*v.0.lock().unwrap(), None, "lost while the stream flowed");
        drop(h);
    }
}
