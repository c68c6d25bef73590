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
//!
//! A disk (`vsmr::disk`) is copied the same way, in the same rounds: the
//! replica sends the hash of every block with its page hashes, the leader
//! sends the blocks whose hash is not what the replica holds, read from
//! its image while its guest runs (a block written meanwhile is sent again
//! next round, or left to the full `syncvm`, which compares every block),
//! as `RejoinPages` messages without pages whose state carries the blocks
//! after the sequence number.

use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_128;

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{Bundle, BundleWriter, Cursor, RawEncoder};
use ftvm_vmm::Vm;

use crate::disk::{ReplicaDisk, BLOCK};
use crate::sync::{Exchange, SyncError};
use crate::sync_id::ID_LEN;
use ftvm_replication::output::DiskWrite;
use ftvm_replication::pipeline::encode::hash_compare::hash_pages;
use ftvm_replication::pipeline::encode::page_frame::page_frame;
use ftvm_replication::protocol::{self, Kind, ProtocolError};
use ftvm_vmm::switch;

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
    /// XXH3-128 of every block of its disk, in order (none without one).
    blocks: Vec<u128>,
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
    /// Disk blocks (4 KiB) sent, over all rounds.
    #[serde(default)]
    pub blocks: u64,
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
    let nblocks = x.disk.map_or(0, ReplicaDisk::blocks);
    if reply.hashes.len() as u64 != n || reply.blocks.len() as u64 != nblocks {
        return Err(ProtocolError::Corrupt(format!(
            "{} page hashes for {n} pages, {} block hashes for {nblocks} blocks",
            reply.hashes.len(),
            reply.blocks.len()
        ))
        .into());
    }
    // What the replica holds, page by page and block by block.
    let mut known = reply.hashes;
    let mut known_blocks = reply.blocks;
    let all_blocks: Vec<u64> = (0..nblocks).collect();
    let all: Vec<u64> = (0..n).collect();
    let mut buf = vec![0u8; PAGE];
    let (mut sent, mut acked) = (0u64, 0u64);
    for round in 0..=ROUNDS {
        if !serving.load(Ordering::SeqCst) {
            return Err(SyncError::Closed);
        }
        let now = hash_pages(ram, &all);
        let changed: Vec<u64> = all.iter().copied().filter(|&p| now[p as usize] != known[p as usize]).collect();
        let changed_blocks: Vec<u64> = match x.disk {
            Some(d) => {
                let now = d.hash(&all_blocks).map_err(|e| SyncError::Disk(e.to_string()))?;
                all_blocks.iter().copied().filter(|&b| now[b as usize] != known_blocks[b as usize]).collect()
            }
            None => Vec::new(),
        };
        let left = changed.len() + changed_blocks.len();
        m.left = left as u64;
        if left == 0 || round == ROUNDS || (round > 0 && left < DONE_PAGES) {
            break;
        }
        m.rounds += 1;
        for batch in changed_blocks.chunks(BATCH_PAGES) {
            while sent - acked >= WINDOW {
                acked = acked.max(wait_ack(x)?);
            }
            sent += 1;
            let d = x.disk.expect("blocks only with a disk");
            let mut blocks = Vec::with_capacity(batch.len());
            for &b in batch {
                let data = d.read(b).map_err(|e| SyncError::Disk(e.to_string()))?;
                known_blocks[b as usize] = xxh3_128(&data);
                blocks.push(DiskWrite { offset: b * BLOCK, data });
            }
            let frame = blocks_frame(x, sent, &blocks);
            m.precopy_bytes += frame.len() as u64;
            m.blocks += batch.len() as u64;
            if !x.mesh.send(x.peer, frame) {
                return Err(SyncError::Send);
            }
        }
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

/// A `RejoinPages` message without pages: its state is the sequence
/// number, then the blocks.
fn blocks_frame(x: &Exchange<'_>, seq: u64, blocks: &[DiskWrite]) -> Vec<u8> {
    let mut state = seq.to_le_bytes().to_vec();
    state.extend_from_slice(&postcard::to_allocvec(blocks).expect("serializes"));
    let mut frame = Vec::new();
    protocol::begin_frame(&mut frame, Kind::RejoinPages);
    frame.extend_from_slice(&x.id.header());
    BundleWriter::begin(&mut frame, &state, &mut RawEncoder, false).finish();
    protocol::finish_frame(&mut frame);
    frame
}

fn wait_ack(x: &Exchange<'_>) -> Result<u64, SyncError> {
    let payload = x.expect(Kind::RejoinAck, BATCH_PAGES as u64)?;
    let seq = payload.get(ID_LEN..ID_LEN + 8).ok_or_else(|| ProtocolError::Corrupt("a short RejoinAck".into()))?;
    Ok(u64::from_le_bytes(seq.try_into().expect("8 bytes")))
}

/// The replica's answer to `RejoinStart`: in step (skip), or the hash of
/// every page of its (held) VM.
pub fn answer(vm: &Vm, disk: Option<&ReplicaDisk>, in_step: bool) -> Result<Vec<u8>, SyncError> {
    let hashes = if in_step { Vec::new() } else { hash_pages(vm.ram(), &(0..vm.ram().pages()).collect::<Vec<_>>()) };
    let blocks = match disk {
        Some(d) if !in_step => d.hash(&d.all()).map_err(|e| SyncError::Disk(e.to_string()))?,
        _ => Vec::new(),
    };
    Ok(postcard::to_allocvec(&HashesMsg { in_step, hashes, blocks }).expect("serializes"))
}

/// The replica writes one `RejoinPages` message (checked whole first) into
/// its held VM; returns its sequence number, to acknowledge.
/// Disk blocks after the sequence number are written into `disk` (each
/// checked to be one whole block of it first).
pub fn write_pages(payload: &[u8], vm: &Vm, disk: Option<&ReplicaDisk>) -> Result<u64, SyncError> {
    let mut c = Cursor::new(payload.get(ID_LEN..).unwrap_or_default());
    let bundle = Bundle::parse(&mut c, vm.ram().pages()).map_err(ProtocolError::from)?;
    if !c.is_empty() {
        return Err(ProtocolError::Corrupt("rejoin pages have trailing bytes".into()).into());
    }
    let (seq, blocks) =
        bundle.state.split_at_checked(8).ok_or_else(|| ProtocolError::Corrupt("rejoin pages without a sequence number".into()))?;
    if !blocks.is_empty() {
        let blocks: Vec<DiskWrite> = protocol::decode(blocks)?;
        let Some(d) = disk.filter(|d| blocks.iter().all(|w| d.fits(w))) else {
            return Err(ProtocolError::Corrupt("rejoin disk blocks that are not blocks of this disk".into()).into());
        };
        d.write(&blocks).map_err(SyncError::Disk)?;
    }
    bundle.apply(vm.ram()).map_err(ftvm_vmm::VmError::from)?;
    Ok(u64::from_le_bytes(seq.try_into().expect("8 bytes")))
}
