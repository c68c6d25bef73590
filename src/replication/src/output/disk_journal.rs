//! The disk writes of each epoch, which travel to the backup with that
//! epoch's checkpoint so the backup's disk always matches its memory.
//!
//! The journal is bounded (`bounds`): past `JOURNAL_EARLY` bytes in one
//! epoch it asks the primary for the checkpoint now (`Trigger`), and at
//! `JOURNAL_BOUND` it stops the guest's disk from taking more requests
//! until that checkpoint has taken the journal (then it wakes the disk).

use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use ftvm_vmm::devices::Waker;
use ftvm_vmm::hooks::DiskWriteObserver;
use ftvm_vmm::sync::Lock;

use super::OutputListener;
use crate::bounds::{JOURNAL_BOUND, JOURNAL_EARLY, WRITE_OVERHEAD};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskWrite {
    /// Byte offset on the disk.
    pub offset: u64,
    pub data: Vec<u8>,
}

#[derive(Default)]
struct Inner {
    /// None while not replicating.
    writes: Option<Vec<DiskWrite>>,
    /// What `writes` costs, data plus `WRITE_OVERHEAD` per write.
    cost: u64,
    /// The disk was told to wait: wake it when there is room.
    refused: bool,
}

/// Records completed guest disk writes while replication is on.
pub struct DiskJournal {
    inner: Mutex<Inner>,
    trigger: Arc<dyn OutputListener>,
    waker: Waker,
}

/// A journal nobody asks for early checkpoints (a VM whose checkpoints
/// another mechanism paces, such as a consensus replica's `syncvm`).
impl Default for DiskJournal {
    fn default() -> DiskJournal {
        struct Nobody;
        impl OutputListener for Nobody {}
        DiskJournal::new(std::sync::Arc::new(Nobody), Waker::default())
    }
}

impl DiskJournal {
    /// A journal that asks `trigger` for early checkpoints and wakes the
    /// disk with `waker`.
    pub fn new(trigger: Arc<dyn OutputListener>, waker: Waker) -> DiskJournal {
        DiskJournal { inner: Mutex::default(), trigger, waker }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Replace the contents; wake the disk if it was waiting for room.
    fn reset(&self, writes: Option<Vec<DiskWrite>>) -> Vec<DiskWrite> {
        let mut inner = self.lock();
        let old = std::mem::replace(&mut inner.writes, writes);
        inner.cost = 0;
        let wake = std::mem::take(&mut inner.refused);
        drop(inner);
        if wake {
            self.waker.wake();
        }
        old.unwrap_or_default()
    }

    /// Begin recording (replication starts); anything recorded before is dropped.
    pub fn start(&self) {
        self.reset(Some(Vec::new()));
    }

    pub fn stop(&self) {
        self.reset(None);
    }

    /// The writes since the last take, in the order they completed.
    pub fn take(&self) -> Vec<DiskWrite> {
        let recording = self.lock().writes.is_some();
        self.reset(recording.then(Vec::new))
    }

    /// What the writes recorded since the last take cost (see `bounds`).
    pub fn cost(&self) -> u64 {
        self.lock().cost
    }
}

impl DiskWriteObserver for DiskJournal {
    fn written(&self, offset: u64, data: &[u8]) {
        let mut inner = self.lock();
        let Some(w) = inner.writes.as_mut() else { return };
        w.push(DiskWrite { offset, data: data.to_vec() });
        let before = inner.cost;
        inner.cost += data.len() as u64 + WRITE_OVERHEAD;
        if before < JOURNAL_EARLY && inner.cost >= JOURNAL_EARLY {
            self.trigger.checkpoint_wanted();
        }
    }

    fn accepting(&self) -> bool {
        let mut inner = self.lock();
        if inner.writes.is_none() || inner.cost < JOURNAL_BOUND {
            return true;
        }
        inner.refused = true;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_started() {
        let j = DiskJournal::default();
        j.written(0, b"before");
        j.start();
        j.written(512, b"a");
        j.written(1024, b"b");
        assert_eq!(j.cost(), 2 + 2 * WRITE_OVERHEAD);
        assert_eq!(j.take(), vec![DiskWrite { offset: 512, data: b"a".to_vec() }, DiskWrite { offset: 1024, data: b"b".to_vec() }]);
        assert!(j.take().is_empty());
        assert_eq!(j.cost(), 0);
        j.stop();
        j.written(0, b"after");
        assert!(j.take().is_empty());
    }

    #[test]
    fn a_full_epoch_asks_for_its_checkpoint_then_makes_the_disk_wait() {
        /// Remembers whether a checkpoint was asked for.
        #[derive(Default)]
        struct Asked(std::sync::atomic::AtomicBool);
        impl OutputListener for Asked {
            fn checkpoint_wanted(&self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let asked = Arc::new(Asked::default());
        let j = DiskJournal::new(asked.clone(), Waker::default());
        j.start();
        let chunk = vec![7u8; 1 << 20];
        let mut offset = 0;
        while j.cost() + chunk.len() as u64 + WRITE_OVERHEAD < JOURNAL_EARLY {
            assert!(j.accepting());
            j.written(offset, &chunk);
            offset += chunk.len() as u64;
        }
        assert!(!asked.0.load(std::sync::atomic::Ordering::SeqCst), "below the early mark");
        j.written(offset, &chunk);
        assert!(asked.0.load(std::sync::atomic::Ordering::SeqCst), "the early mark asks for the checkpoint");
        while j.accepting() {
            offset += chunk.len() as u64;
            j.written(offset, &chunk);
        }
        assert!(j.cost() >= JOURNAL_BOUND && j.cost() < JOURNAL_BOUND + chunk.len() as u64 + WRITE_OVERHEAD);
        assert!(!j.accepting(), "the disk waits until the checkpoint takes the journal");
        let taken = j.take();
        assert_eq!(taken.len() as u64, offset / chunk.len() as u64 + 1);
        assert!(j.accepting(), "room again");
        // Not recording: never in the way.
        j.stop();
        for _ in 0..100 {
            j.written(0, &chunk);
        }
        assert!(j.accepting());
    }
}
