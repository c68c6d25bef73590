//! The proxy's state as checkpoints carry it (`--fake-ack-state`): whole,
//! or only what changed since the checkpoint before.
//!
//! During a bulk transfer the store holds up to a few hundred KB of frames
//! at every freeze, and most of them were already in the previous
//! checkpoint: between two freezes a store only loses segments at its front
//! (the peer acknowledged them) and gains segments at its back (the guest
//! sent them). So a change of a flow is its fields, how many segments left
//! the front of the store the backup holds, and the segments added; flows
//! that ended are named. The backup keeps the whole table and applies the
//! changes over it, all or nothing, with the checkpoint (checked when the
//! checkpoint is staged), so a backup that takes over holds exactly what a
//! whole copy would have given it.
//!
//! Changes are counted from the previous checkpoint *sent*, not the last
//! acknowledged one: the stream is ordered and the backup applies every
//! checkpoint in order (with pipelined checkpoints in flight too), and a
//! backup that cannot apply one stops, so the one before is always what it
//! holds. Each change names the epoch it was counted from, and a backup
//! whose last applied checkpoint is another refuses it. A new backup
//! (re-protection) starts from a whole copy (`Sender::reset`).

use serde::{Deserialize, Serialize};

use super::flow::{Flow, FlowKey, Stored, Table, MAX_FLOWS};
use ftvm_vmm::switch;

switch! {
    /// `--fake-ack-state`: how each checkpoint carries the proxy's state.
    pub enum Sending {
        /// Only what changed since the previous checkpoint (the backup keeps the rest).
        Changed = "changed",
        /// The whole table, every checkpoint.
        All = "all",
    }
}

/// The proxy's state in a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Carried {
    Whole(Table),
    Changes(Changes),
}

/// What changed since checkpoint `base`'s table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changes {
    /// The epoch of the checkpoint whose table these changes apply to.
    pub base: u64,
    /// Flows gone since (ended, reset, or replaced by a new connection,
    /// which then appears in `flows` too).
    pub removed: Vec<FlowKey>,
    /// Flows new or changed since.
    pub flows: Vec<FlowChange>,
}

/// One flow's change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowChange {
    pub key: FlowKey,
    /// The flow's fields (its store empty here).
    pub fields: Flow,
    /// Segments gone from the front of the store the base holds.
    pub trimmed: u32,
    /// Segments added at its back.
    pub added: Vec<Stored>,
}

impl Carried {
    /// Frame bytes of the stored segments it carries.
    pub fn frame_bytes(&self) -> u64 {
        match self {
            Carried::Whole(t) => t.stored_bytes(),
            Carried::Changes(c) => c.flows.iter().flat_map(|f| &f.added).map(|s| s.frame.len() as u64).sum(),
        }
    }

    /// The whole table it makes over `held`, the table of checkpoint
    /// `held_epoch` that the backup holds; nothing is changed. Refused:
    /// changes over another checkpoint's table (or none), or changes that
    /// do not fit the table they name.
    pub fn over(self, held: Option<(u64, &Table)>) -> Result<Table, String> {
        let changes = match self {
            Carried::Whole(t) => return Ok(t),
            Carried::Changes(c) => c,
        };
        let Some((epoch, held)) = held.filter(|(epoch, _)| *epoch == changes.base) else {
            return Err(format!(
                "its fake-ACK state is counted from checkpoint {}, and this backup holds {}",
                changes.base,
                held.map_or("none".to_string(), |(e, _)| format!("checkpoint {e}'s"))
            ));
        };
        let mut table = held.clone();
        for key in &changes.removed {
            let Some(flow) = table.flows.remove(key) else {
                return Err(format!("its fake-ACK state removes a flow checkpoint {epoch} did not have"));
            };
            table.stored -= flow.stored_bytes();
        }
        for change in changes.flows {
            let flow = table.flows.entry(change.key).or_insert_with(|| change.fields.clone());
            let trimmed = change.trimmed as usize;
            if trimmed > flow.store.len() {
                return Err(format!(
                    "its fake-ACK state trims {trimmed} segments of a flow that held {} at checkpoint {epoch}",
                    flow.store.len()
                ));
            }
            let gone: u64 = flow.store.drain(..trimmed).map(|s| s.frame.len() as u64).sum();
            let added: u64 = change.added.iter().map(|s| s.frame.len() as u64).sum();
            flow.store.extend(change.added);
            flow.set_fields(change.fields);
            table.stored = table.stored - gone + added;
        }
        if table.flows.len() > MAX_FLOWS {
            return Err(format!("its fake-ACK state has {} flows, more than {MAX_FLOWS}", table.flows.len()));
        }
        Ok(table)
    }
}

/// The primary's side: what it last sent the backup.
#[derive(Debug)]
pub struct Sender {
    mode: Sending,
    /// The table of the last checkpoint sent, and its epoch (with `changed`).
    last: Option<(u64, Table)>,
}

impl Sender {
    pub fn new(mode: Sending) -> Sender {
        Sender { mode, last: None }
    }

    /// A new backup: it holds nothing.
    pub fn reset(&mut self) {
        self.last = None;
    }

    /// What checkpoint `epoch` carries of `table` (saved at its freeze).
    pub fn carry(&mut self, epoch: u64, table: Table) -> Carried {
        if self.mode == Sending::All {
            return Carried::Whole(table);
        }
        // The frames are shared: keeping the table copies none of them.
        let carried = match self.last.take() {
            Some((base, last)) => Carried::Changes(changes(base, &last, &table)),
            None => Carried::Whole(table.clone()),
        };
        self.last = Some((epoch, table));
        carried
    }
}

/// `new` as changes over `old` (checkpoint `base`'s table).
fn changes(base: u64, old: &Table, new: &Table) -> Changes {
    let removed = old.flows.keys().filter(|k| !new.flows.contains_key(k)).copied().collect();
    let mut flows = Vec::new();
    for (key, flow) in &new.flows {
        let (trimmed, kept) = match old.flows.get(key) {
            Some(o) => continuation(&o.store, &flow.store),
            None => (0, 0),
        };
        let unchanged = trimmed == 0 && kept == flow.store.len() && old.flows.get(key).is_some_and(|o| o.fields() == flow.fields());
        if unchanged {
            continue;
        }
        let added = flow.store.iter().skip(kept).cloned().collect();
        flows.push(FlowChange { key: *key, fields: flow.fields(), trimmed: trimmed as u32, added });
    }
    Changes { base, removed, flows }
}

/// How `new` follows from `old`: (segments gone from `old`'s front,
/// segments of `new` that are `old`'s remaining ones). Anything else (a
/// store that is not `old` trimmed and grown) counts as all gone, all new.
fn continuation<'a>(old: &'a std::collections::VecDeque<Stored>, new: &'a std::collections::VecDeque<Stored>) -> (usize, usize) {
    let same = |a: &Stored, b: &Stored| {
        a.seq == b.seq && a.len == b.len && a.epoch == b.epoch && (std::sync::Arc::ptr_eq(&a.frame, &b.frame) || a.frame == b.frame)
    };
    let Some(first) = new.front() else { return (old.len(), 0) };
    let Some(trimmed) = old.iter().position(|s| same(s, first)) else { return (old.len(), 0) };
    let kept = old.len() - trimmed;
    if kept <= new.len() && old.iter().skip(trimmed).zip(new).all(|(a, b)| same(a, b)) {
        (trimmed, kept)
    } else {
        (old.len(), 0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::flow::Early;
    use super::super::segment::tests::{frame, GUEST, PEER};
    use super::super::segment::{Endpoint, ACK, RST, SYN};
    use super::*;

    /// The guest's endpoint for peer `i`'s connection (several flows).
    fn peer(i: u16) -> Endpoint {
        Endpoint { port: PEER.port + i, ..PEER }
    }

    /// Peer `i` connects; the guest (ISN `isn`) accepts.
    fn open(t: &mut Table, i: u16, isn: u32) {
        let mut resend = Vec::new();
        t.peer_sent(&mut frame(peer(i), GUEST, 1000, 0, SYN, 65535, &[], b""), 0, &mut resend);
        t.guest_sent(&frame(GUEST, peer(i), isn, 1001, SYN | ACK, 4096, &[], b""), None);
        t.peer_sent(&mut frame(peer(i), GUEST, 1001, isn.wrapping_add(1), ACK, 65535, &[], b""), 0, &mut resend);
    }

    /// A table as the backup holds it, compared by what it carries (the
    /// retransmission timers are the primary's own).
    fn encoded(t: &Table) -> Vec<u8> {
        postcard::to_allocvec(t).unwrap()
    }

    /// A bulk send on three flows, with the peers acknowledging part of it
    /// and one connection reset and opened again: after each checkpoint the
    /// backup, applying the changes, holds exactly the primary's table, and
    /// the changes carry each stored segment once.
    #[test]
    fn a_backup_applying_changes_holds_what_a_whole_copy_would() {
        let mut t = Table::new(1 << 20, Early::Every);
        // The last flow's sequence numbers wrap during the run.
        let isns = [5000, 90_000, u32::MAX - 20_000];
        for (i, isn) in isns.iter().enumerate() {
            open(&mut t, i as u16, *isn);
        }
        let mut next: Vec<u32> = isns.iter().map(|i| i.wrapping_add(1)).collect();
        let mut acked = next.clone();
        let mut sender = Sender::new(Sending::Changed);
        let mut whole_sender = Sender::new(Sending::All);
        let mut backup: Option<(u64, Table)> = None;
        let (mut carried_bytes, mut whole_bytes, mut sent_bytes) = (0, 0, 0);
        let mut resend = Vec::new();
        let mut rng = 7u32;
        for epoch in 1..=40u64 {
            for _ in 0..6 {
                rng = rng.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let i = (rng >> 16) as usize % 3;
                let len = 200 + (rng >> 8) % 1200;
                let data = frame(GUEST, peer(i as u16), next[i], 1001, ACK, 4096, &[], &vec![epoch as u8; len as usize]);
                sent_bytes += data.len() as u64;
                t.guest_sent(&data, Some(epoch));
                next[i] = next[i].wrapping_add(len);
            }
            // Peer 0 acknowledges everything but the last segment, peer 1 half.
            for (i, to) in [(0, next[0].wrapping_sub(1)), (1, acked[1].wrapping_add(next[1].wrapping_sub(acked[1]) / 2))] {
                t.peer_sent(&mut frame(peer(i as u16), GUEST, 1001, to, ACK, 65535, &[], b""), epoch, &mut resend);
                acked[i] = to;
            }
            if epoch % 13 == 0 {
                // Peer 2 resets, then connects again (the same ports).
                t.peer_sent(&mut frame(peer(2), GUEST, 1001, next[2], RST | ACK, 0, &[], b""), epoch, &mut resend);
                open(&mut t, 2, 777);
                next[2] = 778;
            }
            let whole = whole_sender.carry(epoch, t.clone());
            whole_bytes += whole.frame_bytes();
            let changes = sender.carry(epoch, t.clone());
            carried_bytes += changes.frame_bytes();
            assert_eq!(matches!(changes, Carried::Whole(_)), epoch == 1, "checkpoint {epoch}: whole only the first time");
            let applied = changes.over(backup.as_ref().map(|(e, b)| (*e, b))).unwrap();
            assert_eq!(encoded(&applied), encoded(&t), "checkpoint {epoch}");
            assert_eq!(applied.stored_bytes(), t.stored_bytes());
            assert!(applied.consistent());
            backup = Some((epoch, applied));
        }
        assert!(t.stored_bytes() > 0 && t.flows() == 3);
        // Each stored segment went once at most; whole, most went many times.
        assert!(carried_bytes <= sent_bytes, "{carried_bytes} bytes of frames carried as changes, {sent_bytes} sent");
        assert!(carried_bytes * 2 < whole_bytes, "{carried_bytes} bytes of frames carried as changes, {whole_bytes} whole");
    }

    /// Pipelined checkpoints are counted each from the one before; a
    /// backup that holds another checkpoint's table (or none) refuses
    /// changes; a new backup gets the table whole.
    #[test]
    fn changes_apply_only_over_the_checkpoint_they_were_counted_from() {
        let mut t = Table::new(1 << 20, Early::Every);
        open(&mut t, 0, 10);
        let mut sender = Sender::new(Sending::Changed);
        let first = sender.carry(1, t.clone());
        t.guest_sent(&frame(GUEST, peer(0), 11, 1001, ACK, 4096, &[], &[1; 100]), Some(2));
        let second = sender.carry(2, t.clone());
        t.guest_sent(&frame(GUEST, peer(0), 111, 1001, ACK, 4096, &[], &[2; 100]), Some(3));
        let third = sender.carry(3, t.clone());
        let at1 = first.over(None).unwrap();
        assert!(third.clone().over(Some((1, &at1))).unwrap_err().contains("counted from checkpoint 2"));
        assert!(second.clone().over(None).unwrap_err().contains("holds none"));
        let at2 = second.over(Some((1, &at1))).unwrap();
        assert_eq!(encoded(&third.over(Some((2, &at2))).unwrap()), encoded(&t));
        // Changes that do not fit the table they name are refused.
        let bad = Carried::Changes(Changes { base: 2, removed: vec![FlowKey { guest: GUEST, peer: peer(9) }], flows: Vec::new() });
        assert!(bad.over(Some((2, &at2))).is_err());
        sender.reset();
        assert!(matches!(sender.carry(4, t.clone()), Carried::Whole(_)));
    }
}
