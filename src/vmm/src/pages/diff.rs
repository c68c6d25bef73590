//! Sub-page diffs: the body of a `Diff` entry is the XOR of a page with the
//! version of it the reader already has, for the 64-byte blocks that
//! differ, behind a two-level header (after LLVFT):
//!
//! ```text
//! diff   := l1 u8 | l2 u8 * popcount(l1) | block [64] * popcount(l2...)
//! ```
//!
//! Bit `c` of `l1` says that chunk `c` (512 bytes, 8 blocks) has changed
//! blocks; each chunk with its bit set has one `l2` byte whose bit `b` says
//! block `8c + b` changed; the changed blocks follow in page order, each as
//! `old ^ new`. An unchanged page is the single byte 0. A `DiffLz4` body is
//! such a diff compressed as one LZ4 block (XOR leaves zeros wherever a
//! changed block kept its bytes, which LZ4 squeezes out).
//!
//! Diffs are never longer than a page (the writer sends a raw page instead),
//! so a bundle's bound does not change.

use super::FormatError;
use crate::memory::PAGE;

/// The unit of a diff: a 512-bit SIMD register.
pub const BLOCK: usize = 64;
/// Blocks in a page: one bit each in a `u64` mask.
pub const BLOCKS: usize = PAGE / BLOCK;
/// The longest header: `l1` and eight `l2` bytes.
pub const MAX_HEADER: usize = 1 + 8;

/// The header of a diff whose changed blocks are the set bits of `mask`.
pub fn write_header(mask: u64, out: &mut Vec<u8>) {
    let l1 = (0..8).fold(0u8, |l1, c| if (mask >> (8 * c)) as u8 != 0 { l1 | 1 << c } else { l1 });
    out.push(l1);
    for c in 0..8 {
        let l2 = (mask >> (8 * c)) as u8;
        if l2 != 0 {
            out.push(l2);
        }
    }
}

/// Bytes of the header for `mask`.
pub fn header_len(mask: u64) -> usize {
    1 + (0..8).filter(|c| (mask >> (8 * c)) as u8 != 0).count()
}

/// A diff's body checked: its block mask and where the blocks start.
/// Anything but a well-formed diff of at most one page is corruption (an
/// `l2` byte of 0, a length that is not the blocks the header names).
pub fn parse(body: &[u8]) -> Result<(u64, usize), FormatError> {
    let corrupt = |what: &str| FormatError::Corrupt(format!("diff: {what}"));
    let (&l1, rest) = body.split_first().ok_or_else(|| corrupt("no header"))?;
    let chunks = l1.count_ones() as usize;
    let l2 = rest.get(..chunks).ok_or_else(|| corrupt("header cut short"))?;
    let mut mask = 0u64;
    let mut next = l2.iter();
    for c in (0..8).filter(|c| l1 & 1 << c != 0) {
        let byte = *next.next().expect("one l2 byte per chunk");
        if byte == 0 {
            return Err(corrupt("a chunk marked changed has no changed block"));
        }
        mask |= u64::from(byte) << (8 * c);
    }
    let start = 1 + chunks;
    let want = start + BLOCK * mask.count_ones() as usize;
    if body.len() != want || want > PAGE {
        return Err(corrupt(&format!("{} bytes for a header naming {} blocks", body.len(), mask.count_ones())));
    }
    Ok((mask, start))
}

/// XOR the blocks of a checked diff into `page`, which holds the version it
/// was made against; afterwards `page` holds the new version.
pub fn apply(page: &mut [u8], mask: u64, blocks: &[u8]) {
    let mut from = blocks.chunks_exact(BLOCK);
    for b in (0..BLOCKS).filter(|b| mask & 1 << b != 0) {
        let delta = from.next().expect("the header was checked against the length");
        for (byte, d) in page[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(delta) {
            *byte ^= d;
        }
    }
}

/// Room `compress` needs for a diff of up to one page.
pub fn compress_bound() -> usize {
    lz4_flex::block::get_maximum_output_size(PAGE)
}

/// Compress a diff body into `out` (`compress_bound` long) as the body of a
/// `DiffLz4` entry; its length, if smaller than `plain`.
pub fn compress(plain: &[u8], out: &mut [u8]) -> Option<usize> {
    lz4_flex::block::compress_into(plain, out).ok().filter(|&n| n < plain.len())
}

/// Decompress a `DiffLz4` body into `out` (one page long) and check the
/// diff it holds; returns its length in `out`.
pub fn decompress(body: &[u8], out: &mut [u8]) -> Result<usize, FormatError> {
    let n = lz4_flex::block::decompress_into(body, &mut out[..PAGE]).map_err(|e| FormatError::Corrupt(format!("compressed diff: {e}")))?;
    parse(&out[..n])?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_for_every_chunk_pattern() {
        for l1 in 0..=255u64 {
            // A different block pattern in each chunk that is present.
            let mask = (0..8).filter(|c| l1 & 1 << c != 0).fold(0u64, |m, c| m | ((c as u64 * 37 + 1) % 255 + 1) << (8 * c));
            let mut body = Vec::new();
            write_header(mask, &mut body);
            assert_eq!(body.len(), header_len(mask));
            body.resize(body.len() + BLOCK * mask.count_ones() as usize, 0xee);
            assert_eq!(parse(&body).unwrap(), (mask, header_len(mask)), "mask {mask:#x}");
        }
    }

    #[test]
    fn malformed_diffs_are_corrupt() {
        let full = {
            let mut b = Vec::new();
            write_header(u64::MAX, &mut b);
            b.resize(b.len() + PAGE, 1);
            b
        };
        for (what, body) in [
            ("empty", vec![]),
            ("l2 missing", vec![0b1]),
            ("l2 of zero", vec![0b1, 0]),
            ("block missing", vec![0b1, 0b1]),
            ("block too long", [vec![0b1, 0b1], vec![0; BLOCK + 1]].concat()),
            ("longer than a page", full),
        ] {
            assert!(matches!(parse(&body), Err(FormatError::Corrupt(_))), "{what}");
        }
    }

    #[test]
    fn unchanged_is_one_byte() {
        assert_eq!(parse(&[0]).unwrap(), (0, 1));
        let mut page = vec![5u8; PAGE];
        apply(&mut page, 0, &[]);
        assert!(page.iter().all(|&b| b == 5));
    }

    #[test]
    fn compressed_diffs_are_checked_after_decompression() {
        let mut out = vec![0u8; PAGE];
        let good = [vec![0b10, 0b1000_0001], vec![0u8; 2 * BLOCK]].concat();
        let mut packed = vec![0u8; compress_bound()];
        let n = compress(&good, &mut packed).expect("zeros compress");
        let packed = &packed[..n];
        assert_eq!(decompress(packed, &mut out).unwrap(), good.len());
        assert_eq!(&out[..good.len()], &good[..]);
        let bad = lz4_flex::block::compress(&good[..good.len() - 1]);
        assert!(decompress(&bad, &mut out).is_err(), "a diff cut short inside valid LZ4");
        assert!(decompress(&packed[..packed.len() - 1], &mut out).is_err(), "LZ4 cut short");
        let too_long = lz4_flex::block::compress(&vec![0u8; PAGE + 1]);
        assert!(decompress(&too_long, &mut out).is_err(), "more than a page");
    }
}
