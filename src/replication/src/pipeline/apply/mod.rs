//! Apply, on the backup: a received checkpoint is first staged (parsed and
//! checked against the replica, nothing changed), then committed.

use std::os::unix::fs::FileExt;

use crate::backup::Replica;
use crate::checkpoint::Checkpoint;
use crate::protocol::ProtocolError;
use crate::ReplicationError;

pub trait Apply: Send {
    /// Check checkpoint `payload` against `replica`; nothing changes.
    fn stage<'a>(&mut self, replica: &Replica, payload: &'a [u8]) -> Result<Checkpoint<'a>, ReplicationError>;
    /// Make a staged checkpoint the replica's state.
    fn commit(&mut self, replica: &mut Replica, checkpoint: Checkpoint<'_>) -> Result<(), ReplicationError>;
}

/// Today's apply: pages straight into the replica's RAM, writes into its disk.
pub struct InPlace;

impl Apply for InPlace {
    fn stage<'a>(&mut self, replica: &Replica, payload: &'a [u8]) -> Result<Checkpoint<'a>, ReplicationError> {
        let ckpt = Checkpoint::parse(payload, replica.vm.ram().pages(), replica.disk_size)?;
        if ckpt.epoch != replica.next_epoch {
            return Err(ProtocolError::Corrupt(format!("checkpoint {} arrived, {} was expected", ckpt.epoch, replica.next_epoch)).into());
        }
        Ok(ckpt)
    }

    fn commit(&mut self, replica: &mut Replica, checkpoint: Checkpoint<'_>) -> Result<(), ReplicationError> {
        checkpoint.pages.apply(replica.vm.ram()).map_err(ftvm_vmm::VmError::from)?;
        if let Some(disk) = &replica.disk {
            for w in &checkpoint.state.disk {
                disk.write_all_at(&w.data, w.offset).map_err(ReplicationError::BackupDisk)?;
            }
        }
        replica.next_epoch = checkpoint.epoch + 1;
        replica.committed = Some((checkpoint.epoch, checkpoint.state.vm));
        Ok(())
    }
}
