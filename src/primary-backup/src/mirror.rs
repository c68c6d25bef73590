//! Frame mirroring: what clients need from a backup that takes over, at once.
//!
//! A client that talks to a primary which then fails has, most of the time,
//! a request the backup's checkpoint does not contain (it reached the
//! primary after the last checkpoint), or a reply that the checkpoint
//! contains but that the primary never released. Either way the client
//! waits for its TCP retransmission timer (at least 200 ms on Linux; with
//! one segment in flight, duplicate ACKs from the restored guest cannot
//! make it retransmit sooner). So while protected, the primary sends the
//! backup a copy of every frame the guest receives and transmits, tagged
//! with the epoch it belongs to, and when the backup takes over from
//! checkpoint *n* it first sends epoch *n*'s output (which the primary may
//! not have released; the backup now owns the VM and its state includes
//! that output, so the output-commit rule holds), then delivers to the
//! guest the input that arrived after checkpoint *n*. The client gets its
//! reply, or its request is served, without retransmitting anything.
//!
//! Mirrored frames travel as UDP datagrams from a socket of the primary's
//! to one of the backup's (its port is in Welcome), apart from heartbeats
//! so that a burst of frames never delays one; a lost datagram only costs
//! the client its retransmission, as without mirroring. A copy the primary
//! did release too reaches the client twice, which TCP ignores (networks
//! duplicate frames as well). The primary never waits for the mirror: a full
//! socket drops the copy.
//!
//! With `--mirror on` an epoch's first output frames (up to
//! `bounds::OUTPUT_FOLD_MAX` bytes: the replies of a request-response
//! service) are not mirrored at all: its checkpoint carries them
//! (`CheckpointState::output`), which costs no datagram, no wake-up and no
//! send, and they reach the backup exactly with the state a takeover starts
//! from. Input, and output beyond the fold, is mirrored as it comes, the
//! frames queued together sent in one datagram. `--mirror per-frame` sends
//! every frame, output included, in a datagram of its own (what `on` did
//! before; kept to measure the difference).
//!
//! Datagram (little-endian), one or more entries:
//!
//! ```text
//!  "FTVF" | version u16 | flags u8 (bit 0: tagged) | session [16] | seq u64 | entry... | tag [32]
//!  entry: direction u8 (1 in, 2 out) | epoch u64 | length u32 | frame
//! ```
//!
//! As heartbeats: only of this session, newer than the last one accepted
//! (a replayed or reordered one is dropped), and with `--secret-file` tagged
//! (BLAKE3 keyed with the heartbeat key of the direction, over everything
//! before the tag). Frames are not encrypted, so with `--encrypt` the
//! primary does not mirror.

use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ftvm_vmm::hooks::HostInputFilter;
use ftvm_vmm::sync::Lock;

use ftvm_replication::liveness::{Keys, SessionId};
use ftvm_replication::output::{OutputBuffer, OutputListener};
use ftvm_replication::protocol::PROTOCOL_VERSION;
use ftvm_vmm::switch;

switch! {
    /// `--mirror`: send the backup a copy of the guest's frames so that a
    /// takeover replays them (clients see no retransmission timeout).
    pub enum Mode {
        /// Mirror frames (not with `--encrypt`: they would travel in clear):
        /// input batched into datagrams, each epoch's first output frames
        /// carried in its checkpoint.
        On = "on",
        /// Mirror every frame, output included, in a datagram of its own.
        PerFrame = "per-frame",
        /// Only checkpoints: after a takeover clients recover by retransmitting.
        Off = "off",
    }
}

impl Mode {
    /// Bytes of each epoch's first output frames its checkpoint carries
    /// instead of the mirror.
    pub fn fold(self) -> usize {
        match self {
            Mode::On => ftvm_replication::bounds::OUTPUT_FOLD_MAX as usize,
            Mode::PerFrame | Mode::Off => 0,
        }
    }
}

const MAGIC: &[u8; 4] = b"FTVF";
const IN: u8 = 1;
const OUT: u8 = 2;
const FLAG_TAGGED: u8 = 1;
/// Everything before the entries.
const HEAD: usize = 4 + 2 + 1 + 16 + 8;
/// Everything of an entry before its frame.
const ENTRY_HEAD: usize = 1 + 8 + 4;
const TAG: usize = 32;
/// Largest datagram: a frame of the largest size the network card moves.
const MAX_DATAGRAM: usize = 65_535;
/// What the backup keeps at most (frame bytes): beyond it, newer frames are
/// dropped until a checkpoint makes room.
pub const MIRROR_BOUND: u64 = 16 << 20;
/// How often the backup's receiving thread looks at its stop flag.
const POLL: Duration = Duration::from_millis(50);

/// One end of the mirror path.
pub struct Codec {
    pub session: SessionId,
    /// With an authenticated channel: tag datagrams (`send`), accept only tagged ones (`recv`).
    pub keys: Option<Keys>,
}

/// Why a datagram is not a mirrored frame of this session.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Reject {
    #[error("not a mirrored frame ({0} bytes)")]
    Malformed(usize),
    #[error("mirrored frame of protocol version {0}")]
    Version(u16),
    #[error("mirrored frame of another session")]
    OtherSession,
    #[error("mirrored frame without the right tag")]
    BadTag,
}

/// A mirrored frame, decoded.
#[derive(Debug, PartialEq, Eq)]
pub struct Mirrored<'a> {
    pub input: bool,
    pub epoch: u64,
    pub frame: &'a [u8],
}

/// A datagram's frames: (input, epoch, frame), in the order they came.
pub type Entries<'a> = [(bool, u64, &'a [u8])];

impl Codec {
    /// Datagram `seq` holding `entries` (which fit: [`fits`]) into `out`.
    pub fn encode(&self, seq: u64, entries: &Entries, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out.push(if self.keys.is_some() { FLAG_TAGGED } else { 0 });
        out.extend_from_slice(&self.session);
        out.extend_from_slice(&seq.to_le_bytes());
        for &(input, epoch, frame) in entries {
            out.push(if input { IN } else { OUT });
            out.extend_from_slice(&epoch.to_le_bytes());
            out.extend_from_slice(&(frame.len() as u32).to_le_bytes());
            out.extend_from_slice(frame);
        }
        if let Some(keys) = &self.keys {
            let tag = blake3::keyed_hash(&keys.send, out);
            out.extend_from_slice(tag.as_bytes());
        }
    }

    /// The sequence number and frames of datagram `d`, checked whole.
    pub fn decode<'a>(&self, d: &'a [u8]) -> Result<(u64, Vec<Mirrored<'a>>), Reject> {
        let tag_len = if self.keys.is_some() { TAG } else { 0 };
        if d.len() < HEAD + tag_len || &d[..4] != MAGIC {
            return Err(Reject::Malformed(d.len()));
        }
        let version = u16::from_le_bytes([d[4], d[5]]);
        if version != PROTOCOL_VERSION {
            return Err(Reject::Version(version));
        }
        let body = &d[..d.len() - tag_len];
        match &self.keys {
            Some(keys) => {
                let tag: [u8; TAG] = d[body.len()..].try_into().expect("tag length");
                // Constant-time comparison (blake3::Hash's PartialEq).
                if d[6] & FLAG_TAGGED == 0 || blake3::keyed_hash(&keys.recv, body) != blake3::Hash::from(tag) {
                    return Err(Reject::BadTag);
                }
            }
            None if d[6] & FLAG_TAGGED != 0 => return Err(Reject::BadTag),
            None => {}
        }
        if d[7..23] != self.session {
            return Err(Reject::OtherSession);
        }
        let seq = u64::from_le_bytes(d[23..31].try_into().expect("8 bytes"));
        let mut frames = Vec::new();
        let mut rest = &body[HEAD..];
        while !rest.is_empty() {
            let malformed = || Reject::Malformed(d.len());
            if rest.len() < ENTRY_HEAD || !matches!(rest[0], IN | OUT) {
                return Err(malformed());
            }
            let epoch = u64::from_le_bytes(rest[1..9].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(rest[9..13].try_into().expect("4 bytes")) as usize;
            let frame = rest.get(ENTRY_HEAD..ENTRY_HEAD + len).ok_or_else(malformed)?;
            frames.push(Mirrored { input: rest[0] == IN, epoch, frame });
            rest = &rest[ENTRY_HEAD + len..];
        }
        if frames.is_empty() {
            return Err(Reject::Malformed(d.len()));
        }
        Ok((seq, frames))
    }
}

/// The frames of `queued` grouped into datagrams, in order: as many per
/// datagram as fit (`batch`), or one each.
fn datagrams(queued: &[(bool, u64, Vec<u8>)], batch: bool) -> Vec<Vec<(bool, u64, &[u8])>> {
    let mut out: Vec<Vec<(bool, u64, &[u8])>> = Vec::new();
    let mut used = 0;
    for (input, epoch, frame) in queued {
        match out.last_mut() {
            Some(entries) if batch && fits(used, frame.len()) => entries.push((*input, *epoch, frame)),
            _ => {
                out.push(vec![(*input, *epoch, frame)]);
                used = 0;
            }
        }
        used = used.max(HEAD) + ENTRY_HEAD + frame.len();
    }
    out
}

/// Whether a datagram of `used` bytes so far (0: none yet) has room for one
/// more frame of `len` bytes.
fn fits(used: usize, len: usize) -> bool {
    used.max(HEAD) + ENTRY_HEAD + len + TAG <= MAX_DATAGRAM
}

/// The primary's end: copies of frames, sent to the backup by a thread of
/// its own. The device thread only queues them: a UDP send per frame inside
/// the device's pass (tens of frames per pass under load) was most of the
/// time a checkpoint's pause waited for that pass.
pub struct Sender {
    shared: Arc<SenderShared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct SenderShared {
    queue: Mutex<Queued>,
    ready: Condvar,
    stopped: AtomicBool,
    dropped: AtomicU64,
    sent: AtomicU64,
}

#[derive(Default)]
struct Queued {
    frames: Vec<(bool, u64, Vec<u8>)>,
    bytes: usize,
}

/// Frame bytes queued and not sent yet beyond which copies are dropped (a
/// stalled sender thread must not grow the primary without bound).
const QUEUE_BOUND: usize = 4 << 20;

/// The output buffer hands the mirror each frame it holds.
impl OutputListener for Sender {
    fn frame_held(&self, epoch: u64, frame: &[u8]) {
        self.send(false, epoch, frame);
    }
}

impl Sender {
    /// A sender from the primary's address `local` to the backup's mirror
    /// socket `peer`: the frames queued together in one datagram (`batch`),
    /// or each in its own.
    pub fn new(local: IpAddr, peer: SocketAddr, codec: Codec, batch: bool) -> io::Result<Sender> {
        let socket = UdpSocket::bind((local, 0))?;
        socket.set_nonblocking(true)?;
        let shared = Arc::new(SenderShared {
            queue: Mutex::new(Queued::default()),
            ready: Condvar::new(),
            stopped: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            sent: AtomicU64::new(0),
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new().name("mirror".into()).spawn(move || {
            ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Replication);
            worker.run(&socket, peer, &codec, batch);
        })?;
        Ok(Sender { shared, thread: Mutex::new(Some(thread)) })
    }

    /// A copy of `frame`, received (`input`) or transmitted by the guest in `epoch`.
    pub fn send(&self, input: bool, epoch: u64, frame: &[u8]) {
        let s = &self.shared;
        if s.stopped.load(Ordering::Relaxed) || !fits(0, frame.len()) {
            return;
        }
        let mut q = s.queue.locked();
        if q.bytes + frame.len() > QUEUE_BOUND {
            // The client retransmits instead.
            s.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let wake = q.frames.is_empty();
        q.bytes += frame.len();
        q.frames.push((input, epoch, frame.to_vec()));
        drop(q);
        if wake {
            s.ready.notify_one();
        }
    }

    /// Send nothing more (the session with this backup ended).
    pub fn stop(&self) {
        let s = &self.shared;
        if !s.stopped.swap(true, Ordering::Relaxed) {
            drop(s.queue.locked()); // the thread is waiting or will see the flag
            s.ready.notify_one();
            tracing::info!(sent = s.sent.load(Ordering::Relaxed), dropped = s.dropped.load(Ordering::Relaxed), "frame mirror ended");
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.stop();
        if let Some(t) = self.thread.locked().take() {
            let _ = t.join();
        }
    }
}

impl SenderShared {
    /// Send what is queued, in order, until stopped: as many frames per
    /// datagram as fit (`batch`), or one.
    fn run(&self, socket: &UdpSocket, peer: SocketAddr, codec: &Codec, batch_frames: bool) {
        let mut batch = Vec::new();
        let mut buf = Vec::new();
        let mut seq = 0u64;
        loop {
            {
                let mut q = self.queue.locked();
                while q.frames.is_empty() && !self.stopped.load(Ordering::Relaxed) {
                    q = ftvm_vmm::sync::wait(&self.ready, q);
                }
                if self.stopped.load(Ordering::Relaxed) {
                    return;
                }
                std::mem::swap(&mut batch, &mut q.frames);
                q.bytes = 0;
            }
            for entries in datagrams(&batch, batch_frames) {
                codec.encode(seq, &entries, &mut buf);
                seq += 1;
                let counter = match socket.send_to(&buf, peer) {
                    Ok(_) => &self.sent,
                    // A full socket or an unreachable backup: the client retransmits instead.
                    Err(_) => &self.dropped,
                };
                counter.fetch_add(entries.len() as u64, Ordering::Relaxed);
            }
            batch.clear();
        }
    }
}

/// The primary's input hook: every frame from the network, on its way to
/// the guest, is mirrored with the epoch the guest is running in. (Device
/// threads are paused for a checkpoint between frames, so a frame delivered
/// now is in the checkpoint of that epoch, not an earlier one.)
pub struct InputMirror {
    pub sender: Arc<Sender>,
    pub output: Arc<OutputBuffer>,
}

impl HostInputFilter for InputMirror {
    fn admit(&self, frame: &[u8]) -> bool {
        if let Some(epoch) = self.output.open_epoch() {
            self.sender.send(true, epoch, frame);
        }
        true
    }
}

#[derive(Default)]
struct Store {
    /// (epoch, input, frame), in the order they arrived.
    frames: VecDeque<(u64, bool, Vec<u8>)>,
    bytes: u64,
    last_seq: Option<u64>,
    /// The last checkpoint applied: input of it or earlier, and output
    /// before it, are no longer needed.
    applied: Option<u64>,
    overflowed: bool,
    rejected: u64,
}

/// What the backup does at takeover from a checkpoint.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// Output of the checkpoint's epoch, to send before the guest runs.
    pub output: Vec<Vec<u8>>,
    /// Input after the checkpoint, to deliver to the guest first.
    pub input: Vec<Vec<u8>>,
}

/// The backup's end: keeps the frames a takeover from the latest checkpoint
/// replays, no more (bounded by [`MIRROR_BOUND`]).
#[derive(Default)]
pub struct Mirror {
    store: Mutex<Store>,
}

impl Mirror {
    fn needed(applied: Option<u64>, epoch: u64, input: bool) -> bool {
        match applied {
            None => true,
            Some(a) if input => epoch > a,
            Some(a) => epoch >= a,
        }
    }

    /// A datagram arrived; keep its frames if it is valid and new, those
    /// that are needed.
    pub fn receive(&self, codec: &Codec, d: &[u8]) {
        let mut s = self.store.locked();
        let (seq, frames) = match codec.decode(d) {
            Ok(m) => m,
            Err(e) => {
                s.rejected += 1;
                if s.rejected == 1 {
                    tracing::warn!("ignored a datagram on the mirror port: {e}");
                }
                return;
            }
        };
        if s.last_seq.is_some_and(|last| seq <= last) {
            return;
        }
        s.last_seq = Some(seq);
        for m in frames {
            if !Mirror::needed(s.applied, m.epoch, m.input) {
                continue;
            }
            if s.bytes + m.frame.len() as u64 > MIRROR_BOUND {
                if !std::mem::replace(&mut s.overflowed, true) {
                    tracing::warn!("mirrored frames reached {MIRROR_BOUND} bytes before a checkpoint; dropping more until the next one");
                }
                return;
            }
            s.bytes += m.frame.len() as u64;
            s.frames.push_back((m.epoch, m.input, m.frame.to_vec()));
        }
    }

    /// Checkpoint `epoch` was applied: forget what a takeover from it does not need.
    pub fn applied(&self, epoch: u64) {
        let mut s = self.store.locked();
        s.applied = Some(epoch);
        s.overflowed = false;
        let mut bytes = 0;
        s.frames.retain(|(e, input, f)| {
            let keep = Mirror::needed(Some(epoch), *e, *input);
            if keep {
                bytes += f.len() as u64;
            }
            keep
        });
        s.bytes = bytes;
    }

    /// What a takeover from checkpoint `epoch` replays (and nothing stays):
    /// `folded`, the epoch's first output frames its checkpoint carried,
    /// then the rest of its output, mirrored, and the input after it.
    pub fn take(&self, epoch: u64, folded: Vec<Vec<u8>>) -> Replay {
        let mut s = self.store.locked();
        let mut replay = Replay { output: folded, input: Vec::new() };
        for (e, input, frame) in std::mem::take(&mut s.frames) {
            match (input, e) {
                (true, e) if e > epoch => replay.input.push(frame),
                (false, e) if e == epoch => replay.output.push(frame),
                _ => {}
            }
        }
        s.bytes = 0;
        replay
    }
}

/// The backup's mirror socket: on its listening address, any port (told to
/// the primary in Welcome).
pub fn bind_backup(ip: IpAddr) -> io::Result<UdpSocket> {
    let socket = UdpSocket::bind((ip, 0))?;
    socket.set_read_timeout(Some(POLL))?;
    Ok(socket)
}

/// The backup's receiving thread: datagrams of this session into `mirror`
/// until dropped.
pub struct Receiver {
    stop: Arc<AtomicBool>,
}

impl Receiver {
    pub fn start(socket: UdpSocket, codec: Codec, mirror: Arc<Mirror>) -> io::Result<Receiver> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new().name("mirror".into()).spawn(move || {
            let mut buf = vec![0u8; MAX_DATAGRAM];
            while !flag.load(Ordering::Relaxed) {
                match socket.recv(&mut buf) {
                    Ok(n) => mirror.receive(&codec, &buf[..n]),
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) => {}
                    Err(e) => tracing::debug!("mirror receive: {e}"),
                }
            }
        })?;
        Ok(Receiver { stop })
    }
}

impl Drop for Receiver {
    /// The thread ends within [`POLL`], on its own: a takeover does not wait
    /// for it.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codec(keys: Option<Keys>) -> Codec {
        Codec { session: [7; 16], keys }
    }

    fn datagram(c: &Codec, input: bool, seq: u64, epoch: u64, frame: &[u8]) -> Vec<u8> {
        let mut d = Vec::new();
        c.encode(seq, &[(input, epoch, frame)], &mut d);
        d
    }

    #[test]
    fn datagrams_round_trip_and_are_checked() {
        let keys = Keys { send: [1; 32], recv: [1; 32] };
        for c in [codec(None), codec(Some(keys.clone()))] {
            let d = datagram(&c, true, 5, 9, b"frame");
            assert_eq!(c.decode(&d), Ok((5, vec![Mirrored { input: true, epoch: 9, frame: b"frame" }])));
            assert!(matches!(c.decode(&d[..10]), Err(Reject::Malformed(10))));
            let mut batch = Vec::new();
            c.encode(6, &[(true, 9, b"in"), (false, 9, b""), (false, 10, b"out")], &mut batch);
            let frames = vec![
                Mirrored { input: true, epoch: 9, frame: b"in" },
                Mirrored { input: false, epoch: 9, frame: b"" },
                Mirrored { input: false, epoch: 10, frame: b"out" },
            ];
            assert_eq!(c.decode(&batch), Ok((6, frames)));
            if c.keys.is_none() {
                // An entry cut short, or no entry at all, is not a datagram of ours.
                assert!(matches!(c.decode(&batch[..batch.len() - 1]), Err(Reject::Malformed(_))));
                assert!(matches!(c.decode(&batch[..HEAD]), Err(Reject::Malformed(_))));
            }
            let mut other = d.clone();
            other[8] ^= 1;
            assert!(c.decode(&other).is_err(), "another session");
        }
        let tagged = codec(Some(keys.clone()));
        let mut d = datagram(&tagged, false, 1, 1, b"x");
        let last = d.len() - 1;
        d[last] ^= 1;
        assert_eq!(tagged.decode(&d), Err(Reject::BadTag));
        let wrong = codec(Some(Keys { send: [2; 32], recv: [2; 32] }));
        assert_eq!(tagged.decode(&datagram(&wrong, false, 1, 1, b"x")), Err(Reject::BadTag));
        assert_eq!(
            tagged.decode(&datagram(&codec(None), false, 1, 1, &[0; 40])),
            Err(Reject::BadTag),
            "untagged on an authenticated channel"
        );
    }

    #[test]
    fn a_takeover_replays_the_last_epochs_output_and_later_input() {
        let c = codec(None);
        let m = Mirror::default();
        let mut seq = 0;
        let mut put = |input, epoch, frame: &[u8]| {
            seq += 1;
            m.receive(&c, &datagram(&c, input, seq, epoch, frame));
        };
        put(false, 3, b"out3");
        put(true, 3, b"in3");
        put(false, 4, b"out4");
        put(true, 4, b"in4");
        put(true, 5, b"in5");
        put(false, 5, b"out5");
        m.applied(4);
        // Epoch 4's output (maybe never released), input after checkpoint 4.
        // The checkpoint's folded frames come first, in the order sent.
        let folded = vec![b"fold4".to_vec()];
        assert_eq!(m.take(4, folded), Replay { output: vec![b"fold4".to_vec(), b"out4".to_vec()], input: vec![b"in5".to_vec()] });
        assert_eq!(m.take(4, Vec::new()), Replay::default(), "taken once");
    }

    #[test]
    fn queued_frames_go_as_few_datagrams_as_fit_in_order() {
        let big = vec![7u8; MAX_DATAGRAM / 2];
        let queued = vec![
            (true, 1, b"a".to_vec()),
            (false, 1, b"b".to_vec()),
            (true, 2, big.clone()),
            (true, 2, big.clone()),
            (true, 2, b"c".to_vec()),
        ];
        let shape = |batch| datagrams(&queued, batch).iter().map(|d| d.iter().map(|e| e.2.len()).collect::<Vec<_>>()).collect::<Vec<_>>();
        let half = big.len();
        // Two halves of the largest datagram do not fit in one with their headers.
        assert_eq!(shape(true), vec![vec![1, 1, half], vec![half, 1]]);
        assert_eq!(shape(false), vec![vec![1], vec![1], vec![half], vec![half], vec![1]]);
        let c = codec(None);
        let mut buf = Vec::new();
        for d in datagrams(&queued, true) {
            c.encode(0, &d, &mut buf);
            assert!(buf.len() <= MAX_DATAGRAM);
        }
    }

    #[test]
    fn stale_replayed_and_unneeded_frames_are_dropped() {
        let c = codec(None);
        let m = Mirror::default();
        m.applied(10);
        m.receive(&c, &datagram(&c, true, 2, 11, b"new"));
        m.receive(&c, &datagram(&c, true, 2, 11, b"replayed"));
        m.receive(&c, &datagram(&c, true, 1, 11, b"reordered"));
        m.receive(&c, &datagram(&c, true, 3, 10, b"in the checkpoint"));
        m.receive(&c, &datagram(&c, false, 4, 9, b"released long ago"));
        m.receive(&c, b"garbage");
        assert_eq!(m.take(10, Vec::new()), Replay { output: vec![], input: vec![b"new".to_vec()] });
    }

    #[test]
    fn what_the_backup_keeps_is_bounded() {
        let c = codec(None);
        let m = Mirror::default();
        let frame = vec![0u8; 60_000];
        let n = MIRROR_BOUND / frame.len() as u64;
        for seq in 0..n + 10 {
            m.receive(&c, &datagram(&c, true, seq, 1, &frame));
        }
        assert_eq!(m.take(0, Vec::new()).input.len() as u64, n);
    }
}
