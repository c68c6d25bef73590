//! Encode: the frozen state and the captured pages into one checkpoint
//! frame, each page through the chosen `PageEncoder`.

use ftvm_vmm::pages::{BundleWriter, PageEncoder, RawEncoder};

use super::capture::Captured;
use crate::checkpoint::CheckpointState;
use crate::protocol::{self, Kind};
use crate::switch::switch;

switch! {
    /// `--encoding`: how pages are encoded.
    pub enum Encoding {
        /// Whole pages; all-zero pages as a bare tag.
        Raw = "raw",
    }
}

pub fn new(encoding: Encoding) -> Box<dyn PageEncoder> {
    match encoding {
        Encoding::Raw => Box::new(RawEncoder),
    }
}

/// Build checkpoint `epoch` in `frame` (a complete frame, ready to send).
pub fn checkpoint(frame: &mut Vec<u8>, epoch: u64, state: &CheckpointState, pages: &Captured, encoder: &mut dyn PageEncoder) {
    protocol::begin_frame(frame, Kind::Checkpoint);
    frame.extend_from_slice(&epoch.to_le_bytes());
    let state = postcard::to_allocvec(state).expect("checkpoint state serializes");
    // The backup's pages hold the previous epoch: a page that became zero must be sent.
    let mut bundle = BundleWriter::begin(frame, &state, encoder, false);
    for (p, data) in pages.iter() {
        bundle.page(p, data);
    }
    bundle.finish();
    protocol::finish_frame(frame);
}
