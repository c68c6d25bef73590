//! The proxy's flows: per TCP connection of the guest, what the peer really
//! acknowledged and allows, what the guest was told, and the data told
//! acknowledged that the peer has not acknowledged yet (the store). No I/O
//! here: the callers pass frames in and send what comes out.
//!
//! Invariants, per flow (sequence numbers are the guest's):
//! - `real_ack <= fake_ack`: the guest is never told less than the peer said;
//! - the store holds every byte of `[real_ack, fake_ack)`, in order: each
//!   one is either acknowledged by the peer or can be sent again;
//! - the guest is never allowed past `real_edge` (the peer's last
//!   acknowledgement plus its window): every window it hears is counted
//!   from what it is told acknowledged up to that edge.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::segment::{self, before, later, Endpoint, Segment, ACK, FIN, RST, SYN};

/// Flows tracked at most; connections beyond them pass untouched.
pub const MAX_FLOWS: usize = 1024;
/// First retransmission timeout of stored data, doubled on each timeout up
/// to `MAX_BACKOFF` doublings.
pub const RTO: Duration = Duration::from_millis(200);
const MAX_BACKOFF: u32 = 5;
/// Duplicate ACKs from the peer that make the proxy resend its oldest segment.
const DUP_ACKS: u32 = 3;
/// A flow whose handshake has not completed after this long is forgotten:
/// a peer that gave up on a SYN the guest never answered sends nothing
/// more, and such flows would fill `MAX_FLOWS` for good.
pub const HALF_OPEN_TIMEOUT: Duration = Duration::from_secs(60);
/// Payload bytes from which a segment counts as full-sized (`Sent::bulk`):
/// Ethernet's MSS is 1460, and a stack sends full segments while it has
/// more queued than one holds.
pub const BULK_SEGMENT: u32 = 1024;
/// Bytes of a flow the peer has not acknowledged from which the guest's
/// sender would be held back without the proxy (half the 64 KiB send
/// buffer of the kv guest and of the Linux personality's sockets): below
/// it the made-up ACK does not change its pace.
pub const BULK_UNACKNOWLEDGED: u32 = 32 << 10;

/// Which flows have their held data acknowledged early.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Early {
    /// Every tracked flow (`--fake-ack on`).
    #[default]
    Every,
    /// Only flows found carrying bulk data (`--fake-ack bulk`, the
    /// default under `--tuning auto`; `Flow::bulk`).
    Bulk,
}

/// A connection: the guest's end and the peer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FlowKey {
    pub guest: Endpoint,
    pub peer: Endpoint,
}

/// A guest segment told acknowledged, kept until the peer acknowledges it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stored {
    pub seq: u32,
    pub len: u32,
    /// The output epoch it was sent in: it may be sent again only once that
    /// epoch's output was released (output commit).
    pub epoch: u64,
    /// Shared, so that saving the state at a freeze copies no frame.
    #[serde(with = "frame_bytes")]
    pub frame: Arc<[u8]>,
}

/// A frame as one byte string on the wire (not a sequence of single bytes).
mod frame_bytes {
    use std::sync::Arc;

    use serde::de::{Error, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(frame: &Arc<[u8]>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(frame)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<[u8]>, D::Error> {
        struct Bytes;
        impl<'de> Visitor<'de> for Bytes {
            type Value = Arc<[u8]>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a frame's bytes")
            }
            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Arc<[u8]>, E> {
                Ok(v.into())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Arc<[u8]>, A::Error> {
                let mut v = Vec::new();
                while let Some(b) = seq.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(v.into())
            }
        }
        d.deserialize_bytes(Bytes)
    }
}

impl Stored {
    fn end(&self) -> u32 {
        self.seq.wrapping_add(self.len)
    }
}

/// One flow's state, as checkpoints carry it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flow {
    /// Window scale options of the two SYNs (each side's shift).
    guest_wscale: Option<u8>,
    peer_wscale: Option<u8>,
    /// Both SYNs seen: sequence numbers and the window scale are known.
    synced: bool,
    /// The peer's highest acknowledgement, and how far it lets the guest send.
    real_ack: u32,
    real_edge: u32,
    /// What the guest was told acknowledged (at least `real_ack`).
    fake_ack: u32,
    /// What the guest heard last (acknowledgement, and the edge of its
    /// window), so that a rewritten stale ACK that tells it nothing new is
    /// absorbed.
    told_ack: u32,
    told_edge: u32,
    /// The acknowledgement and window of the guest's latest segment: a
    /// stored segment goes again with them (`Flow::again`).
    guest_ack: u32,
    guest_window: u16,
    guest_fin: bool,
    peer_fin: bool,
    /// The flow carries bulk data (`Flow::classify`): with `Early::Bulk`
    /// only such a flow is acknowledged early and keeps a store.
    bulk: bool,
    pub(super) store: VecDeque<Stored>,
    #[serde(skip)]
    timer: Timer,
}

/// Retransmission bookkeeping: not replicated (a backup that takes over
/// resends everything stored at once and starts afresh).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Timer {
    dup_acks: u32,
    /// When the oldest released stored segment is sent again.
    rto_at: Option<Instant>,
    backoff: u32,
    /// When `tick` first saw the flow half open.
    half_open_since: Option<Instant>,
}

impl Flow {
    fn new() -> Flow {
        Flow {
            guest_wscale: None,
            peer_wscale: None,
            synced: false,
            real_ack: 0,
            real_edge: 0,
            fake_ack: 0,
            told_ack: 0,
            told_edge: 0,
            guest_ack: 0,
            guest_window: 0,
            guest_fin: false,
            peer_fin: false,
            bulk: false,
            store: VecDeque::new(),
            timer: Timer::default(),
        }
    }

    /// The handshake completed: everything up to `start` is acknowledged,
    /// the guest may send up to `edge`.
    fn sync(&mut self, start: u32, edge: u32) {
        (self.real_ack, self.fake_ack, self.told_ack) = (start, start, start);
        (self.real_edge, self.told_edge) = (edge, edge);
        self.synced = true;
    }

    /// The shift of the peer's windows: its option, if both sides sent one.
    fn shift(&self) -> u8 {
        match (self.guest_wscale, self.peer_wscale) {
            (Some(_), Some(s)) => s,
            _ => 0,
        }
    }

    /// The window field that lets the guest, told `ack`, send up to
    /// `real_edge` and no further (rounded down by the shift).
    fn window_from(&self, ack: u32) -> u16 {
        if before(self.real_edge, ack) {
            return 0;
        }
        (self.real_edge.wrapping_sub(ack) >> self.shift()).min(u32::from(u16::MAX)) as u16
    }

    /// The right edge a window field gives from `ack`.
    fn edge(&self, ack: u32, window: u16) -> u32 {
        ack.wrapping_add(u32::from(window) << self.shift())
    }

    /// Its fields without the store (what a change of the flow carries
    /// besides the segments; `delta`).
    pub(super) fn fields(&self) -> Flow {
        Flow { store: VecDeque::new(), timer: Timer::default(), ..*self }
    }

    /// Take `fields`' fields, keeping this flow's store and timer.
    pub(super) fn set_fields(&mut self, fields: Flow) {
        *self = Flow { store: std::mem::take(&mut self.store), timer: std::mem::take(&mut self.timer), ..fields };
    }

    pub(super) fn stored_bytes(&self) -> u64 {
        self.store.iter().map(|s| s.frame.len() as u64).sum()
    }

    /// Whether the guest's data segment `seg` (new data, ending at `end`)
    /// puts this flow in bulk mode or takes it out, with `Early::Bulk`.
    ///
    /// Measured (docs/replication.md, "The tuning policy"): acknowledging
    /// early made a bulk read (GET of 4 MiB) 1.6x faster but small
    /// request/response traffic (kv, redis-server at -P 1, 100-byte
    /// values) 3-18% slower, each reply costing a stored frame, a made-up
    /// ACK the guest has to take in, and the peer's ACKs rewritten. So it
    /// is done only where it pays, decided per flow from what it sends:
    /// - in: a bulk send (`bulk_send`): a full-sized segment while the peer
    ///   has 32 KiB or more of the flow unacknowledged, which only a sender
    ///   with more queued than its replies of a few KB reaches, and from
    ///   which, held, it would soon stop on a full send buffer. Replies of
    ///   kv and redis-server to 16 pipelined requests of 1000 bytes stay
    ///   below it.
    /// - out: a short segment sent with nothing of the flow unacknowledged
    ///   and nothing stored, a lone reply on an idle connection: the flow
    ///   went back to requests and responses. A bulk reply's segments go
    ///   out with earlier ones in flight, and the first segment of the
    ///   next one on an idle connection is full-sized.
    ///
    /// A flow leaves only with nothing stored and nothing told beyond the
    /// peer, so the store invariant holds across the change.
    fn classify(&mut self, seg: &Segment, end: u32) {
        if !self.bulk && bulk_send(seg, end, self.real_ack) {
            self.bulk = true;
        } else if self.bulk && seg.len < BULK_SEGMENT && seg.seq == self.real_ack && self.fake_ack == self.real_ack && self.store.is_empty()
        {
            self.bulk = false;
        }
    }

    /// Whether the guest's held data of this flow is acknowledged early.
    fn early(&self, early: Early) -> bool {
        early == Early::Every || self.bulk
    }

    /// The sequence number a pure ACK of the guest's starting at `seq` must
    /// carry instead, if any: the peer's window edge when `seq` lies beyond
    /// it because the guest was told acknowledged more than the peer took.
    ///
    /// A peer may shrink its window (Linux with `tcp_shrink_window=1` does
    /// when its reader stops reading), dropping data it had room for when
    /// the proxy acknowledged it to the guest: the guest's next sequence
    /// number is then beyond the peer's window, and a peer drops a segment
    /// out of its window whole, acknowledgement and window included. A
    /// client that writes without reading (Redis's "PIPELINING stresser")
    /// then never hears the guest take its requests in, and stops for good
    /// (its own window stays shut). Linux's senders answer the same way
    /// (`tcp_acceptable_seq`: an ACK carries the window's end when its next
    /// sequence number is beyond it).
    fn acceptable_seq(&self, seq: u32) -> Option<u32> {
        (before(self.real_ack, self.fake_ack) && before(self.real_edge, seq)).then_some(self.real_edge)
    }

    /// Stored segment `s` to send again, with the guest's latest
    /// acknowledgement and window instead of those it was sent with.
    ///
    /// A peer drops a segment whose acknowledgement lies more than a
    /// window behind what it knows acknowledged (Linux: RFC 5961's blind
    /// data injection check, `TCP_TOO_OLD_ACK`), data and all. A segment
    /// stored while the peer's window was shut goes again after the peer
    /// may have sent megabytes more that the guest acknowledged: with its
    /// old acknowledgement it would never be taken. A retransmission by
    /// the guest itself would carry the current ones too.
    fn again(&self, s: &Stored) -> Vec<u8> {
        let mut frame = s.frame.to_vec();
        let stale = segment::parse(&frame).filter(|seg| seg.has(ACK) && (seg.ack, seg.window) != (self.guest_ack, self.guest_window));
        if let Some(seg) = stale {
            segment::set_ack_window(&mut frame, &seg, self.guest_ack, self.guest_window);
        }
        frame
    }

    /// The peer's window reaches past `old_edge` now. Stored segments that
    /// lay beyond it when it was the edge were dropped by the peer (it
    /// shrank its window after they were acknowledged to the guest, or
    /// they probed a shut one), and the guest will not send them again (it
    /// was told they arrived): the released ones that fit now go again at
    /// once, not at the retransmission timer, which backs off to seconds
    /// while a window stays shut.
    fn window_opened(&mut self, old_edge: u32, released_before: u64, resend: &mut Vec<Vec<u8>>) {
        let before_len = resend.len();
        let fit = self.store.iter().filter(|s| s.epoch < released_before && before(old_edge, s.end()) && before(s.seq, self.real_edge));
        resend.extend(fit.map(|s| self.again(s)));
        if resend.len() > before_len {
            tracing::debug!(segments = resend.len() - before_len, "fake ACK: the peer's window opened; resending what it dropped");
            (self.timer.rto_at, self.timer.backoff) = (None, 0);
        }
    }

    /// The peer acknowledged up to `ack`: forget what it covers.
    fn acknowledged(&mut self, ack: u32) -> u64 {
        let mut freed = 0;
        while self.store.front().is_some_and(|s| !before(ack, s.end())) {
            freed += self.store.pop_front().expect("non-empty").frame.len() as u64;
        }
        freed
    }
}

/// What the proxy holds: all flows, and what their stores hold together.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Table {
    pub(super) flows: BTreeMap<FlowKey, Flow>,
    pub(super) stored: u64,
    /// Stored frame bytes over all flows beyond which segments pass without
    /// a made-up ACK (the guest waits for the peer's); twice as many at
    /// most are stored (what the guest sent unacknowledged).
    bound: u64,
    /// Which flows are acknowledged early.
    early: Early,
}

/// A full-sized segment of a flow with at least `BULK_UNACKNOWLEDGED`
/// bytes the peer has not acknowledged (`real_ack`) once it is sent:
/// part of a bulk send, whose sender goes on once acknowledged.
fn bulk_send(seg: &Segment, end: u32, real_ack: u32) -> bool {
    seg.len >= BULK_SEGMENT && end.wrapping_sub(real_ack) >= BULK_UNACKNOWLEDGED
}

/// What a guest frame led to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// An ACK to give the guest.
    pub ack: Option<Vec<u8>>,
    /// The acknowledged segment was full-sized: part of a bulk send, whose
    /// sender goes on once acknowledged (a short one usually ends a reply).
    pub bulk: bool,
    /// The frame to send instead of the guest's: its pure ACK with the
    /// sequence number pulled back to the peer's window edge
    /// (`Flow::acceptable_seq`).
    pub instead: Option<Vec<u8>>,
}

impl Table {
    pub fn new(bound: u64, early: Early) -> Table {
        Table { flows: BTreeMap::new(), stored: 0, bound, early }
    }

    pub fn flows(&self) -> usize {
        self.flows.len()
    }

    /// Flows in bulk mode (`Flow::classify`; with `Early::Every` every
    /// flow is acknowledged early whichever mode it is in).
    pub fn bulk_flows(&self) -> usize {
        self.flows.values().filter(|f| f.bulk).count()
    }

    /// Frame bytes stored, over all flows.
    pub fn stored_bytes(&self) -> u64 {
        self.stored
    }

    /// What a backup needs of this table: the flows whose guest was told
    /// more acknowledged than the peer said, or that hold a store. The
    /// others (every request/response flow under `Early::Bulk`, and the
    /// idle ones) the guest restored from the checkpoint knows exactly as
    /// the peer does: a backup that takes over has nothing to resend or
    /// raise for them, and its proxy lets a flow it does not track pass
    /// untouched. Without them a checkpoint carries no fields of flows
    /// that change with every request.
    pub fn carried(mut self) -> Table {
        self.flows.retain(|_, f| f.fake_ack != f.real_ack || !f.store.is_empty());
        self
    }

    /// The guest transmits `frame` (held with its epoch, or sent at once;
    /// `Sent::instead` may replace it). `epoch`: the output epoch while
    /// output is held (the only time data is acknowledged on the peer's
    /// behalf).
    pub fn guest_sent(&mut self, frame: &[u8], epoch: Option<u64>) -> Sent {
        let Some(seg) = segment::parse(frame) else { return Sent::default() };
        let key = FlowKey { guest: seg.src, peer: seg.dst };
        if seg.has(RST) {
            self.remove(&key);
            return Sent::default();
        }
        if seg.has(SYN) {
            self.guest_syn(key, &seg);
            return Sent::default();
        }
        let bound = self.bound;
        let stored = self.stored;
        let Some(flow) = self.flows.get_mut(&key) else { return Sent::default() };
        if !flow.synced || !seg.has(ACK) {
            return Sent::default();
        }
        (flow.guest_ack, flow.guest_window) = (seg.ack, seg.window);
        if seg.has(FIN) {
            flow.guest_fin = true;
        }
        if seg.len == 0 && !seg.has(FIN) {
            let instead = flow.acceptable_seq(seg.seq).map(|seq| {
                let mut f = frame.to_vec();
                segment::set_seq(&mut f, &seg, seq);
                f
            });
            return Sent { instead, ..Sent::default() };
        }
        if seg.has(FIN) {
            return Sent::default();
        }
        let end = seg.seq.wrapping_add(seg.len);
        if !before(flow.fake_ack, end) && flow.early(self.early) {
            // Sent again, all of it told acknowledged already (the guest
            // missed an ACK, or restarted from a checkpoint before it):
            // tell it again (held or not: it was stored when told).
            let ack = flow.fake_ack;
            let window = flow.window_from(ack);
            flow.told_ack = ack;
            flow.told_edge = flow.edge(ack, window);
            return Sent { ack: Some(segment::pure_ack(&seg, seg.ack, ack, window)), ..Sent::default() };
        }
        if before(flow.fake_ack, end) {
            flow.classify(&seg, end);
        }
        if !flow.early(self.early) {
            // Not acknowledged early: nothing to store either (the flow
            // left bulk mode with an empty store).
            return Sent::default();
        }
        // Every segment is stored (unless after a gap or beyond all room),
        // acknowledged or not: a store that covers everything the guest
        // sent beyond the peer's acknowledgement lets the next segment be
        // acknowledged (with all before it) whenever there is room again;
        // without it, one segment passed unacknowledged would leave a gap
        // behind every later one as long as data is in flight.
        let len = frame.len() as u64;
        let next = flow.store.back().map_or(flow.fake_ack, |s| later(flow.fake_ack, s.end()));
        if (before(next, seg.seq) && !flow.store.is_empty()) || stored + len > bound * 2 {
            // After a gap behind what is stored (no room for a segment):
            // it goes as it would without the proxy.
            return Sent::default();
        }
        // Sent unprotected, it is already out: as good as released (epoch 0).
        flow.store.push_back(Stored { seq: seg.seq, len: seg.len, epoch: epoch.unwrap_or(0), frame: frame.into() });
        self.stored += len;
        // Acknowledged only while output is held, within the peer's window,
        // while what is stored stays within the bound, and once the store
        // reaches back to what the guest was told: an empty store may start
        // after a gap (a flow entering bulk mode with data in flight that
        // was not stored, or one that had no room), and the segments from
        // there are acknowledged once the peer's acknowledgement reaches
        // them (the guest resends what lies before, as without the proxy).
        let covered = flow.store.front().is_some_and(|s| !before(flow.fake_ack, s.seq));
        if epoch.is_none() || before(flow.real_edge, end) || stored + len > bound || !covered {
            return Sent::default();
        }
        flow.fake_ack = end;
        let window = flow.window_from(end);
        flow.told_ack = end;
        flow.told_edge = flow.edge(end, window);
        let bulk = bulk_send(&seg, end, flow.real_ack);
        Sent { ack: Some(segment::pure_ack(&seg, seg.ack, end, window)), bulk, instead: None }
    }

    fn guest_syn(&mut self, key: FlowKey, seg: &Segment) {
        if !seg.has(ACK) {
            // The guest connects out: a new flow (a reused one starts afresh).
            self.open(key, Flow { guest_wscale: seg.wscale, ..Flow::new() });
            return;
        }
        // The guest accepts a connection the peer opened (a SYN-ACK sent
        // again changes nothing).
        if let Some(flow) = self.flows.get_mut(&key).filter(|f| !f.synced) {
            flow.guest_wscale = seg.wscale;
            let start = seg.seq.wrapping_add(1);
            // The peer's SYN window is not scaled.
            let edge = start.wrapping_add(flow.real_edge);
            flow.sync(start, edge);
        }
    }

    /// A frame from the network for the guest: rewrite it so the guest
    /// never hears an acknowledgement below what it was told (its window
    /// counted to the peer's real edge). False: absorb it (a stale pure ACK
    /// telling the guest nothing new). `released_before`: output of epochs
    /// before it has been released. Segments to send again go to `resend`.
    pub fn peer_sent(&mut self, frame: &mut [u8], released_before: u64, resend: &mut Vec<Vec<u8>>) -> bool {
        let Some(seg) = segment::parse(frame) else { return true };
        let key = FlowKey { guest: seg.dst, peer: seg.src };
        if seg.has(RST) {
            self.remove(&key);
            return true;
        }
        if seg.has(SYN) {
            self.peer_syn(key, &seg);
            return true;
        }
        let Some(flow) = self.flows.get_mut(&key) else { return true };
        if !flow.synced || !seg.has(ACK) {
            return true;
        }
        if seg.has(FIN) {
            flow.peer_fin = true;
        }
        let ack = seg.ack;
        let edge = flow.edge(ack, seg.window);
        let old_edge = flow.real_edge;
        let mut freed = 0;
        if before(flow.real_ack, ack) {
            // New data acknowledged.
            freed = flow.acknowledged(ack);
            flow.real_ack = ack;
            flow.real_edge = edge;
            flow.fake_ack = later(flow.fake_ack, ack);
            flow.timer = Timer::default();
        } else if ack == flow.real_ack {
            let dup = seg.len == 0 && !seg.has(FIN) && edge == flow.real_edge && !flow.store.is_empty();
            flow.real_edge = edge;
            if dup {
                flow.timer.dup_acks += 1;
                if flow.timer.dup_acks == DUP_ACKS {
                    if let Some(s) = flow.store.front().filter(|s| s.epoch < released_before) {
                        tracing::debug!(seq = s.seq, "fake ACK: resending after duplicate ACKs");
                        resend.push(flow.again(s));
                    }
                }
            }
        }
        // (An acknowledgement older than the last one changes nothing.)
        if before(old_edge, flow.real_edge) {
            flow.window_opened(old_edge, released_before, resend);
        }
        self.stored -= freed;
        let told = later(ack, flow.fake_ack);
        // Not raised, the frame is current (its edge is the real one): its
        // own window stands.
        let window = if told == ack { seg.window } else { flow.window_from(told) };
        let told_edge = flow.edge(told, window);
        let pure = seg.len == 0 && seg.flags & (SYN | FIN | RST) == 0;
        if told != ack || window != seg.window {
            if pure && told == flow.told_ack && told_edge == flow.told_edge {
                return false;
            }
            segment::set_ack_window(frame, &seg, told, window);
        }
        flow.told_ack = told;
        flow.told_edge = told_edge;
        if flow.guest_fin && flow.peer_fin && flow.store.is_empty() {
            self.flows.remove(&key);
        }
        true
    }

    fn peer_syn(&mut self, key: FlowKey, seg: &Segment) {
        if !seg.has(ACK) {
            // The peer connects to the guest: remember its window (not
            // scaled in a SYN) until the guest's SYN-ACK gives the start.
            self.open(key, Flow { peer_wscale: seg.wscale, real_edge: u32::from(seg.window), ..Flow::new() });
            return;
        }
        // The peer accepts the guest's connection.
        if let Some(flow) = self.flows.get_mut(&key).filter(|f| !f.synced) {
            flow.peer_wscale = seg.wscale;
            flow.sync(seg.ack, seg.ack.wrapping_add(u32::from(seg.window)));
        }
    }

    /// A SYN starts `flow` afresh under `key`, unless the table is full.
    fn open(&mut self, key: FlowKey, flow: Flow) {
        self.remove(&key);
        if self.flows.len() < MAX_FLOWS {
            self.flows.insert(key, flow);
        }
    }

    fn remove(&mut self, key: &FlowKey) {
        if let Some(flow) = self.flows.remove(key) {
            self.stored -= flow.stored_bytes();
        }
    }

    /// Time passed: segments whose timeout expired (released ones only)
    /// go to `resend`.
    pub fn tick(&mut self, now: Instant, released_before: u64, resend: &mut Vec<Vec<u8>>) {
        self.flows.retain(|_, flow| {
            // Half open: nothing stored yet (the guest sends data only
            // once its SYN-ACK made the flow synced).
            flow.synced || now.saturating_duration_since(*flow.timer.half_open_since.get_or_insert(now)) < HALF_OPEN_TIMEOUT
        });
        for flow in self.flows.values_mut() {
            let Some(first) = flow.store.front().filter(|s| s.epoch < released_before) else { continue };
            match flow.timer.rto_at {
                None => flow.timer.rto_at = Some(now + RTO),
                Some(at) if now >= at => {
                    tracing::debug!(seq = first.seq, backoff = flow.timer.backoff, "fake ACK: resending after a timeout");
                    resend.push(flow.again(first));
                    flow.timer.backoff = (flow.timer.backoff + 1).min(MAX_BACKOFF);
                    flow.timer.rto_at = Some(now + RTO * (1 << flow.timer.backoff));
                }
                Some(_) => {}
            }
        }
    }

    /// Every stored segment, flow by flow in order: what a backup that
    /// takes over sends at once (the peer may have received none of it).
    pub fn unacknowledged(&self) -> Vec<Vec<u8>> {
        self.flows.values().flat_map(|f| f.store.iter().map(|s| f.again(s))).collect()
    }

    /// Whether every stored byte count adds up and each store covers
    /// exactly what its flow told the guest beyond the peer (tests).
    pub fn consistent(&self) -> bool {
        let sum: u64 = self.flows.values().map(Flow::stored_bytes).sum();
        sum == self.stored
            && self.flows.values().all(|f| {
                // A store may start after a gap while nothing is told beyond the peer.
                let mut at = match f.store.front() {
                    Some(s) if f.fake_ack == f.real_ack && before(f.real_ack, s.seq) => s.seq,
                    _ => f.real_ack,
                };
                for s in &f.store {
                    if before(at, s.seq) {
                        return false;
                    }
                    at = later(at, s.end());
                }
                !before(f.fake_ack, f.real_ack) && (f.store.is_empty() || !before(at, f.fake_ack))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::super::segment::tests::{frame, GUEST, PEER};
    use super::super::segment::{checksum_ok, parse};
    use super::*;

    const WS_OPT: [u8; 4] = [1, 3, 3, 2]; // NOP, window scale 2

    /// A flow whose handshake never completes is forgotten after
    /// HALF_OPEN_TIMEOUT (of `tick`s); a synced one is kept.
    #[test]
    fn half_open_flows_expire() {
        let mut t = synced(5000);
        let mut resend = Vec::new();
        let mut other = PEER;
        other.port += 1;
        assert!(t.peer_sent(&mut frame(other, GUEST, 7000, 0, SYN, 65535, &WS_OPT, b""), 0, &mut resend));
        assert_eq!(t.flows.len(), 2);
        let now = Instant::now();
        t.tick(now, 0, &mut resend);
        t.tick(now + HALF_OPEN_TIMEOUT - Duration::from_secs(1), 0, &mut resend);
        assert_eq!(t.flows.len(), 2, "not yet");
        t.tick(now + HALF_OPEN_TIMEOUT, 0, &mut resend);
        assert_eq!(t.flows.len(), 1, "the half-open flow is gone, the synced one stays");
        assert!(t.consistent());
    }

    /// A table with one synced flow: the peer connected (its ISN 1000,
    /// window 8192 << 2 after the handshake), the guest accepted (ISN `isn`).
    fn synced(isn: u32) -> Table {
        synced_acknowledging(isn, Early::Every)
    }

    fn synced_acknowledging(isn: u32, early: Early) -> Table {
        let mut t = Table::new(1 << 20, early);
        let mut resend = Vec::new();
        assert!(t.peer_sent(&mut frame(PEER, GUEST, 1000, 0, SYN, 65535, &WS_OPT, b""), 0, &mut resend));
        assert_eq!(t.guest_sent(&frame(GUEST, PEER, isn, 1001, SYN | ACK, 4096, &WS_OPT, b""), None), Sent::default());
        // The handshake's ACK, with the scaled window: 8192 << 2.
        assert!(t.peer_sent(&mut frame(PEER, GUEST, 1001, isn.wrapping_add(1), ACK, 8192, &[], b""), 0, &mut resend));
        assert!(resend.is_empty());
        t
    }

    fn data(seq: u32, n: usize) -> Vec<u8> {
        frame(GUEST, PEER, seq, 1001, ACK | 0x08, 4096, &[], &vec![0xab; n])
    }

    fn peer_ack(ack: u32, window: u16) -> Vec<u8> {
        frame(PEER, GUEST, 1001, ack, ACK, window, &[], b"")
    }

    /// The peer acknowledges the first of four segments told acknowledged
    /// to the guest and shrinks its window to nothing (Linux with
    /// `tcp_shrink_window=1` and a reader that stops reading): it dropped
    /// the other three. The guest's pure ACKs then start beyond the peer's
    /// window, where the peer would drop them whole (and a client blocked
    /// writing would never hear its requests taken in): they go with the
    /// window's edge as their sequence number. When the window opens, the
    /// three go again at once; a later opening sends nothing twice.
    #[test]
    fn after_the_peer_shrinks_its_window_acks_stay_in_it_and_what_it_dropped_goes_again_when_it_opens() {
        for isn in [5000, u32::MAX - 1500] {
            let mut t = synced(isn);
            let start = isn.wrapping_add(1);
            let mut resend = Vec::new();
            let segments: Vec<Vec<u8>> = (0..4).map(|i| data(start.wrapping_add(i * 1000), 1000)).collect();
            for s in &segments {
                assert!(t.guest_sent(s, Some(1)).ack.is_some());
            }
            let told = start.wrapping_add(4000);
            let guest_ack = frame(GUEST, PEER, told, 1001, ACK, 4096, &[], b"");
            assert_eq!(t.guest_sent(&guest_ack, Some(1)).instead, None, "within the peer's window: as it is");
            // Released; the peer takes the first and shuts its window.
            let edge = start.wrapping_add(1000);
            let mut shut = peer_ack(edge, 0);
            assert!(t.peer_sent(&mut shut, 2, &mut resend));
            assert!(resend.is_empty());
            let rewritten = parse(&shut).unwrap();
            assert_eq!((rewritten.ack, rewritten.window), (told, 0), "never less than it was told");
            // The guest acknowledges the peer's data: its next sequence number is beyond the window.
            let sent = t.guest_sent(&frame(GUEST, PEER, told, 1101, ACK, 4096, &[], b""), Some(2));
            let instead = sent.instead.expect("pulled back into the window");
            let s = parse(&instead).unwrap();
            assert_eq!((s.seq, s.ack, s.window, s.len), (edge, 1101, 4096, 0));
            assert!(checksum_ok(&instead));
            assert_eq!(sent.ack, None);
            // Data keeps its sequence number (stored, it goes again with the rest).
            let more = data(told, 10);
            assert_eq!(t.guest_sent(&more, Some(2)).instead, None);
            // The window opens: what the peer dropped goes again, not the segment it took.
            assert!(t.peer_sent(&mut peer_ack(edge, 2048), 3, &mut resend));
            let seqs = |frames: &[Vec<u8>]| frames.iter().map(|f| parse(f).unwrap().seq).collect::<Vec<_>>();
            assert_eq!(seqs(&resend), seqs(&[&segments[1..], std::slice::from_ref(&more)].concat()));
            assert!(resend[..3] == segments[1..] && resend[3] == more, "the frames as the guest sent them");
            resend.clear();
            assert!(t.peer_sent(&mut peer_ack(edge, 4096), 3, &mut resend));
            assert!(resend.is_empty(), "sent again once per opening");
            // Acknowledged at last: the guest's ACKs go as they are again.
            assert!(t.peer_sent(&mut peer_ack(told.wrapping_add(10), 4096), 3, &mut resend));
            assert_eq!(t.guest_sent(&frame(GUEST, PEER, told.wrapping_add(10), 1101, ACK, 4096, &[], b""), Some(3)).instead, None);
            assert!(t.consistent());
        }
    }

    /// A stored segment goes again with the guest's latest acknowledgement
    /// and window (a peer drops one whose acknowledgement is more than a
    /// window old, data and all), by the timer, on duplicate ACKs, and
    /// from a backup that takes over; its payload is untouched.
    #[test]
    fn stored_segments_go_again_with_the_guests_latest_acknowledgement() {
        let mut t = synced(5000);
        let mut resend = Vec::new();
        let first = data(5001, 1000);
        assert!(t.guest_sent(&first, Some(1)).ack.is_some());
        // The peer sends 3 MB more; the guest acknowledges it with a pure ACK.
        let latest = 1001u32.wrapping_add(3 << 20);
        t.guest_sent(&frame(GUEST, PEER, 6001, latest, ACK, 777, &[], b""), Some(2));
        let check = |frames: &[Vec<u8>]| {
            assert_eq!(frames.len(), 1);
            let (s, f) = (parse(&frames[0]).unwrap(), parse(&first).unwrap());
            assert_eq!((s.seq, s.len, s.ack, s.window), (f.seq, f.len, latest, 777));
            assert!(checksum_ok(&frames[0]));
            assert_eq!(frames[0][frames[0].len() - 1000..], first[first.len() - 1000..]);
        };
        check(&t.unacknowledged());
        let now = Instant::now();
        t.tick(now, 2, &mut resend);
        t.tick(now + RTO, 2, &mut resend);
        check(&resend);
        resend.clear();
        for _ in 0..DUP_ACKS {
            assert!(!t.peer_sent(&mut peer_ack(5001, 8192), 2, &mut resend));
        }
        check(&resend);
    }

    /// What the peer dropped goes again when its window opens only once
    /// its epoch's output was released (output commit).
    #[test]
    fn an_opening_window_resends_only_released_segments() {
        let mut t = synced(5000);
        let mut resend = Vec::new();
        for i in 0..3 {
            t.guest_sent(&data(5001 + i * 1000, 1000), Some(4));
        }
        assert!(t.peer_sent(&mut peer_ack(6001, 0), 4, &mut resend));
        assert!(t.peer_sent(&mut peer_ack(6001, 2048), 4, &mut resend));
        assert!(resend.is_empty(), "epoch 4 is still held");
        assert!(t.consistent());
    }

    #[test]
    fn data_sent_while_held_is_acknowledged_at_once_within_the_peers_window() {
        for isn in [5000, u32::MAX - 1500] {
            let mut t = synced(isn);
            let start = isn.wrapping_add(1);
            let sent = t.guest_sent(&data(start, 1000), Some(3));
            let ack = parse(sent.ack.as_ref().expect("acknowledged")).unwrap();
            assert!(checksum_ok(sent.ack.as_ref().unwrap()));
            assert_eq!((ack.src, ack.dst, ack.seq, ack.ack), (PEER, GUEST, 1001, start.wrapping_add(1000)));
            // 8192 << 2 from the real ack, less the 1000 told acknowledged, in units of 4.
            assert_eq!(u32::from(ack.window), (8192 * 4 - 1000) / 4);
            assert_eq!(t.stored_bytes(), data(start, 1000).len() as u64);
            assert!(t.consistent());
            assert!(!sent.bulk, "a short segment");
            // A full-sized one with half a send buffer unacknowledged by the peer is part of a bulk send.
            assert!(!t.guest_sent(&data(start.wrapping_add(1000), 1460), Some(3)).bulk, "little unacknowledged");
            // (The peer's window grows to hold it.)
            t.peer_sent(&mut peer_ack(start, 65535), 3, &mut Vec::new());
            let mut at = start.wrapping_add(2460);
            while at.wrapping_sub(start) + 1460 < BULK_UNACKNOWLEDGED {
                t.guest_sent(&data(at, 1460), Some(3));
                at = at.wrapping_add(1460);
            }
            assert!(t.guest_sent(&data(at, 1460), Some(3)).bulk);
            at = at.wrapping_add(1460);
            // Not while output is unheld.
            assert_eq!(t.guest_sent(&data(at, 10), None), Sent::default());
        }
    }

    /// `Early::Bulk`: replies of a request/response flow pass as without
    /// the proxy (no ACK, nothing stored, the peer's ACKs untouched); a
    /// flow that sends full-sized segments past 32 KiB unacknowledged is
    /// in bulk mode from that segment on, stored from it and acknowledged
    /// early once the peer's acknowledgement reaches it; a short reply
    /// sent on the idle connection takes it out again.
    #[test]
    fn bulk_mode_acknowledges_early_only_flows_found_carrying_bulk_data() {
        for isn in [5000, u32::MAX - 20_000] {
            let mut t = synced_acknowledging(isn, Early::Bulk);
            let mut resend = Vec::new();
            let start = isn.wrapping_add(1);
            // Request/response: short replies, each acknowledged by the peer after its release.
            let mut at = start;
            for _ in 0..20 {
                assert_eq!(t.guest_sent(&data(at, 100), Some(1)), Sent::default(), "a short reply");
                at = at.wrapping_add(100);
                let mut ack = peer_ack(at, 65535);
                let unchanged = ack.clone();
                assert!(t.peer_sent(&mut ack, 2, &mut resend));
                assert_eq!(ack, unchanged, "the peer's ACK of a small flow passes as it is");
            }
            // A few full-sized segments held, but less than 32 KiB: no bulk send yet.
            let reply = at;
            while at.wrapping_add(1460).wrapping_sub(reply) < BULK_UNACKNOWLEDGED {
                assert_eq!(t.guest_sent(&data(at, 1460), Some(2)), Sent::default(), "under the threshold");
                at = at.wrapping_add(1460);
            }
            assert_eq!((t.stored_bytes(), t.bulk_flows()), (0, 0));
            assert!(t.consistent());
            // The segment that reaches it: bulk mode, stored, but not
            // acknowledged: the data before it (in flight) is not stored.
            let first = at;
            assert_eq!(t.guest_sent(&data(at, 1460), Some(2)), Sent::default(), "a gap before the store");
            at = at.wrapping_add(1460);
            assert_eq!(t.bulk_flows(), 1);
            assert_eq!(t.guest_sent(&data(at, 1460), Some(2)), Sent::default());
            at = at.wrapping_add(1460);
            assert_eq!(t.stored_bytes(), 2 * data(first, 1460).len() as u64);
            assert!(t.consistent());
            // The peer acknowledges up to the store's start (epoch 2 released): the next segment
            // is acknowledged early with everything stored before it.
            assert!(t.peer_sent(&mut peer_ack(first, 65535), 3, &mut resend));
            let sent = t.guest_sent(&data(at, 1460), Some(3));
            at = at.wrapping_add(1460);
            assert_eq!(parse(sent.ack.as_ref().expect("acknowledged early")).unwrap().ack, at);
            assert!(t.consistent());
            // The reply's last, short segment with data in flight: still bulk, acknowledged.
            assert!(t.guest_sent(&data(at, 300), Some(3)).ack.is_some());
            at = at.wrapping_add(300);
            assert_eq!(t.bulk_flows(), 1);
            // The peer acknowledges everything, raised nowhere (it is all it was told).
            assert!(t.peer_sent(&mut peer_ack(at, 65535), 4, &mut resend));
            assert_eq!(t.stored_bytes(), 0);
            // The next reply of a bulk flow starts full-sized on the idle connection: still bulk.
            assert!(t.guest_sent(&data(at, 1460), Some(4)).ack.is_some());
            at = at.wrapping_add(1460);
            assert!(t.peer_sent(&mut peer_ack(at, 65535), 5, &mut resend));
            // A lone short reply on the idle connection: back to requests and responses.
            assert_eq!(t.guest_sent(&data(at, 100), Some(5)), Sent::default());
            assert_eq!((t.bulk_flows(), t.stored_bytes()), (0, 0));
            assert!(t.consistent());
            assert!(resend.is_empty());
        }
    }

    /// What a checkpoint carries: only the flows with something told beyond
    /// the peer or stored, with all that is stored.
    #[test]
    fn a_checkpoint_carries_only_flows_with_something_told_or_stored() {
        let mut t = synced_acknowledging(0, Early::Bulk);
        t.guest_sent(&data(1, 100), Some(1));
        assert_eq!(t.clone().carried().flows(), 0, "a small reply: nothing told early");
        let mut e = synced(0);
        e.guest_sent(&data(1, 100), Some(1));
        let carried = e.clone().carried();
        assert_eq!((carried.flows(), carried.stored_bytes()), (1, e.stored_bytes()));
        assert!(carried.consistent());
        e.peer_sent(&mut peer_ack(101, 8192), 2, &mut Vec::new());
        assert_eq!(e.carried().flows(), 0, "all acknowledged by the peer: nothing for a backup");
    }

    /// Two flows of one table: the bulk one is acknowledged early, the
    /// small one beside it never is.
    #[test]
    fn bulk_mode_is_per_flow() {
        let mut t = synced_acknowledging(0, Early::Bulk);
        let mut resend = Vec::new();
        let mut other = PEER;
        other.port += 1;
        t.peer_sent(&mut frame(other, GUEST, 7000, 0, SYN, 65535, &WS_OPT, b""), 0, &mut resend);
        t.guest_sent(&frame(GUEST, other, 90, 7001, SYN | ACK, 4096, &WS_OPT, b""), None);
        t.peer_sent(&mut frame(other, GUEST, 7001, 91, ACK, 65535, &[], b""), 0, &mut resend);
        t.peer_sent(&mut peer_ack(1, 65535), 0, &mut resend);
        let (mut bulk_at, mut small_at) = (1u32, 91u32);
        let mut bulk_acks = 0;
        for _ in 0..60 {
            bulk_acks += usize::from(t.guest_sent(&data(bulk_at, 1460), Some(1)).ack.is_some());
            bulk_at += 1460;
            let small = frame(GUEST, other, small_at, 7001, ACK | 0x08, 4096, &[], &[1; 200]);
            assert_eq!(t.guest_sent(&small, Some(1)), Sent::default(), "the small flow is never acknowledged early");
            small_at += 200;
            t.peer_sent(&mut frame(other, GUEST, 7001, small_at, ACK, 65535, &[], b""), 0, &mut resend);
        }
        assert_eq!((t.flows(), t.bulk_flows()), (2, 1));
        // Stored from the bulk send on; acknowledged once the peer reached the store.
        assert_eq!(bulk_acks, 0, "nothing acknowledged before the peer's ACK reaches the store");
        t.peer_sent(&mut peer_ack(1 + 23 * 1460, 65535), 2, &mut resend);
        assert!(t.guest_sent(&data(bulk_at, 1460), Some(2)).ack.is_some());
        assert!(t.consistent());
    }

    #[test]
    fn never_syn_fin_or_rst_and_never_beyond_the_window_or_the_bound() {
        let mut t = synced(0);
        let fin = frame(GUEST, PEER, 1, 1001, ACK | FIN, 4096, &[], b"bye");
        assert_eq!(t.guest_sent(&fin, Some(1)), Sent::default(), "FIN");
        let mut t = synced(0);
        // The window is 32768 bytes: a segment ending beyond it passes.
        assert!(t.guest_sent(&data(1, 30000), Some(1)).ack.is_some());
        assert_eq!(t.guest_sent(&data(30001, 3000), Some(1)), Sent::default(), "beyond the window");
        let mut small = synced(0);
        small.bound = 100;
        assert_eq!(small.guest_sent(&data(1, 200), Some(1)), Sent::default(), "beyond the bound");
        let mut t = synced(0);
        t.guest_sent(&data(1, 100), Some(1));
        t.guest_sent(&frame(GUEST, PEER, 101, 1001, RST | ACK, 0, &[], b""), Some(1));
        assert_eq!((t.flows(), t.stored_bytes()), (0, 0), "RST forgets the flow");
    }

    #[test]
    fn peer_acks_are_raised_to_what_the_guest_was_told_and_free_the_store() {
        let mut t = synced(0);
        let mut resend = Vec::new();
        t.guest_sent(&data(1, 1000), Some(1));
        t.guest_sent(&data(1001, 1000), Some(1));
        // Data from the peer acknowledging only the first segment.
        let mut f = frame(PEER, GUEST, 1001, 1001, ACK, 8192, &[], b"GET x");
        assert!(t.peer_sent(&mut f, 2, &mut resend));
        let s = parse(&f).unwrap();
        assert_eq!(s.ack, 2001, "raised to the fake level");
        // The peer allows 1001 + 32768; the guest, told 2001, gets the rest.
        assert_eq!(u32::from(s.window), (1001 + 32768 - 2001) / 4);
        assert!(checksum_ok(&f));
        assert_eq!(t.stored_bytes(), data(1001, 1000).len() as u64, "the first segment is freed");
        assert!(t.consistent());
        // A stale pure ACK that tells nothing new is absorbed.
        assert!(!t.peer_sent(&mut peer_ack(1001, 8192), 2, &mut resend));
        // Acknowledging everything: passes as it is.
        let mut all = peer_ack(2001, 8192);
        let before_rewrite = all.clone();
        assert!(t.peer_sent(&mut all, 2, &mut resend));
        assert_eq!(all, before_rewrite);
        assert_eq!(t.stored_bytes(), 0);
        assert!(resend.is_empty());
    }

    #[test]
    fn duplicate_acks_and_timeouts_resend_only_released_segments() {
        let mut t = synced(0);
        let mut resend = Vec::new();
        let first = data(1, 500);
        t.guest_sent(&first, Some(4));
        t.guest_sent(&data(501, 500), Some(4));
        // Epoch 4 not released yet: nothing is sent again.
        for _ in 0..3 {
            t.peer_sent(&mut peer_ack(1, 8192), 4, &mut resend);
        }
        assert!(resend.is_empty());
        let now = Instant::now();
        t.tick(now, 4, &mut resend);
        t.tick(now + RTO * 10, 4, &mut resend);
        assert!(resend.is_empty());
        // Released: the third duplicate resends the oldest segment.
        let mut t2 = synced(0);
        t2.guest_sent(&first, Some(4));
        t2.guest_sent(&data(501, 500), Some(4));
        for _ in 0..3 {
            t2.peer_sent(&mut peer_ack(1, 8192), 5, &mut resend);
        }
        assert_eq!(resend, vec![first.clone()]);
        resend.clear();
        // And a timeout does too, then backs off.
        t2.tick(now, 5, &mut resend);
        assert!(resend.is_empty(), "the timer starts");
        t2.tick(now + RTO, 5, &mut resend);
        assert_eq!(resend, vec![first.clone()]);
        t2.tick(now + RTO + RTO, 5, &mut resend);
        assert_eq!(resend.len(), 1, "backed off");
        assert_eq!(t2.unacknowledged().len(), 2);
    }

    #[test]
    fn after_a_segment_passed_unacknowledged_the_next_one_with_room_acknowledges_both() {
        let mut t = synced(0);
        let mut resend = Vec::new();
        t.bound = 2 * data(1, 1000).len() as u64;
        assert!(t.guest_sent(&data(1, 1000), Some(1)).ack.is_some());
        assert!(t.guest_sent(&data(1001, 1000), Some(1)).ack.is_some());
        assert_eq!(t.guest_sent(&data(2001, 1000), Some(1)), Sent::default(), "no room: stored, not acknowledged");
        assert!(t.consistent());
        // The peer acknowledges the first two: room again.
        t.peer_sent(&mut peer_ack(2001, 8192), 2, &mut resend);
        let ack = t.guest_sent(&data(3001, 1000), Some(2)).ack.expect("acknowledged");
        assert_eq!(parse(&ack).unwrap().ack, 4001, "both, the one before without a gap");
        assert_eq!(t.unacknowledged(), vec![data(2001, 1000), data(3001, 1000)]);
        assert!(t.consistent());
        // Unprotected data is stored too (already out), so protecting later leaves no gap.
        let mut u = synced(0);
        assert_eq!(u.guest_sent(&data(1, 100), None), Sent::default());
        assert!(u.guest_sent(&data(101, 100), Some(1)).ack.is_some());
        assert_eq!(u.unacknowledged().len(), 2);
    }

    #[test]
    fn a_guest_resending_what_it_was_told_acknowledged_is_told_again() {
        let mut t = synced(0);
        t.guest_sent(&data(1, 100), Some(1));
        let again = t.guest_sent(&data(1, 100), Some(1)).ack.expect("told again");
        assert_eq!(parse(&again).unwrap().ack, 101);
        assert_eq!(t.stored_bytes(), data(1, 100).len() as u64, "stored once");
    }

    #[test]
    fn the_state_survives_serialization() {
        let mut t = synced(7);
        t.guest_sent(&data(8, 100), Some(1));
        let bytes = postcard::to_allocvec(&t).unwrap();
        let back: Table = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, t);
        assert!(back.consistent());
    }

    #[test]
    fn a_connection_the_guest_opens_is_tracked_too() {
        let mut t = Table::new(1 << 20, Early::Every);
        let mut resend = Vec::new();
        t.guest_sent(&frame(GUEST, PEER, 70, 0, SYN, 4096, &WS_OPT, b""), None);
        t.peer_sent(&mut frame(PEER, GUEST, 9000, 71, SYN | ACK, 20000, &WS_OPT, b""), 0, &mut resend);
        let ack = t.guest_sent(&frame(GUEST, PEER, 71, 9001, ACK, 4096, &[], b"PING"), Some(1)).ack.expect("acknowledged");
        let a = parse(&ack).unwrap();
        assert_eq!((a.seq, a.ack), (9001, 75));
        assert_eq!(u32::from(a.window), (20000 - 4) >> 2);
    }
}
