//! The disk writes of each epoch, which travel to the backup with that
//! epoch's checkpoint so the backup's disk always matches its memory.

use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use ftvm_vmm::hooks::DiskWriteObserver;
use ftvm_vmm::sync::Lock;

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
        self.writes.locked()
    }

    /// Begin recording (replication starts); anything recorded before is dropped.
    pub fn start(&self) {
        *self.lock() = Some(Vec::new());
    }

    pub fn stop(&self) {
        *self.lock() = None;
    }

    /// The writes since the last take, in the order they completed.
    pub fn take(&self) -> Vec<DiskWrite> {
        self.lock().as_mut().map(std::mem::take).unwrap_or_default()
    }
}

impl DiskWriteObserver for DiskJournal {
    fn written(&self, offset: u64, data: &[u8]) {
        if let Some(w) = self.lock().as_mut() {
            w.push(DiskWrite { offset, data: data.to_vec() });
        }
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
        assert_eq!(j.take(), vec![DiskWrite { offset: 512, data: b"a".to_vec() }, DiskWrite { offset: 1024, data: b"b".to_vec() }]);
        assert!(j.take().is_empty());
        j.stop();
        j.written(0, b"after");
        assert!(j.take().is_empty());
    }
}
