//! The root file system image: host files the VMM packs into guest memory
//! (memory map region [`crate::mem_kind::ROOTFS`]) for the Linux
//! personality to serve read-only, so that dynamically linked programs
//! find their interpreter and libraries without a disk driver or a file
//! system format on a block device.
//!
//! Layout (little-endian): a [`HEADER_SIZE`]-byte header, `count` entries
//! of [`ENTRY_SIZE`] bytes, then the path strings and the file contents
//! (each file's data page-aligned, so a later loader could map it in
//! place). Paths are absolute and normalised (`/usr/bin/redis-server`); a
//! directory comes before everything in it. The header also names the
//! program to run (`exec`), a path in the image.
//!
//! Only the reader lives here (`no_std`, shared by the guest and the VMM's
//! tests); the VMM writes images.

pub const MAGIC: u64 = u64::from_le_bytes(*b"FTVMROOT");
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 32;
pub const ENTRY_SIZE: usize = 32;

pub const KIND_DIR: u32 = 1;
pub const KIND_FILE: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// Too short, wrong magic, or another version.
    Header,
    /// An entry or string lies outside the image.
    Bounds,
    /// A path that is not absolute UTF-8, or an unknown kind.
    Entry,
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Error::Header => "not a root file system image of this version",
            Error::Bounds => "an entry lies outside the image",
            Error::Entry => "an entry has a bad path or kind",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
}

/// One directory or file of the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry<'a> {
    pub path: &'a str,
    pub kind: Kind,
    /// Permission bits (`0o755`).
    pub mode: u32,
    /// The file's contents (empty for a directory).
    pub data: &'a [u8],
}

/// A checked image.
#[derive(Clone, Copy, Debug)]
pub struct Archive<'a> {
    bytes: &'a [u8],
    count: usize,
    exec: &'a str,
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from(u32_at(b, off)) | (u64::from(u32_at(b, off + 4)) << 32)
}

fn str_at(bytes: &[u8], off: u64, len: u64) -> Result<&str, Error> {
    let end = off.checked_add(len).ok_or(Error::Bounds)?;
    let b = bytes.get(off as usize..end as usize).ok_or(Error::Bounds)?;
    core::str::from_utf8(b).map_err(|_| Error::Entry)
}

impl<'a> Archive<'a> {
    /// Check the header and every entry of `bytes`.
    pub fn parse(bytes: &'a [u8]) -> Result<Archive<'a>, Error> {
        if bytes.len() < HEADER_SIZE || u64_at(bytes, 0) != MAGIC || u32_at(bytes, 8) != VERSION {
            return Err(Error::Header);
        }
        let count = u32_at(bytes, 12) as usize;
        let exec = str_at(bytes, u32_at(bytes, 16).into(), u32_at(bytes, 20).into())?;
        if count.checked_mul(ENTRY_SIZE).and_then(|n| n.checked_add(HEADER_SIZE)).is_none_or(|end| end > bytes.len()) {
            return Err(Error::Bounds);
        }
        let archive = Archive { bytes, count, exec };
        for i in 0..count {
            archive.read_entry(i)?;
        }
        Ok(archive)
    }

    /// The program to run: a path in the image (may be empty).
    pub fn exec(&self) -> &'a str {
        self.exec
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn read_entry(&self, i: usize) -> Result<Entry<'a>, Error> {
        let e = &self.bytes[HEADER_SIZE + i * ENTRY_SIZE..][..ENTRY_SIZE];
        let path = str_at(self.bytes, u32_at(e, 0).into(), u32_at(e, 4).into())?;
        if !path.starts_with('/') {
            return Err(Error::Entry);
        }
        let kind = match u32_at(e, 8) {
            KIND_DIR => Kind::Dir,
            KIND_FILE => Kind::File,
            _ => return Err(Error::Entry),
        };
        let (off, size) = (u64_at(e, 16), u64_at(e, 24));
        let end = off.checked_add(size).ok_or(Error::Bounds)?;
        let data = self.bytes.get(off as usize..end as usize).ok_or(Error::Bounds)?;
        Ok(Entry { path, kind, mode: u32_at(e, 12) & 0o7777, data })
    }

    /// The `i`th entry (`i < len()`; checked by [`Archive::parse`]).
    pub fn entry(&self, i: usize) -> Entry<'a> {
        self.read_entry(i).expect("entries are checked by parse")
    }

    pub fn entries(&self) -> impl Iterator<Item = Entry<'a>> + '_ {
        (0..self.count).map(|i| self.entry(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An image of one file `/a` holding `data`, with `exec` "/a".
    fn image(data: &[u8]) -> [u8; 128] {
        let mut b = [0u8; 128];
        b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&1u32.to_le_bytes());
        // exec and the path share the string at 64.
        b[16..20].copy_from_slice(&64u32.to_le_bytes());
        b[20..24].copy_from_slice(&2u32.to_le_bytes());
        let e = HEADER_SIZE;
        b[e..e + 4].copy_from_slice(&64u32.to_le_bytes());
        b[e + 4..e + 8].copy_from_slice(&2u32.to_le_bytes());
        b[e + 8..e + 12].copy_from_slice(&KIND_FILE.to_le_bytes());
        b[e + 12..e + 16].copy_from_slice(&0o100755u32.to_le_bytes());
        b[e + 16..e + 24].copy_from_slice(&96u64.to_le_bytes());
        b[e + 24..e + 32].copy_from_slice(&(data.len() as u64).to_le_bytes());
        b[64..66].copy_from_slice(b"/a");
        b[96..96 + data.len()].copy_from_slice(data);
        b
    }

    #[test]
    fn an_image_reads_back() {
        let b = image(b"hello");
        let a = Archive::parse(&b).unwrap();
        assert_eq!((a.exec(), a.len()), ("/a", 1));
        // Only the permission bits of the mode are kept.
        assert_eq!(a.entry(0), Entry { path: "/a", kind: Kind::File, mode: 0o755, data: b"hello" });
    }

    #[test]
    fn damaged_images_are_refused() {
        let good = image(b"hello");
        let mut b = good;
        b[8] = 2;
        assert_eq!(Archive::parse(&b).unwrap_err(), Error::Header);
        // More entries than the image holds.
        let mut b = good;
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Archive::parse(&b).unwrap_err(), Error::Bounds);
        // Data past the end.
        let mut b = good;
        b[HEADER_SIZE + 24..HEADER_SIZE + 32].copy_from_slice(&100u64.to_le_bytes());
        assert_eq!(Archive::parse(&b).unwrap_err(), Error::Bounds);
        // A relative path, an unknown kind.
        let mut b = good;
        b[64] = b'a';
        assert_eq!(Archive::parse(&b).unwrap_err(), Error::Entry);
        let mut b = good;
        b[HEADER_SIZE + 8] = 9;
        assert_eq!(Archive::parse(&b).unwrap_err(), Error::Entry);
    }
}
