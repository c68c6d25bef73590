//! Guest images: static x86-64 ELF executables loaded at their physical
//! addresses above the system area.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::loader::{Elf, KernelLoader};
use vm_memory::GuestAddress;

use ftvm_abi::layout::SYSTEM_AREA_END;
use ftvm_abi::note::{self, AbiNote};

use crate::memory::GuestMemory;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("cannot open image {path}: {err}")]
    Open { path: String, err: std::io::Error },
    #[error("image {0} is not an ELF file")]
    NotElf(String),
    #[error("image {path} is not a 64-bit little-endian x86-64 executable ({what})")]
    WrongKind { path: String, what: &'static str },
    #[error("image {path} is malformed: {what}")]
    Malformed { path: String, what: &'static str },
    #[error("image {path} has a segment at {start:#x}..{end:#x}; loadable segments must lie in {min:#x}..{max:#x}")]
    OutOfRange { path: String, start: u64, end: u64, min: u64, max: u64 },
    #[error("image {path} needs {needed} MiB of guest memory, the VM has {have} MiB")]
    TooLarge { path: String, needed: u64, have: u64 },
    #[error("cannot load image {path}: {err}")]
    Load { path: String, err: String },
}

/// Where a loaded image lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadedImage {
    pub entry: u64,
    /// Lowest and one-past-highest address of any loadable segment (incl. bss).
    pub start: u64,
    pub end: u64,
    /// The ftvm ABI note; `None` for a plain Linux program.
    pub note: Option<AbiNote>,
    /// Address of the program header table once loaded (0: no loadable
    /// segment covers it) and its entry count.
    pub phdr: u64,
    pub phnum: u16,
    /// Every loadable segment has its virtual address equal to its physical
    /// one (the guest runs identity-mapped, and Linux programs are linked by
    /// virtual address).
    pub identity: bool,
}

const EHDR_SIZE: usize = 64;
pub(crate) const PHDR_SIZE: usize = 56;
const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
/// Larger note segments are not read (ours is 32 bytes).
const MAX_NOTE_SEGMENT: u64 = 4096;
const PT_INTERP: u32 = 3;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
const EM_X86_64: u16 = 62;

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(b[off..off + 2].try_into().expect("slice of 2"))
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("slice of 4"))
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("slice of 8"))
}

/// Whether `path` is a position-independent Linux program (ET_DYN: a PIE,
/// dynamically linked or static-pie), which the Linux personality loads
/// itself from the root file system. A file that is no x86-64 ELF at all
/// is not, and [`inspect`] says what is wrong with it; a dynamically
/// linked program at fixed addresses is refused (it would overlap the
/// runtime's memory).
pub fn is_dynamic(path: &Path) -> Result<bool, ImageError> {
    let name = path.display().to_string();
    let mut file = File::open(path).map_err(|err| ImageError::Open { path: name.clone(), err })?;
    let mut ehdr = [0u8; EHDR_SIZE];
    let n = file.read(&mut ehdr).map_err(|err| ImageError::Open { path: name.clone(), err })?;
    if n < EHDR_SIZE || &ehdr[..4] != b"\x7fELF" || ehdr[4] != 2 || ehdr[5] != 1 || u16_at(&ehdr, 18) != EM_X86_64 {
        return Ok(false);
    }
    match u16_at(&ehdr, 16) {
        ET_DYN => return Ok(true),
        ET_EXEC => {}
        _ => return Ok(false),
    }
    let (phoff, phentsize, phnum) = (u64_at(&ehdr, 32), u16_at(&ehdr, 54) as usize, u16_at(&ehdr, 56) as usize);
    if phentsize != PHDR_SIZE || phnum > 64 {
        return Ok(false);
    }
    let mut phdrs = vec![0u8; phnum * PHDR_SIZE];
    if file.seek(SeekFrom::Start(phoff)).and_then(|_| file.read_exact(&mut phdrs)).is_err() {
        return Ok(false);
    }
    if phdrs.chunks_exact(PHDR_SIZE).any(|ph| u32_at(ph, 0) == PT_INTERP) {
        return Err(ImageError::WrongKind { path: name, what: "dynamically linked at fixed addresses; build it as a PIE (-pie)" });
    }
    Ok(false)
}

/// Check that `path` is an image this VMM can run in `mem_size` bytes and
/// return its extent, before anything is written to guest memory.
pub fn inspect(path: &Path, mem_size: u64) -> Result<LoadedImage, ImageError> {
    let name = path.display().to_string();
    let mut file = File::open(path).map_err(|err| ImageError::Open { path: name.clone(), err })?;
    let mut ehdr = [0u8; EHDR_SIZE];
    let n = file.read(&mut ehdr).map_err(|err| ImageError::Open { path: name.clone(), err })?;
    if n < 4 || &ehdr[..4] != b"\x7fELF" {
        return Err(ImageError::NotElf(name));
    }
    let wrong = |what| ImageError::WrongKind { path: name.clone(), what };
    if n < EHDR_SIZE || ehdr[4] != 2 {
        return Err(wrong("not ELF64"));
    }
    if ehdr[5] != 1 {
        return Err(wrong("not little-endian"));
    }
    if u16_at(&ehdr, 18) != EM_X86_64 {
        return Err(wrong("machine is not x86-64"));
    }
    if u16_at(&ehdr, 16) != ET_EXEC {
        return Err(wrong("not a static executable (ET_EXEC)"));
    }
    let entry = u64_at(&ehdr, 24);
    let phoff = u64_at(&ehdr, 32);
    let phentsize = u16_at(&ehdr, 54) as usize;
    let phnum = u16_at(&ehdr, 56) as usize;
    let malformed = |what| ImageError::Malformed { path: name.clone(), what };
    if phentsize != PHDR_SIZE || phnum == 0 || phnum > 64 {
        return Err(malformed("bad program header table"));
    }
    let mut phdrs = vec![0u8; phnum * PHDR_SIZE];
    file.seek(SeekFrom::Start(phoff)).and_then(|_| file.read_exact(&mut phdrs)).map_err(|_| malformed("truncated program header table"))?;
    let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let (mut start, mut end) = (u64::MAX, 0u64);
    let (mut abi_note, mut phdr, mut identity) = (None, 0, true);
    let phdrs_len = (phnum * PHDR_SIZE) as u64;
    for ph in phdrs.chunks_exact(PHDR_SIZE) {
        let (offset, vaddr, paddr, filesz, memsz) = (u64_at(ph, 8), u64_at(ph, 16), u64_at(ph, 24), u64_at(ph, 32), u64_at(ph, 40));
        if offset.checked_add(filesz).is_none_or(|e| e > file_len) {
            return Err(malformed("segment extends past the end of the file"));
        }
        match u32_at(ph, 0) {
            PT_LOAD => {}
            PT_NOTE if abi_note.is_none() && filesz <= MAX_NOTE_SEGMENT => {
                let mut notes = vec![0u8; filesz as usize];
                file.seek(SeekFrom::Start(offset)).and_then(|_| file.read_exact(&mut notes)).map_err(|_| malformed("truncated note"))?;
                abi_note = find_abi_note(&notes);
                continue;
            }
            _ => continue,
        }
        if filesz > memsz {
            return Err(malformed("segment extends past the end of the file"));
        }
        let seg_end = paddr.checked_add(memsz).ok_or_else(|| malformed("segment address overflows"))?;
        start = start.min(paddr);
        end = end.max(seg_end);
        identity &= vaddr == paddr;
        if phdr == 0 && offset <= phoff && phoff.saturating_add(phdrs_len) <= offset + filesz {
            phdr = paddr + (phoff - offset);
        }
    }
    if end == 0 {
        return Err(malformed("no loadable segment"));
    }
    if start < SYSTEM_AREA_END || end > (1 << 32) {
        return Err(ImageError::OutOfRange { path: name, start, end, min: SYSTEM_AREA_END, max: 1 << 32 });
    }
    if end > mem_size {
        return Err(ImageError::TooLarge { path: name, needed: end.div_ceil(1 << 20), have: mem_size >> 20 });
    }
    if !(start..end).contains(&entry) {
        return Err(malformed("entry point outside the loadable segments"));
    }
    Ok(LoadedImage { entry, start, end, note: abi_note, phdr, phnum: phnum as u16, identity })
}

/// The ftvm ABI descriptor among the ELF notes of one `PT_NOTE` segment.
fn find_abi_note(mut notes: &[u8]) -> Option<AbiNote> {
    // Each note: namesz, descsz, type (u32 each), then name and descriptor,
    // each padded to 4 bytes.
    while notes.len() >= 12 {
        let (namesz, descsz, kind) = (u32_at(notes, 0) as usize, u32_at(notes, 4) as usize, u32_at(notes, 8));
        let name_end = 12 + namesz.next_multiple_of(4);
        let desc_end = name_end.checked_add(descsz.next_multiple_of(4))?;
        if desc_end > notes.len() {
            return None;
        }
        if kind == note::TYPE_ABI && &notes[12..12 + namesz] == note::NAME && descsz >= note::DESC_SIZE {
            let d = &notes[name_end..];
            return Some(AbiNote { abi_version: u32_at(d, 0), flags: u32_at(d, 4), syscall_entry: u64_at(d, 8) });
        }
        notes = &notes[desc_end..];
    }
    None
}

/// Validate and copy the image's segments into guest memory. Memory beyond
/// each segment's file size (bss) is left as is: guest RAM starts zeroed.
pub fn load(mem: &GuestMemory, path: &Path, mem_size: u64) -> Result<LoadedImage, ImageError> {
    let image = inspect(path, mem_size)?;
    let name = path.display().to_string();
    let mut file = File::open(path).map_err(|err| ImageError::Open { path: name.clone(), err })?;
    Elf::load(mem, None, &mut file, Some(GuestAddress(SYSTEM_AREA_END)))
        .map_err(|e| ImageError::Load { path: name, err: e.to_string() })?;
    Ok(image)
}
