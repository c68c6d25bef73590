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
///
/// A component that changed may also go as the XOR of its encoding with
/// the base's (`against`, consensus-ordered replicas): a vCPU's ~6 KB of
/// state changes in a few registers between two `syncvm`s, so its XOR is
/// nearly all zeros, which the link's compression takes away.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct StateDelta {
    /// Components that changed, with their state.
    pub changed: Components,
    /// Components as the previous checkpoint left them.
    pub kept: Vec<ComponentId>,
    /// Components that changed, as their XOR with the base's (same length).
    pub xored: Components,
}

impl StateDelta {
    /// Every component of `state`.
    pub fn whole(state: Components) -> StateDelta {
        StateDelta { changed: state, kept: Vec::new(), xored: Components::default() }
    }

    /// `state` over `base`: each component kept if the same, XORed with
    /// the base's if of the same length, else whole.
    pub fn against(state: &Components, base: &Components) -> StateDelta {
        let mut delta = StateDelta::default();
        for (id, bytes) in state.iter() {
            match base.get(id) {
                Some(old) if old == bytes => delta.kept.push(id.clone()),
                Some(old) if old.len() == bytes.len() => delta.xored.insert(id.clone(), xor(old, bytes)),
                _ => delta.changed.insert(id.clone(), bytes.to_vec()),
            }
        }
        delta
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
            return match self.kept.first().or(self.xored.ids().next()) {
                Some(id) => Err(format!("it leaves out state this backup never received ({id})")),
                None => Ok(()),
            };
        };
        if let Some(id) = self.kept.iter().find(|id| !base.contains(id)) {
            return Err(format!("it keeps {id}, which the previous one did not have"));
        }
        if let Some(id) = self.kept.iter().chain(self.xored.ids()).find(|id| self.changed.contains(id)) {
            return Err(format!("it both keeps and changes {id}"));
        }
        if let Some(id) = self.kept.iter().find(|id| self.xored.contains(id)) {
            return Err(format!("it both keeps and changes {id}"));
        }
        if let Some((id, _)) = self.xored.iter().find(|(id, x)| base.get(id).is_none_or(|old| old.len() != x.len())) {
            return Err(format!("it changes {id} by an XOR that does not fit the previous one's"));
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
            for (id, x) in self.xored.iter() {
                let old = base.get(id).expect("checked: every XORed component is in the base");
                whole.insert(id.clone(), xor(old, x));
            }
        }
        whole
    }
}

/// Byte by byte (same lengths).
fn xor(a: &[u8], b: &[u8]) -> Vec<u8> {
    a.iter().zip(b).map(|(a, b)| a ^ b).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn state(parts: &[(&str, &[u8])]) -> Components {
        let mut c = Components::default();
        for (id, bytes) in parts {
            c.insert(ComponentId::new(*id), bytes.to_vec());
        }
        c
    }

    /// Against a base, an unchanged component is kept, one of the same
    /// length goes as its XOR (zeros where it did not change), another
    /// whole; over the base, the delta is the state again.
    #[test]
    fn a_delta_against_the_base_keeps_xors_and_sends_whole() {
        let base = state(&[("clock", b"aaaa"), ("vcpu/0", &[1, 2, 3, 4, 5, 6]), ("devices/net0", b"xy")]);
        let now = state(&[("clock", b"aaaa"), ("vcpu/0", &[1, 2, 9, 4, 5, 6]), ("devices/net0", b"xyz"), ("new", b"n")]);
        let delta = StateDelta::against(&now, &base);
        assert_eq!(delta.kept, [ComponentId::new("clock")]);
        assert_eq!(delta.xored.get(&ComponentId::new("vcpu/0")), Some(&[0, 0, 3 ^ 9, 0, 0, 0][..]));
        assert_eq!(delta.changed.ids().map(ComponentId::as_str).collect::<Vec<_>>(), ["devices/net0", "new"]);
        delta.check(Some(&base)).unwrap();
        assert_eq!(delta.over(Some(base)), now);
    }

    /// A delta that XORs what the base lacks, or does not fit it, or that
    /// needs a base where there is none, is refused by `check`.
    #[test]
    fn a_delta_that_does_not_fit_the_base_is_refused() {
        let base = state(&[("vcpu/0", &[1, 2, 3])]);
        let delta = StateDelta::against(&state(&[("vcpu/0", &[1, 2, 4])]), &base);
        let err = delta.check(None).unwrap_err();
        assert!(err.contains("never received (vcpu/0)"), "{err}");
        let shorter = state(&[("vcpu/0", &[1, 2])]);
        let err = delta.check(Some(&shorter)).unwrap_err();
        assert!(err.contains("XOR that does not fit"), "{err}");
        let err = delta.check(Some(&state(&[("clock", b"c")]))).unwrap_err();
        assert!(err.contains("vcpu/0"), "{err}");
        let mut both = StateDelta::against(&state(&[("vcpu/0", &[1, 2, 4])]), &base);
        both.changed.insert(ComponentId::new("vcpu/0"), vec![0; 3]);
        assert!(both.check(Some(&base)).unwrap_err().contains("both keeps and changes vcpu/0"));
    }
}
