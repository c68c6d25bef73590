//! Fake ACK (`--fake-ack on`, after LLVFT): while the guest's TCP data
//! waits in the output buffer for its checkpoint's acknowledgement, the VMM
//! acknowledges it to the guest on the peer's behalf, so the guest's send
//! buffer empties and it keeps sending at once instead of one buffer per
//! hold.
//!
//! The proxy sits on both paths of the network card:
//! - guest to network (a `FrameSink` in front of the output buffer): each
//!   frame goes on to the buffer first; a data segment of a tracked flow,
//!   sent while output is held, is kept in the flow's store and answered
//!   with a made-up pure ACK that the card gives the guest in the same pass
//!   (`flow::Table::guest_sent`);
//! - network to guest (`GuestProxy::rewrite`): the peer's acknowledgements
//!   free the store; every frame the guest gets acknowledges at least what
//!   it was told, with the window counted so that it never sends beyond
//!   the peer's real window; stale pure ACKs are absorbed. Duplicate ACKs
//!   a timer (`flow::RTO`) and a peer's window opening after it shrank
//!   send stored segments again (with the guest's latest acknowledgement),
//!   only those of released epochs: output commit holds for every resent
//!   frame.
//!
//! The table (flows and stores) is saved at each checkpoint's freeze and
//! applied with it on the backup (whole, or as what changed: `delta`); a backup that takes over first sends
//! every stored segment (the peer may have none of it), then runs its own
//! proxy from that state. See docs/replication.md, "Fake ACK".

pub mod delta;
pub mod flow;
pub mod segment;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ftvm_vmm::hooks::{FrameSink, GuestProxy};
use ftvm_vmm::sync::Lock;

use crate::output::OutputBuffer;
pub use flow::Table;
use ftvm_vmm::switch;

switch! {
    /// `--fake-ack`: acknowledge the guest's held TCP data on the peer's behalf.
    pub enum Mode {
        /// The guest hears only the peer's acknowledgements (after its output is released).
        Off = "off",
        /// Held data is acknowledged to the guest at once (replicated proxy state).
        On = "on",
        /// As `on`, but only on flows found carrying bulk data (`flow::Flow::classify`).
        Bulk = "bulk",
    }
}

impl Mode {
    /// Which flows the proxy acknowledges early; none when off.
    pub fn early(self) -> Option<flow::Early> {
        match self {
            Mode::Off => None,
            Mode::On => Some(flow::Early::Every),
            Mode::Bulk => Some(flow::Early::Bulk),
        }
    }
}

/// How often the timer looks for stored data to send again.
const TICK: Duration = Duration::from_millis(20);
/// After a made-up ACK for a full-sized segment (`flow::Sent::bulk`), how
/// long the guest does not count as idle for an output-triggered
/// checkpoint: it may go idle before the card has given it the ACK (the
/// card delivers it after its transmit pass), and then wakes to send on.
/// Without this, each epoch of a bulk send ends after one send buffer. The
/// hold bound still ends the epoch if the guest keeps sending. Not after a
/// short segment: that usually ends a reply, and delaying the checkpoint
/// for every reply of a request-response load (kv) doubled its latency.
const BUSY_AFTER_ACK: Duration = Duration::from_micros(500);

/// The proxy's whole state, as saved at a freeze and held by a backup.
pub type State = Table;

/// Where the guest's frames go on to, and what tells held from released.
enum Next {
    /// The primary: the output buffer.
    Held(Arc<OutputBuffer>),
    /// Unprotected (a backup that took over): straight to the network.
    Direct,
}

pub struct FakeAck {
    table: Mutex<Table>,
    next: Next,
    /// The network card's TAP: resent segments go straight out.
    network: Arc<dyn FrameSink>,
    /// Made-up ACKs for the guest, taken by the card after each pass.
    made_up: Mutex<Vec<Vec<u8>>>,
    stopped: AtomicBool,
}

impl FakeAck {
    /// The primary's proxy, in front of `output`, acknowledging the flows
    /// `early` says; resent segments go to `network`.
    pub fn new(output: Arc<OutputBuffer>, network: Arc<dyn FrameSink>, early: flow::Early) -> Arc<FakeAck> {
        FakeAck::start(Table::new(crate::bounds::FAKE_ACK_BOUND, early), Next::Held(output), network)
    }

    /// A backup's proxy after taking over with `state`: everything stored
    /// goes to `network` now (returns how many segments), then the proxy
    /// keeps rewriting and resending until the peer acknowledged it all.
    pub fn took_over(state: State, network: Arc<dyn FrameSink>) -> (Arc<FakeAck>, usize) {
        let resend = state.unacknowledged();
        for frame in &resend {
            network.send(frame);
        }
        (FakeAck::start(state, Next::Direct, network), resend.len())
    }

    fn start(table: Table, next: Next, network: Arc<dyn FrameSink>) -> Arc<FakeAck> {
        let proxy =
            Arc::new(FakeAck { table: Mutex::new(table), next, network, made_up: Mutex::new(Vec::new()), stopped: AtomicBool::new(false) });
        let weak = Arc::downgrade(&proxy);
        // The thread ends within a tick of the proxy's last owner letting go.
        let spawned = std::thread::Builder::new().name("fake-ack".into()).spawn(move || timer(weak));
        if let Err(e) = spawned {
            // Duplicate ACKs still resend; only a lost last segment waits for the next input.
            tracing::warn!("fake ACK: no retransmission timer: {e}");
        }
        proxy
    }

    /// Output of epochs before this one has been released.
    fn released_before(&self) -> u64 {
        match &self.next {
            Next::Held(output) => output.first_held_epoch().unwrap_or(u64::MAX),
            Next::Direct => u64::MAX,
        }
    }

    /// The proxy's state now (at a checkpoint's freeze: the VM is paused,
    /// no frame is on its way through).
    pub fn save(&self) -> State {
        self.table.locked().clone()
    }

    /// Stop resending (the VM's network is someone else's now).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }

    /// Send `frames` (released already) again, unless stopped or the
    /// output buffer's release gate says this process may have been
    /// stopped long enough for its backup to take over.
    fn resend(&self, frames: Vec<Vec<u8>>) {
        if frames.is_empty() || self.stopped.load(Ordering::SeqCst) {
            return;
        }
        if let Next::Held(output) = &self.next {
            if !output.may_resend() {
                return;
            }
        }
        for frame in &frames {
            self.network.send(frame);
        }
    }

    fn tick(&self) {
        let released = self.released_before();
        let mut resend = Vec::new();
        self.table.locked().tick(Instant::now(), released, &mut resend);
        self.resend(resend);
    }
}

fn timer(proxy: Weak<FakeAck>) {
    // It sleeps, looks at the output buffer and writes to the TAP, as the
    // threads that release output do.
    ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Replication);
    loop {
        std::thread::sleep(TICK);
        let Some(p) = proxy.upgrade() else { return };
        if p.stopped.load(Ordering::SeqCst) {
            return;
        }
        p.tick();
    }
}

impl FrameSink for FakeAck {
    /// A frame the guest sent: if it is data of a tracked flow held in an
    /// epoch, into the store, and an ACK for the guest; then on to the
    /// output buffer (or the network), a pure ACK pulled back into the
    /// peer's window where it lies beyond (`flow::Flow::acceptable_seq`).
    fn send(&self, frame: &[u8]) {
        // The epoch it is held in (the freeze cannot come before it is: the card is in its pass).
        let epoch = match &self.next {
            Next::Held(output) => output.open_epoch(),
            Next::Direct => None,
        };
        let sent = self.table.locked().guest_sent(frame, epoch);
        let frame = sent.instead.as_deref().unwrap_or(frame);
        match &self.next {
            Next::Held(output) => output.send(frame),
            Next::Direct => self.network.send(frame),
        }
        if let Some(ack) = sent.ack {
            self.made_up.locked().push(ack);
            if let (Next::Held(output), true) = (&self.next, sent.bulk) {
                // The guest idles now only to wake to this ACK and send on.
                output.busy_until(Instant::now() + BUSY_AFTER_ACK);
            }
        }
    }

    fn accepting(&self) -> bool {
        match &self.next {
            Next::Held(output) => output.accepting(),
            Next::Direct => true,
        }
    }
}

impl GuestProxy for FakeAck {
    fn rewrite(&self, frame: &mut [u8]) -> bool {
        let released = self.released_before();
        let mut resend = Vec::new();
        let deliver = self.table.locked().peer_sent(frame, released, &mut resend);
        self.resend(resend);
        deliver
    }

    fn take_made_up(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut *self.made_up.locked())
    }
}

#[cfg(test)]
mod tests {
    use super::segment::tests::{frame, GUEST, PEER};
    use super::segment::{parse, ACK, SYN};
    use super::*;
    use crate::test_util::Wire;

    fn handshake(proxy: &FakeAck) {
        let mut syn = frame(PEER, GUEST, 1000, 0, SYN, 65535, &[], b"");
        assert!(proxy.rewrite(&mut syn));
        proxy.send(&frame(GUEST, PEER, 0, 1001, SYN | ACK, 4096, &[], b""));
        assert!(proxy.rewrite(&mut frame(PEER, GUEST, 1001, 1, ACK, 60000, &[], b"")));
    }

    #[test]
    fn held_data_is_acknowledged_stored_with_the_checkpoint_and_sent_by_a_backup_that_takes_over() {
        let wire = Arc::new(Wire::default());
        let output = Arc::new(OutputBuffer::new(wire.clone()));
        let proxy = FakeAck::new(output.clone(), wire.clone(), flow::Early::Every);
        handshake(&proxy);
        assert!(proxy.take_made_up().is_empty(), "nothing acknowledged unprotected");
        output.protect(1);
        wire.0.locked().clear();
        let data = frame(GUEST, PEER, 1, 1001, ACK, 4096, &[], &[7; 1000]);
        proxy.send(&data);
        assert!(wire.0.locked().is_empty(), "held");
        let made_up = proxy.take_made_up();
        assert_eq!(made_up.len(), 1);
        assert_eq!(parse(&made_up[0]).unwrap().ack, 1001);
        // The checkpoint's state, then the primary is gone: the backup's proxy sends the segment.
        let state = proxy.save();
        assert_eq!(state.stored_bytes(), data.len() as u64);
        let bytes = postcard::to_allocvec(&state).unwrap();
        let restored: State = postcard::from_bytes(&bytes).unwrap();
        let backup_wire = Arc::new(Wire::default());
        let (taken_over, resent) = FakeAck::took_over(restored, backup_wire.clone());
        assert_eq!(resent, 1);
        assert_eq!(*backup_wire.0.locked(), vec![data.clone()]);
        // Its guest hears the peer's stale ACK raised to what it was told.
        let mut stale = frame(PEER, GUEST, 1001, 1, ACK, 60000, &[], b"more");
        assert!(taken_over.rewrite(&mut stale));
        assert_eq!(parse(&stale).unwrap().ack, 1001);
        // The primary's release lets the frame out once.
        output.close_epoch();
        output.release_through(1);
        assert_eq!(*wire.0.locked(), vec![data]);
    }
}
