//! The checkpoint on the wire: `epoch u64 | bundle`, where the bundle's
//! state is the VM's state plus the epoch's disk writes and its pages are
//! the epoch's dirty pages (see `ftvm_vmm::pages`).

use serde::{Deserialize, Serialize};

use ftvm_vmm::pages::{Bundle, Cursor};
use ftvm_vmm::VmState;

use crate::output::DiskWrite;
use crate::protocol::ProtocolError;

/// What a checkpoint carries besides pages.
#[derive(Debug, Serialize, Deserialize)]
pub struct CheckpointState {
    pub vm: VmState,
    /// The guest's disk writes of the epoch, in the order they completed.
    pub disk: Vec<DiskWrite>,
}

/// A received checkpoint, fully parsed and checked against the replica it
/// is for, before anything is applied.
pub struct Checkpoint<'a> {
    pub epoch: u64,
    pub state: CheckpointState,
    pub pages: Bundle<'a>,
}

impl<'a> Checkpoint<'a> {
    pub fn parse(payload: &'a [u8], ram_pages: u64, disk_size: u64) -> Result<Checkpoint<'a>, ProtocolError> {
        let mut c = Cursor::new(payload);
        let epoch = c.u64()?;
        let pages = Bundle::parse(&mut c, ram_pages).map_err(|e| ProtocolError::Corrupt(format!("checkpoint {epoch}: {e}")))?;
        if !c.is_empty() {
            return Err(ProtocolError::Corrupt(format!("checkpoint {epoch} has trailing bytes")));
        }
        let state: CheckpointState = crate::protocol::decode(pages.state)?;
        if let Some(w) = state.disk.iter().find(|w| w.offset.checked_add(w.data.len() as u64).is_none_or(|e| e > disk_size)) {
            return Err(ProtocolError::Corrupt(format!(
                "checkpoint {epoch} writes {} bytes at disk offset {}, beyond the {disk_size}-byte disk",
                w.data.len(),
                w.offset
            )));
        }
        Ok(Checkpoint { epoch, state, pages })
    }
}
