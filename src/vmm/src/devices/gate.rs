//! The switch that pauses device threads between two pieces of work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::sync::{self, Lock};

/// Lets the pauser stop every device thread between two pieces of work.
#[derive(Default)]
pub struct Gate {
    /// Whether the gate is stopping for good. The paused flag lives in
    /// `pausing` so devices can read it mid-pass without this lock; it is
    /// only written with this lock held, so a waiter cannot miss a change.
    stopping: Mutex<bool>,
    changed: Condvar,
    pausing: PauseFlag,
}

/// Read by a device in the middle of a long piece of work: a pause is
/// waiting for it, and work it leaves for later (frames still on the TAP)
/// is better done after the pause than inside it.
#[derive(Clone, Default)]
pub struct PauseFlag(Arc<Flags>);

#[derive(Default)]
struct Flags {
    raised: AtomicBool,
    work_left: AtomicBool,
}

impl PauseFlag {
    pub fn raised(&self) -> bool {
        self.0.raised.load(Ordering::Acquire)
    }

    /// The device stopped short for the pause: it needs a pass after it.
    pub fn left_work(&self) {
        self.0.work_left.store(true, Ordering::Release);
    }
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, bool> {
        self.stopping.locked()
    }

    /// Block while paused; false once stopping.
    pub fn wait_running(&self) -> bool {
        let mut stopping = self.lock();
        while self.pausing.raised() && !*stopping {
            stopping = sync::wait(&self.changed, stopping);
        }
        !*stopping
    }

    pub fn paused(&self) -> bool {
        self.pausing.raised()
    }

    pub fn pause_flag(&self) -> PauseFlag {
        self.pausing.clone()
    }

    /// Whether a device stopped short during the pause that just ended.
    pub fn take_work_left(&self) -> bool {
        self.pausing.0.work_left.swap(false, Ordering::AcqRel)
    }

    pub fn set(&self, paused: Option<bool>, stopping: bool) {
        let mut st = self.lock();
        if let Some(p) = paused {
            self.pausing.0.raised.store(p, Ordering::Release);
        }
        *st |= stopping;
        self.changed.notify_all();
    }
}
