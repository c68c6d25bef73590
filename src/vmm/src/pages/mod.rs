//! The one encoding of "state plus a set of pages": snapshot files,
//! pre-copy rounds and checkpoints all carry guest memory this way.
//!
//! ```text
//! bundle := state_len u64 | state | entry* | end
//! entry  := tag u8 | page u64 | body_len u32 | body
//! end    := tag u8 0
//! ```
//! (little-endian). The tag says how the body encodes the page, per page,
//! so encodings mix inside one bundle: a zero page has no body, a raw page
//! is its 4096 bytes, a diff is the XOR of the changed 64-byte blocks
//! against the version the reader has (`diff`), plain or LZ4-compressed.
//! Readers check every entry (known tag, page inside guest RAM, a body that
//! decodes as its tag says) before anything is applied.

mod decode;
pub mod diff;
mod encode;

pub use decode::{read_bundle, Bundle, Entry};
pub use encode::{is_zero, BundleWriter, PageEncoder, RawEncoder, Written};

use crate::memory::PAGE;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("data ends in the middle of a bundle")]
    Truncated,
    #[error("{0}")]
    Corrupt(String),
    #[error("I/O error: {0}")]
    Io(std::io::Error),
}

/// How an entry's body encodes its page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PageTag {
    /// The page is all zeros; no body.
    Zero = 1,
    /// The body is the page.
    Raw = 2,
    /// The body is a diff against the reader's version of the page (`diff`).
    Diff = 3,
    /// The body is a diff compressed as one LZ4 block.
    DiffLz4 = 4,
}

const END: u8 = 0;
const ENTRY_HEADER: usize = 1 + 8 + 4;

impl PageTag {
    fn from_u8(v: u8) -> Option<PageTag> {
        match v {
            1 => Some(PageTag::Zero),
            2 => Some(PageTag::Raw),
            3 => Some(PageTag::Diff),
            4 => Some(PageTag::DiffLz4),
            _ => None,
        }
    }

    /// Whether a body of `len` bytes can be of this tag (checked before
    /// the body is read).
    fn body_fits(self, len: usize) -> bool {
        match self {
            PageTag::Zero => len == 0,
            PageTag::Raw => len == PAGE,
            PageTag::Diff | PageTag::DiffLz4 => (1..=PAGE).contains(&len),
        }
    }

    /// Whether `body` decodes as this tag says (after `body_fits`).
    fn check_body(self, page: u64, body: &[u8]) -> Result<(), FormatError> {
        let in_page = |e: FormatError| match e {
            FormatError::Corrupt(what) => FormatError::Corrupt(format!("page {page}: {what}")),
            other => other,
        };
        match self {
            PageTag::Zero | PageTag::Raw => Ok(()),
            PageTag::Diff => diff::parse(body).map(drop).map_err(in_page),
            PageTag::DiffLz4 => diff::decompress(body, &mut [0u8; PAGE]).map(drop).map_err(in_page),
        }
    }
}

/// The most bytes a bundle takes whose state is at most `state_len` bytes
/// and which holds at most `pages` pages, each once: the state with its
/// length, every entry's header with a whole page of body (no tag's body is
/// longer, `check_entry` enforces it) and the end tag.
pub fn max_bundle_len(state_len: u64, pages: u64) -> u64 {
    8 + state_len + pages * (ENTRY_HEADER + PAGE) as u64 + 1
}

/// An entry header, checked against a guest RAM of `ram_pages` pages.
fn check_entry(raw_tag: u8, page: u64, len: u32, ram_pages: u64) -> Result<PageTag, FormatError> {
    let tag = PageTag::from_u8(raw_tag).ok_or_else(|| FormatError::Corrupt(format!("unknown page encoding {raw_tag}")))?;
    if page >= ram_pages {
        return Err(FormatError::Corrupt(format!("page {page} is beyond guest RAM ({ram_pages} pages)")));
    }
    if !tag.body_fits(len as usize) {
        return Err(FormatError::Corrupt(format!("page {page}: a {tag:?} body of {len} bytes")));
    }
    Ok(tag)
}

/// Bounds-checked reads from a byte string that arrived whole (a verified
/// frame): running short is corruption, not truncation.
pub struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8]) -> Cursor<'a> {
        Cursor { bytes, at: 0 }
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| FormatError::Corrupt("message shorter than its contents".into()))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    pub fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.bytes[self.at..];
        self.at = self.bytes.len();
        s
    }

    pub fn is_empty(&self) -> bool {
        self.at == self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GuestRam;

    const RAM_PAGES: u64 = 64;

    fn page(fill: u8) -> Vec<u8> {
        vec![fill; PAGE]
    }

    /// A bundle with state "st" and pages 3 (raw), 5 (zero), 9 (raw).
    fn sample() -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = RawEncoder;
        let mut w = BundleWriter::begin(&mut out, b"st", &mut enc, false);
        w.page(3, &page(7));
        w.page(5, &page(0));
        w.page(9, &page(1));
        assert_eq!(w.finish().pages, 3);
        out
    }

    #[test]
    fn the_largest_bundle_is_within_its_bound() {
        let mut out = Vec::new();
        let mut enc = RawEncoder;
        let mut w = BundleWriter::begin(&mut out, b"state", &mut enc, false);
        for p in 0..RAM_PAGES {
            w.page(p, &page(p as u8 + 1));
        }
        w.finish();
        assert_eq!(out.len() as u64, max_bundle_len(5, RAM_PAGES), "every page raw is the worst case, exactly");
    }

    #[test]
    fn bundles_round_trip_with_mixed_encodings() {
        let bytes = sample();
        let mut c = Cursor::new(&bytes);
        let b = Bundle::parse(&mut c, RAM_PAGES).unwrap();
        assert!(c.is_empty());
        assert_eq!(b.state, b"st");
        let entries: Vec<_> = b.entries().map(|e| (e.page, e.tag, e.body.len())).collect();
        assert_eq!(entries, vec![(3, PageTag::Raw, PAGE), (5, PageTag::Zero, 0), (9, PageTag::Raw, PAGE)]);

        let ram = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
        ram.write_page(5, &page(0xee)).unwrap();
        b.apply(&ram).unwrap();
        let mut got = page(0);
        for (p, fill) in [(3, 7), (5, 0), (9, 1), (4, 0)] {
            ram.read_page(p, &mut got).unwrap();
            assert_eq!(got, page(fill), "page {p}");
        }

        let streamed = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
        assert_eq!(read_bundle(&mut &bytes[..], &streamed, 100).unwrap(), b"st");
        streamed.read_page(9, &mut got).unwrap();
        assert_eq!(got, page(1));
    }

    #[test]
    fn zero_pages_are_left_out_for_a_fresh_reader() {
        let mut out = Vec::new();
        let mut enc = RawEncoder;
        let mut w = BundleWriter::begin(&mut out, b"", &mut enc, true);
        w.page(1, &page(0));
        w.page(2, &page(2));
        assert_eq!(w.finish().pages, 1);
        assert_eq!(Bundle::parse(&mut Cursor::new(&out), RAM_PAGES).unwrap().len(), 1);
    }

    #[test]
    fn what_follows_a_bundle_stays_with_the_caller() {
        let mut bytes = sample();
        bytes.extend_from_slice(b"tail");
        let mut c = Cursor::new(&bytes);
        Bundle::parse(&mut c, RAM_PAGES).unwrap();
        assert_eq!(c.rest(), b"tail");
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        let ram = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
        for cut in 0..bytes.len() {
            assert!(Bundle::parse(&mut Cursor::new(&bytes[..cut]), RAM_PAGES).is_err(), "cut at {cut}");
            assert!(matches!(read_bundle(&mut &bytes[..cut], &ram, 100), Err(FormatError::Truncated)), "streamed cut at {cut}");
        }
    }

    #[test]
    fn bad_entries_are_rejected_before_anything_is_applied() {
        let bytes = sample();
        let first_entry = 8 + 2;
        let mut beyond = bytes.clone();
        beyond[first_entry + 1..first_entry + 9].copy_from_slice(&RAM_PAGES.to_le_bytes());
        let mut unknown = bytes.clone();
        unknown[first_entry] = 0x7f;
        let mut short_body = bytes.clone();
        short_body[first_entry + 9..first_entry + 13].copy_from_slice(&100u32.to_le_bytes());
        for (what, bad) in [("page beyond RAM", beyond), ("unknown tag", unknown), ("raw body of 100 bytes", short_body)] {
            let r = Bundle::parse(&mut Cursor::new(&bad), RAM_PAGES);
            assert!(matches!(r, Err(FormatError::Corrupt(_))), "{what}: {r:?}");
            let ram = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
            assert!(read_bundle(&mut &bad[..], &ram, 100).is_err(), "{what} streamed");
        }
    }

    /// An encoder that sends the entries it is given, as they are.
    struct Given(Vec<(PageTag, Vec<u8>)>);

    impl PageEncoder for Given {
        fn encode(&mut self, _page: u64, _data: &[u8], out: &mut Vec<u8>) -> PageTag {
            let (tag, body) = self.0.remove(0);
            out.extend_from_slice(&body);
            tag
        }
    }

    fn bundle_of(entries: Vec<(u64, PageTag, Vec<u8>)>) -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = Given(entries.iter().map(|(_, t, b)| (*t, b.clone())).collect());
        let mut w = BundleWriter::begin(&mut out, b"", &mut enc, false);
        for (p, _, _) in &entries {
            w.page(*p, &page(0));
        }
        w.finish();
        out
    }

    #[test]
    fn diffs_apply_onto_what_the_reader_has_and_bad_ones_are_refused() {
        // Page 4 changes in block 1 (byte 64) and block 63; page 6 in block 8.
        let mut d4 = Vec::new();
        diff::write_header(1 << 1 | 1 << 63, &mut d4);
        d4.extend([vec![0u8; 64], vec![0xff; 64]].concat());
        d4[diff::header_len(1 << 1 | 1 << 63)] = 0x0f;
        let mut d6 = Vec::new();
        diff::write_header(1 << 8, &mut d6);
        d6.extend(vec![0x01; 64]);
        let mut packed = vec![0u8; diff::compress_bound()];
        let n = diff::compress(&d6, &mut packed).unwrap();
        for (tag6, body6) in [(PageTag::Diff, d6.clone()), (PageTag::DiffLz4, packed[..n].to_vec())] {
            let bytes = bundle_of(vec![(4, PageTag::Diff, d4.clone()), (6, tag6, body6), (7, PageTag::Diff, vec![0])]);
            let ram = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
            for p in [4, 6, 7] {
                ram.write_page(p, &page(0x10)).unwrap();
            }
            Bundle::parse(&mut Cursor::new(&bytes), RAM_PAGES).unwrap().apply(&ram).unwrap();
            let mut got = page(0);
            ram.read_page(4, &mut got).unwrap();
            let mut want = page(0x10);
            want[64] ^= 0x0f;
            want[PAGE - 64..].iter_mut().for_each(|b| *b ^= 0xff);
            assert_eq!(got, want);
            ram.read_page(6, &mut got).unwrap();
            let mut want = page(0x10);
            want[512..576].iter_mut().for_each(|b| *b ^= 1);
            assert_eq!(got, want, "{tag6:?}");
            ram.read_page(7, &mut got).unwrap();
            assert_eq!(got, page(0x10), "an empty diff changes nothing");
            let streamed = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
            read_bundle(&mut &bytes[..], &streamed, 100).unwrap();
        }
        let mut long = Vec::new();
        diff::write_header(u64::MAX >> 1, &mut long);
        long.resize(long.len() + 63 * 64, 1);
        for (what, tag, body) in [
            ("a header naming more blocks than the body has", PageTag::Diff, d4[..d4.len() - 1].to_vec()),
            ("a chunk without blocks", PageTag::Diff, vec![1, 0]),
            ("an empty body", PageTag::Diff, vec![]),
            ("a body longer than a page", PageTag::Diff, [long.clone(), vec![0; 64]].concat()),
            ("not LZ4", PageTag::DiffLz4, vec![0xff; 10]),
        ] {
            let bytes = bundle_of(vec![(4, PageTag::Raw, page(9)), (6, tag, body)]);
            let r = Bundle::parse(&mut Cursor::new(&bytes), RAM_PAGES);
            assert!(matches!(r, Err(FormatError::Corrupt(_))), "{what}: {r:?}");
            let ram = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
            assert!(read_bundle(&mut &bytes[..], &ram, 100).is_err(), "{what} streamed");
        }
    }

    #[test]
    fn zero_check() {
        assert!(is_zero(&page(0)));
        let mut p = page(0);
        p[PAGE - 1] = 1;
        assert!(!is_zero(&p));
        assert!(!is_zero(&p[1..]), "unaligned views are checked too");
    }
}
