//! The checkpoint on the wire: `epoch u64 | bundle`, where the bundle's
//! state is the VM's state (each component whole, or left out when it is
//! what the previous checkpoint carried) plus the epoch's disk writes, and
//! its pages are the epoch's dirty pages (see `ftvm_vmm::pages`).

use serde::{Deserialize, Serialize};

use ftvm_vmm::pages::{Bundle, Cursor};
use ftvm_vmm::{ComponentId, Components};

use crate::output::DiskWrite;
use crate::protocol::ProtocolError;

/// What a checkpoint carries besides pages.
#[derive(Debug, Serialize, Deserialize)]
pub struct CheckpointState {
    pub vm: StateDelta,
    /// The guest's disk writes of the epoch, in the order they completed.
    pub disk: Vec<DiskWrite>,
    /// The fake-ACK proxy's flows and stored data at the freeze
    /// (`--fake-ack on`), whole or as changes over the previous
    /// checkpoint's (`fakeack::delta`): a backup that takes over sends what
    /// the peer has not acknowledged and runs the proxy on.
    pub fake_ack: Option<crate::fakeack::delta::Carried>,
    /// The epoch's first frames, as the guest sent them (`--mirror on`,
    /// at most `bounds::OUTPUT_FOLD_MAX` bytes): a backup that takes over
    /// from this checkpoint sends them first, since the primary may never
    /// have released them.
    pub output: Vec<Vec<u8>>,
}

/// What a checkpoint's state carries besides the VM's own, in figures.
#[derive(Clone, Copy, Debug, Default)]
pub struct Carrying {
    /// The epoch's disk writes, and their bytes.
    pub disk_writes: u64,
    pub disk_bytes: u64,
    /// Disk requests in flight at the freeze (saved in its state).
    pub disk_pending: u64,
    /// `--fake-ack`: frame bytes the proxy stored at the freeze, and its flows.
    pub fake_ack_bytes: u64,
    pub fake_ack_flows: u64,
    /// Of those flows, the ones in bulk mode.
    pub fake_ack_bulk_flows: u64,
    /// Of `fake_ack_bytes`, the frame bytes the checkpoint carries (all of
    /// them whole, those stored since the previous checkpoint as changes).
    pub fake_ack_sent_bytes: u64,
}

/// The VM's state as a checkpoint carries it: its components (`ftvm_vmm::
/// components`) by id, each whole, or named only when it is exactly what
/// the previous checkpoint of the stream left the backup with
/// (`--device-state changed`, `pipeline::encode::state`). The first
/// checkpoint to a backup carries every component. Nothing here knows what
/// a component is: a VM that gains one sends it with no change here.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct StateDelta {
    /// Components that changed, with their state.
    pub changed: Components,
    /// Components as the previous checkpoint left them.
    pub kept: Vec<ComponentId>,
}

impl StateDelta {
    /// Every component of `state`.
    pub fn whole(state: Components) -> StateDelta {
        StateDelta { changed: state, kept: Vec::new() }
    }

    /// Components left out.
    pub fn omitted(&self) -> usize {
        self.kept.len()
    }

    /// Whether this delta makes a whole state on top of `base` (the state
    /// the last checkpoint left): every component it keeps is in `base`,
    /// and none is both kept and changed.
    pub fn check(&self, base: Option<&Components>) -> Result<(), String> {
        let Some(base) = base else {
            return match self.kept.first() {
                Some(id) => Err(format!("it leaves out state this backup never received ({id})")),
                None => Ok(()),
            };
        };
        if let Some(id) = self.kept.iter().find(|id| !base.contains(id)) {
            return Err(format!("it keeps {id}, which the previous one did not have"));
        }
        if let Some(id) = self.kept.iter().find(|id| self.changed.contains(id)) {
            return Err(format!("it both keeps and changes {id}"));
        }
        Ok(())
    }

    /// The whole state: this delta over `base`, which `check` accepted.
    /// A component of `base` that the delta neither keeps nor changes is
    /// no longer the VM's.
    pub fn over(self, base: Option<Components>) -> Components {
        let mut whole = self.changed;
        if let Some(mut base) = base {
            for id in self.kept {
                let bytes = base.remove(&id).expect("checked: every kept component is in the base");
                whole.insert(id, bytes);
            }
        }
        whole
    }
}

/// A received checkpoint, fully parsed and checked against the replica it
/// is for, before anything is applied.
pub struct Checkpoint<'a> {
    pub epoch: u64,
    pub state: CheckpointState,
    pub pages: Bundle<'a>,
    /// The fake-ACK proxy's whole state after this checkpoint: made by the
    /// apply's stage from `state.fake_ack` over what the replica holds.
    pub fake_ack: Option<crate::fakeack::State>,
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
        Ok(Checkpoint { epoch, state, pages, fake_ack: None })
    }
}
