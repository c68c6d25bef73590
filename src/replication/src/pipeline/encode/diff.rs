//! The diff encoder (`--diff`): a page whose previous version the backup
//! has (kept in `LastSent`) goes as the XOR of its changed 64-byte blocks
//! (`ftvm_vmm::pages::diff`), optionally LZ4-compressed; any other page,
//! and any page whose diff would not be smaller, goes through the base
//! encoder (whole), and is kept for next time.

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::diff::{self, BLOCK};
use ftvm_vmm::pages::{PageEncoder, PageTag};
use ftvm_vmm::PageBitmap;

use super::xor::Kernel;
use crate::pipeline::last_sent::LastSent;

/// Diffs shorter than this are not worth an LZ4 attempt.
const LZ4_MIN: usize = 2 * BLOCK;

pub struct DiffEncoder {
    kept: LastSent,
    kernel: Kernel,
    compress: bool,
    /// For pages sent whole.
    base: Box<dyn PageEncoder>,
    /// The changed blocks' XOR, then the diff body for compression.
    blocks: Box<[u8; PAGE]>,
    body: Vec<u8>,
    packed: Vec<u8>,
    /// Pages whose last encoding found nothing changed.
    unchanged: PageBitmap,
}

impl DiffEncoder {
    pub fn new(kept: LastSent, kernel: Kernel, compress: bool, base: Box<dyn PageEncoder>) -> DiffEncoder {
        let unchanged = PageBitmap::new(kept.ram_pages());
        DiffEncoder {
            unchanged,
            kept,
            kernel,
            compress,
            base,
            blocks: Box::new([0; PAGE]),
            body: Vec::with_capacity(PAGE),
            packed: vec![0; diff::compress_bound()],
        }
    }

    /// The diff of `new` against the kept `old` into `out`, bringing `old`
    /// up to `new`; None (nothing written or changed) when it would not be
    /// smaller than the page.
    fn diff(&mut self, page: u64, new: &[u8; PAGE], out: &mut Vec<u8>) -> Option<PageTag> {
        let (kernel, blocks) = (self.kernel, &mut self.blocks);
        let old = self.kept.get_mut(page)?;
        let mask = kernel.diff(old, new, blocks);
        if mask == 0 {
            self.unchanged.set(page);
        }
        let n = BLOCK * mask.count_ones() as usize;
        if diff::header_len(mask) + n >= PAGE {
            return None;
        }
        for b in (0..diff::BLOCKS).filter(|b| mask & 1 << b != 0) {
            old[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&new[b * BLOCK..(b + 1) * BLOCK]);
        }
        let body = if self.compress { &mut self.body } else { &mut *out };
        let at = body.len();
        diff::write_header(mask, body);
        body.extend_from_slice(&blocks[..n]);
        if !self.compress {
            return Some(PageTag::Diff);
        }
        let plain = &self.body[at..];
        if plain.len() >= LZ4_MIN {
            if let Some(packed) = diff::compress(plain, &mut self.packed) {
                out.extend_from_slice(&self.packed[..packed]);
                self.body.clear();
                return Some(PageTag::DiffLz4);
            }
        }
        out.extend_from_slice(plain);
        self.body.clear();
        Some(PageTag::Diff)
    }
}

impl PageEncoder for DiffEncoder {
    fn encode(&mut self, page: u64, data: &[u8], out: &mut Vec<u8>) -> PageTag {
        let new: &[u8; PAGE] = data[..PAGE].try_into().expect("one page");
        self.unchanged.unset(page);
        if let Some(tag) = self.diff(page, new, out) {
            return tag;
        }
        let tag = self.base.encode(page, data, out);
        self.kept.put(page).copy_from_slice(new);
        tag
    }

    fn reset(&mut self) {
        self.kept.clear();
        self.unchanged.clear();
        self.base.reset();
    }

    fn forget(&mut self, page: u64) {
        self.kept.forget(page);
        self.unchanged.unset(page);
        self.base.forget(page);
    }

    fn keeps(&self, page: u64) -> bool {
        self.kept.get(page).is_some()
    }

    fn unchanged(&self, page: u64) -> bool {
        self.unchanged.is_set(page)
    }

    fn compress(&mut self, on: bool) {
        self.compress = on;
    }
}

#[cfg(test)]
mod tests {
    use ftvm_vmm::memory::GuestRam;
    use ftvm_vmm::pages::{Bundle, BundleWriter, Cursor, RawEncoder};

    use super::*;

    use crate::pipeline::encode::xor::tests::Rng;

    const RAM_PAGES: u64 = 32;

    /// One epoch's change to `pages`: each page is left alone, has a few
    /// bytes changed, a few blocks rewritten, is rewritten whole or zeroed.
    fn mutate(pages: &mut [[u8; PAGE]], rng: &mut Rng) -> Vec<u64> {
        let mut dirty = Vec::new();
        for (p, page) in pages.iter_mut().enumerate() {
            match rng.next() % 6 {
                0 => continue,
                1 => {
                    for _ in 0..1 + rng.next() % 8 {
                        page[rng.next() as usize % PAGE] ^= 1 + (rng.next() % 255) as u8;
                    }
                }
                2 => {
                    for _ in 0..1 + rng.next() % 20 {
                        let at = rng.next() as usize % (PAGE - 100);
                        page[at..at + 100].iter_mut().for_each(|b| *b = rng.next() as u8);
                    }
                }
                3 => page.iter_mut().for_each(|b| *b = rng.next() as u8),
                4 => page.fill(0),
                _ => {} // marked dirty, unchanged
            }
            dirty.push(p as u64);
        }
        dirty
    }

    /// Epoch after epoch, the pages as the encoder sends them, applied to a
    /// replica, rebuild every page exactly, with every kernel, compressed
    /// or not, and with a store too small for all pages.
    #[test]
    fn diffs_rebuild_every_page_epoch_after_epoch() {
        for kernel in Kernel::available() {
            for compress in [false, true] {
                for capacity in [RAM_PAGES as usize, 5] {
                    let mut enc = DiffEncoder::new(LastSent::new(RAM_PAGES, capacity), kernel, compress, Box::new(RawEncoder));
                    let replica = GuestRam::new(RAM_PAGES * PAGE as u64, false).unwrap();
                    let mut pages = vec![[0u8; PAGE]; RAM_PAGES as usize];
                    let mut rng = Rng(0x1234_5678 + capacity as u64);
                    let mut tags = [0usize; 5];
                    let mut left_out = 0;
                    for epoch in 0..40 {
                        let dirty = mutate(&mut pages, &mut rng);
                        let mut out = Vec::new();
                        let mut w = BundleWriter::begin(&mut out, b"", &mut enc, false);
                        for &p in &dirty {
                            w.page(p, &pages[p as usize]);
                        }
                        let written = w.finish();
                        // Pages marked dirty but equal to the kept copy are left out.
                        assert!(written.pages <= dirty.len() as u64);
                        left_out += dirty.len() as u64 - written.pages;
                        let bundle = Bundle::parse(&mut Cursor::new(&out), RAM_PAGES).unwrap();
                        bundle.entries().for_each(|e| tags[e.tag as usize] += 1);
                        bundle.apply(&replica).unwrap();
                        let mut got = [0u8; PAGE];
                        for (p, want) in pages.iter().enumerate() {
                            replica.read_page(p as u64, &mut got).unwrap();
                            assert!(
                                got == *want,
                                "{} compress={compress} capacity={capacity}: page {p} after epoch {epoch}",
                                kernel.name()
                            );
                        }
                    }
                    assert!(tags[PageTag::Raw as usize] > 0 && tags[PageTag::Zero as usize] > 0, "whole pages");
                    if capacity == RAM_PAGES as usize {
                        assert!(left_out > 0, "unchanged pages were left out");
                        assert!(tags[PageTag::Diff as usize] > 0, "diffs were sent");
                        assert_eq!(compress, tags[PageTag::DiffLz4 as usize] > 0, "compressed diffs only when asked");
                    }
                }
            }
        }
    }

    #[test]
    fn a_reset_sends_every_page_whole_again() {
        let mut enc = DiffEncoder::new(LastSent::new(RAM_PAGES, 8), Kernel::best(), false, Box::new(RawEncoder));
        let mut out = Vec::new();
        let page = [7u8; PAGE];
        assert_eq!(enc.encode(1, &page, &mut out), PageTag::Raw);
        out.clear();
        assert_eq!(enc.encode(1, &page, &mut out), PageTag::Diff);
        assert_eq!(out, [0], "unchanged: an empty header");
        enc.reset();
        assert_eq!(enc.encode(1, &page, &mut out), PageTag::Raw);
    }

    #[test]
    fn a_page_changed_almost_everywhere_goes_whole() {
        let mut enc = DiffEncoder::new(LastSent::new(RAM_PAGES, 8), Kernel::best(), false, Box::new(RawEncoder));
        let mut out = Vec::new();
        let mut page = [1u8; PAGE];
        enc.encode(2, &page, &mut out);
        // 63 blocks changed: header 9 + 63 * 64 = 4041 bytes, still smaller.
        page.chunks_exact_mut(BLOCK).skip(1).for_each(|b| b[0] = 2);
        out.clear();
        assert_eq!(enc.encode(2, &page, &mut out), PageTag::Diff);
        assert_eq!(out.len(), 9 + 63 * BLOCK);
        // All 64: a diff would be longer than the page.
        page.iter_mut().for_each(|b| *b = 3);
        out.clear();
        assert_eq!(enc.encode(2, &page, &mut out), PageTag::Raw);
        out.clear();
        assert_eq!(enc.encode(2, &page, &mut out), PageTag::Diff, "and is kept whole");
    }
}
