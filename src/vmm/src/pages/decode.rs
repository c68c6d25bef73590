//! Reading bundles: from a verified frame in memory, or streamed from a file.

use std::io::Read;

use super::{check_entry, diff, Cursor, FormatError, PageTag, END, ENTRY_HEADER};
use crate::memory::{GuestRam, MemoryError, PAGE};

/// One page of a bundle.
#[derive(Clone, Copy, Debug)]
pub struct Entry<'a> {
    pub page: u64,
    pub tag: PageTag,
    pub body: &'a [u8],
}

/// What a `Zero` entry stands for.
static ZERO_PAGE: [u8; PAGE] = [0; PAGE];

impl<'a> Entry<'a> {
    /// The page's contents if the entry carries them whole (`Raw`, or
    /// `Zero`: a page of zeros); a diff needs the reader's page.
    pub fn whole(&self) -> Option<&'a [u8]> {
        match self.tag {
            PageTag::Zero => Some(&ZERO_PAGE[..]),
            PageTag::Raw => Some(self.body),
            PageTag::Diff | PageTag::DiffLz4 => None,
        }
    }

    /// Write the page into `ram`; a diff goes onto the version `ram` holds.
    /// The entry was checked (`Bundle::parse`, `read_bundle`): only a page
    /// outside `ram` can fail.
    pub fn apply(&self, ram: &GuestRam) -> Result<(), MemoryError> {
        match self.tag {
            PageTag::Zero => ram.write_page(self.page, &[0u8; PAGE]),
            PageTag::Raw => ram.write_page(self.page, self.body),
            PageTag::Diff => Self::apply_diff(ram, self.page, self.body),
            PageTag::DiffLz4 => {
                let mut plain = [0u8; PAGE];
                let n = diff::decompress(self.body, &mut plain).expect("checked when the bundle was read");
                Self::apply_diff(ram, self.page, &plain[..n])
            }
        }
    }

    fn apply_diff(ram: &GuestRam, page: u64, body: &[u8]) -> Result<(), MemoryError> {
        let (mask, start) = diff::parse(body).expect("checked when the bundle was read");
        if mask == 0 {
            return Ok(());
        }
        let mut data = [0u8; PAGE];
        ram.read_page(page, &mut data)?;
        diff::apply(&mut data, mask, &body[start..]);
        ram.write_page(page, &data)
    }
}

/// A bundle parsed from bytes, every entry checked, nothing applied yet.
#[derive(Debug)]
pub struct Bundle<'a> {
    pub state: &'a [u8],
    entries: &'a [u8],
    count: u64,
}

impl<'a> Bundle<'a> {
    /// Parse the bundle at the cursor for a guest RAM of `ram_pages` pages.
    pub fn parse(c: &mut Cursor<'a>, ram_pages: u64) -> Result<Bundle<'a>, FormatError> {
        let state_len = c.u64()?;
        let state = c.take(usize::try_from(state_len).map_err(|_| FormatError::Corrupt("state length".into()))?)?;
        let mut entries = Cursor::new(c.rest());
        let mut count = 0;
        let mut used = 0;
        loop {
            let tag = entries.u8()?;
            if tag == END {
                used += 1;
                break;
            }
            let (page, len) = (entries.u64()?, entries.u32()?);
            let tag = check_entry(tag, page, len, ram_pages)?;
            tag.check_body(page, entries.take(len as usize)?)?;
            used += ENTRY_HEADER + len as usize;
            count += 1;
        }
        // Hand back what follows the bundle to the caller's cursor.
        let all = entries.bytes;
        *c = Cursor::new(&all[used..]);
        Ok(Bundle { state, entries: &all[..used - 1], count })
    }

    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The entries (already checked by `parse`).
    pub fn entries(&self) -> impl Iterator<Item = Entry<'a>> + 'a {
        let mut c = Cursor::new(self.entries);
        std::iter::from_fn(move || {
            if c.is_empty() {
                return None;
            }
            let tag = PageTag::from_u8(c.u8().ok()?)?;
            let page = c.u64().ok()?;
            let len = c.u32().ok()?;
            Some(Entry { page, tag, body: c.take(len as usize).ok()? })
        })
    }

    /// Write every page into `ram`.
    pub fn apply(&self, ram: &GuestRam) -> Result<(), MemoryError> {
        self.entries().try_for_each(|e| e.apply(ram))
    }
}

fn read_exact(r: &mut impl Read, buf: &mut [u8]) -> Result<(), FormatError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FormatError::Truncated,
        _ => FormatError::Io(e),
    })
}

/// Read a bundle from a stream straight into `ram` (a fresh VM that is
/// discarded if this fails); returns the state. States longer than
/// `state_limit` are corruption.
pub fn read_bundle(r: &mut impl Read, ram: &GuestRam, state_limit: u64) -> Result<Vec<u8>, FormatError> {
    let mut word = [0u8; 8];
    read_exact(r, &mut word)?;
    let state_len = u64::from_le_bytes(word);
    if state_len > state_limit {
        return Err(FormatError::Corrupt(format!("state of {state_len} bytes")));
    }
    let mut state = vec![0u8; state_len as usize];
    read_exact(r, &mut state)?;
    let mut header = [0u8; ENTRY_HEADER];
    let mut body = vec![0u8; PAGE];
    loop {
        read_exact(r, &mut header[..1])?;
        if header[0] == END {
            return Ok(state);
        }
        read_exact(r, &mut header[1..])?;
        let page = u64::from_le_bytes(header[1..9].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(header[9..].try_into().expect("4 bytes"));
        let tag = check_entry(header[0], page, len, ram.pages())?;
        read_exact(r, &mut body[..len as usize])?;
        tag.check_body(page, &body[..len as usize])?;
        Entry { page, tag, body: &body[..len as usize] }.apply(ram).map_err(|e| FormatError::Corrupt(e.to_string()))?;
    }
}
