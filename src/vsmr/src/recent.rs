//! `--takeover-replay`: a VM replica that does not lead keeps its guest's
//! frames since its last completed `syncvm`, and sends them when it
//! becomes the leader.
//!
//! Replies the old leader held die with it; without this, the clients get
//! them only when their TCP retransmission timer fires (200 ms at least),
//! which dominates a VSMR failover. The secondary's guest produced the same
//! replies itself: it ran the same committed input.
//!
//! Why sending them is safe (output commit): a frame kept here is output of
//! the secondary's own execution since its last completed `syncvm`, from
//! the state that `syncvm` gave it (the leader's state then) and the
//! committed input that followed. That execution is exactly the state the
//! new leader continues from: no later `syncvm` replaced it (each completed
//! one clears this buffer, inside its pause, before the guest runs on the
//! leader's state), and a replica may lead only while it is in step. So the
//! frames are output of the state the service now has, as a primary-backup
//! backup's mirrored output of the checkpoint it took over from is. Where
//! they differ from what the old leader sent (divergence: timing, TCP
//! segmentation, timestamps), the old leader's were of a state that is
//! gone; clients take the new leader's as they would after any failover,
//! and a byte stream the old leader did release is the same bytes (same
//! input, same order, a deterministic service), which TCP takes once.
//! Frames of the replaced execution (before the `syncvm`) are never sent.

use std::collections::VecDeque;
use std::sync::Mutex;

use ftvm_vmm::hooks::FrameSink;
use ftvm_vmm::sync::Lock;

use ftvm_vmm::switch;

switch! {
    /// `--takeover-replay`: whether a new leader sends its guest's frames
    /// since its last `syncvm`.
    pub enum Mode {
        /// Keep them while not leading, send them at takeover.
        On = "on",
        /// Discard them: clients recover by retransmitting.
        Off = "off",
    }
}

/// Frame bytes kept at most: newer frames beyond are dropped (a dropped
/// one only costs its client a retransmission).
pub const BOUND: usize = 16 << 20;

#[derive(Default)]
struct Inner {
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
    dropped: u64,
    /// The first this many frames are the leader's (`reset`).
    leaders: usize,
}

/// The output sink of a VM replica that does not lead.
#[derive(Default)]
pub struct Recent {
    /// Off: a sink that keeps nothing.
    keep: bool,
    inner: Mutex<Inner>,
}

impl Recent {
    pub fn new(mode: Mode) -> Recent {
        Recent { keep: mode == Mode::On, inner: Mutex::default() }
    }

    /// A `syncvm` replaced the guest's state (call while it is paused):
    /// what it sent before is of an execution that is gone.
    pub fn clear(&self) {
        let mut inner = self.inner.locked();
        inner.frames.clear();
        inner.bytes = 0;
        inner.dropped = 0;
        inner.leaders = 0;
    }

    /// A `syncvm` replaced the guest's state with the leader's, whose
    /// output still held when it froze for that `syncvm` was `frames`
    /// (`--sync-output on`): keep those in place of this guest's own. They are output of
    /// the state this replica now holds, so a takeover may send them (the
    /// leader may have died before it released them).
    pub fn reset(&self, frames: Vec<Vec<u8>>) {
        self.clear();
        for f in frames {
            self.send(&f);
        }
        let mut inner = self.inner.locked();
        inner.leaders = inner.frames.len();
    }

    /// Everything kept, oldest first, how many frames were dropped past
    /// the bound, and how many of those kept are the leader's (`reset`);
    /// empties the buffer.
    pub fn take(&self) -> (Vec<Vec<u8>>, u64, usize) {
        let mut inner = self.inner.locked();
        let frames = std::mem::take(&mut inner.frames).into();
        let dropped = std::mem::take(&mut inner.dropped);
        let leaders = std::mem::take(&mut inner.leaders);
        inner.bytes = 0;
        (frames, dropped, leaders)
    }
}

impl FrameSink for Recent {
    fn send(&self, frame: &[u8]) {
        if !self.keep {
            return;
        }
        let mut inner = self.inner.locked();
        if inner.bytes + frame.len() > BOUND {
            inner.dropped += 1;
            return;
        }
        inner.bytes += frame.len();
        inner.frames.push_back(frame.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_frames_until_cleared_and_within_the_bound() {
        let r = Recent::new(Mode::On);
        r.send(b"a");
        r.clear();
        r.send(b"b");
        r.send(b"c");
        assert_eq!(r.take(), (vec![b"b".to_vec(), b"c".to_vec()], 0, 0));
        assert_eq!(r.take(), (Vec::new(), 0, 0));
        let big = vec![0u8; BOUND / 2 + 1];
        r.send(&big);
        r.send(&big);
        r.send(b"d");
        assert_eq!(r.take(), (vec![big, b"d".to_vec()], 1, 0));
        let off = Recent::new(Mode::Off);
        off.send(b"x");
        assert_eq!(off.take(), (Vec::new(), 0, 0));
        off.reset(vec![b"y".to_vec()]);
        assert_eq!(off.take(), (Vec::new(), 0, 0));
    }

    #[test]
    fn a_syncvm_leaves_the_leaders_frames_of_its_epoch() {
        let r = Recent::new(Mode::On);
        r.send(b"own, of the replaced execution");
        r.reset(vec![b"leader 1".to_vec(), b"leader 2".to_vec()]);
        r.send(b"own, after the apply");
        let (frames, dropped, leaders) = r.take();
        assert_eq!(frames, vec![b"leader 1".to_vec(), b"leader 2".to_vec(), b"own, after the apply".to_vec()]);
        assert_eq!((dropped, leaders), (0, 2));
    }
}
