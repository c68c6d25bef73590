//! The replication stream: framed, versioned, checksummed messages.
//!
//! Frame: `magic "FTVR" | protocol version u16 | kind u16 | payload length
//! u64 | payload | crc32c u32` (little-endian; the checksum covers header
//! and payload). A frame is used only once it has arrived whole and its
//! checksum matches, so a truncated or corrupted stream is never applied.

use std::io::{self, Read};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use ftvm_vmm::arch::compat::CpuProfile;
use ftvm_vmm::devices::DeviceKind;
use ftvm_vmm::pages::FormatError;

/// Version 2: pages travel as tagged bundle entries, messages in postcard.
/// Version 3: Hello and Welcome carry each side's heartbeat path
/// ([`Heartbeat`]; `liveness`).
/// Version 4: Welcome carries the backup's mirror port (`mirror`).
/// Version 5: bundle entries may be sub-page diffs (`Diff`, `DiffLz4`); a
/// checkpoint's VM state may leave out components that did not change.
/// Version 6: Hello carries the primary's vCPU profile
/// (`ftvm_vmm::arch::compat`), which the backup checks against its host.
/// Version 7: `Prefetch`, pages of the open epoch sent while the guest runs;
/// `Handover` (a planned switch-over, `ftvm switchover`); the
/// consensus-ordered replicas' messages (`vsmr`): PeerHello, Raft, and the
/// `syncvm` exchange.
/// Version 8: a replica rejoins by live pre-copy (`vsmr::rejoin`):
/// RejoinStart, RejoinHashes, RejoinPages, RejoinAck.
/// Version 9: a checkpoint's state carries the fake-ACK proxy's flows and
/// stored segments (`CheckpointState::fake_ack`, `--fake-ack`).
/// Version 10: a disk's saved state carries its pending list (requests in
/// flight, `ftvm_vmm::devices::virtio::block::PendingRequest`).
/// Version 11: `syncvm` compares disks too: SyncBitmap carries the disk's
/// size and dirty blocks, SyncHashes the blocks' hashes, SyncPages the
/// divergent blocks (`vsmr::disk`); RejoinHashes the hash of every disk
/// block, and RejoinPages may carry disk blocks after its sequence number.
/// Version 12: a checkpoint's fake-ACK state is whole or the changes since
/// the previous checkpoint (`fakeack::delta::Carried`, `--fake-ack-state`).
/// Version 13: the backup pulls prefetched pages (`--prefetch-by pull`):
/// PullMap, PullList, PullDone (`pipeline::prefetch::pull`).
/// Version 14: a replica's log entry may hold several input frames
/// (`vsmr::log::Entry::Inputs`, `--input-batch on`).
/// Version 15: a replica's SyncPages carries the leader's output of the
/// epoch the `syncvm` closes (`--sync-output on`).
/// Version 16: messages between replicas may go compressed (`Lz4`,
/// `--link-compress lz4`).
/// Version 17: the VM state (a checkpoint's, a SyncPages') is its
/// components by id (`ftvm_vmm::components`), a checkpoint's as the
/// changed ones with their bytes and the ids of the kept ones
/// (`checkpoint::StateDelta`).
/// Version 18: a checkpoint carries its epoch's first frames
/// (`CheckpointState::output`), and a mirrored datagram holds several
/// frames (`--mirror on`).
/// Version 19: the fake-ACK state's flows carry their bulk mode, and its
/// table which flows it acknowledges early (`--fake-ack bulk`); a
/// checkpoint carries only the flows a backup needs (`Table::carried`).
/// Version 20: `syncvm`'s block hashes are 16 bits (SyncBlockHashes), its
/// page and disk block hashes 16 fixed bytes each (SyncHashes); a block
/// patch carries the leader's hash of its page, which the secondary checks
/// once patched, asking for the pages that fail whole (SyncRepair,
/// answered by SyncRepaired) before it acknowledges.
/// Version 21: SyncHashes carries the low 4 bytes of each hash (all 16 in
/// a full `syncvm`), SyncPages a digest of the leader's hashes of the union.
/// Version 22: the fake-ACK state's flows carry the guest's latest
/// acknowledgement and window, which stored segments go again with
/// (`fakeack::flow::Flow::again`).
pub const PROTOCOL_VERSION: u16 = 22;
const MAGIC: &[u8; 4] = b"FTVR";
const HEADER: usize = 16;
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
    Bye = 9,
    /// On an authenticated channel, before every frame: its sequence
    /// number and tag (`pipeline::transport::auth`).
    Seal = 10,
    /// Authentication handshake (`pipeline::transport::auth`), before Hello.
    AuthHello = 11,
    AuthChallenge = 12,
    AuthProof = 13,
    AuthAccept = 14,
    /// With `--prefetch`: epoch u64, then a bundle (empty state) of pages
    /// of that epoch sent while the guest runs; the backup stages them and
    /// commits them with checkpoint `epoch` (`pipeline::prefetch`).
    Prefetch = 15,
    /// The primary stopped its guest, and the backup acknowledged the last
    /// checkpoint: it runs the VM from here (`ftvm switchover`).
    Handover = 16,
    /// `--prefetch-by pull`: the name of the primary's Unix socket that
    /// hands a same-host backup its guest memory, read-only (`PullMap`).
    PullMap = 17,
    /// `--prefetch-by pull`: a list of pages of the open epoch the backup
    /// reads from that mapping and stages (`PullList`).
    PullList = 18,
    /// `--prefetch-by pull`, backup to primary: the backup finished
    /// reading the list with this number (u64).
    PullDone = 19,
    /// Consensus-ordered replicas (`vsmr`): who dials, first on a link.
    PeerHello = 20,
    /// A raft message (protobuf, as raft-rs encodes it).
    Raft = 21,
    /// `syncvm`: a replica's dirty bitmap.
    SyncBitmap = 22,
    /// `syncvm`: the secondary's page hashes over the union.
    SyncHashes = 23,
    /// `syncvm`: the leader's divergent pages and VM state.
    SyncPages = 24,
    /// `syncvm`: the secondary staged the pages.
    SyncAck = 25,
    /// `syncvm`, `--sync-pages blocks`: the divergent pages the leader wants block hashes of.
    SyncWant = 26,
    /// `syncvm`, `--sync-pages blocks`: the secondary's block hashes.
    SyncBlockHashes = 27,
    /// Rejoin pre-copy (`vsmr::rejoin`): the leader asks a replica that is
    /// not in step for its page hashes.
    RejoinStart = 28,
    /// Rejoin: the replica's hash of every page (or: it is in step, skip).
    RejoinHashes = 29,
    /// Rejoin: a batch of the leader's pages (a bundle whose state is the
    /// batch's sequence number), sent while its guest runs.
    RejoinPages = 30,
    /// Rejoin: the replica wrote the batch with this sequence number.
    RejoinAck = 31,
    /// Another frame, compressed whole (`vsmr::squeeze`, `--link-compress
    /// lz4`).
    Lz4 = 32,
    /// `syncvm`, secondary to leader: the patched pages that did not hash
    /// to the leader's page hash (a block-hash collision); it wants them whole.
    SyncRepair = 33,
    /// `syncvm`, leader to secondary: those pages whole (a bundle without
    /// state), as the leader froze them.
    SyncRepaired = 34,
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
            9 => Kind::Bye,
            10 => Kind::Seal,
            11 => Kind::AuthHello,
            12 => Kind::AuthChallenge,
            13 => Kind::AuthProof,
            14 => Kind::AuthAccept,
            15 => Kind::Prefetch,
            16 => Kind::Handover,
            17 => Kind::PullMap,
            18 => Kind::PullList,
            19 => Kind::PullDone,
            20 => Kind::PeerHello,
            21 => Kind::Raft,
            22 => Kind::SyncBitmap,
            23 => Kind::SyncHashes,
            24 => Kind::SyncPages,
            25 => Kind::SyncAck,
            26 => Kind::SyncWant,
            27 => Kind::SyncBlockHashes,
            28 => Kind::RejoinStart,
            29 => Kind::RejoinHashes,
            30 => Kind::RejoinPages,
            31 => Kind::RejoinAck,
            32 => Kind::Lz4,
            33 => Kind::SyncRepair,
            34 => Kind::SyncRepaired,
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
    #[error("unauthenticated replication data: {0}")]
    Unauthenticated(String),
    #[error("replication stream timed out")]
    Timeout,
    #[error("replication stream I/O error: {0}")]
    Io(io::Error),
}

impl From<FormatError> for ProtocolError {
    fn from(e: FormatError) -> ProtocolError {
        match e {
            FormatError::Truncated => ProtocolError::Truncated,
            FormatError::Corrupt(what) => ProtocolError::Corrupt(what),
            FormatError::Io(e) => ProtocolError::Io(e),
        }
    }
}

fn io_err(e: io::Error) -> ProtocolError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => ProtocolError::Truncated,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ProtocolError::Timeout,
        _ => ProtocolError::Io(e),
    }
}

/// `--prefetch-by pull`: pages of the open epoch `epoch` for the backup to
/// read from its read-only mapping of the primary's guest memory and stage
/// (`pipeline::prefetch::pull`); it answers `PullDone` with `list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullList {
    pub epoch: u64,
    /// Numbers lists of one primary, increasing.
    pub list: u64,
    pub pages: Vec<u64>,
}

/// What the primary tells the backup first: who it is and the VM's shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub mem_size: u64,
    pub vcpus: u32,
    /// Devices in slot order.
    pub devices: Vec<DeviceKind>,
    /// The guest's MAC address, if it has a network card.
    pub mac: Option<[u8; 6]>,
    /// The disk's size in bytes, if it has a disk.
    pub disk_size: Option<u64>,
    pub epoch_ms: u64,
    /// Number of the first checkpoint this backup will receive.
    pub first_epoch: u64,
    /// Where and how often the primary's heartbeats come from.
    pub heartbeat: Heartbeat,
    /// What the vCPUs' saved state needs of a host that restores it: a
    /// backup that cannot restore it refuses the primary at once, not at
    /// failover.
    pub cpu: CpuProfile,
}

/// The backup's answer to a Hello it accepts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub heartbeat: Heartbeat,
    /// The UDP port (at the address of the backup's end of the stream) that
    /// receives mirrored frames (`mirror`).
    pub mirror_port: u16,
}

/// One side's heartbeat path, told to the other in Hello and Welcome
/// (`liveness`): heartbeats travel as UDP datagrams between the two hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// This side's half of the session id, fresh and random for every
    /// connection: a heartbeat counts only if it carries both halves.
    pub session: [u8; 8],
    /// The UDP port this side receives heartbeats on, at the address of its
    /// end of the stream.
    pub port: u16,
    /// How often this side sends heartbeats.
    pub interval_ms: u64,
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

/// A complete frame of `kind` carrying `payload`.
pub fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER + payload.len() + 4);
    begin_frame(&mut buf, kind);
    buf.extend_from_slice(payload);
    finish_frame(&mut buf);
    buf
}

/// The raw kind and the payload of a complete frame whose length field
/// matches its size (the checksum is not checked), or None.
pub fn split_frame(frame: &[u8]) -> Option<(u16, &[u8])> {
    if frame.len() < HEADER + 4 || &frame[..4] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(frame[8..16].try_into().expect("8 bytes"));
    if len != (frame.len() - HEADER - 4) as u64 {
        return None;
    }
    Some((u16::from_le_bytes([frame[6], frame[7]]), &frame[HEADER..frame.len() - 4]))
}

/// Whether a complete frame's checksum matches its header and payload.
pub fn checksum_ok(frame: &[u8]) -> bool {
    let (body, crc) = frame.split_at(frame.len() - 4);
    crc32c::crc32c(body).to_le_bytes() == crc
}

/// Recompute the checksum of a complete frame whose payload was changed in place.
pub fn refresh_checksum(frame: &mut [u8]) {
    let at = frame.len() - 4;
    let crc = crc32c::crc32c(&frame[..at]);
    frame[at..].copy_from_slice(&crc.to_le_bytes());
}

/// Where a complete frame's payload starts.
pub const PAYLOAD_OFFSET: usize = HEADER;

/// The payload length of a complete frame.
pub fn payload_len(frame: &[u8]) -> u64 {
    (frame.len() - HEADER - 4) as u64
}

/// A complete frame of `kind` carrying `msg`.
pub fn message<T: Serialize>(kind: Kind, msg: &T) -> Vec<u8> {
    let mut buf = Vec::new();
    begin_frame(&mut buf, kind);
    buf.extend_from_slice(&postcard::to_allocvec(msg).expect("messages serialize"));
    finish_frame(&mut buf);
    buf
}

/// An acknowledgement: the epoch as a fixed u64, like the epoch that
/// starts a checkpoint, so captures of the stream can read it.
pub fn ack(epoch: u64) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER + 12);
    begin_frame(&mut buf, Kind::Ack);
    buf.extend_from_slice(&epoch.to_le_bytes());
    finish_frame(&mut buf);
    buf
}

pub fn read_ack(payload: &[u8]) -> Result<u64, ProtocolError> {
    let bytes: [u8; 8] = payload.try_into().map_err(|_| ProtocolError::Corrupt(format!("acknowledgement of {} bytes", payload.len())))?;
    Ok(u64::from_le_bytes(bytes))
}

pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ProtocolError> {
    postcard::from_bytes(payload).map_err(|e| ProtocolError::Corrupt(format!("bad message: {e}")))
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
    read_payload(r, len as usize, buf)?;
    let mut crc = [0u8; 4];
    r.read_exact(&mut crc).map_err(io_err)?;
    let expected = crc32c::crc32c_append(crc32c::crc32c(&header), buf);
    if u32::from_le_bytes(crc) != expected {
        return Err(ProtocolError::Corrupt(format!("{kind:?} checksum mismatch")));
    }
    Ok(kind)
}

/// The payload is read in chunks of at most this many bytes, so a header
/// claiming a huge length costs memory only as the bytes really arrive.
const READ_CHUNK: usize = 1 << 20;

/// Read exactly `len` bytes into `buf`, growing it with the data: never
/// more than one chunk ahead of what arrived (plus doubling), and never
/// beyond `len`. What `buf` already holds is overwritten, not zeroed first.
fn read_payload(r: &mut impl Read, len: usize, buf: &mut Vec<u8>) -> Result<(), ProtocolError> {
    let mut filled = 0;
    while filled < len {
        let want = (len - filled).min(READ_CHUNK);
        if buf.len() < filled + want {
            if buf.capacity() < filled + want {
                let target = (2 * buf.capacity()).max(filled + want).min(len);
                buf.reserve_exact(target - buf.len());
            }
            buf.resize(filled + want, 0);
        }
        r.read_exact(&mut buf[filled..filled + want]).map_err(io_err)?;
        filled += want;
    }
    buf.truncate(len);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/replication.md` names the version the code speaks: where it
    /// says what the version is, and in its frame diagrams.
    #[test]
    fn the_documented_protocol_version_is_the_code_s() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/replication.md")).unwrap();
        let flat = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            flat.contains(&format!("The version ({PROTOCOL_VERSION}) is checked on every frame")),
            "docs/replication.md: the version is not {PROTOCOL_VERSION}"
        );
        let diagrams: Vec<&str> = doc.lines().filter(|l| l.trim_start().starts_with("\"FTVR\" |")).collect();
        assert!(!diagrams.is_empty());
        for line in diagrams {
            let version = line.split('|').nth(1).unwrap().trim();
            assert_eq!(version, PROTOCOL_VERSION.to_string(), "docs/replication.md: {line}");
        }
    }

    fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        begin_frame(&mut v, kind);
        v.extend_from_slice(payload);
        finish_frame(&mut v);
        v
    }

    #[test]
    fn messages_round_trip() {
        let bytes = message(Kind::Refuse, &"no".to_string());
        let mut buf = Vec::new();
        assert_eq!(read_frame(&mut &bytes[..], 100, &mut buf).unwrap(), Kind::Refuse);
        assert_eq!(decode::<String>(&buf).unwrap(), "no");
        assert!(decode::<String>(&[0xff]).is_err());
        let bytes = ack(7);
        assert_eq!(read_frame(&mut &bytes[..], 100, &mut buf).unwrap(), Kind::Ack);
        assert_eq!(read_ack(&buf).unwrap(), 7);
        assert!(read_ack(&buf[..7]).is_err());
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

    /// A reader that yields `avail` bytes of zeros, then ends.
    struct Trickle {
        avail: usize,
    }

    impl Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = out.len().min(self.avail);
            out[..n].fill(0);
            self.avail -= n;
            Ok(n)
        }
    }

    #[test]
    fn a_claimed_length_costs_memory_only_as_bytes_arrive() {
        let claimed = 1u64 << 30;
        let mut header = Vec::new();
        begin_frame(&mut header, Kind::Checkpoint);
        header[8..16].copy_from_slice(&claimed.to_le_bytes());
        let mut r = (&header[..]).chain(Trickle { avail: 3 << 20 });
        let mut buf = Vec::new();
        assert!(matches!(read_frame(&mut r, claimed, &mut buf), Err(ProtocolError::Truncated)));
        assert!(buf.capacity() <= 8 << 20, "allocated {} bytes for 3 MiB received", buf.capacity());
        // A frame that does arrive whole is read whole, across chunks.
        let big = frame(Kind::Pages, &vec![3u8; 3 * READ_CHUNK + 5]);
        assert_eq!(read_frame(&mut &big[..], 4 << 20, &mut buf).unwrap(), Kind::Pages);
        assert_eq!(buf.len(), 3 * READ_CHUNK + 5);
        assert!(buf.iter().all(|&b| b == 3));
    }

    #[test]
    fn oversized_frames_are_refused_before_reading() {
        let bytes = frame(Kind::Pages, &[0u8; 64]);
        assert!(matches!(read_frame(&mut &bytes[..], 63, &mut Vec::new()), Err(ProtocolError::Corrupt(_))));
    }
}
