//! Framing of the append-only log on a byte device.
//!
//! A record is `[len: u32 LE][crc: u32 LE][payload: len bytes]`, where `crc`
//! is the CRC-32 (IEEE, as zlib computes it) of the payload and `len > 0`.
//! Records follow each other with no padding. A device is read from offset
//! 0 until the first record that is not whole and intact: a zero length
//! (never-written, zeroed space), a record running past the end of the
//! bytes, or a checksum mismatch (a write torn by a crash). Everything from
//! there on is the torn tail, and the next append should overwrite it,
//! starting at the end offset of the last good record.

use alloc::vec::Vec;

/// Bytes of framing before each payload.
pub const HEADER_LEN: usize = 8;

/// The checksum of a record's payload: CRC-32 (IEEE 802.3, reflected,
/// initial value and final XOR all ones), the one zlib computes. Part of the
/// on-disk format: logs written before stay readable only while it does not
/// change.
pub fn crc32(payload: &[u8]) -> u32 {
    crc32fast::hash(payload)
}

/// Append the framed `payload` to `out`. An empty payload would read back
/// as the end of the log, so callers must not log one (the server never
/// does).
pub fn encode(payload: &[u8], out: &mut Vec<u8>) {
    debug_assert!(!payload.is_empty());
    // A payload is at most one request's worth of bytes, far below 4 GiB.
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    out.reserve(HEADER_LEN + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// The intact records at the start of `bytes`, each as (payload, offset just
/// past the record). The last offset yielded is where appending resumes (0
/// if nothing is yielded).
pub fn records(bytes: &[u8]) -> impl Iterator<Item = (&[u8], usize)> {
    Records { bytes, pos: 0 }
}

struct Records<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Iterator for Records<'a> {
    type Item = (&'a [u8], usize);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.bytes.get(self.pos..)?;
        let header = rest.get(..HEADER_LEN)?;
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        if len == 0 {
            self.pos = self.bytes.len();
            return None;
        }
        let payload = match rest.get(HEADER_LEN..).and_then(|r| r.get(..len)) {
            Some(p) if crc32(p) == crc => p,
            _ => {
                // Stop for good: a torn record says nothing about what
                // follows it.
                self.pos = self.bytes.len();
                return None;
            }
        };
        self.pos += HEADER_LEN + len;
        Some((payload, self.pos))
    }
}
