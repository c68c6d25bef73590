//! Snapshot files: a paused VM's state and memory, restorable in a fresh
//! process.
//!
//! Layout (little-endian):
//! `magic "FTVMSNAP" | version u32 | header length u32 | header (bincode) |
//! page-presence bitmap (one bit per page) | the pages whose bit is set |
//! crc32c u32 of everything before it`.
//! All-zero pages are left out: a fresh VM's RAM is zero already.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use ftvm_abi::PAGE_SIZE;

use crate::dirty::DirtyBitmap;
use crate::memory::GuestRam;
use crate::vm::VmState;

const MAGIC: &[u8; 8] = b"FTVMSNAP";
pub const FORMAT_VERSION: u32 = 1;
/// A header larger than this is corruption, not a VM.
const MAX_HEADER: u32 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot {op} snapshot {path}: {err}")]
    Io { op: &'static str, path: String, err: std::io::Error },
    #[error("{0} is not an ftvm snapshot")]
    NotSnapshot(String),
    #[error("snapshot {path} has format version {found}; this ftvm reads version {FORMAT_VERSION}")]
    Version { path: String, found: u32 },
    #[error("snapshot {path} is truncated")]
    Truncated { path: String },
    #[error("snapshot {path} is corrupted: {what}")]
    Corrupted { path: String, what: String },
}

/// The shape of the VM a snapshot belongs to, and its non-memory state.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotHeader {
    pub mem_size: u64,
    pub vcpus: u32,
    pub state: VmState,
}

/// Writes through a running crc32c.
struct CrcWriter<W> {
    inner: W,
    crc: u32,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

struct CrcReader<R> {
    inner: R,
    crc: u32,
}

impl<R: Read> Read for CrcReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        Ok(n)
    }
}

/// Write `header` and all of `ram` (the VM must be paused) to `path`.
/// Returns the file size.
pub fn write(path: &Path, header: &SnapshotHeader, ram: &GuestRam) -> Result<u64, SnapshotError> {
    let name = path.display().to_string();
    let io = |op| {
        let name = name.clone();
        move |err| SnapshotError::Io { op, path: name, err }
    };
    // Write to a temporary name and rename, so a crash or full disk never
    // leaves a half-written file under the final name.
    let tmp = path.with_extension("partial");
    let file = File::create(&tmp).map_err(io("create"))?;
    let mut out = CrcWriter { inner: BufWriter::with_capacity(1 << 20, file), crc: 0 };
    let head = bincode::serialize(header).expect("snapshot header serializes");
    // SAFETY: the caller paused the VM, so guest memory is not changing.
    let mem = unsafe { ram.as_slice() };
    let mut present = DirtyBitmap::new(ram.pages());
    for (start, end) in ram.populated_ranges() {
        for page in start / PAGE_SIZE..end.div_ceil(PAGE_SIZE) {
            let at = (page * PAGE_SIZE) as usize;
            if !is_zero(&mem[at..at + PAGE_SIZE as usize]) {
                present.set(page);
            }
        }
    }
    let result = (|| {
        out.write_all(MAGIC)?;
        out.write_all(&FORMAT_VERSION.to_le_bytes())?;
        out.write_all(&(head.len() as u32).to_le_bytes())?;
        out.write_all(&head)?;
        for w in present.words() {
            out.write_all(&w.to_le_bytes())?;
        }
        for page in present.pages() {
            let start = (page * PAGE_SIZE) as usize;
            out.write_all(&mem[start..start + PAGE_SIZE as usize])?;
        }
        let crc = out.crc;
        out.inner.write_all(&crc.to_le_bytes())?;
        out.inner.flush()?;
        out.inner.get_ref().sync_all()
    })();
    if let Err(err) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(SnapshotError::Io { op: "write", path: name, err });
    }
    std::fs::rename(&tmp, path).map_err(io("rename"))?;
    std::fs::metadata(path).map(|m| m.len()).map_err(io("stat"))
}

fn is_zero(page: &[u8]) -> bool {
    page.chunks_exact(8).all(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")) == 0)
}

/// Read only the header of `path` (to size the VM before loading memory).
pub fn read_header(path: &Path) -> Result<SnapshotHeader, SnapshotError> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|err| SnapshotError::Io { op: "open", path: name.clone(), err })?;
    let mut input = CrcReader { inner: BufReader::new(file), crc: 0 };
    read_header_from(&mut input, &name)
}

fn read_exact(input: &mut impl Read, buf: &mut [u8], name: &str) -> Result<(), SnapshotError> {
    input.read_exact(buf).map_err(|err| match err.kind() {
        std::io::ErrorKind::UnexpectedEof => SnapshotError::Truncated { path: name.into() },
        _ => SnapshotError::Io { op: "read", path: name.into(), err },
    })
}

fn read_header_from(input: &mut impl Read, name: &str) -> Result<SnapshotHeader, SnapshotError> {
    let mut fixed = [0u8; 16];
    input.read_exact(&mut fixed).map_err(|_| SnapshotError::NotSnapshot(name.into()))?;
    if &fixed[..8] != MAGIC {
        return Err(SnapshotError::NotSnapshot(name.into()));
    }
    let version = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version { path: name.into(), found: version });
    }
    let len = u32::from_le_bytes(fixed[12..16].try_into().expect("4 bytes"));
    if len > MAX_HEADER {
        return Err(SnapshotError::Corrupted { path: name.into(), what: format!("header length {len}") });
    }
    let mut head = vec![0u8; len as usize];
    read_exact(input, &mut head, name)?;
    bincode::deserialize(&head).map_err(|e| SnapshotError::Corrupted { path: name.into(), what: e.to_string() })
}

/// Read `path` into the fresh VM memory `ram`, verifying the checksum.
/// On any error `ram` must be discarded (it may be partly written).
pub fn read(path: &Path, ram: &GuestRam) -> Result<SnapshotHeader, SnapshotError> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|err| SnapshotError::Io { op: "open", path: name.clone(), err })?;
    let mut input = CrcReader { inner: BufReader::with_capacity(1 << 20, file), crc: 0 };
    let header = read_header_from(&mut input, &name)?;
    if header.mem_size != ram.size() {
        return Err(SnapshotError::Corrupted { path: name, what: "memory size differs from the header".into() });
    }
    let mut words = vec![0u8; ram.pages().div_ceil(64) as usize * 8];
    read_exact(&mut input, &mut words, &name)?;
    let mut present = DirtyBitmap::new(ram.pages());
    for (i, w) in words.chunks_exact(8).enumerate() {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        for b in 0..64 {
            if w & (1 << b) != 0 {
                if i as u64 * 64 + b >= ram.pages() {
                    return Err(SnapshotError::Corrupted { path: name, what: "page bitmap beyond RAM".into() });
                }
                present.set(i as u64 * 64 + b);
            }
        }
    }
    // SAFETY: the VM is being restored and has not run; nothing else
    // accesses its memory.
    let mem = unsafe { ram.as_mut_slice() };
    for page in present.pages() {
        let start = (page * PAGE_SIZE) as usize;
        read_exact(&mut input, &mut mem[start..start + PAGE_SIZE as usize], &name)?;
    }
    let expected = input.crc;
    let mut crc = [0u8; 4];
    read_exact(&mut input.inner, &mut crc, &name)?;
    if u32::from_le_bytes(crc) != expected {
        return Err(SnapshotError::Corrupted { path: name, what: "checksum mismatch".into() });
    }
    if input.inner.read(&mut [0u8; 1]).map_err(|err| SnapshotError::Io { op: "read", path: name.clone(), err })? != 0 {
        return Err(SnapshotError::Corrupted { path: name, what: "trailing data".into() });
    }
    Ok(header)
}
