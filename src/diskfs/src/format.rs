//! The on-disk format (ftvm-fs version 1), described for users in
//! `docs/guest-abi.md` ("The persistent directory").
//!
//! Block 0 is the superblock. Two metadata slots of `meta_blocks` blocks
//! each follow; a commit writes the whole metadata (every node) into the
//! slot its sequence number selects (`seq % 2`), so a torn commit leaves
//! the other slot, the previous commit, intact. Mount takes the valid slot
//! with the highest sequence number. Data blocks follow the slots.

use alloc::string::String;
use alloc::vec::Vec;

use crate::{Error, Kind, NodeId};

pub const BLOCK: usize = 4096;
pub const VERSION: u32 = 1;
const SUPER_MAGIC: &[u8; 8] = b"FTVMFS\0\x01";
const META_MAGIC: &[u8; 8] = b"FTFSMETA";
/// Metadata slot header: magic, seq u64, payload length u32, crc32 u32.
pub const META_HEADER: usize = 24;
/// Longest name in a directory.
pub const NAME_MAX: usize = 255;

/// Block 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Super {
    /// Blocks the file system spans (at most the device's).
    pub blocks: u64,
    /// Blocks of each of the two metadata slots.
    pub meta_blocks: u64,
}

impl Super {
    /// The layout for a device of `blocks` blocks: a metadata slot is 1/64
    /// of the disk, between 2 and 64 blocks (8 KiB to 256 KiB).
    pub fn for_device(blocks: u64) -> Result<Super, Error> {
        let meta_blocks = (blocks / 64).clamp(2, 64);
        let sb = Super { blocks, meta_blocks };
        // Room for at least as many data blocks as metadata blocks.
        if blocks < sb.data_start() + 2 * meta_blocks {
            return Err(Error::TooSmall);
        }
        Ok(sb)
    }

    pub fn slot_start(&self, slot: u64) -> u64 {
        1 + slot * self.meta_blocks
    }

    pub fn data_start(&self) -> u64 {
        1 + 2 * self.meta_blocks
    }

    pub fn meta_capacity(&self) -> usize {
        self.meta_blocks as usize * BLOCK - META_HEADER
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(BLOCK);
        b.extend_from_slice(SUPER_MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(BLOCK as u32).to_le_bytes());
        b.extend_from_slice(&self.blocks.to_le_bytes());
        b.extend_from_slice(&self.meta_blocks.to_le_bytes());
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b.resize(BLOCK, 0);
        b
    }

    /// `Ok(None)` for a blank (all-zero) block 0: an unformatted disk.
    pub fn decode(b: &[u8], device_blocks: u64) -> Result<Option<Super>, Error> {
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        if &b[..8] != SUPER_MAGIC {
            return Err(Error::Foreign);
        }
        let crc = u32_at(b, 32);
        if crc32fast::hash(&b[..32]) != crc {
            return Err(Error::Corrupt("superblock checksum"));
        }
        if u32_at(b, 8) != VERSION || u32_at(b, 12) != BLOCK as u32 {
            return Err(Error::Corrupt("superblock version or block size"));
        }
        let sb = Super { blocks: u64_at(b, 16), meta_blocks: u64_at(b, 24) };
        if sb.blocks > device_blocks {
            return Err(Error::Corrupt("file system larger than the disk"));
        }
        if sb.meta_blocks < 2 || sb.blocks < sb.data_start() {
            return Err(Error::Corrupt("superblock layout"));
        }
        Ok(Some(sb))
    }
}

/// A run of blocks: `start..start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub start: u64,
    pub len: u64,
}

/// One node as committed: where it is in the tree and, for a file, its
/// size and blocks (in file order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub id: NodeId,
    pub parent: NodeId,
    pub name: String,
    pub kind: Kind,
    pub mtime_ns: u64,
    pub size: u64,
    pub extents: Vec<Extent>,
}

impl Record {
    pub fn encoded_len(&self) -> usize {
        4 + 4 + 1 + 1 + self.name.len() + 8 + 8 + 4 + 16 * self.extents.len()
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.parent.to_le_bytes());
        out.push(match self.kind {
            Kind::File => 1,
            Kind::Dir => 2,
        });
        out.push(self.name.len() as u8);
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&self.mtime_ns.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&(self.extents.len() as u32).to_le_bytes());
        for e in &self.extents {
            out.extend_from_slice(&e.start.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
        }
    }
}

/// The metadata slot image of commit `seq`: header and payload, padded to
/// whole blocks.
pub fn encode_meta(seq: u64, records: &[Record]) -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(&(records.len() as u32).to_le_bytes());
    for r in records {
        r.encode(&mut payload);
    }
    let mut out = Vec::with_capacity(META_HEADER + payload.len() + BLOCK);
    out.extend_from_slice(META_MAGIC);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let mut h = crc32fast::Hasher::new();
    h.update(&seq.to_le_bytes());
    h.update(&payload);
    out.extend_from_slice(&h.finalize().to_le_bytes());
    out.extend_from_slice(&payload);
    out.resize(out.len().next_multiple_of(BLOCK), 0);
    out
}

/// The slot's header: `Some((seq, payload_len))` if it holds a commit (the
/// payload is checked by [`decode_meta`]).
pub fn meta_header(b: &[u8]) -> Option<(u64, usize)> {
    (&b[..8] == META_MAGIC).then(|| (u64_at(b, 8), u32_at(b, 16) as usize))
}

/// The records of a slot image whose header [`meta_header`] accepted;
/// `None` if the checksum or the encoding is wrong (a torn commit).
pub fn decode_meta(b: &[u8]) -> Option<(u64, Vec<Record>)> {
    let (seq, len) = meta_header(b)?;
    let payload = b.get(META_HEADER..META_HEADER + len)?;
    let mut h = crc32fast::Hasher::new();
    h.update(&seq.to_le_bytes());
    h.update(payload);
    if h.finalize() != u32_at(b, 20) {
        return None;
    }
    let mut r = Reader { b: payload, at: 0 };
    let count = r.u32()? as usize;
    let mut records = Vec::with_capacity(count.min(len / 30));
    for _ in 0..count {
        let id = r.u32()?;
        let parent = r.u32()?;
        let kind = match r.u8()? {
            1 => Kind::File,
            2 => Kind::Dir,
            _ => return None,
        };
        let name_len = r.u8()? as usize;
        let name = String::from(core::str::from_utf8(r.take(name_len)?).ok()?);
        let mtime_ns = r.u64()?;
        let size = r.u64()?;
        let n = r.u32()? as usize;
        let mut extents = Vec::with_capacity(n.min(len / 16));
        for _ in 0..n {
            extents.push(Extent { start: r.u64()?, len: r.u64()? });
        }
        records.push(Record { id, parent, name, kind, mtime_ns, size, extents });
    }
    (r.at == payload.len()).then_some((seq, records))
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn metadata_round_trips_and_a_flipped_bit_is_refused() {
        let records = vec![
            Record { id: 1, parent: 0, name: "d".into(), kind: Kind::Dir, mtime_ns: 5, size: 0, extents: vec![] },
            Record {
                id: 2,
                parent: 1,
                name: "appendonly.aof".into(),
                kind: Kind::File,
                mtime_ns: 7,
                size: 9000,
                extents: vec![Extent { start: 40, len: 2 }, Extent { start: 90, len: 1 }],
            },
        ];
        let mut img = encode_meta(42, &records);
        assert_eq!(img.len() % BLOCK, 0);
        assert_eq!(decode_meta(&img), Some((42, records)));
        img[META_HEADER + 3] ^= 1;
        assert_eq!(decode_meta(&img), None);
    }

    #[test]
    fn superblock_round_trips_and_blank_means_unformatted() {
        let sb = Super::for_device(1000).unwrap();
        assert_eq!(Super::decode(&sb.encode(), 1000).unwrap(), Some(sb));
        assert_eq!(Super::decode(&[0; BLOCK], 1000).unwrap(), None);
        assert!(matches!(Super::decode(&sb.encode(), 999), Err(Error::Corrupt(_))));
        assert!(matches!(Super::decode(&[1; BLOCK], 1000), Err(Error::Foreign)));
        assert!(matches!(Super::for_device(8), Err(Error::TooSmall)));
    }
}
