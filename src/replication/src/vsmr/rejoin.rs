//! Rejoin by live pre-copy: before its first `syncvm` with a replica it
//! has not synchronized (a restarted one, a witness with a VM), the leader
//! copies it its memory while its own guest keeps running, so that the
//! full `syncvm` that follows (the stop-and-copy) finds few pages to send.
//!
//! ```text
//!  leader (guest runs)                        replica (VM held, paused)
//!  RejoinStart ──────────────────────────────▶ out of step; hash every page
//!              ◀────────────────────────────── RejoinHashes
//!  round: hash every page, send those whose
//!  hash is not what the replica holds
//!  RejoinPages (bundle, seq) ────────────────▶ write them
//!              ◀────────────────────────────── RejoinAck (seq)
//!  ... until a round finds few changed pages; then a full syncvm
//! ```
//!
//! The leader tracks what the replica holds by hash (of the bytes it
//! read and sent), not by dirty logging: its dirty log belongs to the
//! `syncvm`s and barriers it keeps running meanwhile. Nothing here needs
//! to be exact: the full `syncvm` that follows compares every page with
//! both VMs paused. The primary-backup pre-copy's message builder
//! (`primary::precopy::page_frame`) and the bundle encoding are shared.

use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_128;

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{Bundle, Cursor};
use ftvm_vmm::Vm;

use super::sync::{hash_pages, Exchange, SyncError, ID_LEN};
use crate::primary::precopy::page_frame;
use crate::protocol::{self, Kind, ProtocolError};
use crate::switch::switch;

/// Pages per `RejoinPages` message (1 MiB).
const BATCH_PAGES: usize = 256;
/// Batches sent and not yet written by the replica at most: bounds what
/// waits in the link's queue.
const WINDOW: u64 = 8;
/// Pre-copy stops when a round finds fewer changed pages than this...
const DONE_PAGES: usize = 256;
/// ... or after this many rounds.
const ROUNDS: usize = 8;

switch! {
    /// `--rejoin`: how the leader brings a replica it has not synchronized
    /// up to date.
    pub enum RejoinMode {
        /// Live pre-copy while the guest runs, then a full `syncvm`.
        Precopy = "precopy",
        /// A full `syncvm` alone: every differing page copied in the pause.
        Syncvm = "syncvm",
    }
}

/// `RejoinHashes`.
#[derive(Serialize, Deserialize)]
struct HashesMsg {
    /// The replica is in step already (a leader that stepped down): no
    /// pre-copy; it keeps its VM running and may still lead.
    in_step: bool,
    /// XXH3-128 of every page, in order.
    hashes: Vec<u128>,
}

/// One pre-copy, as the leader records it (`--metrics`: a line
/// `{"rejoin": ...}`; `ftvm status` detail).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejoinMetrics {
    pub term: u64,
    /// The replica brought up to date.
    pub peer: u64,
    pub ok: bool,
    /// The replica said it is in step: nothing copied.
    pub skipped: bool,
    /// Rounds that sent pages.
    pub rounds: u64,
    /// Pages sent, over all rounds.
    pub pages: u64,
    /// Pages that had changed again when it stopped: left to the full `syncvm`.
    pub left: u64,
    /// Bytes of the `RejoinPages` messages.
    pub precopy_bytes: u64,
    /// From `RejoinStart` to the last acknowledgement.
    pub duration_us: u64,
}

/// A metrics line.
#[derive(Serialize)]
pub struct RejoinRecord {
    pub rejoin: RejoinMetrics,
}

/// The leader's side: bring `x.peer` close to this VM while it runs.
/// Gives up (`SyncError::Closed`) once `serving` is cleared.
pub fn precopy(x: &Exchange<'_>, vm: &Vm, serving: &AtomicBool, m: &mut RejoinMetrics) -> Result<(), SyncError> {
    if !serving.load(Ordering::SeqCst) {
        return Err(SyncError::Closed);
    }
    let ram = vm.ram();
    let n = ram.pages();
    x.send(Kind::RejoinStart, &[])?;
    // The replica hashes all its pages first.
    let reply: HashesMsg = protocol::decode(&x.expect(Kind::RejoinHashes, n)?[ID_LEN..])?;
    if reply.in_step {
        m.skipped = true;
        return Ok(());
    }
    if reply.hashes.len() as u64 != n {
        return Err(ProtocolError::Corrupt(format!("{} page hashes for {n} pages", reply.hashes.len())).into());
    }
    // What the replica holds, page by page.
    let mut known = reply.hashes;
    let all: Vec<u64> = (0..n).collect();
    let mut buf = vec![0u8; PAGE];
    let (mut sent, mut acked) = (0u64, 0u64);
    for round in 0..=ROUNDS {
        if !serving.load(Ordering::SeqCst) {
            return Err(SyncError::Closed);
        }
        let now = hash_pages(ram, &all);
        let changed: Vec<u64> = all.iter().copied().filter(|&p| now[p as usize] != known[p as usize]).collect();
        m.left = changed.len() as u64;
        if changed.is_empty() || round == ROUNDS || (round > 0 && changed.len() < DONE_PAGES) {
            break;
        }
        m.rounds += 1;
        for batch in changed.chunks(BATCH_PAGES) {
            while sent - acked >= WINDOW {
                acked = acked.max(wait_ack(x)?);
            }
            sent += 1;
            let mut frame = Vec::with_capacity(BATCH_PAGES * (PAGE + 16) + 64);
            // What the replica will hold is what was read now (a page
            // written during the read is sent again next round).
            page_frame(&mut frame, Kind::RejoinPages, &x.id.header(), &sent.to_le_bytes(), ram, batch, false, &mut buf, |p, data| {
                known[p as usize] = xxh3_128(data)
            })?;
            m.precopy_bytes += frame.len() as u64;
            m.pages += batch.len() as u64;
            if !x.mesh.send(x.peer, frame) {
                return Err(SyncError::Send);
            }
        }
    }
    while acked < sent {
        acked = acked.max(wait_ack(x)?);
    }
    Ok(())
}

fn wait_ack(x: &Exchange<'_>) -> Result<u64, SyncError> {
    let payload = x.expect(Kind::RejoinAck, BATCH_PAGES as u64)?;
    let seq = payload.get(ID_LEN..ID_LEN + 8).ok_or_else(|| ProtocolError::Corrupt("a short RejoinAck".into()))?;
    Ok(u64::from_le_bytes(seq.try_into().expect("8 bytes")))
}

/// The replica's answer to `RejoinStart`: in step (skip), or the hash of
/// every page of its (held) VM.
pub fn answer(vm: &Vm, in_step: bool) -> Vec<u8> {
    let hashes = if in_step { Vec::new() } else { hash_pages(vm.ram(), &(0..vm.ram().pages()).collect::<Vec<_>>()) };
    postcard::to_allocvec(&HashesMsg { in_step, hashes }).expect("serializes")
}

/// The replica writes one `RejoinPages` message (checked whole first) into
/// its held VM; returns its sequence number, to acknowledge.
pub fn write_pages(payload: &[u8], vm: &Vm) -> Result<u64, SyncError> {
    let mut c = Cursor::new(payload.get(ID_LEN..).unwrap_or_default());
    let bundle = Bundle::parse(&mut c, vm.ram().pages()).map_err(ProtocolError::from)?;
    if !c.is_empty() {
        return Err(ProtocolError::Corrupt("rejoin pages have trailing bytes".into()).into());
    }
    let seq: [u8; 8] = bundle.state.try_into().map_err(|_| ProtocolError::Corrupt("rejoin pages without a sequence number".into()))?;
    bundle.apply(vm.ram()).map_err(ftvm_vmm::VmError::from)?;
    Ok(u64::from_le_bytes(seq))
}
