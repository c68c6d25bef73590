//! Trigger: when the next checkpoint is taken. At the end of every epoch,
//! or earlier when a bounded resource of the primary asks for it (the disk
//! journal when an epoch has written much), so no checkpoint outgrows what
//! the backup accepts.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

use ftvm_vmm::sync::{self, Lock};

/// Shared between whatever may ask for an early checkpoint and the
/// replication thread that takes checkpoints.
#[derive(Default)]
pub struct Trigger {
    early: Mutex<bool>,
    asked: Condvar,
}

impl Trigger {
    /// Ask for a checkpoint as soon as possible.
    pub fn fire(&self) {
        *self.early.locked() = true;
        self.asked.notify_all();
    }

    /// Whether a checkpoint was asked for (and not yet taken).
    pub fn is_pending(&self) -> bool {
        *self.early.locked()
    }

    /// Wait until `deadline` or until a checkpoint is asked for, whichever
    /// comes first; true if it was asked for (the request is consumed).
    pub fn wait_until(&self, deadline: Instant) -> bool {
        let mut early = self.early.locked();
        loop {
            if std::mem::take(&mut *early) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            early = sync::wait_timeout(&self.asked, early, deadline - now);
        }
    }

    /// Forget a request (the checkpoint it asked for is being taken).
    pub fn clear(&self) {
        *self.early.locked() = false;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn an_early_request_ends_the_wait_once() {
        let t = Arc::new(Trigger::default());
        assert!(!t.wait_until(Instant::now() + Duration::from_millis(5)), "nothing asked: the deadline passes");
        let asker = {
            let t = t.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                t.fire();
            })
        };
        let t0 = Instant::now();
        assert!(t.wait_until(Instant::now() + Duration::from_secs(60)), "the request ends the wait");
        assert!(t0.elapsed() < Duration::from_secs(60));
        asker.join().unwrap();
        assert!(!t.is_pending(), "consumed by the wait");
        t.fire();
        t.clear();
        assert!(!t.wait_until(Instant::now()), "cleared");
    }
}
