//! The `syncvm` repair round: a secondary whose patched page does not hash
//! to the leader's page hash (two 16-bit block hashes collided, and a
//! block that differs was left out) asks for the page whole before it
//! acknowledges (`SyncRepair`), and the leader answers with the page as
//! it froze it (`SyncRepaired`).
//!
//! The leader keeps the pages it patched (`Repairs`) from before it sends
//! them until newer `syncvm`s replace them, because its guest runs on (or
//! its copy aside is reused) while the acknowledgement is awaited, and
//! because the link thread that reads the request answers it: whichever
//! thread awaits the acknowledgement (the applier, the proposer, the
//! acknowledgement thread with `--sync-pipeline on`), none reads it.
//!
//! The answer reaches the secondary here too, not through its `syncvm`
//! inbox: with `--sync-pipeline on` the leader's next `syncvm` may already
//! have sent its bitmap, which the inbox must keep for that `syncvm`.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use ftvm_replication::protocol::{self, Kind, ProtocolError};
use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{Bundle, BundleWriter, Cursor, RawEncoder};
use ftvm_vmm::sync::{self as vsync, Lock};

use crate::sync_id::{SyncId, ID_LEN};

/// `syncvm`s whose patched pages the leader keeps, per peer: more than can
/// await their acknowledgement at once (`--sync-pipeline on` overlaps two).
const KEPT: usize = 4;

/// `SyncRepair`: the patched pages the secondary wants whole (ascending).
#[derive(Serialize, Deserialize)]
pub(crate) struct RepairMsg {
    pub pages: Vec<u64>,
}

/// Answers a secondary has not taken (yet): a stale one is let go.
const ANSWERS: usize = 4;

/// The leader's patched pages of its latest `syncvm`s, as frozen; the
/// secondary's answers from its leader.
#[derive(Default)]
pub struct Repairs {
    kept: Mutex<VecDeque<Kept>>,
    answers: Mutex<VecDeque<(u64, Vec<u8>)>>,
    arrived: Condvar,
}

struct Kept {
    peer: u64,
    id: SyncId,
    /// Page number and contents, ascending.
    pages: Vec<(u64, Vec<u8>)>,
}

impl Repairs {
    /// Keep `pages` (ascending), patched in `peer`'s `syncvm` `id`, until
    /// `KEPT` newer ones to `peer` replace them.
    pub(crate) fn keep(&self, peer: u64, id: SyncId, pages: Vec<(u64, Vec<u8>)>) {
        let mut kept = self.kept.locked();
        if kept.iter().filter(|k| k.peer == peer).count() >= KEPT {
            if let Some(oldest) = kept.iter().position(|k| k.peer == peer) {
                kept.remove(oldest);
            }
        }
        kept.push_back(Kept { peer, id, pages });
    }

    /// The `SyncRepaired` frame that answers `from`'s `SyncRepair`
    /// (`payload`: its id, then the pages wanted).
    pub fn answer(&self, from: u64, payload: &[u8]) -> Result<Vec<u8>, ProtocolError> {
        let id = SyncId::parse(payload).ok_or(ProtocolError::Truncated)?;
        let want: RepairMsg = protocol::decode(&payload[ID_LEN..])?;
        let kept = self.kept.locked();
        let k = kept.iter().find(|k| k.peer == from && k.id == id).ok_or_else(|| {
            ProtocolError::Corrupt(format!(
                "replica {from} wants pages of syncvm {}/{}, which this leader no longer holds",
                id.term, id.index
            ))
        })?;
        let mut frame = Vec::new();
        protocol::begin_frame(&mut frame, Kind::SyncRepaired);
        frame.extend_from_slice(&id.header());
        let mut encoder = RawEncoder;
        let mut bundle = BundleWriter::begin(&mut frame, &[], &mut encoder, false);
        for &p in &want.pages {
            let i = k
                .pages
                .binary_search_by_key(&p, |(page, _)| *page)
                .map_err(|_| ProtocolError::Corrupt(format!("replica {from} wants page {p} whole, which this leader did not patch")))?;
            bundle.page(p, &k.pages[i].1);
        }
        bundle.finish();
        protocol::finish_frame(&mut frame);
        Ok(frame)
    }

    /// A link thread read a `SyncRepaired` from `from` (its payload).
    pub fn arrived(&self, from: u64, payload: Vec<u8>) {
        let mut answers = self.answers.locked();
        if answers.len() >= ANSWERS {
            answers.pop_front();
        }
        answers.push_back((from, payload));
        self.arrived.notify_all();
    }

    /// The secondary: `from`'s answer for `syncvm` `id` (its payload, the
    /// id included), or None once `timeout` passed or `lost` says the
    /// leader's link closed.
    pub(crate) fn await_answer(&self, from: u64, id: SyncId, timeout: Duration, lost: impl Fn() -> bool) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut answers = self.answers.locked();
        loop {
            answers.retain(|(f, p)| *f != from || SyncId::parse(p).is_some_and(|i| i.index >= id.index));
            if let Some(at) = answers.iter().position(|(f, p)| *f == from && SyncId::parse(p) == Some(id)) {
                return answers.remove(at).map(|(_, p)| p);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || lost() {
                return None;
            }
            // (`lost` has no notice of its own: looked at every 20 ms.)
            answers = vsync::wait_timeout(&self.arrived, answers, left.min(Duration::from_millis(20)));
        }
    }
}

/// The secondary's check of a `SyncRepaired` payload (after the id): each
/// of `asked` whole, in order, nothing else.
pub(crate) fn parse_repaired<'a>(payload: &'a [u8], asked: &[u64], ram_pages: u64) -> Result<Vec<&'a [u8]>, ProtocolError> {
    let mut c = Cursor::new(payload);
    let bundle = Bundle::parse(&mut c, ram_pages)?;
    if !c.is_empty() || !bundle.state.is_empty() {
        return Err(ProtocolError::Corrupt("a syncvm repair has trailing bytes or a state".into()));
    }
    let pages: Vec<_> = bundle.entries().collect();
    if pages.len() != asked.len() {
        return Err(ProtocolError::Corrupt(format!("{} pages repaired for {} asked", pages.len(), asked.len())));
    }
    pages
        .iter()
        .zip(asked)
        .map(|(e, &p)| match e.whole() {
            Some(data) if e.page == p && data.len() == PAGE => Ok(data),
            _ => Err(ProtocolError::Corrupt(format!("page {} repaired where page {p} was asked for whole", e.page))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: SyncId, pages: &[u64]) -> Vec<u8> {
        let mut payload = id.header().to_vec();
        payload.extend_from_slice(&postcard::to_allocvec(&RepairMsg { pages: pages.to_vec() }).unwrap());
        payload
    }

    /// The payload of a frame the leader sends.
    fn payload(frame: &[u8]) -> Vec<u8> {
        let mut payload = Vec::new();
        assert_eq!(protocol::read_frame(&mut &frame[..], 1 << 20, &mut payload).unwrap(), Kind::SyncRepaired);
        payload
    }

    /// The leader answers with the pages it kept for that peer and
    /// `syncvm`, whole; the secondary takes exactly what it asked for.
    #[test]
    fn a_repair_returns_the_kept_pages_whole() {
        let held = Repairs::default();
        let id = SyncId { term: 2, index: 40 };
        held.keep(7, id, vec![(3, vec![1u8; PAGE]), (5, vec![0u8; PAGE]), (9, vec![2u8; PAGE])]);
        let answer = payload(&held.answer(7, &request(id, &[9])).unwrap());
        assert_eq!(SyncId::parse(&answer), Some(id));
        let pages = parse_repaired(&answer[ID_LEN..], &[9], 16).unwrap();
        assert_eq!(pages, [&[2u8; PAGE][..]]);
        // A page of zeros travels as such.
        let zeros = payload(&held.answer(7, &request(id, &[3, 5])).unwrap());
        assert_eq!(parse_repaired(&zeros[ID_LEN..], &[3, 5], 16).unwrap(), [&[1u8; PAGE][..], &[0u8; PAGE][..]]);
        // What it did not ask for, in another order, or more, is refused.
        assert!(parse_repaired(&answer[ID_LEN..], &[3], 16).is_err());
        assert!(parse_repaired(&answer[ID_LEN..], &[9, 3], 16).is_err());
        assert!(parse_repaired(&answer[ID_LEN..], &[9], 8).is_err(), "page 9 beyond a RAM of 8 pages");
        // Another peer, another syncvm, a page not patched: clear errors.
        for (from, req) in [(8, request(id, &[9])), (7, request(SyncId { term: 2, index: 41 }, &[9])), (7, request(id, &[4]))] {
            let err = held.answer(from, &req).unwrap_err().to_string();
            assert!(err.contains("this leader"), "{err}");
        }
    }

    /// Truncated or corrupt requests and answers are errors, never a panic.
    #[test]
    fn a_truncated_or_corrupt_repair_is_an_error() {
        let held = Repairs::default();
        let id = SyncId { term: 1, index: 5 };
        held.keep(7, id, vec![(3, vec![1u8; PAGE])]);
        let req = request(id, &[3]);
        for n in 0..req.len() {
            assert!(held.answer(7, &req[..n]).is_err(), "a request cut at {n} bytes");
        }
        let answer = payload(&held.answer(7, &req).unwrap());
        let body = &answer[ID_LEN..];
        for n in 0..body.len() {
            assert!(parse_repaired(&body[..n], &[3], 16).is_err(), "an answer cut at {n} bytes");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(parse_repaired(&long, &[3], 16).is_err(), "trailing bytes");
    }

    /// Only the latest `KEPT` `syncvm`s of a peer are kept.
    #[test]
    fn older_syncvms_are_let_go() {
        let held = Repairs::default();
        let id = |index| SyncId { term: 1, index };
        for index in 0..=KEPT as u64 {
            held.keep(7, id(index), vec![(3, vec![0u8; PAGE])]);
            held.keep(8, id(index), vec![(3, vec![0u8; PAGE])]);
        }
        assert!(held.answer(7, &request(id(0), &[3])).is_err(), "the oldest was let go");
        assert!(held.answer(7, &request(id(1), &[3])).is_ok());
        assert!(held.answer(8, &request(id(KEPT as u64), &[3])).is_ok());
    }

    /// The secondary takes its leader's answer for its `syncvm`, not
    /// another replica's nor an older `syncvm`'s; none: it gives up.
    #[test]
    fn the_secondary_takes_the_answer_for_its_syncvm() {
        let repairs = Repairs::default();
        let id = SyncId { term: 3, index: 9 };
        let answer = |id: SyncId, tail: u8| [&id.header()[..], &[tail]].concat();
        repairs.arrived(2, answer(SyncId { term: 3, index: 8 }, 1));
        repairs.arrived(7, answer(id, 2));
        assert_eq!(repairs.await_answer(1, id, Duration::from_millis(30), || false), None);
        repairs.arrived(1, answer(id, 3));
        assert_eq!(repairs.await_answer(1, id, Duration::from_secs(5), || false), Some(answer(id, 3)));
        assert_eq!(repairs.await_answer(7, id, Duration::from_secs(5), || true), Some(answer(id, 2)), "already there");
        assert_eq!(repairs.await_answer(2, id, Duration::from_secs(5), || true), None, "the leader's link closed");
    }
}
