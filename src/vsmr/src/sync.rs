//! `syncvm`: the leader brings the secondary to its exact state by sending
//! only the pages that differ.
//!
//! Both VM replicas run it when they apply the same committed `Sync`
//! entry, so both have received exactly the same input before it:
//!
//! ```text
//!  leader                                   secondary
//!  freeze (pause, dirty set, state,          pause, dirty set
//!          close the output epoch)
//!  SyncBitmap ─────────────────────────────▶
//!            ◀───────────────────────────── SyncBitmap
//!  hash the union (xxh3-128, all cores)      hash the union
//!            ◀───────────────────────────── SyncHashes (32 bits a page)
//!  compare: divergent pages
//!  SyncPages (divergent pages, VM state,
//!             undelivered input, digest of
//!             the union's hashes) ─────────▶ stage (parse, check, digest)
//!  resume
//!            ◀───────────────────────────── SyncAck
//!  release the closed epoch's output         apply pages, then state; resume
//! ```
//!
//! With `--sync-pages blocks` (or `adaptive`) the leader may first ask
//! for a 16-bit hash of each 64-byte block of the divergent pages
//! (`SyncWant`, `SyncBlockHashes`) and send only the blocks that differ,
//! each patched page with its hash; a secondary whose page, patched, does
//! not hash to it (two block hashes collided) asks for those pages whole
//! (`SyncRepair`, `SyncRepaired`: `repair`) before it acknowledges.
//!
//! With `--early-resume on` the leader copies the union's pages and disk
//! blocks aside once the bitmaps are swapped (`aside`), resumes, and then
//! hashes, compares and sends from the copy; the secondary's side is the
//! same either way.
//!
//! The pipeline's stages do the work: the copy aside is a capture
//! (`capture::Capture`, its pages added in the pause), the compare an
//! encoding for a reader known by hashes (`encode::hash_compare`: which
//! divergent pages go whole, which as changed blocks); this module is the
//! exchange between them.
//!
//! The secondary's page hashes travel as their low 32 bits; the digest of
//! the leader's whole hashes of the union catches a page whose short hashes
//! collided (`hash_compare`): the secondary refuses the `syncvm` (nothing
//! applied, no acknowledgement), is out of step, and the next one is full,
//! comparing every page by its whole hash.
//!
//! Every message carries the `Sync` entry's term and index; anything else
//! is a leftover of an abandoned `syncvm` and is dropped. A full `syncvm`
//! (a secondary this leader has not synchronized) compares every page.
//! The secondary applies only a whole, checked message, after its
//! acknowledgement: a leader that dies mid-transfer leaves it as it was.

use std::collections::BTreeSet;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use ftvm_vmm::memory::{GuestRam, PAGE};
use ftvm_vmm::pages::{Bundle, BundleWriter, Cursor, RawEncoder};
use ftvm_vmm::{Components, PageBitmap, Vm};

use crate::aside::{Aside, Blocks};
use crate::disk::{self, ReplicaDisk};
use crate::mesh::{Inbound, Mesh};
use crate::repair::{self, RepairMsg};
pub use crate::sync_id::SyncId;
use crate::sync_id::ID_LEN;
use crate::writes::Writes;
use ftvm_replication::checkpoint::StateDelta;
use ftvm_replication::output::DiskWrite;
use ftvm_replication::pipeline::capture::Captured;
/// `--sync-pages`: how the leader sends a divergent page.
pub use ftvm_replication::pipeline::encode::hash_compare::Granularity as PageMode;
use ftvm_replication::pipeline::encode::hash_compare::{self, hash_pages, BlockPatch, HashCompare, HashWidth, PAGE_BLOCK_HASHES};
use ftvm_replication::pipeline::freeze::Frozen;
use ftvm_replication::pipeline::predict;
use ftvm_replication::protocol::{self, Kind, ProtocolError};
use ftvm_replication::ReplicationError;
use ftvm_vmm::sync::Lock;

/// How long one side waits for the other's next message, beyond the time
/// the other needs to hash or copy its pages: a dead peer costs the paused
/// guest no more than this.
pub const STEP_TIMEOUT: Duration = Duration::from_millis(500);
/// Time allowed per page the other side hashes or sends (a 2-core host
/// hashes and copies a page in about 2 µs, several times that when loaded).
const PER_PAGE: Duration = Duration::from_micros(10);

#[derive(Serialize, Deserialize)]
struct BitmapMsg {
    /// Compare every page: the leader has not synchronized this secondary
    /// (or lost track of its writes), or the secondary is not in step.
    full: bool,
    words: Vec<u64>,
    /// This replica's disk size in bytes (0: no disk): both must match.
    disk_size: u64,
    /// The disk's 4 KiB blocks written since the last `syncvm` (empty
    /// when `full`), sorted.
    blocks: Vec<u64>,
}

/// `SyncHashes`: the secondary's XXH3-128 of each page of the union, then
/// of each disk block of the union of both dirty block sets: the low 4
/// bytes of each, all 16 in a compare of every page
/// (`hash_compare::HashWidth`, `pack_hashes`).
#[derive(Serialize, Deserialize)]
struct HashesMsg {
    hashes: Vec<u8>,
    blocks: Vec<u8>,
}

/// `SyncWant`: the divergent pages whose block hashes the leader asks for.
#[derive(Serialize, Deserialize)]
struct WantMsg {
    pages: Vec<u64>,
}

/// `SyncBlockHashes`: a 16-bit hash of each 64-byte block of each wanted
/// page (`hash_compare::block_hashes`).
#[derive(Serialize, Deserialize)]
struct BlockHashesMsg {
    hashes: Vec<u8>,
}

/// The state part of `SyncPages`.
#[derive(Serialize, Deserialize)]
struct SyncState {
    /// The leader's VM state: whole, or over the one of `base`.
    vm: StateDelta,
    /// The `syncvm` whose state `vm` is a delta over (`StateBase`).
    base: Option<SyncId>,
    /// Input the leader's guest had not taken in yet (its receive queue was
    /// full): the secondary's guest gets exactly these next.
    pending_input: Vec<Vec<u8>>,
    /// `--sync-pages blocks`: divergent pages of which only some blocks
    /// differ (the others travel whole, as bundle entries).
    patches: Vec<BlockPatch>,
    /// The disk blocks whose hashes differed, whole.
    disk: Vec<DiskWrite>,
    /// `--sync-output on`: the leader's output of the epoch this `syncvm`
    /// closed (held until the acknowledgement), which the secondary keeps
    /// for a takeover (`recent`).
    output: Vec<Vec<u8>>,
    /// `hash_compare::union_digest` of the leader's whole hashes of the
    /// union's pages and disk blocks: the secondary's, with what this
    /// message brings, must be the same.
    digest: [u8; hash_compare::PAGE_HASH],
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("the peer did not answer within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("cannot send to the peer")]
    Send,
    #[error("the peer's link closed")]
    PeerLost,
    #[error(transparent)]
    Vm(#[from] ftvm_vmm::VmError),
    /// The copy aside (`--early-resume on`).
    #[error("copying the union aside: {0}")]
    Capture(#[from] ReplicationError),
    #[error("the replica is stopping")]
    Closed,
    /// `--sync-pipeline on`: a `syncvm` before it failed (or this replica
    /// stepped down), so its acknowledgement releases nothing.
    #[error("abandoned: an earlier syncvm failed")]
    Abandoned,
    #[error("disk: {0}")]
    Disk(String),
    /// After the acknowledgement: the leader may release output this
    /// replica's VM does not hold.
    #[error("acknowledged but could not apply: {0}")]
    Unusable(String),
    /// Two pages' short hashes collided: the `syncvm` is refused and a
    /// full one follows.
    #[error("the union's hashes do not match the leader's digest (short page hashes collided): out of step until a full syncvm")]
    Collided,
}

/// Figures of one `syncvm`, on either side.
#[derive(Clone, Copy, Debug, Default)]
pub struct Figures {
    /// Pages written on either side since the previous `syncvm`.
    pub dirty_pages: u64,
    /// Of those, pages whose contents differed (sent).
    pub divergent_pages: u64,
    /// Of those, pages sent as their changed blocks (`--sync-pages`).
    pub patched_pages: u64,
    /// The secondary: of those, pages that did not check once patched (a
    /// block-hash collision), asked for whole (`repair`).
    pub repaired_pages: u64,
    /// How long this side's guest was paused.
    pub pause: Duration,
    /// Bytes of the `SyncPages` message.
    pub page_bytes: u64,
    /// Disk blocks written on either side since the previous `syncvm`.
    pub dirty_blocks: u64,
    /// Of those, blocks whose contents differed (sent).
    pub divergent_blocks: u64,
    /// Tests (`FTVM_TEST_FAULT=syncvm-digest:1`): XXH3-64 over the page
    /// hashes of all guest memory, as the leader froze it and as the
    /// secondary has it once the pages are applied.
    pub memory_digest: Option<u64>,
    /// The steps (`SyncMetrics`' `bitmap_us`, `hash_us`, `wait_us`, `ack_us`).
    pub steps: Steps,
    /// `--predict-writes`: this side's pages left writable through the
    /// interval, and how many of them were written.
    pub predicted: predict::Figures,
}

/// Where a `syncvm`'s time went, on one side.
#[derive(Clone, Copy, Debug, Default)]
pub struct Steps {
    /// The leader: its freeze (the vCPUs paused, the dirty set and the VM
    /// state taken); the secondary: taking its dirty set once paused.
    pub freeze: Duration,
    /// From sending this side's bitmap until the peer's arrived (the
    /// leader's copy of its own dirty pages meanwhile not counted).
    pub bitmap: Duration,
    /// The leader with `--early-resume on`: copying the union's pages and
    /// disk blocks aside, in the pause.
    pub copy: Duration,
    /// Hashing the union (pages and disk blocks): the leader with
    /// `--early-resume on` hashes its copy, its guest running.
    pub hash: Duration,
    /// The leader: waiting for the secondary's hashes (and block hashes);
    /// the secondary: from sending its hashes until the pages came.
    pub wait: Duration,
    /// The leader: from sending the pages until the acknowledgement.
    pub ack: Duration,
}

/// The VM state a leader last sent to a secondary, which that secondary
/// holds once it applied that `syncvm`: the next `syncvm`'s state goes as
/// a delta over it (`StateDelta::against`). A leader keeps the state it
/// sent, a secondary the one it applied; either has one at most.
pub struct StateBase {
    /// The other side: the secondary it was sent to, the leader it came from.
    pub peer: u64,
    pub id: SyncId,
    pub state: Components,
}

/// The exchange with one peer.
pub struct Exchange<'a> {
    pub mesh: &'a Mesh,
    pub inbox: &'a Receiver<Inbound>,
    pub peer: u64,
    pub id: SyncId,
    /// The VM's disk, if it has one.
    pub disk: Option<&'a ReplicaDisk>,
    /// When the exchange began: the peer's link closing after this ends it.
    pub started: Instant,
    /// A `syncvm`'s: this replica's write prediction (`--predict-writes`),
    /// which learns from the union's hashes.
    pub writes: Option<&'a Mutex<Writes>>,
    /// A `syncvm`'s: the state its VM state goes as a delta over.
    pub state_base: Option<&'a Mutex<Option<StateBase>>>,
}

impl Exchange<'_> {
    /// Send `body` after this `syncvm`'s id (`term u64 | index u64`).
    pub(super) fn send(&self, kind: Kind, body: &[u8]) -> Result<(), SyncError> {
        let mut payload = self.id.header().to_vec();
        payload.extend_from_slice(body);
        if self.mesh.send(self.peer, protocol::frame(kind, &payload)) {
            Ok(())
        } else {
            Err(SyncError::Send)
        }
    }

    /// The next message of `kind` for this `syncvm` from the peer (its
    /// payload, the id included); others (stale ones, of an abandoned
    /// `syncvm`) are dropped.
    pub(super) fn expect(&self, kind: Kind, pages: u64) -> Result<Vec<u8>, SyncError> {
        self.expect_any(&[kind], pages).map(|(_, payload)| payload)
    }

    /// `expect` for the first of several kinds to arrive.
    fn expect_any(&self, kinds: &[Kind], pages: u64) -> Result<(Kind, Vec<u8>), SyncError> {
        let timeout = STEP_TIMEOUT + PER_PAGE * pages as u32;
        let deadline = Instant::now() + timeout;
        loop {
            // Its link closed before this exchange began (the notice then
            // counts as stale) and it did not come back.
            if self.mesh.is_lost(self.peer) {
                return Err(SyncError::PeerLost);
            }
            let msg = match self.inbox.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => return Err(SyncError::Timeout(timeout)),
                Err(RecvTimeoutError::Disconnected) => return Err(SyncError::Closed),
            };
            if msg.from != self.peer {
                continue;
            }
            if let Some(at) = msg.lost {
                if at >= self.started {
                    return Err(SyncError::PeerLost);
                }
                continue;
            }
            if !kinds.contains(&msg.kind) {
                continue;
            }
            let Some(id) = SyncId::parse(&msg.payload) else { continue };
            if id == self.id {
                return Ok((msg.kind, msg.payload));
            }
            tracing::debug!(?id, want = ?self.id, "dropped a stale syncvm message");
        }
    }

    /// Send this side's dirty bitmap, receive the other's: the union, or
    /// every page when either side asks for a full compare.
    /// The same for the disk's dirty blocks (`blocks`): their union too.
    /// `meanwhile` runs between the sending and the receiving (the
    /// leader's copy of its own dirty pages with `--early-resume on`).
    /// Also how long the peer's bitmap took to come once this one's was
    /// sent and `meanwhile` was done.
    fn swap_bitmaps(
        &self,
        mine: &PageBitmap,
        blocks: Vec<u64>,
        full: bool,
        meanwhile: impl FnOnce() -> Result<(), SyncError>,
    ) -> Result<(PageBitmap, Vec<u64>, Duration), SyncError> {
        let words = if full { Vec::new() } else { mine.words().to_vec() };
        let disk_size = self.disk.map_or(0, ReplicaDisk::size);
        let blocks = if full { Vec::new() } else { blocks };
        let msg = BitmapMsg { full, words, disk_size, blocks };
        self.send(Kind::SyncBitmap, &postcard::to_allocvec(&msg).expect("serializes"))?;
        meanwhile()?;
        let sent = Instant::now();
        let theirs: BitmapMsg = protocol::decode(&self.expect(Kind::SyncBitmap, 0)?[ID_LEN..])?;
        let waited = sent.elapsed();
        if theirs.disk_size != disk_size {
            return Err(ProtocolError::Corrupt(format!(
                "replica {} has a disk of {} bytes, this one of {disk_size} (0: none): every VM replica needs a disk of the same size",
                self.peer, theirs.disk_size
            ))
            .into());
        }
        let blocks = match self.disk {
            Some(d) if full || theirs.full => d.all(),
            Some(d) => {
                if theirs.blocks.iter().any(|&b| b >= d.blocks()) {
                    return Err(ProtocolError::Corrupt("a dirty disk block beyond the disk".into()).into());
                }
                disk::union(&msg.blocks, &theirs.blocks)
            }
            None => Vec::new(),
        };
        let mut union = PageBitmap::new(mine.capacity());
        if full || theirs.full {
            union.set_range(0, mine.capacity() - 1);
        } else {
            if theirs.words.len() != mine.words().len() {
                return Err(ProtocolError::Corrupt(format!(
                    "a dirty bitmap of {} words for {} pages",
                    theirs.words.len(),
                    mine.capacity()
                ))
                .into());
            }
            union.copy_from(mine);
            union.or_words(&theirs.words);
        }
        Ok((union, blocks, waited))
    }

    /// This side's hashes of `blocks` of its disk.
    fn hash_blocks(&self, blocks: &[u64]) -> Result<Vec<u128>, SyncError> {
        match self.disk {
            Some(d) => d.hash(blocks).map_err(|e| SyncError::Disk(e.to_string())),
            None => Ok(Vec::new()),
        }
    }
}

/// Where the leader reads the frozen contents of the union it compares
/// and sends: its VM's memory and disk while its guest is paused, or the
/// copy taken in the pause (`--early-resume on`: the pages captured, the
/// disk blocks) once it runs again.
enum Contents<'a> {
    Live(&'a GuestRam, Option<&'a ReplicaDisk>),
    Aside(&'a Captured, &'a Blocks),
}

impl Contents<'_> {
    fn hash_pages(&self, pages: &[u64]) -> Vec<u128> {
        match self {
            Contents::Live(ram, _) => hash_pages(ram, pages),
            Contents::Aside(captured, _) => hash_compare::hash_captured(captured, pages),
        }
    }

    fn hash_blocks(&self, blocks: &[u64]) -> Result<Vec<u128>, SyncError> {
        match self {
            Contents::Live(_, Some(d)) => d.hash(blocks).map_err(|e| SyncError::Disk(e.to_string())),
            Contents::Live(_, None) => Ok(Vec::new()),
            Contents::Aside(_, b) => Ok(b.hash(blocks)),
        }
    }

    fn page(&self, page: u64, buf: &mut [u8]) -> Result<(), SyncError> {
        match self {
            Contents::Live(ram, _) => ram.read_page(page, buf).map_err(|e| ftvm_vmm::VmError::from(e).into()),
            Contents::Aside(captured, _) => {
                let p = captured.page(page).ok_or_else(|| SyncError::Vm(ftvm_vmm::memory::MemoryError::OutOfRange { page }.into()))?;
                buf[..PAGE].copy_from_slice(p);
                Ok(())
            }
        }
    }

    fn block(&self, block: u64) -> Result<Vec<u8>, SyncError> {
        match self {
            Contents::Live(_, Some(d)) => d.read(block).map_err(|e| SyncError::Disk(e.to_string())),
            Contents::Live(_, None) => Err(SyncError::Disk("no disk".into())),
            Contents::Aside(_, b) => {
                b.block(block).map(<[u8]>::to_vec).ok_or_else(|| SyncError::Disk(format!("block {block} was not copied")))
            }
        }
    }
}

/// The leader's side, with its VM frozen (dirty set and state taken, the
/// output epoch closed, in the pause): resumes the guest as soon as the
/// pages are sent (with `aside`, once the union is copied into it),
/// returns once the secondary acknowledged them.
pub fn lead(
    x: &Exchange<'_>,
    vm: &Vm,
    frozen: Frozen<'_>,
    full: bool,
    compare: &mut dyn HashCompare,
    aside: Option<&mut Aside>,
    output: Vec<Vec<u8>>,
) -> Result<Figures, SyncError> {
    let mut figures = lead_unacked(x, vm, frozen, full, compare, aside, output)?;
    figures.steps.ack = await_ack(x)?;
    Ok(figures)
}

/// The secondary's acknowledgement of this `syncvm`'s pages (the leader,
/// once they are sent): how long it took.
pub fn await_ack(x: &Exchange<'_>) -> Result<Duration, SyncError> {
    let sent = Instant::now();
    x.expect(Kind::SyncAck, 0)?;
    Ok(sent.elapsed())
}

/// `lead` up to the sending of the pages: the acknowledgement
/// (`await_ack`) is still to come, and the output must wait for it. The
/// guest runs again by then: resumed after the pages were sent, or with
/// `aside` (`--early-resume on`; not in a full `syncvm`) as soon as the
/// union was copied into it, before it is hashed. Either way the frames it
/// sends from its resume on are in the next output epoch (the freeze
/// closed this one), released only by the next `syncvm`.
pub fn lead_unacked(
    x: &Exchange<'_>,
    vm: &Vm,
    mut frozen: Frozen<'_>,
    full: bool,
    compare: &mut dyn HashCompare,
    aside: Option<&mut Aside>,
    output: Vec<Vec<u8>>,
) -> Result<Figures, SyncError> {
    let pending_input = vm.devices().take_injected_host_input();
    // The freeze saved every component: a whole state.
    let state = std::mem::take(&mut frozen.state.vm).over(None);
    // The leadership's journal, taken by the freeze: this side's dirty blocks.
    let blocks = x.disk.map(|d| disk::dirty_blocks(&frozen.state.disk, d.size())).unwrap_or_default();
    // All of memory as frozen (tests only: it reads every page).
    let memory_digest = ftvm_replication::fault::syncvm_digest().then(|| digest(vm.ram()));
    let mut steps = Steps::default();
    let mut aside = aside.filter(|_| !full);
    let ram_pages = vm.ram().pages();
    let union = match aside.as_deref_mut() {
        Some(aside) => copy_aside(x, vm, &frozen.dirty, blocks, aside, &mut steps),
        None => x.swap_bitmaps(&frozen.dirty, blocks, full, || Ok(())).map(|(union, blocks, bitmap)| {
            steps.bitmap = bitmap;
            Copied::Live(union.pages().collect(), blocks)
        }),
    };
    // The guest goes on, and takes the pending input next, as the
    // secondary's will.
    let resume = |frozen: Frozen<'_>, pending: Vec<Vec<u8>>| {
        let pause = frozen.thaw().figures.pause;
        vm.devices().inject_host_input(pending);
        pause
    };
    let (result, pause) = match union {
        Err(e) => (Err(e), resume(frozen, pending_input)),
        // Copied: the guest runs again while the copy is compared and sent.
        Ok(Copied::Aside(pages, blocks)) => {
            let pause = resume(frozen, pending_input.clone());
            let aside = aside.expect("the union was copied into it");
            let result = aside.pages.finish(vm).map_err(SyncError::from).and_then(|captured| {
                let contents = Contents::Aside(captured, &aside.blocks);
                let width = HashWidth::for_union(pages.len() as u64, ram_pages);
                compare_and_send(x, &contents, &pages, &blocks, width, state, compare, &pending_input, output, &mut steps)
            });
            (result, pause)
        }
        // Read live: the guest waits until the pages are sent.
        Ok(Copied::Live(pages, blocks)) => {
            let contents = Contents::Live(vm.ram(), x.disk);
            let width = HashWidth::for_union(pages.len() as u64, ram_pages);
            let result = compare_and_send(x, &contents, &pages, &blocks, width, state, compare, &pending_input, output, &mut steps);
            (result, resume(frozen, pending_input))
        }
    };
    result.map(|figures| Figures { pause, memory_digest, steps, ..figures })
}

/// Where the leader reads the union (its pages and disk blocks) from.
enum Copied {
    /// Copied into the aside: the guest may resume.
    Aside(Vec<u64>, Vec<u64>),
    /// Not copied, read live in the pause: `--early-resume off`, or the
    /// union is every page (the secondary asked for a full compare).
    Live(Vec<u64>, Vec<u64>),
}

/// `--early-resume on`, in the pause: swap the dirty sets, capturing this
/// side's dirty pages meanwhile, then the rest of the union, and copy its
/// disk blocks, into `aside`. (When the union is every page the capture
/// is left unfinished: the next one starts over.)
fn copy_aside(
    x: &Exchange<'_>,
    vm: &Vm,
    dirty: &PageBitmap,
    blocks: Vec<u64>,
    aside: &mut Aside,
    steps: &mut Steps,
) -> Result<Copied, SyncError> {
    aside.blocks.clear();
    let mut copy = Duration::ZERO;
    let (union, blocks, bitmap) = x.swap_bitmaps(dirty, blocks, false, || {
        let t = Instant::now();
        aside.pages.in_pause(vm, dirty, &aside.none_hot)?;
        copy = t.elapsed();
        Ok(())
    })?;
    steps.bitmap = bitmap;
    if union.count() == union.capacity() {
        steps.copy = copy;
        return Ok(Copied::Live(union.pages().collect(), blocks));
    }
    let t = Instant::now();
    let mut rest = union.clone();
    rest.subtract(dirty);
    aside.pages.also(vm, &rest)?;
    if let Some(d) = x.disk {
        aside.blocks.copy(d, &blocks).map_err(|e| SyncError::Disk(e.to_string()))?;
    }
    steps.copy = copy + t.elapsed();
    Ok(Copied::Aside(union.pages().collect(), blocks))
}

/// The leader's comparison, once the union is known: hash its pages and
/// blocks as frozen (`contents`), take the secondary's hashes (`width`
/// bytes each), send the
/// divergent pages (as `compare` chooses) and blocks with the VM state and
/// the guest's undelivered input (`pending`).
#[allow(clippy::too_many_arguments)]
fn compare_and_send(
    x: &Exchange<'_>,
    contents: &Contents<'_>,
    pages: &[u64],
    blocks: &[u64],
    width: HashWidth,
    state: Components,
    compare: &mut dyn HashCompare,
    pending: &[Vec<u8>],
    output: Vec<Vec<u8>>,
    steps: &mut Steps,
) -> Result<Figures, SyncError> {
    let t = Instant::now();
    let mine = contents.hash_pages(pages);
    let my_blocks = contents.hash_blocks(blocks)?;
    steps.hash = t.elapsed();
    // The leader's pages are what both replicas hold once this succeeds.
    let predicted = x.writes.map(|w| w.locked().learn(pages, &mine)).unwrap_or_default();
    let t = Instant::now();
    let theirs: HashesMsg = protocol::decode(&x.expect(Kind::SyncHashes, pages.len() as u64 + blocks.len() as u64)?[ID_LEN..])?;
    steps.wait = t.elapsed();
    let their_pages = hash_compare::unpack_hashes(&theirs.hashes, width, "the secondary's page hashes")?;
    let their_blocks = hash_compare::unpack_hashes(&theirs.blocks, width, "the secondary's disk block hashes")?;
    if their_pages.len() != pages.len() || their_blocks.len() != blocks.len() {
        return Err(ProtocolError::Corrupt(format!(
            "{} hashes for {} pages, {} for {} disk blocks",
            their_pages.len(),
            pages.len(),
            their_blocks.len(),
            blocks.len()
        ))
        .into());
    }
    let mut disk_blocks = Vec::new();
    for ((&b, a), t) in blocks.iter().zip(&my_blocks).zip(&their_blocks) {
        if width.cut(*a) != *t {
            disk_blocks.push(DiskWrite { offset: b * disk::BLOCK, data: contents.block(b)? });
        }
    }
    let divergent_blocks = disk_blocks.len() as u64;
    let mut divergent = hash_compare::divergent(pages, &mine, &their_pages, width);
    if width == HashWidth::Short {
        // Tests: as if the short hashes of some of them had collided.
        divergent.retain(|_| !ftvm_replication::fault::syncvm_short_collision());
    }
    let digest = hash_compare::union_digest(&mine, &my_blocks);
    let mut buf = vec![0u8; PAGE];
    let hash_of = |p: u64| pages.binary_search(&p).map_or(0, |i| mine[i]);
    let patches = patch_pages(x, contents, compare, &divergent, hash_of, &mut buf, steps)?;
    // The others whole, in page order.
    let whole: Vec<u64> = divergent.iter().copied().filter(|p| patches.binary_search_by_key(p, |patch| patch.page).is_err()).collect();
    let patched_pages = patches.len() as u64;
    let (vm, base) = state_delta(x, state, width);
    let sync_state = SyncState { vm, base, pending_input: pending.to_vec(), patches, disk: disk_blocks, output, digest };
    let state = postcard::to_allocvec(&sync_state).expect("serializes");
    let mut frame = Vec::new();
    protocol::begin_frame(&mut frame, Kind::SyncPages);
    frame.extend_from_slice(&x.id.header());
    let mut encoder = RawEncoder;
    let mut bundle = BundleWriter::begin(&mut frame, &state, &mut encoder, false);
    for &p in &whole {
        contents.page(p, &mut buf)?;
        bundle.page(p, &buf);
    }
    bundle.finish();
    protocol::finish_frame(&mut frame);
    let page_bytes = frame.len() as u64;
    if !x.mesh.send(x.peer, frame) {
        return Err(SyncError::Send);
    }
    Ok(Figures {
        dirty_pages: pages.len() as u64,
        divergent_pages: divergent.len() as u64,
        patched_pages,
        repaired_pages: 0,
        pause: Duration::ZERO,
        page_bytes,
        dirty_blocks: blocks.len() as u64,
        divergent_blocks,
        memory_digest: None,
        steps: *steps,
        predicted,
    })
}

/// The leader's VM state for `x`'s secondary: over the state it last sent
/// it (which becomes this one), or whole in a full `syncvm` (`width`) or
/// when it sent it none.
fn state_delta(x: &Exchange<'_>, state: Components, width: HashWidth) -> (StateDelta, Option<SyncId>) {
    let Some(base) = x.state_base else { return (StateDelta::whole(state), None) };
    let mut base = base.locked();
    let delta = match base.as_ref() {
        Some(b) if b.peer == x.peer && width == HashWidth::Short => (StateDelta::against(&state, &b.state), Some(b.id)),
        _ => (StateDelta::whole(state.clone()), None),
    };
    *base = Some(StateBase { peer: x.peer, id: x.id, state });
    delta
}

/// The secondary's whole VM state from the leader's `delta` over `base`
/// (`StateBase`): it must hold the state of that `syncvm`, else it is out
/// of step.
fn state_over(x: &Exchange<'_>, delta: StateDelta, base: Option<SyncId>) -> Result<Components, SyncError> {
    let held = x.state_base.map(|b| b.locked());
    let held = match (base, held.as_ref().and_then(|h| h.as_ref())) {
        (None, _) => None,
        (Some(id), Some(h)) if h.id == id && h.peer == x.peer => Some(&h.state),
        (Some(id), _) => {
            return Err(ProtocolError::Corrupt(format!(
                "the leader's VM state is a delta over syncvm {id:?}, which this replica does not hold"
            ))
            .into())
        }
    };
    delta.check(held).map_err(|e| ProtocolError::Corrupt(format!("the leader's VM state: {e}")))?;
    Ok(delta.over(held.cloned()))
}

/// At most this many pages of a `syncvm` go as patches, for the leader
/// keeps a copy of each until the acknowledgement (16 MiB of them): the
/// rest of a larger divergence (a full `syncvm` of a replica that ran
/// apart) goes whole.
const PATCHED_MAX: usize = 4096;

/// The divergent pages `compare` sends as patches: it chooses those
/// whose block hashes the secondary is asked for (one more round trip),
/// then a patch of each (with the page's hash, `hash_of`), or none
/// (whole). In page order. The patched pages are kept, as frozen, for the
/// secondary's repair (`repair::Repairs`).
fn patch_pages(
    x: &Exchange<'_>,
    contents: &Contents<'_>,
    compare: &mut dyn HashCompare,
    divergent: &[u64],
    hash_of: impl Fn(u64) -> u128,
    buf: &mut [u8],
    steps: &mut Steps,
) -> Result<Vec<BlockPatch>, SyncError> {
    let mut asked = compare.refine(divergent);
    asked.truncate(PATCHED_MAX);
    if asked.is_empty() {
        return Ok(Vec::new());
    }
    x.send(Kind::SyncWant, &postcard::to_allocvec(&WantMsg { pages: asked.clone() }).expect("serializes"))?;
    let t = Instant::now();
    let theirs: BlockHashesMsg = protocol::decode(&x.expect(Kind::SyncBlockHashes, asked.len() as u64)?[ID_LEN..])?;
    steps.wait += t.elapsed();
    if theirs.hashes.len() != asked.len() * PAGE_BLOCK_HASHES {
        return Err(ProtocolError::Corrupt(format!("{} bytes of block hashes for {} pages", theirs.hashes.len(), asked.len())).into());
    }
    let mut patches = Vec::new();
    let mut held = Vec::new();
    for (&p, hashes) in asked.iter().zip(theirs.hashes.chunks_exact(PAGE_BLOCK_HASHES)) {
        contents.page(p, buf)?;
        if let Some(mut patch) = compare.patch(p, buf, hash_of(p), hashes) {
            if ftvm_replication::fault::syncvm_collision() {
                patch.collide();
            }
            patches.push(patch);
            held.push((p, buf[..PAGE].to_vec()));
        }
    }
    if !held.is_empty() {
        x.mesh.repairs().keep(x.peer, x.id, held);
    }
    Ok(patches)
}

/// The secondary's side: pause, exchange, stage, acknowledge, apply,
/// resume; `full` when it is not in step with the leader (never
/// synchronized, or a failed `syncvm` took its dirty set). On an error
/// nothing was applied.
/// `applied` runs once the leader's state is applied, before the resume.
pub fn follow(x: &Exchange<'_>, vm: &Vm, full: bool, applied: impl FnOnce(Vec<Vec<u8>>)) -> Result<Figures, SyncError> {
    vm.pause();
    let t0 = Instant::now();
    let result = follow_paused(x, vm, full).map(|(figures, output)| {
        applied(output);
        figures
    });
    vm.resume();
    let mut figures = result?;
    figures.pause = t0.elapsed();
    Ok(figures)
}

/// `follow` in the pause; with the leader's output of the epoch (`--sync-output`).
fn follow_paused(x: &Exchange<'_>, vm: &Vm, full: bool) -> Result<(Figures, Vec<Vec<u8>>), SyncError> {
    let t = Instant::now();
    let mut dirty = PageBitmap::new(vm.ram().pages());
    match x.writes {
        Some(w) => w.locked().collect(vm, &mut dirty)?,
        None => vm.collect_dirty(&mut dirty, &PageBitmap::new(vm.ram().pages()))?,
    }
    // Its disk's writes since the last syncvm (none is in progress: the
    // disk's I/O runs in the device's pass, which the pause waited for).
    let blocks = x.disk.map(|d| disk::dirty_blocks(&d.journal.take(), d.size())).unwrap_or_default();
    let mut steps = Steps { freeze: t.elapsed(), ..Steps::default() };
    let (union, blocks, bitmap) = x.swap_bitmaps(&dirty, blocks, full, || Ok(()))?;
    steps.bitmap = bitmap;
    let pages: Vec<u64> = union.pages().collect();
    let t = Instant::now();
    let hashes = hash_pages(vm.ram(), &pages);
    let block_hashes = x.hash_blocks(&blocks)?;
    steps.hash = t.elapsed();
    let predicted = x.writes.map(|w| w.locked().learn(&pages, &hashes)).unwrap_or_default();
    let width = HashWidth::for_union(pages.len() as u64, vm.ram().pages());
    let msg = HashesMsg { hashes: hash_compare::pack_hashes(&hashes, width), blocks: hash_compare::pack_hashes(&block_hashes, width) };
    x.send(Kind::SyncHashes, &postcard::to_allocvec(&msg).expect("serializes"))?;
    let t = Instant::now();
    let (mut kind, mut payload) = x.expect_any(&[Kind::SyncWant, Kind::SyncPages], pages.len() as u64 + blocks.len() as u64)?;
    if kind == Kind::SyncWant {
        let want: WantMsg = protocol::decode(&payload[ID_LEN..])?;
        if want.pages.iter().any(|&p| !union.is_set(p)) {
            return Err(ProtocolError::Corrupt("the leader wants blocks of a page outside the union".into()).into());
        }
        let hashes = hash_compare::block_hashes(vm.ram(), &want.pages);
        x.send(Kind::SyncBlockHashes, &postcard::to_allocvec(&BlockHashesMsg { hashes }).expect("serializes"))?;
        (kind, payload) = x.expect_any(&[Kind::SyncPages], want.pages.len() as u64)?;
    }
    steps.wait = t.elapsed();
    debug_assert_eq!(kind, Kind::SyncPages);
    // Stage: everything parsed and checked before anything changes.
    let mut c = Cursor::new(&payload[ID_LEN..]);
    let bundle = Bundle::parse(&mut c, vm.ram().pages()).map_err(ProtocolError::from)?;
    if !c.is_empty() {
        return Err(ProtocolError::Corrupt("syncvm pages have trailing bytes".into()).into());
    }
    let mut state: SyncState = protocol::decode(bundle.state)?;
    let leader_state = state_over(x, std::mem::take(&mut state.vm), state.base)?;
    if let Err(e) = vm.check_components(&leader_state) {
        return Err(ProtocolError::Corrupt(format!("the leader's VM has another shape: {e}")).into());
    }
    let whole: BTreeSet<u64> = bundle.entries().map(|e| e.page).collect();
    for patch in &state.patches {
        if !patch.fits(vm.ram().pages()) {
            return Err(ProtocolError::Corrupt(format!("a block patch of page {} does not fit", patch.page)).into());
        }
        if whole.contains(&patch.page) {
            return Err(ProtocolError::Corrupt(format!("page {} comes both whole and as a block patch", patch.page)).into());
        }
    }
    if !state.disk.is_empty() {
        let fits = |w: &DiskWrite| x.disk.is_some_and(|d| d.fits(w) && blocks.binary_search(&(w.offset / disk::BLOCK)).is_ok());
        if let Some(w) = state.disk.iter().find(|w| !fits(w)) {
            return Err(ProtocolError::Corrupt(format!("a disk block at {} that is not one of the compared blocks", w.offset)).into());
        }
    }
    let (staged, repaired_pages) = stage_patches(x, vm.ram(), &state.patches)?;
    check_digest(&pages, hashes, &blocks, block_hashes, &bundle, &state)?;
    crate::diverge_dump::record(vm.ram(), pages.len(), &bundle, &state.patches, &staged);
    let divergent = bundle.len() + state.patches.len() as u64;
    if let Some(late) = ftvm_replication::fault::syncvm_slow_ack() {
        // Tests: the leader's next syncvm is proposed before this ack.
        std::thread::sleep(late);
    }
    x.send(Kind::SyncAck, &[])?;
    // Commit: pages (checked against RAM at parse), patches (checked
    // above), then the state. None of it should fail now; if it does, this
    // replica acknowledged what it does not hold.
    let memory_digest = commit(vm, x.disk, &bundle, &state, &leader_state, &staged).map_err(|e| SyncError::Unusable(e.to_string()))?;
    if let Some(b) = x.state_base {
        *b.locked() = Some(StateBase { peer: x.peer, id: x.id, state: leader_state });
    }
    if let Some(w) = x.writes {
        w.locked().forget(bundle.entries().map(|e| e.page).chain(state.patches.iter().map(|p| p.page)));
    }
    vm.devices().inject_host_input(state.pending_input);
    let figures = Figures {
        dirty_pages: pages.len() as u64,
        divergent_pages: divergent,
        patched_pages: state.patches.len() as u64,
        repaired_pages,
        pause: Duration::ZERO,
        page_bytes: payload.len() as u64,
        dirty_blocks: blocks.len() as u64,
        divergent_blocks: state.disk.len() as u64,
        memory_digest,
        steps,
        predicted,
    };
    Ok((figures, state.output))
}

/// The secondary's staging of the leader's block patches (they fit): each
/// page patched, in a buffer, checked against the leader's hash of it;
/// those that fail (a block-hash collision left a differing block out)
/// come whole in one more round trip (`repair`) and must check too. The
/// pages to write, in patch order, and how many came whole.
fn stage_patches(x: &Exchange<'_>, ram: &GuestRam, patches: &[BlockPatch]) -> Result<(Vec<Vec<u8>>, u64), SyncError> {
    let mut staged = Vec::with_capacity(patches.len());
    let mut failed = Vec::new();
    for (i, patch) in patches.iter().enumerate() {
        let mut page = vec![0u8; PAGE];
        ram.read_page(patch.page, &mut page).map_err(ftvm_vmm::VmError::from)?;
        patch.apply(&mut page);
        if !patch.check(&page) {
            failed.push(i);
        }
        staged.push(page);
    }
    if failed.is_empty() {
        return Ok((staged, 0));
    }
    let asked: Vec<u64> = failed.iter().map(|&i| patches[i].page).collect();
    tracing::info!(pages = asked.len(), "patched pages do not hash to the leader's (a block-hash collision): asking for them whole");
    x.send(Kind::SyncRepair, &postcard::to_allocvec(&RepairMsg { pages: asked.clone() }).expect("serializes"))?;
    let timeout = STEP_TIMEOUT + PER_PAGE * asked.len() as u32;
    let answer = x.mesh.repairs().await_answer(x.peer, x.id, timeout, || x.mesh.is_lost(x.peer)).ok_or(SyncError::Timeout(timeout))?;
    let whole = repair::parse_repaired(&answer[ID_LEN..], &asked, ram.pages())?;
    for (&i, data) in failed.iter().zip(whole) {
        staged[i].copy_from_slice(data);
        if !patches[i].check(&staged[i]) {
            return Err(ProtocolError::Corrupt(format!(
                "page {} came whole but does not hash to the leader's hash of it",
                patches[i].page
            ))
            .into());
        }
    }
    Ok((staged, failed.len() as u64))
}

/// The secondary's check, once staged, that what it will hold is what the
/// leader froze: the hashes of the union (`hashes` of `pages`, then
/// `block_hashes` of `blocks`: its own) with those of the pages and disk
/// blocks the leader sent put in, digested, are the leader's digest. Short
/// hashes that collided hid a divergent page if not.
fn check_digest(
    pages: &[u64],
    mut hashes: Vec<u128>,
    blocks: &[u64],
    mut block_hashes: Vec<u128>,
    bundle: &Bundle<'_>,
    state: &SyncState,
) -> Result<(), SyncError> {
    let at = |set: &[u64], item: u64, what: &str| {
        set.binary_search(&item)
            .map_err(|_| SyncError::from(ProtocolError::Corrupt(format!("syncvm sent {what} {item}, not of the union"))))
    };
    for e in bundle.entries() {
        let data = e.whole().ok_or_else(|| ProtocolError::Corrupt(format!("syncvm page {} is not whole", e.page)))?;
        hashes[at(pages, e.page, "page")?] = xxh3_128(data);
    }
    for patch in &state.patches {
        hashes[at(pages, patch.page, "a patch of page")?] = u128::from_le_bytes(patch.hash);
    }
    for w in &state.disk {
        block_hashes[at(blocks, w.offset / disk::BLOCK, "disk block")?] = xxh3_128(&w.data);
    }
    if hash_compare::union_digest(&hashes, &block_hashes) != state.digest {
        tracing::warn!(pages = pages.len(), "{}", SyncError::Collided);
        return Err(SyncError::Collided);
    }
    Ok(())
}

/// The secondary's commit of a staged `SyncPages` (`staged`: its patched
/// pages, checked); the memory digest when tests ask for it.
fn commit(
    vm: &Vm,
    disk: Option<&ReplicaDisk>,
    bundle: &Bundle<'_>,
    state: &SyncState,
    vm_state: &Components,
    staged: &[Vec<u8>],
) -> Result<Option<u64>, SyncError> {
    // The disk first: a failed write is undone, and then nothing changed.
    if let Some(d) = disk {
        d.write(&state.disk).map_err(SyncError::Disk)?;
    }
    bundle.apply(vm.ram()).map_err(ftvm_vmm::VmError::from)?;
    for (patch, page) in state.patches.iter().zip(staged) {
        vm.ram().write_page(patch.page, page).map_err(ftvm_vmm::VmError::from)?;
    }
    // Before the state: its restore republishes the clock page, this host's own.
    let memory_digest = ftvm_replication::fault::syncvm_digest().then(|| digest(vm.ram()));
    let _ = vm.devices().take_injected_host_input();
    vm.restore_paused(vm_state)?;
    // The pages the apply wrote stay dirty: compared again next time (the
    // clock page, republished by the restore, is this host's own).
    Ok(memory_digest)
}

/// A digest of all of guest memory (tests only: it reads every page).
fn digest(ram: &GuestRam) -> u64 {
    let pages: Vec<u64> = (0..ram.pages()).collect();
    let hashes: Vec<u8> = hash_pages(ram, &pages).iter().flat_map(|h| h.to_le_bytes()).collect();
    xxh3_64(&hashes)
}
