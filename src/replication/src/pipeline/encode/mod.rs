//! Encode: the frozen state and the captured pages into one checkpoint
//! frame, each page through the chosen `PageEncoder`: whole (`raw`), or
//! with `--diff` as a diff against the version the backup has (`diff`,
//! with the block compare in `xor`), whole where it has none. Beside the
//! `PageEncoder`s, for a reader known only by hashes of its pages: which
//! pages go at all, and how (`hash_compare`); and when `--diff auto`
//! compresses diffs (`link_load`).

mod diff;
pub mod hash_compare;
pub mod link_load;
pub mod page_frame;
pub mod state;
pub mod xor;

use std::time::Instant;

use ftvm_vmm::pages::{BundleWriter, PageEncoder, RawEncoder, Written};

use super::capture::Captured;
use super::last_sent::LastSent;
use crate::checkpoint::CheckpointState;
use crate::protocol::{self, Kind};
pub use diff::DiffEncoder;
use ftvm_vmm::switch;
pub use state::{SentState, States};

switch! {
    /// `--encoding`: how pages are encoded.
    pub enum Encoding {
        /// Whole pages; all-zero pages as a bare tag.
        Raw = "raw",
    }
}

switch! {
    /// `--diff`: send pages the backup has an earlier version of as diffs.
    pub enum Diff {
        /// Every page whole.
        Off = "off",
        /// The XOR of the changed 64-byte blocks, behind a two-level header.
        Xor = "xor",
        /// As `xor`, each diff LZ4-compressed when that makes it smaller.
        Lz4 = "lz4",
        /// As `xor` while the link has room, as `lz4` while it is busy
        /// (`link_load`).
        Auto = "auto",
    }
}

/// The encoder for a guest of `ram_pages` pages.
pub fn new(encoding: Encoding, diff: Diff, ram_pages: u64) -> Box<dyn PageEncoder> {
    let base: Box<dyn PageEncoder> = match encoding {
        Encoding::Raw => Box::new(RawEncoder),
    };
    match diff {
        Diff::Off => base,
        Diff::Xor | Diff::Lz4 | Diff::Auto => {
            let kept = LastSent::new(ram_pages, crate::bounds::last_sent_pages(ram_pages));
            let kernel = xor::Kernel::best();
            tracing::debug!(kernel = kernel.name(), kept_pages = kept.capacity(), "diff encoder");
            Box::new(DiffEncoder::new(kept, kernel, diff == Diff::Lz4, base))
        }
    }
}

/// What encoding one checkpoint took.
#[derive(Clone, Copy, Debug, Default)]
pub struct Encoded {
    pub pages: Written,
    /// Bytes of the state (VM state and disk writes).
    pub state_bytes: u64,
    /// Time spent encoding the pages.
    pub pages_ns: u64,
}

/// Build checkpoint `epoch` in `frame` (a complete frame, ready to send).
pub fn checkpoint(frame: &mut Vec<u8>, epoch: u64, state: &CheckpointState, pages: &Captured, encoder: &mut dyn PageEncoder) -> Encoded {
    protocol::begin_frame(frame, Kind::Checkpoint);
    frame.extend_from_slice(&epoch.to_le_bytes());
    let state = postcard::to_allocvec(state).expect("checkpoint state serializes");
    // The backup's pages hold the previous epoch: a page that became zero must be sent.
    let t0 = Instant::now();
    let mut bundle = BundleWriter::begin(frame, &state, encoder, false);
    for (p, data) in pages.iter() {
        bundle.page(p, data);
    }
    let written = bundle.finish();
    let pages_ns = t0.elapsed().as_nanos() as u64;
    protocol::finish_frame(frame);
    Encoded { pages: written, state_bytes: state.len() as u64, pages_ns }
}
