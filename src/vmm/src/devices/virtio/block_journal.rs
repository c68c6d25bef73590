//! The disk writes of each epoch, which travel to the backup with that
//! epoch's checkpoint so the backup's disk always matches its memory.

use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskWrite {
    /// Byte offset on the disk.
    pub offset: u64,
    pub data: Vec<u8>,
}

/// Records completed guest disk writes while replication is on.
#[derive(Default)]
pub struct DiskJournal {
    writes: Mutex<Option<Vec<DiskWrite>>>,
}

impl DiskJournal {
    fn lock(&self) -> MutexGuard<'_, Option<Vec<DiskWrite>>> {
        self.writes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Begin recording (replication starts); anything recorded before is dropped.
    pub fn start(&self) {
        *self.lock() = Some(Vec::new());
    }

    pub fn stop(&self) {
        *self.lock() = None;
    }

    pub fn record(&self, offset: u64, data: &[u8]) {
        if let Some(w) = self.lock().as_mut() {
            w.push(DiskWrite { offset, data: data.to_vec() });
        }
    }

    /// The writes since the last take, in the order they completed.
    pub fn take(&self) -> Vec<DiskWrite> {
        self.lock().as_mut().map(std::mem::take).unwrap_or_default()
    }
}
