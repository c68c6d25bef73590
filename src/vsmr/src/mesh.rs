//! The links between replicas: every replica listens on its `--peers`
//! address and dials every other one. A dialled link carries this
//! replica's messages to that peer; an accepted one carries the peer's
//! messages here. Each link is the primary-backup channel's transport
//! (`pipeline::transport`: framed, checksummed, and with `--secret-file`
//! authenticated by the same challenge-response handshake), opened with a
//! `PeerHello` that says who dials.
//!
//! Sending never blocks the caller: each peer has a sender thread with a
//! queue, which (re)connects as needed and sends whatever it finds queued
//! with one system call (`--link-batch`; the consensus thread queues a
//! round's raft messages for a peer as one entry, `outbox`); a link's reader reads what has
//! arrived in one call and parses the frames in it. A raft message lost with a broken
//! link is retried by raft itself; a lost `syncvm` message makes that
//! `syncvm` time out, and the leader tries again.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use ftvm_vmm::sync::Lock;

use crate::inbound::Event;
pub use crate::inbound::Inbound;
use crate::release::Awaited;
use crate::repair::Repairs;
use crate::squeeze;
use crate::tuning::{LinkBatch, LinkCompress, LinkDirect};
use ftvm_replication::handshakes::{self, Handshakes, Slot};
use ftvm_replication::pipeline::transport::{self, Auth, AuthTransport, Transport};
use ftvm_replication::protocol::{self, Kind, ProtocolError};
use ftvm_replication::ReplicationError;

/// Largest message between replicas: a `syncvm`'s pages and state of a
/// guest of up to 64 GiB would not fit anyway; the frame limit only bounds
/// what a peer can make this side allocate, and grows with the bytes that
/// really arrive.
const FRAME_LIMIT: u64 = 1 << 36;
/// Messages (or batches: a consensus round's raft messages for a peer go
/// as one, `outbox`) queued for one peer at most; beyond it raft messages
/// are dropped (raft retries) rather than letting a dead peer grow memory.
const QUEUE: usize = 4096;
/// How long a dial may take before the message it carries is dropped.
const DIAL_TIMEOUT: Duration = Duration::from_millis(200);
/// A dialled link whose bytes go unacknowledged this long is dropped and
/// dialled again at the next message (`TcpTransport::set_user_timeout`).
const UNACKED_TIMEOUT: Duration = Duration::from_secs(2);
/// The handshake of an accepted link must be complete within this long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a dialling replica says first.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct PeerHello {
    pub id: u64,
    /// It runs no VM: it votes and keeps the log, never leads.
    pub witness: bool,
    /// A witness with a VM: picked as secondary only when no other VM
    /// replica is alive.
    pub standby: bool,
    /// The size of its VM's disk in bytes (0: none). A VM replica whose
    /// disk differs from this one's in size is never its secondary.
    pub disk: u64,
}

/// Where the messages that arrive go, by kind.
#[derive(Clone)]
pub struct Routes {
    /// Raft messages: the consensus thread.
    pub raft: Sender<Event>,
    /// The `syncvm` exchange: the applier.
    pub sync: Sender<Inbound>,
    /// A leader's pre-copy to this replica (`RejoinStart`, `RejoinPages`).
    pub join: Sender<Inbound>,
    /// A replica's answers to this leader's pre-copy (`RejoinHashes`, `RejoinAck`).
    pub precopy: Sender<Inbound>,
    /// The acknowledgements the leader awaits (`release`): with
    /// `--ack-release link` this link thread releases their output itself
    /// (before handing them to the applier).
    pub acks: Arc<Awaited>,
}

/// One peer's outgoing side: its sender thread's queue (batches of frames,
/// sent in order) and the link, which with `--link-direct on` the thread
/// that sends a message may also write itself.
struct Outgoing {
    queue: SyncSender<Vec<Vec<u8>>>,
    link: Mutex<Option<Box<dyn Transport>>>,
    /// Frames queued that the sender thread has not yet sent or dropped:
    /// none may be overtaken.
    queued: AtomicUsize,
    /// The peer left the group (`Mesh::remove_peer`): its sender thread ends.
    gone: AtomicBool,
}

/// What a frame may add to its size on the link beyond its bytes (a seal
/// with `--secret-file`), for `Mesh::send_now`'s room check.
const FRAME_SLACK: usize = 128;

/// The links' switches.
#[derive(Clone, Copy, Debug, Default)]
pub struct LinkOptions {
    pub batch: LinkBatch,
    pub direct: LinkDirect,
    pub compress: LinkCompress,
    /// `--witness-linger-us` (zero: off).
    pub linger: Duration,
}

/// A sender thread to start: its peer, address, outgoing side and queue.
type Spawn = (u64, String, Arc<Outgoing>, Receiver<Vec<Vec<u8>>>);

/// An accepted link: its number, and a handle to shut it down.
type Accepted = (u64, Box<dyn Transport>);

/// What is known of a peer from its links.
#[derive(Clone, Copy, Debug, Default)]
pub struct PeerInfo {
    pub witness: bool,
    pub standby: bool,
    /// Its VM's disk size (0: none).
    pub disk: u64,
    /// When a message from it last arrived.
    pub heard: Option<Instant>,
}

pub struct Mesh {
    me: PeerHello,
    /// Each peer's outgoing side: the group's members but this one, which
    /// change with the raft configuration (`add_peer`, `remove_peer`).
    out: RwLock<HashMap<u64, Arc<Outgoing>>>,
    /// What a peer's sender thread needs to dial it.
    auth: Option<Auth>,
    batch: LinkBatch,
    /// Starts the sender thread of a member added at run time: a thread
    /// started at `start`, so that the new one has its filter (the
    /// consensus thread's seccomp filter allows no dialling: a thread
    /// inherits its creator's filter).
    spawner: Mutex<Sender<Spawn>>,
    /// `--link-direct`.
    direct: LinkDirect,
    /// `--link-compress`.
    compress: LinkCompress,
    peers: Mutex<HashMap<u64, PeerInfo>>,
    /// Each peer's accepted link. A peer that dials again dropped the old
    /// one (its bytes went unacknowledged: a partition), which would
    /// otherwise keep its reader waiting for ever.
    accepted: Mutex<HashMap<u64, Accepted>>,
    /// Numbers the accepted links.
    links: AtomicU64,
    /// Bytes this replica sent on its links (all kinds), for the metrics.
    sent: AtomicU64,
    /// Frames sent, likewise.
    frames: AtomicU64,
    /// What compression kept off the links (`--link-compress lz4`): the
    /// bytes the frames sent compressed would have added.
    saved: AtomicU64,
    stop: AtomicBool,
    /// `--witness-linger-us` (zero: off).
    linger: Duration,
    /// This replica leads with a synchronized secondary: the witness's
    /// sender lingers (`set_witness_linger`).
    lingering: AtomicBool,
    /// The pages a leader's `syncvm`s patched, for a secondary whose check
    /// of them failed (`repair`): the link thread answers; and a
    /// secondary's answers from its leader.
    repairs: Repairs,
}

/// `--link-batch on`: an accepted link reads what has arrived in one call
/// and parses the frames in it.
fn accepted(stream: std::net::TcpStream, batch: LinkBatch) -> std::io::Result<transport::TcpTransport> {
    let link = transport::TcpTransport::new(stream)?;
    Ok(match batch {
        LinkBatch::On => link.with_read_ahead(),
        LinkBatch::Off => link,
    })
}

impl Mesh {
    /// Listen on `listen`, dial `peers` (id, address) as they come up, and
    /// hand every message that arrives on by its kind (`routes`).
    pub fn start(
        me: PeerHello,
        listen: &str,
        peers: &[(u64, String)],
        auth: Option<Auth>,
        routes: Routes,
        options: LinkOptions,
    ) -> Result<Arc<Mesh>, ReplicationError> {
        let LinkOptions { batch, direct, compress, linger } = options;
        let listener = TcpListener::bind(listen).map_err(|err| ReplicationError::Listen { addr: listen.into(), err })?;
        let (spawner, spawns) = mpsc::channel::<Spawn>();
        let mesh = Arc::new(Mesh {
            me,
            out: RwLock::default(),
            auth: auth.clone(),
            batch,
            spawner: Mutex::new(spawner),
            direct,
            compress,
            peers: Mutex::default(),
            accepted: Mutex::default(),
            links: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            frames: AtomicU64::new(0),
            saved: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            linger,
            lingering: AtomicBool::new(false),
            repairs: Repairs::default(),
        });
        let weak = Arc::downgrade(&mesh);
        std::thread::Builder::new()
            .name("peer-spawn".into())
            .spawn(move || {
                for (id, addr, out, rx) in spawns {
                    let Some(mesh) = weak.upgrade() else { return };
                    let started = std::thread::Builder::new().name(format!("peer-tx-{id}")).spawn(move || {
                        let auth = mesh.auth.clone();
                        mesh.send_loop(id, &addr, auth.as_ref(), &out, rx, mesh.batch)
                    });
                    if let Err(e) = started {
                        tracing::error!(id, "cannot start the sender thread of a new member: {e}");
                    }
                }
            })
            .map_err(ReplicationError::Thread)?;
        for (id, addr) in peers {
            mesh.add_peer(*id, addr);
        }
        let m = mesh.clone();
        let handshakes = Handshakes::new("peer links", HANDSHAKE_TIMEOUT);
        // Non-blocking, so that the loop ends handshakes past their time
        // on its tick even when nothing else arrives.
        listener.set_nonblocking(true).map_err(ReplicationError::Thread)?;
        std::thread::Builder::new()
            .name("peer-accept".into())
            .spawn(move || loop {
                handshakes::wait_readable(&listener, None::<&TcpListener>);
                handshakes.expire();
                loop {
                    let (stream, addr) = match listener.accept() {
                        Ok(accepted) => accepted,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        // WouldBlock: all taken; others (out of descriptors): next tick.
                        Err(_) => break,
                    };
                    if stream.set_nonblocking(false).is_err() {
                        continue;
                    }
                    let Some(slot) = handshakes.admit(&stream, addr) else { continue };
                    let Ok(link) = accepted(stream, batch) else { continue };
                    let (m, auth, routes) = (m.clone(), auth.clone(), routes.clone());
                    let peer = link.peer();
                    let _ = std::thread::Builder::new().name("peer-rx".into()).spawn(move || {
                        // It parses what any peer sends: the narrow filter.
                        ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Replication);
                        m.receive(link, &peer, auth.as_ref(), &routes, slot)
                    });
                }
            })
            .map_err(ReplicationError::Thread)?;
        Ok(mesh)
    }

    /// The `syncvm` repair round's pages (`repair`).
    pub fn repairs(&self) -> &Repairs {
        &self.repairs
    }

    /// Queue `frame` for peer `to`; false when it was dropped (unknown peer, full queue).
    pub fn send(&self, to: u64, frame: Vec<u8>) -> bool {
        self.send_batch(to, vec![frame])
    }

    /// Queue `frames` for peer `to` together: its sender thread is woken
    /// once for them (`outbox`). False when they were dropped (unknown
    /// peer, full queue).
    pub fn send_batch(&self, to: u64, frames: Vec<Vec<u8>>) -> bool {
        if frames.is_empty() {
            return true;
        }
        let Some(out) = self.out.read().unwrap_or_else(|e| e.into_inner()).get(&to).cloned() else { return false };
        let frames: Vec<Vec<u8>> = match self.compress {
            LinkCompress::Lz4 => frames
                .into_iter()
                .map(|f| {
                    let raw = f.len();
                    let packed = squeeze::pack(f);
                    self.saved.fetch_add((raw - packed.len()) as u64, Ordering::Relaxed);
                    packed
                })
                .collect(),
            LinkCompress::Off => frames,
        };
        if self.direct == LinkDirect::On && !self.lingers_for(to) {
            if let Some(sent) = self.send_now(to, &out, &frames) {
                return sent;
            }
        }
        let n = frames.len();
        out.queued.fetch_add(n, Ordering::SeqCst);
        match out.queue.try_send(frames) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                out.queued.fetch_sub(n, Ordering::SeqCst);
                false
            }
        }
    }

    /// `--link-direct on`: write `frames` to the peer's link from this
    /// thread, if nothing queued is still to go before them, the link is
    /// up and no other thread writes it, and its socket has room for them
    /// (the write does not block the caller). None when not (they are
    /// queued for the sender thread); else whether they went (a failed
    /// write drops the link, which the sender thread dials again).
    fn send_now(&self, id: u64, out: &Outgoing, frames: &[Vec<u8>]) -> Option<bool> {
        if frames.len() > transport::BATCH_FRAMES || out.queued.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let mut link = out.link.try_lock().ok()?;
        // (The sender thread lowers the count only once it wrote what it
        // took off: zero, with the lock held, means nothing queued is
        // still to go.)
        if out.queued.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let l = link.as_mut()?;
        let bytes: usize = frames.iter().map(Vec::len).sum();
        if l.room()? < bytes + FRAME_SLACK * frames.len() {
            return None;
        }
        let batch: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        match l.send_batch(&batch) {
            Ok(()) => {
                self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
                self.frames.fetch_add(frames.len() as u64, Ordering::Relaxed);
                Some(true)
            }
            Err(e) => {
                tracing::debug!(peer = id, "link lost: {e}");
                l.shutdown();
                *link = None;
                Some(false)
            }
        }
    }

    /// A member joined the group (or is one at start): dial it at `addr`
    /// as messages for it come, and accept its link. Known already: nothing.
    pub fn add_peer(&self, id: u64, addr: &str) {
        if id == self.me.id {
            return;
        }
        let mut out = self.out.write().unwrap_or_else(|e| e.into_inner());
        if out.contains_key(&id) {
            return;
        }
        let (queue, rx) = mpsc::sync_channel(QUEUE);
        let o = Arc::new(Outgoing { queue, link: Mutex::new(None), queued: AtomicUsize::new(0), gone: AtomicBool::new(false) });
        out.insert(id, o.clone());
        tracing::info!(id, addr, "linking to a member");
        let _ = self.spawner.locked().send((id, addr.to_string(), o, rx));
    }

    /// A member left the group: nothing more goes to it, its link is
    /// closed, and a link it dials is refused.
    pub fn remove_peer(&self, id: u64) {
        let Some(o) = self.out.write().unwrap_or_else(|e| e.into_inner()).remove(&id) else { return };
        o.gone.store(true, Ordering::SeqCst);
        // Not waiting for the link's lock: its sender thread may hold it
        // while it dials the lost peer, and the caller is the consensus
        // thread. That thread closes the link itself then.
        if let Ok(mut link) = o.link.try_lock() {
            if let Some(l) = link.take() {
                l.shutdown();
            }
        }
        if let Some((_, l)) = self.accepted.locked().remove(&id) {
            l.shutdown();
        }
        self.peers.locked().remove(&id);
        tracing::info!(id, "replica left the group: its links are closed");
    }

    /// The members this replica has links for (itself left out).
    pub fn members(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.out.read().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Bytes and frames sent since the last call.
    pub fn take_sent(&self) -> (u64, u64) {
        (self.sent.swap(0, Ordering::Relaxed), self.frames.swap(0, Ordering::Relaxed))
    }

    /// Bytes compression kept off the links since the last call.
    pub fn take_saved(&self) -> u64 {
        self.saved.swap(0, Ordering::Relaxed)
    }

    /// What the links told of each peer.
    pub fn peers(&self) -> HashMap<u64, PeerInfo> {
        self.peers.locked().clone()
    }

    /// The link from `id` closed and nothing came from it since.
    pub fn is_lost(&self, id: u64) -> bool {
        self.peers.locked().get(&id).is_some_and(|p| p.heard.is_none())
    }

    pub fn me(&self) -> PeerHello {
        self.me
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// `--witness-linger-us`: while `on`, what this replica sends a witness
    /// without a VM waits that long in its queue, and goes with whatever
    /// joined it meanwhile. Only a leader with a synchronized secondary
    /// turns it on: the secondary's answers commit every entry then, and
    /// the witness is only kept up to date, one wake-up per linger instead
    /// of per consensus round. Without a secondary (or as a candidate)
    /// the witness's answers are what commits, and nothing waits.
    pub fn set_witness_linger(&self, on: bool) {
        self.lingering.store(on, Ordering::Relaxed);
    }

    fn lingers_for(&self, id: u64) -> bool {
        !self.linger.is_zero() && self.lingering.load(Ordering::Relaxed) && self.peers.locked().get(&id).is_some_and(|p| p.witness)
    }

    fn send_loop(&self, id: u64, addr: &str, auth: Option<&Auth>, out: &Outgoing, rx: Receiver<Vec<Vec<u8>>>, batch: LinkBatch) {
        let most = match batch {
            LinkBatch::On => transport::BATCH_FRAMES,
            LinkBatch::Off => 1,
        };
        let mut frames: Vec<Vec<u8>> = Vec::with_capacity(most);
        // The last send took all it could: more is queued, no lingering.
        let mut full = false;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(f) => frames.extend(f),
                Err(RecvTimeoutError::Timeout) => {
                    if self.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    if out.gone.load(Ordering::SeqCst) {
                        return Self::close(out);
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
            if out.gone.load(Ordering::SeqCst) {
                return Self::close(out);
            }
            // A sleep, not a timed wait on the queue: the messages queued
            // meanwhile wake nothing.
            if !full && self.lingers_for(id) {
                std::thread::sleep(self.linger);
            }
            // `--link-batch on`: what else is queued for this peer by now
            // goes with it, in one system call (nothing waits for more
            // unless it lingered).
            while frames.len() < most {
                match rx.try_recv() {
                    Ok(f) => frames.extend(f),
                    Err(_) => break,
                }
            }
            full = frames.len() >= most;
            self.write_out(id, addr, auth, out, &frames, most);
            // Only now: a direct sender waits until these went.
            out.queued.fetch_sub(frames.len(), Ordering::SeqCst);
            frames.clear();
        }
    }

    /// A removed peer's sender thread ends: its link closes.
    fn close(out: &Outgoing) {
        if let Some(l) = out.link.locked().take() {
            l.shutdown();
        }
    }

    /// The sender thread's write of `frames` (dialling first if the link
    /// is down), at most `most` per system call (one with `--link-batch
    /// off`); they are dropped if the peer cannot be reached or the link
    /// breaks.
    fn write_out(&self, id: u64, addr: &str, auth: Option<&Auth>, out: &Outgoing, frames: &[Vec<u8>], most: usize) {
        let mut link = out.link.locked();
        if link.is_none() {
            match dial(addr, auth, self.me) {
                Ok(l) => *link = Some(l),
                Err(e) => return tracing::debug!(peer = id, frames = frames.len(), "cannot reach peer: {e}"),
            }
        }
        let Some(l) = link.as_mut() else { return };
        for chunk in frames.chunks(most) {
            let batch: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
            match l.send_batch(&batch) {
                Ok(()) => {
                    self.sent.fetch_add(batch.iter().map(|f| f.len() as u64).sum(), Ordering::Relaxed);
                    self.frames.fetch_add(batch.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!(peer = id, "link lost: {e}");
                    l.shutdown();
                    *link = None;
                    return;
                }
            }
        }
    }

    /// Serve one accepted link until it breaks; its handshake holds `slot`.
    fn receive(&self, mut link: transport::TcpTransport, peer: &str, auth: Option<&Auth>, routes: &Routes, slot: Slot) {
        let mut buf = Vec::new();
        let _ = link.set_recv_timeout(Some(HANDSHAKE_TIMEOUT));
        let refuse = |line: &dyn std::fmt::Display| {
            if slot.expired() {
                // (Ended at its deadline: the read says "closed", which is not what happened.)
                slot.refuse(&peer, &format_args!("refused a peer link: no complete handshake within {} ms", HANDSHAKE_TIMEOUT.as_millis()))
            } else {
                slot.refuse(&peer, line)
            }
        };
        let first = match link.recv(protocol::HANDSHAKE_LIMIT, &mut buf) {
            Ok(k) => k,
            Err(ProtocolError::Closed) if !slot.expired() => return tracing::debug!(%peer, "a peer link closed before its handshake"),
            Err(e) => return refuse(&format_args!("refused a peer link: {e}")),
        };
        let mut link: Box<dyn Transport> = match auth {
            Some(auth) => match AuthTransport::respond(link, first, &buf, auth) {
                Ok(mut l) => match l.recv(protocol::HANDSHAKE_LIMIT, &mut buf) {
                    Ok(Kind::PeerHello) => Box::new(l),
                    Ok(k) => return refuse(&format_args!("peer link: expected PeerHello, got {k:?}")),
                    Err(e) => return refuse(&format_args!("peer link: {e}")),
                },
                Err(e) => return refuse(&format_args!("refused a peer: {e}")),
            },
            None if first == Kind::PeerHello => Box::new(link),
            None if first != Kind::AuthHello => {
                transport::refuse(&mut link, &format!("this is a replica's peer port: expected PeerHello, got {first:?}"));
                return refuse(&format_args!("refused a peer link: expected PeerHello, got {first:?}"));
            }
            None => {
                transport::refuse(&mut link, "this replica has no --secret-file; start every replica with the same --secret-file or none");
                return refuse(&"refused a peer: it authenticates, this replica does not");
            }
        };
        let hello: PeerHello = match protocol::decode(&buf) {
            Ok(h) => h,
            Err(e) => return refuse(&format_args!("peer link: bad PeerHello: {e}")),
        };
        if hello.id == self.me.id || !self.out.read().unwrap_or_else(|e| e.into_inner()).contains_key(&hello.id) {
            return refuse(&format_args!("refused a peer that is not a member of the group (id {})", hello.id));
        }
        let _ = link.set_recv_timeout(None);
        drop(slot);
        let number = self.links.fetch_add(1, Ordering::Relaxed);
        let old = match link.try_clone() {
            Ok(handle) => self.accepted.locked().insert(hello.id, (number, handle)),
            // (Then this link ends as any would, the peer lost.)
            Err(_) => self.accepted.locked().remove(&hello.id),
        };
        if let Some((_, old)) = old {
            old.shutdown();
        }
        tracing::info!(%peer, id = hello.id, witness = hello.witness, "peer connected");
        if !hello.witness && !self.me.witness && hello.disk != self.me.disk {
            tracing::error!(
                id = hello.id,
                "replica {} has a disk of {} bytes, this one {} (0: none): they cannot synchronize; give every VM replica a disk of the same size",
                hello.id,
                hello.disk,
                self.me.disk
            );
        }
        loop {
            // (A compressed message that does not decode ends the link as a
            // frame that fails its checksum does.)
            let kind = match link.recv(FRAME_LIMIT, &mut buf).and_then(|kind| inflate(kind, &mut buf)) {
                Ok(k) => k,
                Err(e) => {
                    let mut accepted = self.accepted.locked();
                    if accepted.get(&hello.id).is_some_and(|(n, _)| *n != number) {
                        // Replaced: the peer is on its new link.
                        return tracing::debug!(id = hello.id, "a replaced peer link ended: {e}");
                    }
                    accepted.remove(&hello.id);
                    drop(accepted);
                    match e {
                        ProtocolError::Closed => tracing::info!(id = hello.id, "peer link closed"),
                        e => tracing::warn!(id = hello.id, "peer link: {e}"),
                    }
                    return self.lost(hello.id, routes);
                }
            };
            self.peers.locked().insert(
                hello.id,
                PeerInfo { witness: hello.witness, standby: hello.standby, disk: hello.disk, heard: Some(Instant::now()) },
            );
            let msg = Inbound { from: hello.id, kind, payload: std::mem::take(&mut buf), lost: None };
            let delivered = match kind {
                Kind::Raft => routes.raft.send(Event::Peer(msg)).is_ok(),
                Kind::SyncAck => {
                    // `--ack-release link`: the acknowledgement first, so
                    // that the applier goes on while this thread releases.
                    let release = routes.acks.take(msg.from, &msg.payload);
                    let delivered = routes.sync.send(msg).is_ok();
                    if let Some(r) = release {
                        r.run();
                    }
                    delivered
                }
                Kind::SyncBitmap | Kind::SyncHashes | Kind::SyncWant | Kind::SyncBlockHashes | Kind::SyncPages => {
                    routes.sync.send(msg).is_ok()
                }
                Kind::SyncRepaired => {
                    self.repairs.arrived(msg.from, msg.payload);
                    true
                }
                Kind::SyncRepair => {
                    match self.repairs.answer(msg.from, &msg.payload) {
                        Ok(frame) => {
                            self.send(msg.from, frame);
                        }
                        Err(e) => tracing::warn!(id = msg.from, "cannot repair the replica's pages: {e}"),
                    }
                    true
                }
                // A witness has no VM: nobody reads these (dropped with
                // the receiver).
                Kind::RejoinStart | Kind::RejoinPages => {
                    let _ = routes.join.send(msg);
                    true
                }
                Kind::RejoinHashes | Kind::RejoinAck => {
                    let _ = routes.precopy.send(msg);
                    true
                }
                other => {
                    tracing::warn!(id = hello.id, "unexpected {other:?} on a peer link");
                    true
                }
            };
            if !delivered || self.stop.load(Ordering::SeqCst) {
                return;
            }
        }
    }
}

impl Mesh {
    /// The link a peer dialled here broke: its process most likely died
    /// (a killed VMM's sockets close at once). It no longer counts as
    /// alive, and the consensus thread may take it for a lost leader. A
    /// live peer whose link broke for another reason dials again at its
    /// next message, which makes it alive again.
    fn lost(&self, id: u64, routes: &Routes) {
        if let Some(p) = self.peers.locked().get_mut(&id) {
            p.heard = None;
        }
        let _ = routes.raft.send(Event::PeerLost(id));
        routes.acks.lost(id);
        let _ = routes.sync.send(Inbound { from: id, kind: Kind::PeerHello, payload: Vec::new(), lost: Some(Instant::now()) });
    }
}

/// A frame that came compressed (`--link-compress lz4`) as it was sent:
/// its kind, its payload in `payload`; any other as it is.
fn inflate(kind: Kind, payload: &mut Vec<u8>) -> Result<Kind, ProtocolError> {
    if kind != Kind::Lz4 {
        return Ok(kind);
    }
    let packed = std::mem::take(payload);
    squeeze::unpack(&packed, FRAME_LIMIT, payload)
}

fn dial(addr: &str, auth: Option<&Auth>, me: PeerHello) -> Result<Box<dyn Transport>, ReplicationError> {
    let tcp = transport::connect(addr, DIAL_TIMEOUT)?;
    tcp.set_user_timeout(UNACKED_TIMEOUT).map_err(ReplicationError::Send)?;
    let mut link: Box<dyn Transport> = match auth {
        Some(auth) => Box::new(AuthTransport::initiate(tcp, auth)?),
        None => Box::new(tcp),
    };
    link.send(&protocol::message(Kind::PeerHello, &me)).map_err(ReplicationError::Send)?;
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Routes whose `syncvm` messages (all this test sends) come out of the receiver.
    fn routes() -> (Routes, Receiver<Inbound>) {
        let (sync, inbox) = mpsc::channel();
        let routes = Routes { raft: mpsc::channel().0, sync, join: mpsc::channel().0, precopy: mpsc::channel().0, acks: Arc::default() };
        (routes, inbox)
    }

    /// A free port below Linux's ephemeral range (32768 up): a port the
    /// kernel handed out for this test could be handed out again, before
    /// the node binds it, as the local port of a peer's outgoing
    /// connection (seen as AddrInUse). Each test process starts at its own
    /// place in the range.
    fn free_addr() -> String {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let start = 10_000 + (std::process::id() % 1000) * 20;
        loop {
            let port = start + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 20_000;
            let port = 10_000 + (port - 10_000) % 22_000;
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
                return l.local_addr().unwrap().to_string();
            }
        }
    }

    fn node(id: u64, witness: bool, addrs: &[(u64, String)], linger: Duration) -> (Arc<Mesh>, Receiver<Inbound>) {
        node_with(id, witness, addrs, LinkOptions { batch: LinkBatch::On, direct: LinkDirect::Off, compress: LinkCompress::Off, linger })
    }

    fn node_with(id: u64, witness: bool, addrs: &[(u64, String)], options: LinkOptions) -> (Arc<Mesh>, Receiver<Inbound>) {
        let listen = addrs.iter().find(|(i, _)| *i == id).unwrap().1.clone();
        let others: Vec<(u64, String)> = addrs.iter().filter(|(i, _)| *i != id).cloned().collect();
        let (routes, inbox) = routes();
        let hello = PeerHello { id, witness, standby: false, disk: 0 };
        (Mesh::start(hello, &listen, &others, None, routes, options).unwrap(), inbox)
    }

    /// Replicas 1 and 2 linked with `direct` and `compress`: 1, and 2 with
    /// what reaches it.
    fn sender_and_receiver(direct: LinkDirect, compress: LinkCompress) -> (Arc<Mesh>, Arc<Mesh>, Receiver<Inbound>) {
        let addrs: Vec<(u64, String)> = (1..=2).map(|i| (i, free_addr())).collect();
        let options = LinkOptions { batch: LinkBatch::On, direct, compress, linger: Duration::ZERO };
        let (sender, _) = node_with(1, false, &addrs, options);
        let (receiver, inbox) = node_with(2, false, &addrs, options);
        (sender, receiver, inbox)
    }

    fn frame(tag: u8) -> Vec<u8> {
        protocol::frame(Kind::SyncBitmap, &[tag])
    }

    /// `--link-direct on`: messages sent from two threads at once, each
    /// in turn written directly or queued for the sender thread (the first
    /// ones while the link is being dialled, later ones whenever the
    /// socket or the link is busy), arrive complete and each thread's in
    /// the order it sent them.
    #[test]
    fn direct_and_queued_sends_keep_each_senders_order() {
        let (sender, _receiver, inbox) = sender_and_receiver(LinkDirect::On, LinkCompress::Off);
        const EACH: u32 = 20_000;
        let threads: Vec<_> = (0..2u8)
            .map(|t| {
                let sender = sender.clone();
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        let mut body = vec![t];
                        body.extend_from_slice(&i.to_le_bytes());
                        // A full queue drops (as for raft's messages): retry.
                        while !sender.send(2, protocol::frame(Kind::SyncBitmap, &body)) {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u32; 2];
        while next != [EACH; 2] {
            let m = inbox.recv_timeout(Duration::from_secs(20)).expect("a message went missing");
            let (t, i) = (m.payload[0] as usize, u32::from_le_bytes(m.payload[1..5].try_into().unwrap()));
            assert_eq!(i, next[t], "thread {t}'s messages out of order");
            next[t] += 1;
        }
        threads.into_iter().for_each(|t| t.join().unwrap());
        let (_, frames) = sender.take_sent();
        assert_eq!(frames, 2 * EACH as u64);
        sender.stop();
    }

    /// `--link-compress lz4`: what compresses goes shorter, the rest as it
    /// is, and each arrives as it was sent, in order.
    #[test]
    fn compressed_links_deliver_every_message_as_sent() {
        let (sender, _receiver, inbox) = sender_and_receiver(LinkDirect::Off, LinkCompress::Lz4);
        let sent: Vec<(Kind, Vec<u8>)> = (0..200u32)
            .map(|i| match i % 3 {
                0 => (Kind::SyncPages, [i.to_le_bytes().to_vec(), vec![0; 8192]].concat()),
                1 => {
                    let mut noise = vec![0; 1024];
                    getrandom::fill(&mut noise).unwrap();
                    (Kind::SyncHashes, noise)
                }
                _ => (Kind::SyncAck, i.to_le_bytes().to_vec()),
            })
            .collect();
        let raw: usize = sent.iter().map(|(k, p)| protocol::frame(*k, p).len()).sum();
        for (kind, payload) in &sent {
            assert!(sender.send(2, protocol::frame(*kind, payload)));
        }
        for (kind, payload) in &sent {
            let m = inbox.recv_timeout(Duration::from_secs(20)).expect("a message went missing");
            assert_eq!((m.kind, &m.payload), (*kind, payload));
        }
        let (bytes, frames) = sender.take_sent();
        assert_eq!(frames, sent.len() as u64);
        assert!(bytes * 4 < raw as u64, "{bytes} bytes sent for {raw}");
        assert_eq!(sender.take_saved(), raw as u64 - bytes, "what was saved and what went add up");
        sender.stop();
    }

    /// A link to `addr` that says it is replica `id`.
    fn dial_as(addr: &str, id: u64) -> Box<dyn Transport> {
        dial(addr, None, PeerHello { id, witness: false, standby: false, disk: 0 }).unwrap()
    }

    #[test]
    fn a_peer_that_dials_again_replaces_its_old_link_without_counting_as_lost() {
        let addrs: Vec<(u64, String)> = (1..=2).map(|i| (i, free_addr())).collect();
        let (node1, at1) = node(1, false, &addrs, Duration::ZERO);
        let wait = Duration::from_secs(20);
        let mut old = dial_as(&addrs[0].1, 2);
        old.send(&frame(1)).unwrap();
        assert_eq!(at1.recv_timeout(wait).unwrap().payload, [1]);
        let mut new = dial_as(&addrs[0].1, 2);
        new.send(&frame(2)).unwrap();
        assert_eq!(at1.recv_timeout(wait).unwrap().payload, [2]);
        // The old one was shut down: its reader is gone, and its end of
        // the connection reads the close.
        old.set_recv_timeout(Some(wait)).unwrap();
        let mut buf = Vec::new();
        assert!(matches!(old.recv(FRAME_LIMIT, &mut buf), Err(ProtocolError::Closed)));
        assert!(!node1.is_lost(2), "the replaced link's end made its peer look lost");
        assert!(at1.try_recv().is_err(), "the replaced link's end reached the syncvm route");
        // The current link's end does.
        new.shutdown();
        let notice = at1.recv_timeout(wait).unwrap();
        assert!(notice.lost.is_some() && node1.is_lost(2));
        node1.stop();
    }

    #[test]
    fn a_leader_lingers_only_on_what_it_sends_a_witness() {
        let addrs: Vec<(u64, String)> = (1..=3).map(|i| (i, free_addr())).collect();
        let linger = Duration::from_secs(2);
        let (leader, _at_leader) = node(1, false, &addrs, linger);
        let (secondary, at_secondary) = node(2, false, &addrs, Duration::ZERO);
        let (witness, at_witness) = node(3, true, &addrs, Duration::ZERO);
        let wait = Duration::from_secs(20);
        // Each makes itself known to the leader first.
        for peer in [&secondary, &witness] {
            assert!(peer.send(1, frame(0)));
        }
        while leader.peers().len() < 2 {
            std::thread::sleep(Duration::from_millis(5));
        }
        // Off: nothing waits.
        assert!(leader.send(3, frame(1)));
        assert_eq!(at_witness.recv_timeout(wait).unwrap().payload, [1]);

        leader.set_witness_linger(true);
        let sent = Instant::now();
        assert!(leader.send(3, frame(2)));
        assert!(leader.send(2, frame(3)));
        assert!(leader.send(3, frame(4)));
        assert_eq!(at_secondary.recv_timeout(wait).unwrap().payload, [3]);
        assert!(at_witness.try_recv().is_err(), "the witness's messages did not linger");
        assert_eq!(at_witness.recv_timeout(wait).unwrap().payload, [2]);
        assert!(sent.elapsed() >= linger);
        assert_eq!(at_witness.recv_timeout(wait).unwrap().payload, [4], "what joined in the linger went with it");
        for m in [&leader, &secondary, &witness] {
            m.stop();
        }
    }
}
