//! Hash compare: encoding for a reader this side knows only by a hash of
//! each of its pages (it wrote some of them itself). The reader sends a
//! hash of each page of the union of both sides' dirty sets; the pages
//! whose hashes differ from this side's are divergent, and only they go:
//! whole, or (`ChangedBlocks`) as the 64-byte blocks that differ from the
//! reader's, of whose blocks it sends a 16-bit hash when asked (one more
//! round trip).
//!
//! The reader's page hashes are the bulk of what a compare costs on the
//! wire (hundreds of union pages for a few divergent ones), so they travel
//! short: the low 32 bits of each XXH3-128 (`HashWidth::Short`). A page
//! whose short hashes collide would be left divergent, so this side also
//! sends a digest of its full hashes of the union (`union_digest`); the
//! reader, with what it was sent, must arrive at the same digest before it
//! acknowledges, and otherwise refuses the `syncvm` and asks for a full
//! one, which compares every page by its whole hash (`HashWidth::Whole`):
//! a collision, about one per 4 billion pages compared, costs a full
//! compare, never a page left divergent.
//!
//! A 16-bit hash lets one differing block in 65,536 pass for unchanged,
//! so every patch carries this side's XXH3-128 of the whole page: the
//! reader checks its page once patched against it, before it
//! acknowledges anything, and asks for any page that fails whole
//! (`BlockPatch::check`). A collision costs a round trip, never a page
//! left divergent.
//!
//! A stage beside `PageEncoder`, not one of its encoders: a `PageEncoder`
//! turns one page into one bundle entry from what this side alone knows,
//! while a hash compare needs the reader's hashes first, leaves out every
//! page whose hash matches (a bundle entry cannot say "unchanged"), and
//! its block patches overwrite the reader's blocks (an XOR-diff entry
//! needs the reader's bytes). The pages it keeps whole go as bundle
//! entries through a `PageEncoder`; its patches travel in the state.
//!
//! Which of the two pays depends on how much of a divergent page differs,
//! which only the block hashes tell: `ByDivergence` (`adaptive`) measures
//! it on the pages it asks them for and asks only while little differs,
//! measuring again now and then while it sends whole pages.

use std::convert::Infallible;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::protocol::ProtocolError;

use ftvm_vmm::memory::{GuestRam, PAGE};
use ftvm_vmm::switch;

use crate::pipeline::capture::Captured;
use crate::pipeline::cores::on_cores;

/// Bytes of a block that a patch overwrites.
pub const BLOCK: usize = 64;
/// Blocks of a page.
pub const BLOCKS: usize = PAGE / BLOCK;
/// Bytes of a block's hash as the reader sends it (the low 16 bits of its
/// XXH3-64, little-endian): a page's 64 cost 128 bytes. Short, because a
/// collision is caught by the page hash every patch carries.
pub const BLOCK_HASH: usize = 2;
/// Bytes of a page's block hashes.
pub const PAGE_BLOCK_HASHES: usize = BLOCKS * BLOCK_HASH;
/// Bytes of a page hash (XXH3-128) as sent whole: fixed, little-endian (a
/// varint of a random 128-bit value would take 18 or 19).
pub const PAGE_HASH: usize = 16;

/// How many bytes of each page (or disk block) hash the reader sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashWidth {
    /// The low 4 bytes: an ordinary `syncvm`, checked by `union_digest`.
    Short = 4,
    /// All 16: a compare of every page (a replica out of step, which may
    /// be so because short hashes collided).
    Whole = 16,
}

impl HashWidth {
    /// Short unless every page is compared.
    pub fn for_union(pages: u64, ram_pages: u64) -> HashWidth {
        if pages >= ram_pages {
            HashWidth::Whole
        } else {
            HashWidth::Short
        }
    }

    fn bytes(self) -> usize {
        self as usize
    }

    /// `hash` as far as this width carries it.
    pub fn cut(self, hash: u128) -> u128 {
        match self {
            HashWidth::Short => hash & u128::from(u32::MAX),
            HashWidth::Whole => hash,
        }
    }
}

/// What the writer's pages (then disk blocks) of the union hash to, all
/// of them in order: the reader's, once patched, must match.
pub fn union_digest(pages: &[u128], blocks: &[u128]) -> [u8; PAGE_HASH] {
    let all: Vec<u8> = pages.iter().chain(blocks).flat_map(|h| h.to_le_bytes()).collect();
    xxh3_128(&all).to_le_bytes()
}

switch! {
    /// How a divergent page travels.
    pub enum Granularity {
        /// Whole (PLOVER).
        Whole = "whole",
        /// Only its 64-byte blocks that differ: the reader sends a hash
        /// of each block of the divergent pages (one more round trip).
        Blocks = "blocks",
        /// Blocks while the divergent pages measured differ in little of
        /// their blocks, else whole (`ByDivergence`).
        Adaptive = "adaptive",
    }
}

/// The hash compare for `granularity`: one for all the `syncvm`s of a
/// leadership (`adaptive` learns from each).
pub fn new(granularity: Granularity) -> Box<dyn HashCompare> {
    match granularity {
        Granularity::Whole => Box::new(WholePages),
        Granularity::Blocks => Box::new(ChangedBlocks),
        Granularity::Adaptive => Box::new(ByDivergence::default()),
    }
}

/// How the divergent pages go, once the hashes are compared (`divergent`).
pub trait HashCompare: Send {
    /// Of the divergent pages (ascending), those whose block hashes to ask
    /// the reader for (ascending; none: every page goes whole).
    fn refine(&mut self, divergent: &[u64]) -> Vec<u64>;
    /// Page `page`, asked for: `data` is this side's (whose XXH3-128 is
    /// `hash`), `theirs` the reader's hashes of its blocks
    /// (`PAGE_BLOCK_HASHES` bytes). Its patch, or None to send it whole.
    fn patch(&mut self, page: u64, data: &[u8], hash: u128, theirs: &[u8]) -> Option<BlockPatch>;
}

/// Every divergent page whole.
pub struct WholePages;

impl HashCompare for WholePages {
    fn refine(&mut self, _divergent: &[u64]) -> Vec<u64> {
        Vec::new()
    }

    fn patch(&mut self, _page: u64, _data: &[u8], _hash: u128, _theirs: &[u8]) -> Option<BlockPatch> {
        None
    }
}

/// The blocks that differ, of every divergent page of which at most half
/// do; the others whole.
pub struct ChangedBlocks;

impl HashCompare for ChangedBlocks {
    fn refine(&mut self, divergent: &[u64]) -> Vec<u64> {
        divergent.to_vec()
    }

    fn patch(&mut self, page: u64, data: &[u8], hash: u128, theirs: &[u8]) -> Option<BlockPatch> {
        worth_sending(changed_blocks(page, data, hash, theirs))
    }
}

/// A block's hash as the reader sends it.
fn block_hash(block: &[u8]) -> [u8; BLOCK_HASH] {
    (xxh3_64(block) as u16).to_le_bytes()
}

/// The blocks of `data` (page `page`, hashing to `hash`) whose hashes are
/// not `theirs`.
fn changed_blocks(page: u64, data: &[u8], hash: u128, theirs: &[u8]) -> BlockPatch {
    let mut patch = BlockPatch { page, mask: 0, hash: hash.to_le_bytes(), data: Vec::new() };
    for (b, (block, h)) in data[..PAGE].chunks_exact(BLOCK).zip(theirs.chunks_exact(BLOCK_HASH)).enumerate() {
        if block_hash(block) != h {
            patch.mask |= 1 << b;
            patch.data.extend_from_slice(block);
        }
    }
    patch
}

/// `patch`, unless its page should go whole: a page that differs in most
/// blocks goes whole; one whose blocks all match (a page hash collision
/// cannot be ruled out) goes whole too, never not at all.
fn worth_sending(patch: BlockPatch) -> Option<BlockPatch> {
    (patch.mask != 0 && patch.data.len() <= PAGE / 2).then_some(patch)
}

/// Blocks while the divergent pages measured differ, on average, in at
/// most this share of their blocks; whole pages above it. Asking costs,
/// per divergent page, the reader's 64 block hashes (128 bytes) and the
/// page's number, mask and hash (about 34), and the `syncvm` one more
/// round trip in the leader's pause; at a quarter of the blocks a patch
/// and its asking carry 1,186 bytes, 29% of the whole page. Above it the round trip buys
/// less, and from half of a page's blocks a patch is not sent at all
/// (`worth_sending`).
pub const BLOCKS_UP_TO: f64 = 0.25;
/// While sending whole pages, the block hashes are asked for again (to
/// measure) at every this many-th `syncvm` with divergent pages: one
/// extra round trip in 32.
pub const MEASURE_EVERY: u32 = 32;
/// Weight of the newest `syncvm`'s measurement in the running share.
const WEIGHT: f64 = 0.25;

/// `--sync-pages adaptive`: as `ChangedBlocks` while the share of the
/// blocks of divergent pages that differ, measured on every page it asks
/// for, stays at most `BLOCKS_UP_TO`; as `WholePages` above it, asking
/// again every `MEASURE_EVERY` `syncvm`s to see whether that changed.
/// Before the first measurement it asks.
#[derive(Debug, Default)]
pub struct ByDivergence {
    /// The running share (none before a measurement).
    share: Option<f64>,
    /// Of the `syncvm` under way: blocks compared, and of them those
    /// that differed.
    compared: u64,
    differed: u64,
    /// `syncvm`s with divergent pages sent whole since the last measurement.
    whole_since: u32,
}

impl ByDivergence {
    /// Whether divergent pages go as blocks now.
    pub fn blocks(&self) -> bool {
        self.share.is_none_or(|s| s <= BLOCKS_UP_TO)
    }

    /// The running share of the blocks of divergent pages that differ.
    pub fn share(&self) -> Option<f64> {
        self.share
    }

    /// Fold the last `syncvm`'s measurement (if it asked) into the share.
    fn learn(&mut self) {
        if self.compared == 0 {
            return;
        }
        let measured = self.differed as f64 / self.compared as f64;
        self.share = Some(self.share.map_or(measured, |s| s + WEIGHT * (measured - s)));
        (self.compared, self.differed) = (0, 0);
    }
}

impl HashCompare for ByDivergence {
    fn refine(&mut self, divergent: &[u64]) -> Vec<u64> {
        self.learn();
        if divergent.is_empty() {
            return Vec::new();
        }
        if self.blocks() {
            self.whole_since = 0;
            return divergent.to_vec();
        }
        self.whole_since += 1;
        if self.whole_since < MEASURE_EVERY {
            return Vec::new();
        }
        self.whole_since = 0;
        divergent.to_vec()
    }

    fn patch(&mut self, page: u64, data: &[u8], hash: u128, theirs: &[u8]) -> Option<BlockPatch> {
        let patch = changed_blocks(page, data, hash, theirs);
        self.compared += BLOCKS as u64;
        self.differed += u64::from(patch.mask.count_ones());
        worth_sending(patch)
    }
}

/// Blocks of one page to overwrite: bit `b` of `mask` set for each
/// 64-byte block in `data`, in block order; `hash`, the writer's XXH3-128
/// of the whole page (little-endian), what the page hashes to once patched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockPatch {
    pub page: u64,
    pub mask: u64,
    pub hash: [u8; PAGE_HASH],
    pub data: Vec<u8>,
}

impl BlockPatch {
    /// Whether it fits a reader of `pages` pages: its page in range, one
    /// block of data per bit of its mask.
    pub fn fits(&self, pages: u64) -> bool {
        self.page < pages && self.data.len() == self.mask.count_ones() as usize * BLOCK
    }

    /// Whether `page`, patched, is the writer's page: false when a block
    /// that differs was taken for unchanged (its 16-bit hashes collided),
    /// and the page must come whole.
    pub fn check(&self, page: &[u8]) -> bool {
        xxh3_128(&page[..PAGE]).to_le_bytes() == self.hash
    }

    /// Tests (`fault::syncvm_collision`): leave out its first block, as a
    /// collision of that block's hashes would have.
    pub fn collide(&mut self) {
        if self.mask != 0 {
            self.mask &= self.mask - 1;
            self.data.drain(..BLOCK);
        }
    }

    /// Overwrite its blocks of `page` (the page's contents; the patch fits).
    pub fn apply(&self, page: &mut [u8]) {
        let mut data = self.data.chunks_exact(BLOCK);
        for (b, block) in page[..PAGE].chunks_exact_mut(BLOCK).enumerate() {
            if self.mask & (1 << b) != 0 {
                block.copy_from_slice(data.next().expect("fits: one block per mask bit"));
            }
        }
    }
}

/// The pages whose hashes differ (`mine` and `theirs` of each of `pages`,
/// theirs as `width` carries them).
pub fn divergent(pages: &[u64], mine: &[u128], theirs: &[u128], width: HashWidth) -> Vec<u64> {
    pages.iter().zip(mine).zip(theirs).filter(|((_, a), b)| width.cut(**a) != **b).map(|((&p, _), _)| p).collect()
}

/// XXH3-128 of each page of `ram`, on every core.
pub fn hash_pages(ram: &GuestRam, pages: &[u64]) -> Vec<u128> {
    let mut out = vec![0u128; pages.len()];
    let Ok(()) = on_cores(pages, &mut out, 1, |pages, out| {
        let mut buf = vec![0u8; PAGE];
        for (&p, o) in pages.iter().zip(out) {
            // Pages come from a bitmap of this RAM's size: always in range.
            *o = match ram.read_page(p, &mut buf) {
                Ok(()) => xxh3_128(&buf),
                Err(_) => 0,
            };
        }
        Ok::<(), Infallible>(())
    });
    out
}

/// XXH3-128 of each page as captured, on every core (0 for one not
/// captured, which the caller never asks for: it captured what it hashes).
pub fn hash_captured(captured: &Captured, pages: &[u64]) -> Vec<u128> {
    let mut out = vec![0u128; pages.len()];
    let Ok(()) = on_cores(pages, &mut out, 1, |pages, out| {
        for (&p, o) in pages.iter().zip(out) {
            *o = captured.page(p).map_or(0, xxh3_128);
        }
        Ok::<(), Infallible>(())
    });
    out
}

/// The hash of each 64-byte block of each page of `ram`, in order
/// (`BLOCK_HASH` bytes each): the reader's answer when asked (`refine`).
pub fn block_hashes(ram: &GuestRam, pages: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(pages.len() * PAGE_BLOCK_HASHES);
    let mut buf = vec![0u8; PAGE];
    for &p in pages {
        // Checked against the union, itself of this RAM's size.
        if ram.read_page(p, &mut buf).is_err() {
            buf.fill(0);
        }
        out.extend(buf.chunks_exact(BLOCK).flat_map(block_hash));
    }
    out
}

/// Page hashes as they travel: the low `width` bytes of each,
/// little-endian.
pub fn pack_hashes(hashes: &[u128], width: HashWidth) -> Vec<u8> {
    hashes.iter().flat_map(|h| h.to_le_bytes()[..width.bytes()].to_vec()).collect()
}

/// `pack_hashes` undone (each as `width` carries it): `what` names them in
/// the error of a length that is not a whole number of hashes.
pub fn unpack_hashes(bytes: &[u8], width: HashWidth, what: &str) -> Result<Vec<u128>, ProtocolError> {
    let n = width.bytes();
    if !bytes.len().is_multiple_of(n) {
        return Err(ProtocolError::Corrupt(format!("{what}: {} bytes, not a whole number of {n}-byte hashes", bytes.len())));
    }
    Ok(bytes
        .chunks_exact(n)
        .map(|c| {
            let mut h = [0u8; PAGE_HASH];
            h[..n].copy_from_slice(c);
            u128::from_le_bytes(h)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page patched from the reader's block hashes becomes this side's
    /// and checks against this side's page hash; one that differs in most
    /// blocks, or in none, goes whole.
    #[test]
    fn a_patch_makes_the_readers_page_this_sides() {
        let ram = GuestRam::new(1 << 20, false).unwrap();
        let theirs = vec![7u8; PAGE];
        ram.write_page(3, &theirs).unwrap();
        let reader = block_hashes(&ram, &[3]);
        assert_eq!(reader.len(), PAGE_BLOCK_HASHES, "16 bits a block");
        let mut mine = theirs.clone();
        mine[5] = 1;
        mine[BLOCK * 9 + 2] = 2;
        let hash = xxh3_128(&mine);
        let mut blocks = new(Granularity::Blocks);
        assert_eq!(blocks.refine(&[3, 8]), [3, 8]);
        let patch = blocks.patch(3, &mine, hash, &reader).expect("two blocks differ");
        assert_eq!(patch.mask, 1 | 1 << 9);
        assert!(patch.fits(ram.pages()) && !patch.fits(3));
        let mut page = theirs.clone();
        assert!(!patch.check(&page), "unpatched, the reader's page is not this side's");
        patch.apply(&mut page);
        assert_eq!(page, mine);
        assert!(patch.check(&page));
        assert!(blocks.patch(3, &theirs, hash, &reader).is_none(), "no block differs: whole");
        assert!(blocks.patch(3, &vec![9u8; PAGE], hash, &reader).is_none(), "every block differs: whole");
        let mut whole = new(Granularity::Whole);
        assert!(whole.refine(&[3, 8]).is_empty());
    }

    /// A block whose hashes collide is left out of the patch: the page,
    /// patched, does not check, and the reader knows to ask for it whole.
    #[test]
    fn a_collision_fails_the_page_check() {
        let theirs = vec![7u8; PAGE];
        let reader: Vec<u8> = theirs.chunks_exact(BLOCK).flat_map(block_hash).collect();
        let mut mine = theirs.clone();
        mine[BLOCK * 2] = 1;
        mine[BLOCK * 40] = 1;
        let mut patch = changed_blocks(3, &mine, xxh3_128(&mine), &reader);
        assert_eq!(patch.mask, 1 << 2 | 1 << 40);
        patch.collide();
        assert_eq!((patch.mask, patch.data.len()), (1 << 40, BLOCK), "block 2 left out");
        assert!(patch.fits(8));
        let mut page = theirs.clone();
        patch.apply(&mut page);
        assert_ne!(page, mine);
        assert!(!patch.check(&page), "the left-out block is caught");
        // Over the wire, a flipped page hash is caught the same way.
        let mut patch = changed_blocks(3, &mine, xxh3_128(&mine), &reader);
        patch.hash[0] ^= 1;
        let mut page = theirs.clone();
        patch.apply(&mut page);
        assert!(!patch.check(&page));
    }

    /// Page hashes travel as 4 bytes each, or 16 in a compare of every
    /// page; a length that is not a whole number of them is a clear error.
    #[test]
    fn page_hashes_pack_to_four_or_sixteen_bytes_each() {
        let hashes = [0u128, u128::MAX, 0x0123_4567_89ab_cdef_0011_2233_4455_6677];
        let packed = pack_hashes(&hashes, HashWidth::Whole);
        assert_eq!(packed.len(), 3 * PAGE_HASH);
        assert_eq!(unpack_hashes(&packed, HashWidth::Whole, "hashes").unwrap(), hashes);
        assert!(unpack_hashes(&[], HashWidth::Whole, "hashes").unwrap().is_empty());
        let err = unpack_hashes(&packed[..40], HashWidth::Whole, "the secondary's page hashes").unwrap_err().to_string();
        assert!(err.contains("the secondary's page hashes: 40 bytes, not a whole number of 16-byte"), "{err}");
        let short = pack_hashes(&hashes, HashWidth::Short);
        assert_eq!(short.len(), 12);
        let back = unpack_hashes(&short, HashWidth::Short, "hashes").unwrap();
        assert_eq!(back, [0, u128::from(u32::MAX), 0x4455_6677]);
        assert!(unpack_hashes(&short[..10], HashWidth::Short, "hashes").is_err());
        assert_eq!(HashWidth::for_union(10, 100), HashWidth::Short);
        assert_eq!(HashWidth::for_union(100, 100), HashWidth::Whole);
    }

    /// Short hashes that collide hide a divergent page from the compare;
    /// the union digest, recomputed by the reader from what it holds once
    /// patched, does not match, so the collision is caught.
    #[test]
    fn a_short_hash_collision_is_caught_by_the_union_digest() {
        let writer = [0xaaaa_bbbb_0000_0001u128, 0x1111_2222_3333_4444_5555_6666_7777_8888];
        // The reader's second page differs but agrees in its low 32 bits.
        let reader = [writer[0], 0x9999_2222_3333_4444_5555_6666_7777_8888];
        let sent = unpack_hashes(&pack_hashes(&reader, HashWidth::Short), HashWidth::Short, "h").unwrap();
        assert!(divergent(&[4, 9], &writer, &sent, HashWidth::Short).is_empty(), "the collision hides page 9");
        assert_ne!(union_digest(&writer, &[]), union_digest(&reader, &[]), "the digest does not");
        let whole = unpack_hashes(&pack_hashes(&reader, HashWidth::Whole), HashWidth::Whole, "h").unwrap();
        assert_eq!(divergent(&[4, 9], &writer, &whole, HashWidth::Whole), [9], "the full compare finds it");
        assert_ne!(union_digest(&writer, &[1]), union_digest(&writer, &[]), "disk blocks count too");
    }

    /// `adaptive` asks for block hashes at first, keeps asking while
    /// little of each divergent page differs, sends whole pages once most
    /// of them differs, measuring again every MEASURE_EVERY syncvms, and
    /// goes back to blocks when the pages differ in little again.
    #[test]
    fn adaptive_sends_blocks_while_little_of_a_divergent_page_differs() {
        let theirs = vec![7u8; PAGE];
        let reader: Vec<u8> = theirs.chunks_exact(BLOCK).flat_map(block_hash).collect();
        // A page of which `n` blocks differ from the reader's.
        let differing = |n: usize| {
            let mut page = theirs.clone();
            for b in 0..n {
                page[b * BLOCK] = 1;
            }
            page
        };
        // One syncvm of four divergent pages each differing in `n` blocks:
        // whether it asked, and how many went as patches.
        let syncvm = |c: &mut ByDivergence, n: usize| {
            let asked = c.refine(&[1, 2, 3, 4]);
            let patched = asked.iter().filter(|&&p| c.patch(p, &differing(n), 0, &reader).is_some()).count();
            (!asked.is_empty(), patched)
        };
        let mut c = ByDivergence::default();
        assert!(c.blocks(), "before any measurement: ask");
        assert_eq!(syncvm(&mut c, 2), (true, 4), "2 of 64 blocks: patches");
        assert_eq!(syncvm(&mut c, 2), (true, 4));
        assert!(c.share().unwrap() < 0.05);
        assert!(c.refine(&[]).is_empty(), "nothing divergent: nothing to ask");
        // Most of each page differs: whole pages once the share passes a quarter.
        let mut measured = 0;
        loop {
            let (asked, patched) = syncvm(&mut c, 60);
            if !asked {
                break;
            }
            assert_eq!(patched, 0, "60 of 64 blocks: each page whole");
            measured += 1;
            assert!(measured < 10, "still asking at a share of {:?}", c.share());
        }
        assert!(measured >= 1 && !c.blocks(), "share {:?}", c.share());
        // Whole now, measuring again every MEASURE_EVERY-th syncvm.
        let asks: Vec<bool> = (0..2 * MEASURE_EVERY).map(|_| syncvm(&mut c, 60).0).collect();
        // (The syncvm that found the share too high was the first whole one.)
        let at: Vec<usize> = (0..asks.len()).filter(|&i| asks[i]).collect();
        let every = MEASURE_EVERY as usize;
        assert_eq!(at, [every - 2, 2 * every - 2], "a measurement every {every} syncvms");
        // Little differs again: the measurements bring blocks back.
        let mut syncvms = 0;
        loop {
            syncvm(&mut c, 1);
            c.refine(&[]);
            if c.blocks() {
                break;
            }
            syncvms += 1;
            assert!(syncvms < 10 * MEASURE_EVERY, "still whole at a share of {:?}", c.share());
        }
        assert_eq!(syncvm(&mut c, 1), (true, 4), "back to patches");
        let mut fresh = new(Granularity::Adaptive);
        assert_eq!(fresh.refine(&[5]), [5], "a new one asks first");
    }

    #[test]
    fn divergent_pages_are_those_whose_hashes_differ() {
        let ram = GuestRam::new(1 << 20, false).unwrap();
        ram.write_page(2, &vec![1u8; PAGE]).unwrap();
        let mine = hash_pages(&ram, &[1, 2, 3]);
        let theirs = vec![mine[0], 0, mine[2]];
        assert_eq!(divergent(&[1, 2, 3], &mine, &theirs, HashWidth::Whole), [2]);
    }
}
