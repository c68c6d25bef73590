//! `--link-compress lz4`: messages between replicas compressed on the links.
//!
//! Under a network load most of what VM replicas send each other is the
//! leader's log entries, every input frame to two peers, then the
//! `syncvm`s' divergent pages. Request streams repeat themselves (headers,
//! commands, keys) and guest pages hold runs of zeros, so LZ4 shrinks them
//! at about a microsecond per kilobyte. A frame is sent compressed whole,
//! as the payload of a `Kind::Lz4` frame (its length, u32 little-endian,
//! then the LZ4 block), only when that is shorter; small frames
//! (heartbeats, answers) are not tried. The receiver checks the inner
//! frame as any other (magic, version, kind, length, checksum).

use ftvm_replication::protocol::{self, Kind, ProtocolError};

/// Frames shorter than this go as they are.
pub const COMPRESS_FROM: usize = 256;

/// A compressed frame may not claim more than this many times its size:
/// LZ4 expands a block at most about 255 times.
const MAX_RATIO: usize = 256;
const SIZE_LEN: usize = 4;

/// `frame` (a whole protocol frame) compressed, when it is long enough to
/// try and comes out shorter; else `frame` itself.
pub fn pack(frame: Vec<u8>) -> Vec<u8> {
    if frame.len() < COMPRESS_FROM || frame.len() > u32::MAX as usize {
        return frame;
    }
    let packed = protocol::frame(Kind::Lz4, &lz4_flex::compress_prepend_size(&frame));
    if packed.len() < frame.len() {
        packed
    } else {
        frame
    }
}

/// The frame the payload of a `Kind::Lz4` frame holds: its kind, and its
/// payload into `buf`. A length it cannot hold, a block that does not
/// decode to exactly that length, or an inner frame that is not whole and
/// sound (or is compressed again) is a corrupt message; the claimed length
/// is checked before anything is allocated for it.
pub fn unpack(packed: &[u8], limit: u64, buf: &mut Vec<u8>) -> Result<Kind, ProtocolError> {
    let corrupt = |what: String| ProtocolError::Corrupt(format!("compressed frame: {what}"));
    let (size, block) = packed.split_first_chunk::<SIZE_LEN>().ok_or_else(|| corrupt(format!("{} bytes", packed.len())))?;
    let size = u32::from_le_bytes(*size) as usize;
    if size > block.len().saturating_mul(MAX_RATIO) {
        return Err(corrupt(format!("{} bytes claim {size}", block.len())));
    }
    let frame = lz4_flex::decompress(block, size).map_err(|e| corrupt(e.to_string()))?;
    if frame.len() != size {
        return Err(corrupt(format!("{} bytes decoded, {size} claimed", frame.len())));
    }
    let mut rest = &frame[..];
    let kind = protocol::read_frame(&mut rest, limit, buf)?;
    if kind == Kind::Lz4 || !rest.is_empty() {
        return Err(corrupt(format!("{kind:?} inside, {} bytes after it", rest.len())));
    }
    Ok(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: u64 = 1 << 30;

    fn requests() -> Vec<u8> {
        let stream: Vec<u8> =
            (0..40).flat_map(|i| format!("*3\r\n$3\r\nSET\r\n$16\r\nkey:{i:012}\r\n$3\r\nxxx\r\n").into_bytes()).collect();
        protocol::frame(Kind::Raft, &stream)
    }

    fn payload(frame: &[u8]) -> (Kind, Vec<u8>) {
        let mut buf = Vec::new();
        let kind = protocol::read_frame(&mut &frame[..], LIMIT, &mut buf).unwrap();
        (kind, buf)
    }

    #[test]
    fn repetitive_frames_shrink_and_come_back_whole() {
        let frame = requests();
        let packed = pack(frame.clone());
        assert!(packed.len() * 2 < frame.len(), "{} of {} bytes", packed.len(), frame.len());
        let (kind, outer) = payload(&packed);
        assert_eq!(kind, Kind::Lz4);
        let mut buf = Vec::new();
        assert_eq!(unpack(&outer, LIMIT, &mut buf).unwrap(), Kind::Raft);
        assert_eq!(buf, payload(&frame).1);
    }

    #[test]
    fn small_or_incompressible_frames_go_as_they_are() {
        let small = protocol::frame(Kind::SyncAck, &[7; 8]);
        assert_eq!(pack(small.clone()), small);
        let mut noise = vec![0; 4096];
        getrandom::fill(&mut noise).unwrap();
        let noisy = protocol::frame(Kind::SyncHashes, &noise);
        assert_eq!(pack(noisy.clone()), noisy);
    }

    #[test]
    fn hostile_or_damaged_frames_are_refused() {
        let mut buf = Vec::new();
        assert!(unpack(&[1, 2], LIMIT, &mut buf).is_err(), "shorter than its length field");
        let mut claim = u32::MAX.to_le_bytes().to_vec();
        claim.extend_from_slice(&[0; 16]);
        let e = unpack(&claim, LIMIT, &mut buf).unwrap_err().to_string();
        assert!(e.contains("claim"), "{e}");
        let frame = requests();
        let outer = payload(&pack(frame.clone())).1;
        assert!(unpack(&outer[..outer.len() - 3], LIMIT, &mut buf).is_err(), "a cut block");
        let mut wrong = outer.clone();
        wrong[..4].copy_from_slice(&((frame.len() - 1) as u32).to_le_bytes());
        assert!(unpack(&wrong, LIMIT, &mut buf).is_err(), "a wrong length");
        assert!(unpack(&outer, 64, &mut buf).is_err(), "an inner frame over the limit");
        let mut flipped = frame.clone();
        flipped[40] ^= 1;
        let flipped = payload(&pack(flipped)).1;
        assert!(unpack(&flipped, LIMIT, &mut buf).is_err(), "an inner frame failing its checksum");
        let twice = protocol::frame(Kind::Lz4, &lz4_flex::compress_prepend_size(&pack(frame)));
        let twice = payload(&twice).1;
        assert!(unpack(&twice, LIMIT, &mut buf).unwrap_err().to_string().contains("Lz4 inside"), "compressed twice");
    }
}
