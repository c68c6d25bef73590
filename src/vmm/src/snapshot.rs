//! Snapshot files: a paused VM's state and memory, restorable in a fresh
//! process.
//!
//! Layout (little-endian): `magic "FTVMSNAP" | format version u32 | bundle |
//! crc32c u32 of everything before it`, where the bundle (see `pages`) holds
//! the VM's state (its components by id, `components`) and every page that
//! is not all zeros (a fresh VM's RAM is zero already).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::components::Components;
use crate::memory::{GuestRam, PAGE};
use crate::pages::{self, BundleWriter, FormatError, RawEncoder};
use crate::persist;

const MAGIC: &[u8; 8] = b"FTVMSNAP";
/// Version 4: the state is the VM's components by id.
pub const FORMAT_VERSION: u32 = 4;
/// A state larger than this is corruption, not a VM.
const MAX_STATE: u64 = 64 << 20;
/// Bytes gathered before each write to the file.
const WRITE_CHUNK: usize = 1 << 20;

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
    #[error("{0} exists and is not an ftvm snapshot: not replaced (remove it or choose another path)")]
    NotReplaced(String),
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

/// Write `state` and all of `ram` (the VM must be paused) to `path`.
/// Returns the file size.
pub fn write(path: &Path, state: &Components, ram: &GuestRam) -> Result<u64, SnapshotError> {
    let name = path.display().to_string();
    let io = |op| {
        let name = name.clone();
        move |err| SnapshotError::Io { op, path: name, err }
    };
    // An earlier snapshot may be replaced; anything else under that name (a
    // disk image, the guest's ELF, the control socket) is the operator's.
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_file() || !starts_as_snapshot(path) {
            return Err(SnapshotError::NotReplaced(name));
        }
    }
    // Write to a temporary name and rename, so a crash or full disk never
    // leaves a half-written file under the final name.
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = std::path::PathBuf::from(tmp);
    // Owner-only from its first byte, whatever the umask: it holds all of
    // guest memory. A leftover of a write that was cut off may have another
    // mode, so it is replaced, not reused.
    let create = || std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp);
    let file = match create() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(&tmp).map_err(io("replace"))?;
            create()
        }
        r => r,
    }
    .map_err(io("create"))?;
    let mut out = CrcWriter { inner: BufWriter::with_capacity(WRITE_CHUNK, file), crc: 0 };
    let result = (|| {
        out.write_all(MAGIC)?;
        out.write_all(&FORMAT_VERSION.to_le_bytes())?;
        let mut buf = Vec::with_capacity(2 * WRITE_CHUNK);
        let mut encoder = RawEncoder;
        let mut bundle = BundleWriter::begin(&mut buf, &persist::encode(state), &mut encoder, true);
        let mut page = vec![0u8; PAGE];
        for (start, end) in ram.populated_ranges() {
            for p in start / PAGE as u64..end.div_ceil(PAGE as u64) {
                ram.read_page(p, &mut page).map_err(std::io::Error::other)?;
                bundle.page(p, &page);
                if bundle.pending() >= WRITE_CHUNK {
                    out.write_all(&bundle.take_output())?;
                }
            }
        }
        let rest = bundle.take_output();
        bundle.finish();
        out.write_all(&rest)?;
        out.write_all(&buf)?;
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

/// Whether the file at `path` starts as a snapshot does (of any version:
/// an older one may be replaced too).
fn starts_as_snapshot(path: &Path) -> bool {
    let mut magic = [0u8; MAGIC.len()];
    File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == MAGIC
}

fn format_error(name: &str, e: FormatError) -> SnapshotError {
    match e {
        FormatError::Truncated => SnapshotError::Truncated { path: name.into() },
        FormatError::Corrupt(what) => SnapshotError::Corrupted { path: name.into(), what },
        FormatError::Io(err) => SnapshotError::Io { op: "read", path: name.into(), err },
    }
}

fn read_prefix(input: &mut impl Read, name: &str) -> Result<(), SnapshotError> {
    let mut fixed = [0u8; 12];
    input.read_exact(&mut fixed).map_err(|_| SnapshotError::NotSnapshot(name.into()))?;
    if &fixed[..8] != MAGIC {
        return Err(SnapshotError::NotSnapshot(name.into()));
    }
    let version = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version { path: name.into(), found: version });
    }
    Ok(())
}

fn decode_state(bytes: &[u8], name: &str) -> Result<Components, SnapshotError> {
    persist::decode(bytes).map_err(|e| SnapshotError::Corrupted { path: name.into(), what: format!("VM state: {e}") })
}

fn open(path: &Path) -> Result<(CrcReader<BufReader<File>>, String), SnapshotError> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|err| SnapshotError::Io { op: "open", path: name.clone(), err })?;
    Ok((CrcReader { inner: BufReader::with_capacity(WRITE_CHUNK, file), crc: 0 }, name))
}

/// Read only the VM state of `path` (to size the VM before loading memory).
/// The checksum covers the whole file and is checked by `read`.
pub fn read_state(path: &Path) -> Result<Components, SnapshotError> {
    let (mut input, name) = open(path)?;
    read_prefix(&mut input, &name)?;
    let mut word = [0u8; 8];
    input.read_exact(&mut word).map_err(|_| SnapshotError::Truncated { path: name.clone() })?;
    let len = u64::from_le_bytes(word);
    if len > MAX_STATE {
        return Err(SnapshotError::Corrupted { path: name, what: format!("VM state of {len} bytes") });
    }
    let mut state = vec![0u8; len as usize];
    input.read_exact(&mut state).map_err(|_| SnapshotError::Truncated { path: name.clone() })?;
    decode_state(&state, &name)
}

/// Read `path` into the fresh VM memory `ram`, verifying the checksum.
/// On any error `ram` must be discarded (it may be partly written).
pub fn read(path: &Path, ram: &GuestRam) -> Result<Components, SnapshotError> {
    let (mut input, name) = open(path)?;
    read_prefix(&mut input, &name)?;
    let state = pages::read_bundle(&mut input, ram, MAX_STATE).map_err(|e| format_error(&name, e))?;
    let expected = input.crc;
    let mut crc = [0u8; 4];
    input.inner.read_exact(&mut crc).map_err(|_| SnapshotError::Truncated { path: name.clone() })?;
    if u32::from_le_bytes(crc) != expected {
        return Err(SnapshotError::Corrupted { path: name, what: "checksum mismatch".into() });
    }
    if input.inner.read(&mut [0u8; 1]).map_err(|err| SnapshotError::Io { op: "read", path: name.clone(), err })? != 0 {
        return Err(SnapshotError::Corrupted { path: name, what: "trailing data".into() });
    }
    let state = decode_state(&state, &name)?;
    match crate::memory::saved_size(&state) {
        Ok(size) if size == ram.size() => Ok(state),
        Ok(_) => Err(SnapshotError::Corrupted { path: name, what: "memory size differs from the VM state".into() }),
        Err(e) => Err(SnapshotError::Corrupted { path: name, what: e.to_string() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{self, ClockState};
    use crate::memory::{self, MemoryState};
    use crate::vcpu::{self, VcpuState};

    const RAM: u64 = 4 << 20;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ftvm-snapshot-test-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn state() -> Components {
        let mut state = Components::default();
        state.put(memory::component_id(), &MemoryState { size: RAM });
        let [v, tsc] = vcpu::component_ids(0);
        state.put(v, &VcpuState::default());
        state.put(tsc, &0u64);
        state.put(clock::component_id(), &ClockState { ns: 42 });
        state
    }

    fn written(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
        let ram = GuestRam::new(RAM, false).unwrap();
        ram.write_page(1, &[3u8; PAGE]).unwrap();
        ram.write_page(700, &[9u8; PAGE]).unwrap();
        let path = dir.join("vm.snap");
        write(&path, &state(), &ram).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        (path, bytes)
    }

    #[test]
    fn round_trip_keeps_state_and_pages() {
        let dir = scratch("rt");
        let (path, bytes) = written(&dir);
        assert!(bytes.len() < 3 * PAGE + 4096, "zero pages are left out: {} bytes", bytes.len());
        assert_eq!(clock::saved_ns(&read_state(&path).unwrap()).unwrap(), 42);
        let ram = GuestRam::new(RAM, false).unwrap();
        let st = read(&path, &ram).unwrap();
        assert_eq!(vcpu::count(&st), 1);
        let mut page = [0u8; PAGE];
        ram.read_page(700, &mut page).unwrap();
        assert_eq!(page, [9u8; PAGE]);
        let small = GuestRam::new(RAM / 2, false).unwrap();
        assert!(read(&path, &small).is_err(), "a VM of another size");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn every_truncation_and_bit_flip_is_refused() {
        let dir = scratch("damage");
        let (_, bytes) = written(&dir);
        let bad = dir.join("bad.snap");
        let ram = GuestRam::new(RAM, false).unwrap();
        for cut in 0..bytes.len() {
            std::fs::write(&bad, &bytes[..cut]).unwrap();
            assert!(read(&bad, &ram).is_err(), "truncated to {cut} bytes and accepted");
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 1 << (i % 8);
            std::fs::write(&bad, &b).unwrap();
            let r = read(&bad, &ram);
            assert!(r.is_err(), "flip in byte {i} accepted");
            assert!(!r.unwrap_err().to_string().ends_with(": "), "error says what is wrong");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn only_an_earlier_snapshot_is_replaced() {
        let dir = scratch("replace");
        let (path, before) = written(&dir);
        let ram = GuestRam::new(RAM, false).unwrap();
        write(&path, &state(), &ram).unwrap();
        assert_ne!(std::fs::read(&path).unwrap(), before, "the earlier snapshot was replaced");
        let disk = dir.join("disk.img");
        std::fs::write(&disk, [0x5a; 4096]).unwrap();
        let link = dir.join("link.snap");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        for other in [&disk, &link, &dir] {
            let e = write(other, &state(), &ram).unwrap_err();
            assert!(matches!(e, SnapshotError::NotReplaced(_)), "{}: {e}", other.display());
        }
        assert_eq!(std::fs::read(&disk).unwrap(), [0x5a; 4096]);
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
