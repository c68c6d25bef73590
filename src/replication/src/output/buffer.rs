//! Output commit for network frames and console lines.
//!
//! Frames the guest transmits and what it writes to its console go through
//! here. Unprotected, they go straight out (TAP, console). Protected, each
//! joins the open epoch's queue, in the order the guest produced them, and
//! leaves only when the backup has acknowledged that epoch's checkpoint, so
//! nobody ever sees output whose state could be lost in a failover.
//!
//! What is held is bounded (`bounds::HELD_OUTPUT_BOUND`): at the bound the
//! buffer stops taking frames, so they wait in the guest's transmit queue
//! (back-pressure, as behind a slow link) until a release makes room and
//! wakes the network card.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use ftvm_vmm::devices::Waker;
use ftvm_vmm::hooks::{Console, ConsoleSink, FrameSink};
use ftvm_vmm::sync::Lock;

use super::OutputListener;
use crate::bounds::{FRAME_OVERHEAD, HELD_OUTPUT_BOUND};
use crate::fakeack::segment::{self, Endpoint};
use crate::telemetry::telemetry;

/// One piece of held output.
enum Out {
    Frame(Vec<u8>),
    Console(Vec<u8>),
}

#[derive(Default)]
struct Held {
    epoch: u64,
    items: Vec<Out>,
    frames: usize,
    first_at: Option<Instant>,
    /// Its first frames (this many, of `folded_bytes` bytes) go to the
    /// backup inside its checkpoint ([`OutputBuffer::set_mirror`]).
    folded: usize,
    folded_bytes: usize,
    /// A frame did not fit the fold: later ones are mirrored alone.
    fold_full: bool,
    /// Where its TCP data went (up to `CLIENTS_COUNTED`): the clients
    /// waiting for this epoch's checkpoint.
    clients: Vec<Endpoint>,
}

/// Clients counted per epoch at most: enough to tell one from many.
pub const CLIENTS_COUNTED: usize = 16;

impl Held {
    /// Count the client `frame` carries TCP data (or a FIN) to.
    fn count_client(&mut self, frame: &[u8]) {
        if self.clients.len() >= CLIENTS_COUNTED {
            return;
        }
        if let Some(seg) = segment::parse(frame).filter(|s| s.len > 0 || s.has(segment::FIN)) {
            if !self.clients.contains(&seg.dst) {
                self.clients.push(seg.dst);
            }
        }
    }
}

/// What a held frame counts against the bound.
fn cost(frame: &[u8]) -> u64 {
    frame.len() as u64 + FRAME_OVERHEAD
}

struct Inner {
    protected: bool,
    /// The epoch the guest is running in (frames submitted now belong to it).
    open: Held,
    /// Closed epochs waiting for their acknowledgement, oldest first.
    closed: VecDeque<Held>,
    released_frames: u64,
    /// What every held frame costs together.
    held_cost: u64,
    /// The network card was told to wait: wake it when there is room.
    refused: bool,
    /// Where protected frames are copied to, with their epoch (the backup).
    mirror: Option<Arc<dyn OutputListener>>,
    /// Bytes of each epoch's first frames the checkpoint carries instead
    /// (0: every frame goes to `mirror`).
    fold: usize,
    /// Asked before each acknowledged frame goes out ([`OutputBuffer::set_release_gate`]).
    gate: Option<ReleaseGate>,
    /// The guest has input on its way that will make it send more (the
    /// fake-ACK proxy's acknowledgements) until then: not idle before.
    busy_until: Option<Instant>,
    /// Clients the last closed epoch's output went to.
    closed_clients: usize,
}

/// Whether acknowledged output may go out right now: false when this
/// process finds it has been stopped long enough for its backup to have
/// taken over (`liveness::Pulse::heard_within`).
pub type ReleaseGate = Arc<dyn Fn() -> bool + Send + Sync>;

/// What one release let out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    pub frames: u64,
    /// Longest time a released frame was held, in microseconds.
    pub max_hold_us: u64,
}

/// The VM's transmit hook while it is replicated; released frames go on
/// to `network` (the TAP).
pub struct OutputBuffer {
    inner: Mutex<Inner>,
    network: Arc<dyn FrameSink>,
    console: Console,
    waker: Waker,
    /// Told when the open epoch holds its first output (an output-triggered
    /// checkpoint may be due).
    trigger: Option<Arc<dyn OutputListener>>,
}

impl OutputBuffer {
    pub fn new(network: Arc<dyn FrameSink>) -> OutputBuffer {
        let inner = Inner {
            protected: false,
            open: Held::default(),
            closed: VecDeque::new(),
            released_frames: 0,
            held_cost: 0,
            refused: false,
            mirror: None,
            fold: 0,
            gate: None,
            busy_until: None,
            closed_clients: 0,
        };
        OutputBuffer { inner: Mutex::new(inner), network, console: Console::default(), waker: Waker::default(), trigger: None }
    }

    /// Poke `trigger` when an epoch starts holding output.
    pub fn with_trigger(mut self, trigger: Arc<dyn OutputListener>) -> OutputBuffer {
        self.trigger = Some(trigger);
        self
    }

    /// Released console output goes to `console` (the VM's own).
    pub fn with_console(mut self, console: Console) -> OutputBuffer {
        self.console = console;
        self
    }

    /// Wake the network card with `waker` when a release makes room.
    pub fn with_waker(mut self, waker: Waker) -> OutputBuffer {
        self.waker = waker;
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Hold `item` in the open epoch; the first one of an epoch pokes the
    /// trigger (after the lock is dropped: the trigger looks at the buffer).
    fn hold(&self, mut inner: MutexGuard<'_, Inner>, item: Out) {
        let first = inner.open.first_at.is_none();
        if first {
            inner.open.first_at = Some(Instant::now());
        }
        inner.open.items.push(item);
        drop(inner);
        if let (true, Some(trigger)) = (first, &self.trigger) {
            trigger.first_output_held();
        }
    }

    /// The guest was just given input that makes it send more (an
    /// acknowledgement of its held data): an output-triggered checkpoint
    /// does not count it idle before `until`, so it can use the room it
    /// was given in this epoch instead of being stopped on its way.
    pub fn busy_until(&self, until: Instant) {
        let mut inner = self.lock();
        inner.busy_until = Some(inner.busy_until.map_or(until, |u| u.max(until)));
    }

    /// Whether the guest may count as idle at `now` (see `busy_until`).
    pub fn may_be_idle(&self, now: Instant) -> bool {
        self.lock().busy_until.is_none_or(|u| now >= u)
    }

    /// When the open epoch's first output was held (None: it holds nothing).
    pub fn held_since(&self) -> Option<Instant> {
        self.lock().open.first_at
    }

    /// Start holding output; the guest is now running in epoch `epoch`.
    pub fn protect(&self, epoch: u64) {
        let mut inner = self.lock();
        inner.protected = true;
        inner.open = Held { epoch, ..Held::default() };
    }

    /// End the open epoch (the VM is paused for its checkpoint); frames from
    /// now on belong to the next one. Returns the epoch closed.
    pub fn close_epoch(&self) -> u64 {
        let mut inner = self.lock();
        let next = inner.open.epoch + 1;
        let closed = std::mem::replace(&mut inner.open, Held { epoch: next, ..Held::default() });
        inner.closed_clients = closed.clients.len();
        let epoch = closed.epoch;
        inner.closed.push_back(closed);
        epoch
    }

    /// How many clients (TCP peers, up to `CLIENTS_COUNTED`) the epoch
    /// closed last sent data to: they all wait for its checkpoint.
    pub fn clients_last_closed(&self) -> usize {
        self.lock().closed_clients
    }

    /// Ask `gate` before each acknowledged frame goes out (or stop asking).
    /// A frame it holds back stays at the head of the held output, with
    /// everything after it, until a later release finds the gate open (or
    /// the VM is unprotected, which does not ask).
    pub fn set_release_gate(&self, gate: Option<ReleaseGate>) {
        self.lock().gate = gate;
    }

    /// Whether released output may go out again now (resent by the
    /// fake-ACK proxy): the release gate's answer, yes without one.
    pub fn may_resend(&self) -> bool {
        let gate = self.lock().gate.clone();
        gate.is_none_or(|open| open())
    }

    /// The backup acknowledged every epoch up to `epoch`: let their frames
    /// out, in order, while the release gate allows.
    pub fn release_through(&self, epoch: u64) -> Released {
        let mut inner = self.lock();
        let gate = inner.gate.clone();
        let released = self.release_locked(&mut inner, epoch, gate.as_deref());
        let wake = released.frames > 0 && std::mem::take(&mut inner.refused);
        drop(inner);
        if wake {
            self.waker.wake();
        }
        released
    }

    /// Let out every closed epoch up to `epoch`, under the lock: output of
    /// later epochs, and frames sent unprotected afterwards, must not
    /// overtake it. With a `gate`, it is asked right before each frame (a
    /// process stopped in the middle of a release asks again when it
    /// resumes); what it holds back stays held, in order.
    fn release_locked(&self, inner: &mut Inner, epoch: u64, gate: Option<&(dyn Fn() -> bool + Send + Sync)>) -> Released {
        let mut released = Released::default();
        while inner.closed.front().is_some_and(|h| h.epoch <= epoch) {
            let mut held = inner.closed.pop_front().expect("front exists");
            if let Some(t) = held.first_at {
                released.max_hold_us = released.max_hold_us.max(t.elapsed().as_micros() as u64);
            }
            let mut sent = 0;
            for item in &held.items {
                match item {
                    Out::Frame(frame) => {
                        if gate.is_some_and(|open| !open()) {
                            break;
                        }
                        self.network.send(frame);
                        inner.held_cost -= cost(frame);
                        held.frames -= 1;
                        released.frames += 1;
                    }
                    Out::Console(text) => self.console.write(text),
                }
                sent += 1;
            }
            if sent < held.items.len() {
                held.items.drain(..sent);
                inner.closed.push_front(held);
                tracing::warn!(epoch = inner.closed[0].epoch, "acknowledged output held back: nothing heard from the backup lately");
                break;
            }
        }
        inner.released_frames += released.frames;
        telemetry().held(-(released.frames as i64));
        released
    }

    /// Stop protecting (the backup is gone and the policy is to continue):
    /// everything held goes out, because this VM is now the only copy.
    pub fn unprotect(&self) -> Released {
        let mut inner = self.lock();
        let open = std::mem::take(&mut inner.open);
        let last = open.epoch;
        inner.closed.push_back(open);
        inner.protected = false;
        inner.mirror = None;
        inner.fold = 0;
        // Released before the lock is let go: a frame the guest sends now
        // goes straight out, and must not overtake the held ones.
        let released = self.release_locked(&mut inner, last, None);
        let wake = std::mem::take(&mut inner.refused);
        drop(inner);
        if wake {
            self.waker.wake();
        }
        released
    }

    /// Copy every frame held from now on, with its epoch, to `mirror` (or
    /// stop copying), except each epoch's first frames up to `fold` bytes:
    /// its checkpoint carries those ([`OutputBuffer::folded`]), in one
    /// message instead of one datagram each, and as surely as its state.
    pub fn set_mirror(&self, mirror: Option<Arc<dyn OutputListener>>, fold: usize) {
        let mut inner = self.lock();
        inner.mirror = mirror;
        inner.fold = if inner.mirror.is_some() { fold } else { 0 };
    }

    /// Copies of the frames closed epoch `epoch` folds into its checkpoint
    /// (see `set_mirror`), in the order the guest sent them.
    pub fn folded(&self, epoch: u64) -> Vec<Vec<u8>> {
        let inner = self.lock();
        let Some(held) = inner.closed.iter().find(|h| h.epoch == epoch) else { return Vec::new() };
        let frames = held.items.iter().filter_map(|item| match item {
            Out::Frame(f) => Some(f.clone()),
            Out::Console(_) => None,
        });
        frames.take(held.folded).collect()
    }

    /// The epoch the guest runs in, while output is held.
    pub fn open_epoch(&self) -> Option<u64> {
        let inner = self.lock();
        inner.protected.then_some(inner.open.epoch)
    }

    /// The oldest epoch whose output is still held, while output is held:
    /// everything of earlier epochs has gone out.
    pub fn first_held_epoch(&self) -> Option<u64> {
        let inner = self.lock();
        inner.protected.then(|| inner.closed.front().map_or(inner.open.epoch, |h| h.epoch))
    }

    /// Copies of the frames every closed epoch up to `epoch` still holds,
    /// oldest first, as far as they fit in `limit` bytes. With `syncvm`s
    /// pipelined, the epoch before `epoch` may still await its
    /// acknowledgement: its frames are as unreleased as `epoch`'s.
    pub fn frames_through(&self, epoch: u64, limit: usize) -> Vec<Vec<u8>> {
        let inner = self.lock();
        let mut left = limit;
        inner
            .closed
            .iter()
            .take_while(|h| h.epoch <= epoch)
            .flat_map(|h| &h.items)
            .filter_map(|item| match item {
                Out::Frame(f) => Some(f),
                Out::Console(_) => None,
            })
            .take_while(|f| {
                let fits = f.len() <= left;
                left = left.saturating_sub(f.len());
                fits
            })
            .cloned()
            .collect()
    }

    /// Frames held right now (all unacknowledged epochs).
    pub fn held_frames(&self) -> usize {
        let inner = self.lock();
        inner.open.frames + inner.closed.iter().map(|h| h.frames).sum::<usize>()
    }

    /// Bytes of console output held right now (all unacknowledged epochs).
    pub fn held_console_bytes(&self) -> usize {
        let inner = self.lock();
        let console = |h: &Held| h.items.iter().map(|i| if let Out::Console(c) = i { c.len() } else { 0 }).sum::<usize>();
        console(&inner.open) + inner.closed.iter().map(console).sum::<usize>()
    }

    /// What the held frames count against `HELD_OUTPUT_BOUND`.
    pub fn held_cost(&self) -> u64 {
        self.lock().held_cost
    }

    pub fn is_protected(&self) -> bool {
        self.lock().protected
    }
}

impl FrameSink for OutputBuffer {
    /// A frame (with its virtio-net header) the guest transmitted.
    fn send(&self, frame: &[u8]) {
        let mut inner = self.lock();
        if !inner.protected {
            drop(inner);
            self.network.send(frame);
            return;
        }
        inner.open.frames += 1;
        inner.open.count_client(frame);
        inner.held_cost += cost(frame);
        telemetry().held(1);
        let fold = inner.fold;
        let open = &mut inner.open;
        let folds = fold > 0 && !open.fold_full && open.folded_bytes + frame.len() <= fold;
        if folds {
            open.folded += 1;
            open.folded_bytes += frame.len();
        } else {
            // The fold is the epoch's first frames (`folded` reads them from
            // the front): after any frame outside it (one that did not fit,
            // or one held before the mirror was set) the rest are mirrored,
            // so the backup replays in order.
            open.fold_full = true;
        }
        let (mirror, epoch) = (inner.mirror.clone().filter(|_| !folds), inner.open.epoch);
        self.hold(inner, Out::Frame(frame.to_vec()));
        if let Some(m) = mirror {
            m.frame_held(epoch, frame);
        }
    }

    /// Unprotected, always; protected, until the held frames reach the bound.
    fn accepting(&self) -> bool {
        let mut inner = self.lock();
        if !inner.protected || inner.held_cost < HELD_OUTPUT_BOUND {
            return true;
        }
        inner.refused = true;
        false
    }
}

impl ConsoleSink for OutputBuffer {
    /// Guest console output: held with its epoch like frames (a console
    /// cannot be made to wait, so it is not bounded).
    fn write(&self, bytes: &[u8]) {
        let inner = self.lock();
        if !inner.protected {
            drop(inner);
            self.console.write(bytes);
            return;
        }
        self.hold(inner, Out::Console(bytes.to_vec()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Wire(Mutex<Vec<u8>>);

    impl FrameSink for Wire {
        fn send(&self, frame: &[u8]) {
            self.0.locked().extend_from_slice(frame);
        }
    }

    fn drain(wire: &Wire) -> Vec<u8> {
        std::mem::take(&mut *wire.0.locked())
    }

    #[test]
    fn frames_leave_only_after_their_epoch_is_acknowledged() {
        let wire = Arc::new(Wire::default());
        let out = OutputBuffer::new(wire.clone());
        out.send(b"a");
        assert_eq!(drain(&wire), b"a", "unprotected output is immediate");
        out.protect(1);
        out.send(b"b");
        assert_eq!(out.close_epoch(), 1);
        out.send(b"c");
        assert_eq!(out.close_epoch(), 2);
        assert!(drain(&wire).is_empty(), "held until acknowledged");
        assert_eq!(out.first_held_epoch(), Some(1));
        assert_eq!(out.release_through(1).frames, 1);
        assert_eq!(out.first_held_epoch(), Some(2));
        assert_eq!(drain(&wire), b"b");
        assert_eq!(out.held_frames(), 1);
        out.send(b"d"); // epoch 3, open
        assert_eq!(out.release_through(2).frames, 1);
        assert_eq!(drain(&wire), b"c");
        assert_eq!(out.release_through(2).frames, 0, "releasing again is a no-op");
        assert_eq!(out.unprotect().frames, 1);
        assert_eq!(out.first_held_epoch(), None, "nothing held unprotected");
        assert_eq!(drain(&wire), b"d");
        out.send(b"e");
        assert_eq!(drain(&wire), b"e");
    }

    /// An epoch counts the clients its TCP data went to, each once; pure
    /// ACKs and frames that are not TCP count none.
    #[test]
    fn an_epoch_counts_the_clients_its_data_went_to() {
        use crate::fakeack::segment::tests::{frame, GUEST, PEER};
        use crate::fakeack::segment::{ACK, FIN};
        let out = OutputBuffer::new(Arc::new(Wire::default()));
        out.protect(1);
        let to = |port: u16| Endpoint { port, ..PEER };
        for port in [40000, 40001, 40000, 40002] {
            out.send(&frame(GUEST, to(port), 1, 1, ACK, 100, &[], b"+OK\r\n"));
        }
        out.send(&frame(GUEST, to(40003), 1, 1, ACK, 100, &[], b""));
        out.send(b"not a TCP frame");
        out.close_epoch();
        assert_eq!(out.clients_last_closed(), 3);
        out.send(&frame(GUEST, to(40004), 1, 1, ACK | FIN, 100, &[], b""));
        out.close_epoch();
        assert_eq!(out.clients_last_closed(), 1, "a FIN waits for its checkpoint too");
        for port in 0..2 * CLIENTS_COUNTED as u16 {
            out.send(&frame(GUEST, to(port), 1, 1, ACK, 100, &[], b"x"));
        }
        out.close_epoch();
        assert_eq!(out.clients_last_closed(), CLIENTS_COUNTED);
        out.close_epoch();
        assert_eq!(out.clients_last_closed(), 0, "an epoch without output");
    }

    #[test]
    fn held_closed_epochs_frames_are_copied_within_a_limit_until_released() {
        let wire = Arc::new(Wire::default());
        let out = OutputBuffer::new(wire.clone());
        out.protect(1);
        out.send(b"aa");
        out.send(b"bbb");
        assert!(out.frames_through(1, 100).is_empty(), "the open epoch is not closed yet");
        assert_eq!(out.close_epoch(), 1);
        out.send(b"c");
        assert_eq!(out.close_epoch(), 2);
        out.send(b"open epoch");
        assert_eq!(out.frames_through(1, 100), vec![b"aa".to_vec(), b"bbb".to_vec()], "not the later epoch");
        assert_eq!(out.frames_through(2, 100), vec![b"aa".to_vec(), b"bbb".to_vec(), b"c".to_vec()], "every held epoch");
        assert_eq!(out.frames_through(2, 5), vec![b"aa".to_vec(), b"bbb".to_vec()], "the first frames that fit");
        assert_eq!(out.frames_through(2, 1), Vec::<Vec<u8>>::new());
        out.release_through(1);
        assert_eq!(out.frames_through(2, 100), vec![b"c".to_vec()], "the released epoch is gone");
        out.release_through(2);
        assert!(out.frames_through(2, 100).is_empty(), "released");
        assert_eq!(drain(&wire), b"aabbbc");
    }

    #[test]
    fn a_closed_release_gate_holds_acknowledged_output_back_in_order() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let wire = Arc::new(Wire::default());
        let out = OutputBuffer::new(wire.clone());
        // Open for two frames, then closed (the process was stopped in the
        // middle of a release), until reopened.
        let budget = Arc::new(AtomicUsize::new(2));
        let b = budget.clone();
        out.set_release_gate(Some(Arc::new(move || b.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok())));
        out.protect(1);
        out.send(b"a");
        out.send(b"b");
        out.send(b"c");
        out.close_epoch();
        out.send(b"d");
        out.close_epoch();
        assert_eq!(out.release_through(2).frames, 2);
        assert_eq!(drain(&wire), b"ab");
        assert_eq!(out.held_frames(), 2);
        assert_eq!(out.release_through(2).frames, 0, "still closed");
        budget.store(usize::MAX, Ordering::SeqCst);
        assert_eq!(out.release_through(2).frames, 2);
        assert_eq!(drain(&wire), b"cd");
        assert_eq!(out.held_frames(), 0);
        assert_eq!(out.held_cost(), 0);
        // Unprotecting does not ask the gate.
        budget.store(0, Ordering::SeqCst);
        out.send(b"e");
        assert_eq!(out.unprotect().frames, 1);
        assert_eq!(drain(&wire), b"e");
    }

    #[test]
    fn held_output_is_bounded_and_a_release_makes_room() {
        let wire = Arc::new(Wire::default());
        let out = OutputBuffer::new(wire.clone());
        let frame = vec![0x5a; 1500];
        out.protect(1);
        let mut held = 0;
        while out.accepting() {
            out.send(&frame);
            held += 1;
        }
        assert_eq!(out.held_cost(), held * cost(&frame));
        assert!(out.held_cost() >= HELD_OUTPUT_BOUND && out.held_cost() < HELD_OUTPUT_BOUND + cost(&frame));
        assert!(!out.accepting(), "full until a release");
        out.close_epoch();
        assert_eq!(out.release_through(1).frames, held);
        assert_eq!(out.held_cost(), 0);
        assert!(out.accepting());
        assert_eq!(drain(&wire).len() as u64, held * 1500);
        out.send(&frame);
        assert_eq!(out.unprotect().frames, 1);
        assert_eq!(out.held_cost(), 0);
        for _ in 0..held + 10 {
            out.send(&frame);
        }
        assert!(out.accepting(), "unprotected output is never held");
    }

    /// Frames as numbers, in the order they reached the network.
    #[derive(Default)]
    struct Numbered(Mutex<Vec<u32>>);

    impl FrameSink for Numbered {
        fn send(&self, frame: &[u8]) {
            self.0.locked().push(u32::from_le_bytes(frame.try_into().expect("4-byte frames")));
        }
    }

    #[test]
    fn unprotect_keeps_frame_order_against_a_sending_guest() {
        // The guest keeps sending while the primary gives its backup up:
        // a frame sent after the switch to unprotected must not overtake the
        // held ones still being released.
        for _ in 0..500 {
            let wire = Arc::new(Numbered::default());
            let out = Arc::new(OutputBuffer::new(wire.clone()));
            out.protect(1);
            let running = Arc::new(std::sync::Barrier::new(2));
            let guest = {
                let (out, running) = (out.clone(), running.clone());
                std::thread::spawn(move || {
                    running.wait();
                    for n in 0..2000u32 {
                        out.send(&n.to_le_bytes());
                    }
                })
            };
            running.wait();
            while out.held_frames() < 8 {
                std::hint::spin_loop();
            }
            out.unprotect();
            guest.join().unwrap();
            let seen = wire.0.locked().clone();
            assert_eq!(seen.len(), 2000);
            assert!(seen.windows(2).all(|w| w[0] < w[1]), "frames reordered: {seen:?}");
        }
    }

    #[derive(Default)]
    struct Screen(Mutex<Vec<u8>>);

    impl ConsoleSink for Screen {
        fn write(&self, bytes: &[u8]) {
            self.0.locked().extend_from_slice(bytes);
        }
    }

    #[test]
    fn console_output_is_held_with_its_epoch_in_order_with_frames() {
        let (wire, screen) = (Arc::new(Wire::default()), Arc::new(Screen::default()));
        let out = OutputBuffer::new(wire.clone()).with_console(Console::new(screen.clone()));
        ConsoleSink::write(&out, b"boot\n");
        assert_eq!(&*screen.0.locked(), b"boot\n", "unprotected console output is immediate");
        out.protect(1);
        ConsoleSink::write(&out, b"one\n");
        out.send(b"f1");
        ConsoleSink::write(&out, b"two\n");
        assert_eq!(out.close_epoch(), 1);
        ConsoleSink::write(&out, b"three\n");
        assert_eq!(&*screen.0.locked(), b"boot\n", "held until acknowledged");
        assert!(drain(&wire).is_empty());
        out.release_through(1);
        assert_eq!(&*screen.0.locked(), b"boot\none\ntwo\n");
        assert_eq!(drain(&wire), b"f1");
        assert_eq!(out.held_frames(), 0, "console lines are not frames");
        out.unprotect();
        assert_eq!(&*screen.0.locked(), b"boot\none\ntwo\nthree\n");
    }

    /// Records the frames it is told of, as the mirror would send them.
    #[derive(Default)]
    struct Copies(Mutex<Vec<(u64, Vec<u8>)>>);

    impl OutputListener for Copies {
        fn frame_held(&self, epoch: u64, frame: &[u8]) {
            self.0.locked().push((epoch, frame.to_vec()));
        }
    }

    #[test]
    fn an_epochs_first_frames_fold_into_its_checkpoint_and_the_rest_are_mirrored() {
        let (wire, copies) = (Arc::new(Wire::default()), Arc::new(Copies::default()));
        let out = OutputBuffer::new(wire.clone());
        out.protect(1);
        out.set_mirror(Some(copies.clone()), 5);
        ConsoleSink::write(&out, b"console\n");
        out.send(b"ab");
        out.send(b"cd");
        // Does not fit the 5 bytes: mirrored, and so is all that follows
        // (the backup replays the fold first, then the mirrored frames).
        out.send(b"efgh");
        out.send(b"i");
        assert_eq!(out.close_epoch(), 1);
        out.send(b"jk");
        assert_eq!(out.folded(1), vec![b"ab".to_vec(), b"cd".to_vec()]);
        assert_eq!(out.folded(2), Vec::<Vec<u8>>::new(), "the open epoch is not closed yet");
        assert_eq!(out.close_epoch(), 2);
        assert_eq!(out.folded(2), vec![b"jk".to_vec()], "each epoch has its own fold");
        assert_eq!(*copies.0.locked(), vec![(1, b"efgh".to_vec()), (1, b"i".to_vec())]);
        // Folded or mirrored, every frame is held until acknowledged.
        assert!(drain(&wire).is_empty());
        assert_eq!(out.release_through(2).frames, 5);
        assert_eq!(drain(&wire), b"abcdefghijk");
        // A frame held before the mirror was set ends the epoch's fold: the
        // fold must be the epoch's first frames.
        out.set_mirror(None, 5);
        out.send(b"before");
        out.set_mirror(Some(copies.clone()), 5);
        out.send(b"after");
        assert_eq!(out.close_epoch(), 3);
        assert!(out.folded(3).is_empty());
        assert_eq!(copies.0.locked().last(), Some(&(3, b"after".to_vec())));
        // Without a mirror nothing folds: there is no backup replay to feed.
        out.set_mirror(None, 5);
        out.send(b"x");
        assert_eq!(out.close_epoch(), 4);
        assert!(out.folded(4).is_empty());
    }
}
