//! Output commit for network frames.
//!
//! Frames the guest transmits go through here. Unprotected, they go straight
//! to the TAP. Protected, each frame joins the open epoch's queue and leaves
//! only when the backup has acknowledged that epoch's checkpoint, so no
//! client ever sees output whose state could be lost in a failover.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use ftvm_vmm::hooks::FrameSink;
use ftvm_vmm::sync::Lock;

#[derive(Default)]
struct Held {
    epoch: u64,
    frames: Vec<Vec<u8>>,
    first_at: Option<Instant>,
}

struct Inner {
    protected: bool,
    /// The epoch the guest is running in (frames submitted now belong to it).
    open: Held,
    /// Closed epochs waiting for their acknowledgement, oldest first.
    closed: VecDeque<Held>,
    released_frames: u64,
}

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
}

impl OutputBuffer {
    pub fn new(network: Arc<dyn FrameSink>) -> OutputBuffer {
        OutputBuffer {
            inner: Mutex::new(Inner { protected: false, open: Held::default(), closed: VecDeque::new(), released_frames: 0 }),
            network,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.locked()
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
        let epoch = closed.epoch;
        inner.closed.push_back(closed);
        epoch
    }

    /// The backup acknowledged every epoch up to `epoch`: let their frames out, in order.
    pub fn release_through(&self, epoch: u64) -> Released {
        let mut inner = self.lock();
        let mut released = Released::default();
        while inner.closed.front().is_some_and(|h| h.epoch <= epoch) {
            let held = inner.closed.pop_front().expect("front exists");
            if let Some(t) = held.first_at {
                released.max_hold_us = released.max_hold_us.max(t.elapsed().as_micros() as u64);
            }
            // Sent under the lock: frames of later epochs must not overtake these.
            for frame in &held.frames {
                self.network.send(frame);
            }
            released.frames += held.frames.len() as u64;
        }
        inner.released_frames += released.frames;
        released
    }

    /// Stop protecting (the backup is gone and the policy is to continue):
    /// everything held goes out, because this VM is now the only copy.
    pub fn unprotect(&self) -> Released {
        let last = {
            let mut inner = self.lock();
            let open = std::mem::take(&mut inner.open);
            let epoch = open.epoch;
            inner.closed.push_back(open);
            inner.protected = false;
            epoch
        };
        self.release_through(last)
    }

    /// Frames held right now (all unacknowledged epochs).
    pub fn held_frames(&self) -> usize {
        let inner = self.lock();
        inner.open.frames.len() + inner.closed.iter().map(|h| h.frames.len()).sum::<usize>()
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
        inner.open.first_at.get_or_insert_with(Instant::now);
        inner.open.frames.push(frame.to_vec());
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
        assert_eq!(out.release_through(1).frames, 1);
        assert_eq!(drain(&wire), b"b");
        assert_eq!(out.held_frames(), 1);
        out.send(b"d"); // epoch 3, open
        assert_eq!(out.release_through(2).frames, 1);
        assert_eq!(drain(&wire), b"c");
        assert_eq!(out.release_through(2).frames, 0, "releasing again is a no-op");
        assert_eq!(out.unprotect().frames, 1);
        assert_eq!(drain(&wire), b"d");
        out.send(b"e");
        assert_eq!(drain(&wire), b"e");
    }
}
