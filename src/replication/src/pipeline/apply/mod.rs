//! Apply, on the backup: a received checkpoint is first staged (parsed and
//! checked against the replica, nothing changed), then committed, all of it
//! or none of it.
//!
//! The commit writes the disk first, through an undo log (`undo`): when a
//! write fails (a full replica disk), what was written is put back and the
//! replica is still exactly at the previous checkpoint. Pages go into RAM
//! only after that, when nothing can fail any more (every page number was
//! checked against RAM at stage time), and the VM state last. If even the
//! undo fails, the replica matches no checkpoint and is discarded: it can
//! never be taken over.

mod replica;
mod undo;

use std::io;

pub use replica::{Replica, Staged};
pub use undo::{DiskImage, Failure, UndoLog};

use crate::checkpoint::Checkpoint;
use crate::protocol::ProtocolError;

/// Why a checkpoint (or pre-copy data) could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// Refused at stage: nothing changed.
    #[error("{0}")]
    Invalid(#[from] ProtocolError),
    /// The commit failed and was undone: the replica is at the previous checkpoint.
    #[error("checkpoint {epoch}: cannot write the disk replica {disk} ({err}); its writes were undone")]
    Undone { epoch: u64, disk: String, err: io::Error },
    /// The commit failed and could not be undone: the replica was discarded.
    #[error("checkpoint {epoch}: {reason}; the replica matches no checkpoint and was discarded")]
    Unusable { epoch: u64, reason: String },
    #[error("pre-copy: cannot write the disk replica {disk}: {err}")]
    Precopy { disk: String, err: io::Error },
    /// `--prefetch-by pull`: the primary's memory cannot be mapped.
    #[error(transparent)]
    Pull(#[from] crate::pipeline::prefetch::pull::PullError),
}

pub trait Apply: Send {
    /// Check checkpoint `payload` against `replica`; nothing changes.
    fn stage<'a>(&mut self, replica: &Replica, payload: &'a [u8]) -> Result<Checkpoint<'a>, ApplyError>;
    /// Make a staged checkpoint the replica's state, whole; on an error the
    /// replica is unchanged (`Undone`) or discarded (`Unusable`).
    fn commit(&mut self, replica: &mut Replica, checkpoint: Checkpoint<'_>) -> Result<(), ApplyError>;
}

/// Today's apply: the disk writes through an undo log, then the pages
/// straight into the replica's RAM.
#[derive(Default)]
pub struct InPlace {
    undo: UndoLog,
}

impl Apply for InPlace {
    fn stage<'a>(&mut self, replica: &Replica, payload: &'a [u8]) -> Result<Checkpoint<'a>, ApplyError> {
        let mut ckpt = Checkpoint::parse(payload, replica.vm.ram().pages(), replica.disk_size)?;
        if ckpt.epoch != replica.next_epoch {
            return Err(ProtocolError::Corrupt(format!("checkpoint {} arrived, {} was expected", ckpt.epoch, replica.next_epoch)).into());
        }
        if let Err(why) = ckpt.state.vm.check(replica.committed.as_ref().map(|(_, state)| state)) {
            return Err(ProtocolError::Corrupt(format!("checkpoint {}: {why}", ckpt.epoch)).into());
        }
        if replica.disk.is_none() && !ckpt.state.disk.is_empty() {
            return Err(ProtocolError::Corrupt(format!("checkpoint {} writes to a disk this replica does not have", ckpt.epoch)).into());
        }
        // The proxy's whole state, made now so that the commit cannot fail on it.
        let held = replica.committed.as_ref().map(|(epoch, _)| *epoch).zip(replica.fake_ack.as_ref());
        if let Some(carried) = ckpt.state.fake_ack.take() {
            let whole = carried.over(held).map_err(|why| ProtocolError::Corrupt(format!("checkpoint {}: {why}", ckpt.epoch)))?;
            ckpt.fake_ack = Some(whole);
        }
        Ok(ckpt)
    }

    fn commit(&mut self, replica: &mut Replica, checkpoint: Checkpoint<'_>) -> Result<(), ApplyError> {
        let epoch = checkpoint.epoch;
        if let Some(disk) = &replica.disk {
            match self.undo.write(disk.as_ref(), &checkpoint.state.disk) {
                Ok(()) => {}
                Err(Failure::Undone(err)) => return Err(ApplyError::Undone { epoch, disk: replica.disk_name.clone(), err }),
                Err(Failure::NotUndone { err, undo }) => {
                    replica.discard();
                    let reason =
                        format!("cannot write the disk replica {} ({err}) nor put back what was written ({undo})", replica.disk_name);
                    return Err(ApplyError::Unusable { epoch, reason });
                }
            }
        }
        // Cannot fail: every page was checked against RAM, the prefetched
        // ones when they were staged, the checkpoint's by `stage`. The
        // prefetched pages go first: the checkpoint's pages are newer.
        if let Err(e) = replica.commit_staged().and_then(|()| checkpoint.pages.apply(replica.vm.ram())) {
            replica.discard();
            return Err(ApplyError::Unusable { epoch, reason: format!("copying its pages failed: {e}") });
        }
        replica.next_epoch = epoch + 1;
        // Cannot fail either: `stage` checked the state against this base.
        let state = checkpoint.state.vm.over(replica.committed.take().map(|(_, state)| state));
        replica.committed = Some((epoch, state));
        // The proxy's state belongs to this checkpoint (made whole at stage),
        // and so does the output it carried.
        replica.fake_ack = checkpoint.fake_ack;
        replica.output = checkpoint.state.output;
        Ok(())
    }
}
