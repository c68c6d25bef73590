//! The switch that pauses device threads between two pieces of work.

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::sync::{self, Lock};

/// Lets the pauser stop every device thread between two pieces of work.
#[derive(Default)]
pub struct Gate {
    state: Mutex<(bool, bool)>, // (paused, stopping)
    changed: Condvar,
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

    pub fn set(&self, paused: Option<bool>, stopping: bool) {
        let mut st = self.lock();
        if let Some(p) = paused {
            st.0 = p;
        }
        st.1 |= stopping;
        self.changed.notify_all();
    }
}
