//! What a capture hands on: copies of pages, each in a slot of one
//! buffer, read in page order, some of them perhaps dropped (not to be
//! sent).

use ftvm_vmm::memory::{AlignedPage, GuestRam, MemoryError, PAGE};
use ftvm_vmm::PageBitmap;

use super::huge::HugeBuffer;
use crate::error::ReplicationError;

/// Copies of pages, in ascending page order, some of them perhaps dropped.
#[derive(Default)]
pub struct Captured {
    /// The page in each slot: ascending, unless `append` added a second
    /// run of pages (then `order`).
    numbers: Vec<u64>,
    data: Store,
    /// Per slot: dropped by `retain`.
    dropped: Vec<bool>,
    kept: usize,
    /// The slots in page order once `numbers` holds more than one run
    /// (empty while slot order is page order).
    order: Vec<usize>,
}

/// Where the copies are.
enum Store {
    /// Grows once to the largest epoch and is reused: no zeroing per
    /// epoch. Page-aligned, as the pages copied into it.
    Heap(Vec<AlignedPage>),
    /// On huge pages, mapped at the first copy as `size` bytes.
    Huge { buffer: Option<HugeBuffer>, size: usize },
}

impl Default for Store {
    fn default() -> Store {
        Store::Heap(Vec::new())
    }
}

impl Store {
    fn as_slice(&self) -> &[u8] {
        match self {
            Store::Heap(v) => AlignedPage::bytes(v),
            Store::Huge { buffer, .. } => buffer.as_ref().map_or(&[], HugeBuffer::as_slice),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Store::Heap(v) => AlignedPage::bytes_mut(v),
            Store::Huge { buffer, .. } => buffer.as_mut().map_or(&mut [], HugeBuffer::as_mut_slice),
        }
    }

    /// At least `len` bytes, those held kept.
    fn reserve(&mut self, len: usize) -> Result<(), MemoryError> {
        match self {
            Store::Heap(v) if v.len() * PAGE < len => v.resize(len.div_ceil(PAGE), AlignedPage::ZERO),
            Store::Heap(_) => {}
            Store::Huge { buffer: buffer @ None, size } => *buffer = Some(HugeBuffer::map(len.max(*size))?),
            // Mapped as large as every page there is: more is a page counted twice.
            Store::Huge { buffer: Some(b), .. } if b.as_slice().len() < len => {
                return Err(MemoryError::OutOfRange { page: (len / PAGE) as u64 });
            }
            Store::Huge { .. } => {}
        }
        Ok(())
    }
}

impl Captured {
    /// Copies kept on huge pages (`huge`), in a buffer of `size` bytes
    /// mapped at the first copy.
    pub(super) fn on_huge_pages(size: usize) -> Captured {
        Captured { data: Store::Huge { buffer: None, size }, ..Captured::default() }
    }

    /// Pages to send.
    pub fn len(&self) -> usize {
        self.kept
    }

    pub fn is_empty(&self) -> bool {
        self.kept == 0
    }

    /// The slots in page order.
    fn in_order(&self) -> impl Iterator<Item = usize> + '_ {
        let plain = if self.order.is_empty() { self.numbers.len() } else { 0 };
        (0..plain).chain(self.order.iter().copied())
    }

    fn slot(&self, slot: usize) -> &[u8] {
        &self.data.as_slice()[slot * PAGE..(slot + 1) * PAGE]
    }

    /// The pages to send.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &[u8])> {
        self.in_order().filter(move |&s| !self.dropped[s]).map(move |s| (self.numbers[s], self.slot(s)))
    }

    /// The copy of `page`, unless it was not captured or was dropped.
    pub fn page(&self, page: u64) -> Option<&[u8]> {
        let slot = if self.order.is_empty() {
            self.numbers.binary_search(&page).ok()?
        } else {
            self.order[self.order.binary_search_by_key(&page, |&s| self.numbers[s]).ok()?]
        };
        (!self.dropped[slot]).then(|| self.slot(slot))
    }

    /// Drop the pages for which `keep` says false.
    pub fn retain(&mut self, mut keep: impl FnMut(u64, &[u8]) -> bool) {
        let data = self.data.as_slice();
        for i in 0..self.numbers.len() {
            let s = if self.order.is_empty() { i } else { self.order[i] };
            if !self.dropped[s] && !keep(self.numbers[s], &data[s * PAGE..(s + 1) * PAGE]) {
                self.dropped[s] = true;
                self.kept -= 1;
            }
        }
    }

    /// Copies of the given pages (ascending), for tests of later stages.
    #[cfg(test)]
    pub fn from_pages(pages: &[(u64, &[u8])]) -> Captured {
        Captured {
            numbers: pages.iter().map(|(p, _)| *p).collect(),
            data: Store::Heap(pages.iter().map(|(_, d)| AlignedPage(d[..PAGE].try_into().expect("one page"))).collect()),
            dropped: vec![false; pages.len()],
            kept: pages.len(),
            order: Vec::new(),
        }
    }

    /// Hold nothing (the buffer stays).
    pub(super) fn clear(&mut self) {
        self.numbers.clear();
        self.dropped.clear();
        self.kept = 0;
        self.order.clear();
    }

    /// Make room for copies of `pages` (contents unspecified until filled).
    pub(super) fn prepare(&mut self, pages: &PageBitmap) -> Result<(), ReplicationError> {
        self.clear();
        self.append(pages).map(|_| ())
    }

    /// Room for copies of `pages` too, none of them held already (contents
    /// unspecified until filled): their numbers and their slots, to fill.
    pub(super) fn append(&mut self, pages: &PageBitmap) -> Result<(&[u64], &mut [u8]), ReplicationError> {
        let first = self.numbers.len();
        self.numbers.extend(pages.pages());
        let added = self.numbers.len() - first;
        self.dropped.resize(self.numbers.len(), false);
        self.kept += added;
        if let Err(e) = self.data.reserve(self.numbers.len() * PAGE) {
            self.numbers.truncate(first);
            self.dropped.truncate(first);
            self.kept -= added;
            return Err(ftvm_vmm::VmError::from(e).into());
        }
        if first > 0 && added > 0 {
            // A second run: page order is no longer slot order.
            self.order.clear();
            self.order.extend(0..self.numbers.len());
            let numbers = &self.numbers;
            self.order.sort_unstable_by_key(|&s| numbers[s]);
        }
        Ok((&self.numbers[first..], &mut self.data.as_mut_slice()[first * PAGE..(first + added) * PAGE]))
    }

    /// The page in each slot.
    pub(super) fn numbers(&self) -> &[u64] {
        &self.numbers
    }

    /// Where slot `i` (page `numbers()[i]`) starts, for threads filling the
    /// slots concurrently.
    pub(super) fn slots_mut(&mut self) -> *mut u8 {
        self.data.as_mut_slice().as_mut_ptr()
    }

    /// Copy `pages` of `vm`'s RAM now, after those held.
    pub(super) fn copy_more(&mut self, vm: &ftvm_vmm::Vm, pages: &PageBitmap) -> Result<(), ReplicationError> {
        let (numbers, slots) = self.append(pages)?;
        copy_into(vm.ram(), numbers, slots).map_err(ftvm_vmm::VmError::from)?;
        Ok(())
    }
}

/// Copy `pages` of `ram` into `out`, a page each (`GuestRam::read_page`).
pub(super) fn copy_into(ram: &GuestRam, pages: &[u64], out: &mut [u8]) -> Result<(), MemoryError> {
    pages.iter().zip(out.chunks_exact_mut(PAGE)).try_for_each(|(&page, o)| ram.read_page(page, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bitmap(pages: &[u64]) -> PageBitmap {
        let mut b = PageBitmap::new(64);
        for &p in pages {
            b.set(p);
        }
        b
    }

    fn fill(c: &mut Captured, pages: &[u64]) {
        let (numbers, slots) = c.append(&bitmap(pages)).unwrap();
        for (&p, s) in numbers.iter().zip(slots.chunks_exact_mut(PAGE)) {
            s.fill(p as u8);
        }
    }

    /// A second run of pages interleaves with the first: read in page
    /// order all the same, found by number, dropped as one.
    #[test]
    fn a_second_run_reads_in_page_order() {
        for mut c in [Captured::default(), Captured::on_huge_pages(64 * PAGE)] {
            fill(&mut c, &[3, 9, 20]);
            fill(&mut c, &[1, 10, 30]);
            let order: Vec<u64> = c
                .iter()
                .map(|(p, d)| {
                    assert!(d.iter().all(|&b| b == p as u8));
                    p
                })
                .collect();
            assert_eq!(order, [1, 3, 9, 10, 20, 30]);
            assert_eq!(c.page(10).unwrap()[0], 10);
            assert!(c.page(11).is_none());
            c.retain(|p, _| p != 9);
            assert_eq!(c.len(), 5);
            assert!(c.page(9).is_none());
            // Starting over forgets both runs.
            c.prepare(&bitmap(&[5])).unwrap();
            assert_eq!(c.len(), 1);
            assert!(c.page(10).is_none());
            assert_eq!(c.iter().map(|(p, _)| p).collect::<Vec<_>>(), [5]);
        }
    }

    #[test]
    fn huge_pages_hold_at_most_their_size() {
        let mut c = Captured::on_huge_pages(2 * PAGE);
        fill(&mut c, &[1, 2]);
        assert!(c.append(&bitmap(&[3])).is_err());
        assert_eq!(c.len(), 2, "a refused run leaves what was held");
    }
}
