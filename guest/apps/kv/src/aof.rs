//! The append-only log on the VM's disk: replay at boot, then one
//! synchronous write per logged command.
//!
//! The log is `ftvm_kv::aof` framing from byte 0 of the disk. Appends
//! rewrite the log's last, partly filled sector together with the new
//! record (zero-padded to a sector boundary), so the disk always reads as
//! the log followed by zeros or by a torn tail that `aof::records` stops at.

use alloc::boxed::Box;
use alloc::vec::Vec;

use ftvm_kv::{aof, LogError, LogSink, Server, MAX_REQUEST_LEN};
use ftvm_rt::blk::{self, Disk, SECTOR_SIZE};
use ftvm_rt::println;

/// Boot-time reads of this much at a time.
const READ_CHUNK: u64 = 256 * 1024;
/// A record header claiming more than this is garbage (no request, hence no
/// record, is this big), not a reason to read on.
const MAX_RECORD: u64 = MAX_REQUEST_LEN as u64 + 64 * 1024;
/// Rejected records reported one by one; the rest are only counted.
const MAX_REPORTED: u64 = 10;

const SECTOR: u64 = SECTOR_SIZE as u64;

pub struct DiskLog {
    disk: Disk,
    capacity: u64,
    /// Byte offset just past the last record.
    end: u64,
    /// The log's bytes in sector `end / 512`, up to `end`.
    tail: Vec<u8>,
    /// Reused buffers: the framed record, and the sectors written.
    frame: Vec<u8>,
    scratch: Vec<u8>,
}

pub struct Replayed {
    /// Intact records found (rejected ones included).
    pub records: u64,
    /// Intact records the server refused to apply.
    pub rejected: u64,
}

impl DiskLog {
    /// Replay every intact record on `disk` into `server`, and return the
    /// log positioned after the last one.
    pub fn open(mut disk: Disk, server: &mut Server, now_ms: u64) -> Result<(DiskLog, Replayed), blk::Error> {
        let capacity = disk.capacity_sectors().saturating_mul(SECTOR);
        let mut stats = Replayed { records: 0, rejected: 0 };
        // `buf` holds the disk's bytes from `base` (sector-aligned) to
        // `next`; the records before `base + parsed` have been replayed.
        let mut buf: Vec<u8> = Vec::new();
        let (mut base, mut parsed, mut next) = (0u64, 0usize, 0u64);
        loop {
            let start = parsed;
            for (payload, end) in aof::records(&buf[start..]) {
                if let Err(e) = server.replay(payload, now_ms) {
                    if stats.rejected < MAX_REPORTED {
                        println!("kv: warning: log record {} rejected: {e}", stats.records);
                    }
                    stats.rejected += 1;
                }
                stats.records += 1;
                parsed = start + end;
            }
            // Keep only the sector the next record starts in, onwards.
            let keep = parsed / SECTOR_SIZE * SECTOR_SIZE;
            buf.drain(..keep);
            base += keep as u64;
            parsed -= keep;
            let at = base + parsed as u64;
            if !Self::cut_by_chunk(&buf[parsed..], at, capacity) || next >= capacity {
                break;
            }
            let n = READ_CHUNK.min(capacity - next) as usize;
            let old = buf.len();
            buf.resize(old + n, 0);
            disk.read(next / SECTOR, &mut buf[old..])?;
            next += n as u64;
        }
        let end = base + parsed as u64;
        let tail_start = (end / SECTOR * SECTOR - base) as usize;
        let tail = buf[tail_start..parsed].to_vec();
        let log = DiskLog { disk, capacity, end, tail, frame: Vec::new(), scratch: Vec::new() };
        Ok((log, stats))
    }

    /// Whether the bytes after the last intact record (`rest`, at disk
    /// offset `at`) may be a record cut short by the end of what was read,
    /// rather than the end of the log (zero length) or a torn record.
    fn cut_by_chunk(rest: &[u8], at: u64, capacity: u64) -> bool {
        let Some(header) = rest.get(..aof::HEADER_LEN) else {
            return true;
        };
        let len = u64::from(u32::from_le_bytes([header[0], header[1], header[2], header[3]]));
        let whole = aof::HEADER_LEN as u64 + len;
        len != 0 && len <= MAX_RECORD && at + whole <= capacity && whole > rest.len() as u64
    }

    fn write(&mut self, record: &[u8]) -> Result<(), LogError> {
        self.frame.clear();
        aof::encode(record, &mut self.frame);
        let new_end = self.end + self.frame.len() as u64;
        if new_end > self.capacity {
            return Err(LogError::Full);
        }
        let first = self.end / SECTOR;
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.tail);
        self.scratch.extend_from_slice(&self.frame);
        let padded = self.scratch.len().next_multiple_of(SECTOR_SIZE);
        self.scratch.resize(padded, 0);
        self.disk.write(first, &self.scratch).map_err(|e| match e {
            blk::Error::OutOfRange { .. } => LogError::Full,
            _ => LogError::Io,
        })?;
        let tail_start = ((new_end / SECTOR - first) * SECTOR) as usize;
        let tail_end = tail_start + (new_end % SECTOR) as usize;
        self.tail.clear();
        self.tail.extend_from_slice(&self.scratch[tail_start..tail_end]);
        self.end = new_end;
        Ok(())
    }
}

/// Where the server's records go: nowhere (`aof=off`) or the disk.
pub enum Log {
    Off,
    Disk(Box<DiskLog>),
}

impl LogSink for Log {
    /// Returns once the record is on the device (the write request has
    /// completed), so a reply sent afterwards never runs ahead of its log.
    fn append(&mut self, record: &[u8]) -> Result<(), LogError> {
        match self {
            Log::Off => Ok(()),
            Log::Disk(d) => d.write(record),
        }
    }

    fn enabled(&self) -> bool {
        matches!(self, Log::Disk(_))
    }
}
