//! The `syncvm` repair round: a secondary whose patched page does not hash
//! to the leader's page hash (two 16-bit block hashes collided, and a
//! block that differs was left out) asks for the page whole before it
//! acknowledges (`SyncRepair`), and the leader answers with the page as
//! it froze it (`SyncRepaired`).
//!
//! The leader keeps the pages it patched (`Held`) from before it sends
//! them until newer `syncvm`s replace them, because its guest runs on (or
//! its copy aside is reused) while the acknowledgement is awaited, and
//! because the link thread that reads the request answers it: whichever
//! thread awaits the acknowledgement (the applier, the proposer, the
//! acknowledgement thread with `--sync-pipeline on`), none reads it.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use ftvm_replication::protocol::{self, Kind, ProtocolError};
use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{Bundle, BundleWriter, Cursor, PageTag, RawEncoder};
use ftvm_vmm::sync::Lock;

use crate::sync_id::{SyncId, ID_LEN};

/// `syncvm`s whose patched pages the leader keeps, per peer: more than can
/// await their acknowledgement at once (`--sync-pipeline on` overlaps two).
const KEPT: usize = 4;

/// `SyncRepair`: the patched pages the secondary wants whole (ascending).
#[derive(Serialize, Deserialize)]
pub(crate) struct RepairMsg {
    pub pages: Vec<u64>,
}

/// The leader's patched pages of its latest `syncvm`s, as frozen.
#[derive(Default)]
pub struct Held {
    kept: Mutex<VecDeque<Kept>>,
}

struct Kept {
    peer: u64,
    id: SyncId,
    /// Page number and contents, ascending.
    pages: Vec<(u64, Vec<u8>)>,
}

impl Held {
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
        .map(|(e, &p)| match e.tag {
            PageTag::Raw if e.page == p && e.body.len() == PAGE => Ok(e.body),
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
        let held = Held::default();
        let id = SyncId { term: 2, index: 40 };
        held.keep(7, id, vec![(3, vec![1u8; PAGE]), (9, vec![2u8; PAGE])]);
        let answer = payload(&held.answer(7, &request(id, &[9])).unwrap());
        assert_eq!(SyncId::parse(&answer), Some(id));
        let pages = parse_repaired(&answer[ID_LEN..], &[9], 16).unwrap();
        assert_eq!(pages, [&[2u8; PAGE][..]]);
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
        let held = Held::default();
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
        let held = Held::default();
        let id = |index| SyncId { term: 1, index };
        for index in 0..=KEPT as u64 {
            held.keep(7, id(index), vec![(3, vec![0u8; PAGE])]);
            held.keep(8, id(index), vec![(3, vec![0u8; PAGE])]);
        }
        assert!(held.answer(7, &request(id(0), &[3])).is_err(), "the oldest was let go");
        assert!(held.answer(7, &request(id(1), &[3])).is_ok());
        assert!(held.answer(8, &request(id(KEPT as u64), &[3])).is_ok());
    }
}
