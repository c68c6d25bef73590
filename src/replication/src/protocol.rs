//! The replication stream: framed, versioned, checksummed messages.
//!
//! Frame: `magic "FTVR" | protocol version u16 | kind u16 | payload length
//! u64 | payload | crc32c u32` (little-endian; the checksum covers header
//! and payload). A frame is used only once it has arrived whole and its
//! checksum matches, so a truncated or corrupted stream is never applied.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use ftvm_vmm::devices::virtio::block_journal::DiskWrite;

pub const PROTOCOL_VERSION: u16 = 1;
const MAGIC: &[u8; 4] = b"FTVR";
const HEADER: usize = 16;
pub const PAGE: usize = 4096;
/// Frames before the VM's shape is known are small.
pub const HANDSHAKE_LIMIT: u64 = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    Hello = 1,
    Welcome = 2,
    Refuse = 3,
    Pages = 4,
    Disk = 5,
    Checkpoint = 6,
    Ack = 7,
    Heartbeat = 8,
    Bye = 9,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Refuse,
            4 => Kind::Pages,
            5 => Kind::Disk,
            6 => Kind::Checkpoint,
            7 => Kind::Ack,
            8 => Kind::Heartbeat,
            9 => Kind::Bye,
            _ => return None,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("the peer closed the replication stream")]
    Closed,
    #[error("the replication stream ended in the middle of a message")]
    Truncated,
    #[error("the peer speaks replication protocol version {found}; this ftvm speaks version {PROTOCOL_VERSION}")]
    Version { found: u16 },
    #[error("corrupted replication stream: {0}")]
    Corrupt(String),
    #[error("replication stream timed out")]
    Timeout,
    #[error("replication stream I/O error: {0}")]
    Io(io::Error),
}

fn io_err(e: io::Error) -> ProtocolError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => ProtocolError::Truncated,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ProtocolError::Timeout,
        _ => ProtocolError::Io(e),
    }
}

/// What the primary tells the backup first: who it is and the VM's shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub mem_size: u64,
    pub vcpus: u32,
    /// Device types in slot order (see `ftvm_vmm::devices`).
    pub devices: Vec<u32>,
    /// The guest's MAC address, if it has a network card.
    pub mac: Option<[u8; 6]>,
    /// The disk's size in bytes, if it has a disk.
    pub disk_size: Option<u64>,
    pub epoch_ms: u64,
    /// Number of the first checkpoint this backup will receive.
    pub first_epoch: u64,
}

/// Start a frame in `buf` (cleared); finish it with [`finish_frame`].
pub fn begin_frame(buf: &mut Vec<u8>, kind: Kind) {
    buf.clear();
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    buf.extend_from_slice(&(kind as u16).to_le_bytes());
    buf.extend_from_slice(&0u64.to_le_bytes());
}

/// Fill in the length and append the checksum.
pub fn finish_frame(buf: &mut Vec<u8>) {
    let len = (buf.len() - HEADER) as u64;
    buf[8..16].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(buf);
    buf.extend_from_slice(&crc.to_le_bytes());
}

pub fn write_frame(w: &mut impl Write, kind: Kind, payload: &[u8]) -> Result<(), ProtocolError> {
    let mut buf = Vec::with_capacity(HEADER + payload.len() + 4);
    begin_frame(&mut buf, kind);
    buf.extend_from_slice(payload);
    finish_frame(&mut buf);
    w.write_all(&buf).map_err(io_err)
}

pub fn write_message<T: Serialize>(w: &mut impl Write, kind: Kind, msg: &T) -> Result<(), ProtocolError> {
    write_frame(w, kind, &bincode::serialize(msg).expect("messages serialize"))
}

pub fn decode<'a, T: Deserialize<'a>>(payload: &'a [u8]) -> Result<T, ProtocolError> {
    bincode::deserialize(payload).map_err(|e| ProtocolError::Corrupt(format!("bad message: {e}")))
}

/// Read one whole, verified frame whose payload is at most `limit` bytes.
/// `buf` is reused between calls and holds the payload afterwards.
pub fn read_frame(r: &mut impl Read, limit: u64, buf: &mut Vec<u8>) -> Result<Kind, ProtocolError> {
    let mut header = [0u8; HEADER];
    // A clean close between frames is not an error of the stream.
    let mut got = 0;
    while got < HEADER {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Err(ProtocolError::Closed),
            Ok(0) => return Err(ProtocolError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    if &header[..4] != MAGIC {
        return Err(ProtocolError::Corrupt("bad frame magic".into()));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(ProtocolError::Version { found: version });
    }
    let raw_kind = u16::from_le_bytes([header[6], header[7]]);
    let kind = Kind::from_u16(raw_kind).ok_or_else(|| ProtocolError::Corrupt(format!("unknown message kind {raw_kind}")))?;
    let len = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    if len > limit {
        return Err(ProtocolError::Corrupt(format!("{kind:?} of {len} bytes exceeds the {limit}-byte limit")));
    }
    buf.resize(len as usize, 0);
    r.read_exact(buf).map_err(io_err)?;
    let mut crc = [0u8; 4];
    r.read_exact(&mut crc).map_err(io_err)?;
    let expected = crc32c::crc32c_append(crc32c::crc32c(&header), buf);
    if u32::from_le_bytes(crc) != expected {
        return Err(ProtocolError::Corrupt(format!("{kind:?} checksum mismatch")));
    }
    Ok(kind)
}

/// Bounds-checked reads from a payload.
pub struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8]) -> Cursor<'a> {
        Cursor { bytes, at: 0 }
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| ProtocolError::Corrupt("message shorter than its contents".into()))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    pub fn is_empty(&self) -> bool {
        self.at == self.bytes.len()
    }
}

/// A page set on the wire: `count u64 | count page numbers u64 | count pages`.
pub struct PageSet<'a> {
    pub numbers: &'a [u8],
    pub data: &'a [u8],
}

impl<'a> PageSet<'a> {
    pub fn read(c: &mut Cursor<'a>) -> Result<PageSet<'a>, ProtocolError> {
        let count = c.u64()? as usize;
        let numbers = c.take(count.checked_mul(8).ok_or_else(|| ProtocolError::Corrupt("page count".into()))?)?;
        let data = c.take(count.checked_mul(PAGE).ok_or_else(|| ProtocolError::Corrupt("page count".into()))?)?;
        Ok(PageSet { numbers, data })
    }

    pub fn len(&self) -> usize {
        self.numbers.len() / 8
    }

    pub fn is_empty(&self) -> bool {
        self.numbers.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &'a [u8])> + '_ {
        self.numbers
            .chunks_exact(8)
            .zip(self.data.chunks_exact(PAGE))
            .map(|(n, d)| (u64::from_le_bytes(n.try_into().expect("8 bytes")), d))
    }
}

/// Append a page set of `pages` read by `page_data` to `buf`.
pub fn put_pages<'m>(buf: &mut Vec<u8>, pages: &[u64], mut page_data: impl FnMut(u64) -> &'m [u8]) {
    buf.extend_from_slice(&(pages.len() as u64).to_le_bytes());
    for p in pages {
        buf.extend_from_slice(&p.to_le_bytes());
    }
    buf.reserve(pages.len() * PAGE);
    for &p in pages {
        buf.extend_from_slice(page_data(p));
    }
}

pub fn put_disk_writes(buf: &mut Vec<u8>, writes: &[DiskWrite]) {
    buf.extend_from_slice(&(writes.len() as u64).to_le_bytes());
    for w in writes {
        buf.extend_from_slice(&w.offset.to_le_bytes());
        buf.extend_from_slice(&(w.data.len() as u64).to_le_bytes());
        buf.extend_from_slice(&w.data);
    }
}

/// Disk writes on the wire, as (offset, data).
pub fn read_disk_writes<'a>(c: &mut Cursor<'a>) -> Result<Vec<(u64, &'a [u8])>, ProtocolError> {
    let count = c.u64()?;
    let mut writes = Vec::new();
    for _ in 0..count {
        let offset = c.u64()?;
        let len = c.u64()? as usize;
        writes.push((offset, c.take(len)?));
    }
    Ok(writes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        write_frame(&mut v, kind, payload).unwrap();
        v
    }

    #[test]
    fn round_trip() {
        let bytes = frame(Kind::Ack, &7u64.to_le_bytes());
        let mut buf = Vec::new();
        assert_eq!(read_frame(&mut &bytes[..], 100, &mut buf).unwrap(), Kind::Ack);
        assert_eq!(buf, 7u64.to_le_bytes());
    }

    #[test]
    fn every_truncation_is_detected() {
        let bytes = frame(Kind::Checkpoint, &[5u8; 300]);
        let mut buf = Vec::new();
        assert!(matches!(read_frame(&mut &bytes[..0], 1000, &mut buf), Err(ProtocolError::Closed)));
        for cut in 1..bytes.len() {
            let r = read_frame(&mut &bytes[..cut], 1000, &mut buf);
            assert!(matches!(r, Err(ProtocolError::Truncated)), "cut at {cut}: {r:?}");
        }
    }

    #[test]
    fn every_bit_flip_is_detected() {
        let bytes = frame(Kind::Pages, &[9u8; 64]);
        let mut buf = Vec::new();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(read_frame(&mut &b[..], 1000, &mut buf).is_err(), "flip of byte {i} bit {bit} accepted");
            }
        }
    }

    #[test]
    fn other_versions_are_named() {
        let mut bytes = frame(Kind::Hello, b"x");
        bytes[4] = 9;
        let r = read_frame(&mut &bytes[..], 100, &mut Vec::new());
        assert!(matches!(r, Err(ProtocolError::Version { found: 9 })), "{r:?}");
    }

    #[test]
    fn oversized_frames_are_refused_before_reading() {
        let bytes = frame(Kind::Pages, &[0u8; 64]);
        assert!(matches!(read_frame(&mut &bytes[..], 63, &mut Vec::new()), Err(ProtocolError::Corrupt(_))));
    }

    #[test]
    fn page_sets_and_disk_writes_round_trip() {
        let mem = vec![1u8; 3 * PAGE];
        let mut buf = Vec::new();
        put_pages(&mut buf, &[0, 2], |p| &mem[p as usize * PAGE..(p as usize + 1) * PAGE]);
        put_disk_writes(&mut buf, &[DiskWrite { offset: 512, data: vec![7; 512] }]);
        let mut c = Cursor::new(&buf);
        let set = PageSet::read(&mut c).unwrap();
        assert_eq!(set.iter().map(|(n, d)| (n, d.len())).collect::<Vec<_>>(), vec![(0, PAGE), (2, PAGE)]);
        let writes = read_disk_writes(&mut c).unwrap();
        assert_eq!(writes, vec![(512, &[7u8; 512][..])]);
        assert!(c.is_empty());
        let mut short = Cursor::new(&buf[..20]);
        assert!(PageSet::read(&mut short).is_err());
    }
}
