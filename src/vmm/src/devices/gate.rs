//! The switch that pauses device threads between two pieces of work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::sync::{self, Lock};

/// Lets the pauser stop every device thread between two pieces of work.
#[derive(Default)]
pub struct Gate {
    state: Mutex<(bool, bool)>, // (paused, stopping)
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
    fn lock(&self) -> MutexGuard<'_, (bool, bool)> {
        self.state.locked()
    }

    /// Block while paused; false once stopping.
    pub fn wait_running(&self) -> bool {
        let mut st = self.lock();
        while st.0 && !st.1 {
            st = sync::wait(&self.changed, st);
        }
        !st.1
    }

    pub fn paused(&self) -> bool {
        self.lock().0
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
            st.0 = p;
            self.pausing.0.raised.store(p, Ordering::Release);
        }
        st.1 |= stopping;
        self.changed.notify_all();
    }
}
