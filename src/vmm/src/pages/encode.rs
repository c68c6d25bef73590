//! Writing bundles: a `PageEncoder` turns each page into a tagged body.

use super::{PageTag, END, ENTRY_HEADER};
use crate::memory::PAGE;

/// Turns one page into an entry body (the Encode stage of a checkpoint).
pub trait PageEncoder: Send {
    /// Append the body for page `page`, whose contents are `data` (one
    /// page), to `out`, and say how it is encoded.
    fn encode(&mut self, page: u64, data: &[u8], out: &mut Vec<u8>) -> PageTag;

    /// The reader starts over (a new backup): forget whatever this encoder
    /// assumed about the pages it holds.
    fn reset(&mut self) {}

    /// The reader got page `page` some other way (`--prefetch-by pull`: the
    /// backup read it itself): what this encoder assumed about its copy of
    /// that page no longer holds, so its next encoding must not rely on it.
    fn forget(&mut self, _page: u64) {}

    /// Whether this encoder keeps a copy of what the reader holds as page
    /// `page`, so its next encoding of the page is made against it.
    fn keeps(&self, _page: u64) -> bool {
        false
    }

    /// Whether its last encoding of `page` found the reader's copy equal
    /// to the page (the entry changes nothing).
    fn unchanged(&self, _page: u64) -> bool {
        false
    }

    /// Compress the bodies it can from now on, or stop (the policy's
    /// choice, where it follows the link).
    fn compress(&mut self, _on: bool) {}
}

/// Whole pages, with all-zero pages sent as a bare tag.
#[derive(Clone, Copy, Debug, Default)]
pub struct RawEncoder;

impl PageEncoder for RawEncoder {
    fn encode(&mut self, _page: u64, data: &[u8], out: &mut Vec<u8>) -> PageTag {
        if is_zero(data) {
            return PageTag::Zero;
        }
        out.extend_from_slice(&data[..PAGE]);
        PageTag::Raw
    }
}

/// The zero-page check every writer of pages shares.
pub fn is_zero(page: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: every bit pattern is a valid u64; align_to only reinterprets
        // the aligned middle of the slice.
        unsafe { page.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Appends a bundle to a buffer: the state, then one entry per page, then
/// the end marker (`finish`).
pub struct BundleWriter<'a> {
    out: &'a mut Vec<u8>,
    encoder: &'a mut dyn PageEncoder,
    /// The reader's memory starts zeroed (a fresh VM): zero pages need no entry.
    skip_zero: bool,
    written: Written,
}

/// What a bundle's entries took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Entries (pages) in the bundle.
    pub pages: u64,
    /// Bytes of the entries, headers included.
    pub bytes: u64,
    /// Bytes diffs saved against sending their pages whole.
    pub diff_saved: u64,
}

impl<'a> BundleWriter<'a> {
    pub fn begin(out: &'a mut Vec<u8>, state: &[u8], encoder: &'a mut dyn PageEncoder, skip_zero: bool) -> BundleWriter<'a> {
        out.extend_from_slice(&(state.len() as u64).to_le_bytes());
        out.extend_from_slice(state);
        BundleWriter { out, encoder, skip_zero, written: Written::default() }
    }

    /// Add page `page` with contents `data`.
    pub fn page(&mut self, page: u64, data: &[u8]) {
        let at = self.out.len();
        self.out.resize(at + ENTRY_HEADER, 0);
        let tag = self.encoder.encode(page, data, self.out);
        // An entry that would change nothing at the reader (a page equal to
        // the copy the encoder diffed it against) is left out.
        if (tag == PageTag::Zero && self.skip_zero) || self.encoder.unchanged(page) {
            self.out.truncate(at);
            return;
        }
        let body = self.out.len() - at - ENTRY_HEADER;
        self.out[at] = tag as u8;
        self.out[at + 1..at + 9].copy_from_slice(&page.to_le_bytes());
        self.out[at + 9..at + ENTRY_HEADER].copy_from_slice(&(body as u32).to_le_bytes());
        self.written.pages += 1;
        self.written.bytes += (ENTRY_HEADER + body) as u64;
        if matches!(tag, PageTag::Diff | PageTag::DiffLz4) {
            self.written.diff_saved += PAGE.saturating_sub(body) as u64;
        }
    }

    /// Bytes in the buffer (for writers that stream the bundle out).
    pub fn pending(&self) -> usize {
        self.out.len()
    }

    /// Hand over the bytes written so far and continue with an empty buffer
    /// (for writers that stream the bundle out in pieces).
    pub fn take_output(&mut self) -> Vec<u8> {
        let capacity = self.out.capacity();
        std::mem::replace(self.out, Vec::with_capacity(capacity))
    }

    /// Close the bundle; returns what its entries took.
    pub fn finish(self) -> Written {
        self.out.push(END);
        self.written
    }
}
