//! Loading x86-64 ELF programs the way Linux's `execve` does, for the
//! Linux personality (`no_std`, tested on the host): [`Elf::parse`] checks
//! a program or its interpreter and says what to copy where, [`Elf::copy`]
//! places its segments in memory the caller reserved, and [`stack`] lays out
//! the start-up stack (argv, environment, auxiliary vector).
//!
//! Memory is the caller's: the personality runs identity-mapped, so the
//! loader only needs a free range of [`Elf::span`] bytes for a
//! position-independent image (ET_DYN: a PIE, a static-pie or `ld.so`),
//! moved there by the load bias; images at fixed addresses (ET_EXEC) are
//! placed by the VMM instead.
#![no_std]

extern crate alloc;

pub mod stack;

use alloc::vec::Vec;

pub const PAGE: u64 = 4096;
pub const EHDR_SIZE: usize = 64;
pub const PHDR_SIZE: usize = 56;

const PT_LOAD: u32 = 1;
const PT_INTERP: u32 = 3;
const PT_PHDR: u32 = 6;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
const EM_X86_64: u16 = 62;
/// Executable segment (`p_flags`).
pub const PF_X: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    NotElf,
    /// Not a 64-bit little-endian x86-64 executable or shared object.
    WrongKind,
    /// Headers or segments outside the file, or inconsistent.
    Malformed(&'static str),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::NotElf => f.write_str("not an ELF file"),
            Error::WrongKind => f.write_str("not a 64-bit x86-64 executable"),
            Error::Malformed(what) => write!(f, "malformed ELF: {what}"),
        }
    }
}

/// One `PT_LOAD` segment, addresses as linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub vaddr: u64,
    pub offset: u64,
    pub filesz: u64,
    pub memsz: u64,
    pub flags: u32,
}

/// A checked program or interpreter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Elf<'a> {
    /// Position-independent (ET_DYN): loadable at any page-aligned bias.
    pub relocatable: bool,
    /// Entry point as linked.
    pub entry: u64,
    /// Where the program headers are as linked (`AT_PHDR` minus the bias).
    pub phdr: u64,
    pub phnum: u16,
    /// `PT_INTERP`: the dynamic linker the program asks for.
    pub interp: Option<&'a str>,
    /// Lowest page and one past the highest byte of the loadable segments.
    pub lo: u64,
    pub hi: u64,
    pub segments: Vec<Segment>,
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from(u32_at(b, off)) | (u64::from(u32_at(b, off + 4)) << 32)
}

impl<'a> Elf<'a> {
    pub fn parse(file: &'a [u8]) -> Result<Elf<'a>, Error> {
        if file.len() < 4 || &file[..4] != b"\x7fELF" {
            return Err(Error::NotElf);
        }
        if file.len() < EHDR_SIZE || file[4] != 2 || file[5] != 1 || u16_at(file, 18) != EM_X86_64 {
            return Err(Error::WrongKind);
        }
        let relocatable = match u16_at(file, 16) {
            ET_DYN => true,
            ET_EXEC => false,
            _ => return Err(Error::WrongKind),
        };
        let (entry, phoff) = (u64_at(file, 24), u64_at(file, 32));
        let (phentsize, phnum) = (u16_at(file, 54) as usize, u16_at(file, 56));
        if phentsize != PHDR_SIZE || phnum == 0 || phnum > 128 {
            return Err(Error::Malformed("bad program header table"));
        }
        let table_len = usize::from(phnum) * PHDR_SIZE;
        let table = usize::try_from(phoff)
            .ok()
            .and_then(|o| file.get(o..o.checked_add(table_len)?))
            .ok_or(Error::Malformed("program headers outside the file"))?;
        let (mut interp, mut phdr_seg) = (None, None);
        let mut segments = Vec::new();
        for ph in table.chunks_exact(PHDR_SIZE) {
            let (offset, vaddr, filesz, memsz) = (u64_at(ph, 8), u64_at(ph, 16), u64_at(ph, 32), u64_at(ph, 40));
            let in_file = offset.checked_add(filesz).is_some_and(|e| e <= file.len() as u64);
            match u32_at(ph, 0) {
                PT_LOAD => {
                    if !in_file || filesz > memsz || vaddr.checked_add(memsz).is_none() {
                        return Err(Error::Malformed("segment outside the file or the address space"));
                    }
                    if vaddr % PAGE != offset % PAGE {
                        return Err(Error::Malformed("segment address and file offset disagree modulo the page size"));
                    }
                    segments.push(Segment { vaddr, offset, filesz, memsz, flags: u32_at(ph, 4) });
                }
                PT_INTERP => {
                    if !in_file {
                        return Err(Error::Malformed("interpreter name outside the file"));
                    }
                    let name = &file[offset as usize..(offset + filesz) as usize];
                    let name = name.split(|&b| b == 0).next().unwrap_or_default();
                    interp = Some(core::str::from_utf8(name).map_err(|_| Error::Malformed("interpreter name"))?);
                }
                PT_PHDR => phdr_seg = Some(vaddr),
                _ => {}
            }
        }
        let lo = segments.iter().map(|s| s.vaddr).min().ok_or(Error::Malformed("no loadable segment"))? & !(PAGE - 1);
        let hi = segments.iter().map(|s| s.vaddr + s.memsz).max().unwrap_or(lo);
        // The headers' address: PT_PHDR, else inside the segment that maps
        // their file offset.
        let phdr = phdr_seg
            .or_else(|| {
                segments
                    .iter()
                    .find(|s| s.offset <= phoff && phoff + table_len as u64 <= s.offset + s.filesz)
                    .map(|s| s.vaddr + (phoff - s.offset))
            })
            .unwrap_or(0);
        Ok(Elf { relocatable, entry, phdr, phnum, interp, lo, hi, segments })
    }

    /// Bytes of memory the image covers, from its lowest page.
    pub fn span(&self) -> u64 {
        (self.hi - self.lo).div_ceil(PAGE) * PAGE
    }

    /// Copy the segments' file bytes of `file` into `dst`, which is the
    /// image's span (`dst[0]` is the linked address [`Elf::lo`]) and reads
    /// as zero: the bytes past each segment's file part (bss) stay zero,
    /// and bytes the file part does not cover are never written.
    pub fn copy(&self, file: &[u8], dst: &mut [u8]) {
        for s in &self.segments {
            let at = (s.vaddr - self.lo) as usize;
            let src = &file[s.offset as usize..(s.offset + s.filesz) as usize];
            dst[at..at + src.len()].copy_from_slice(src);
        }
    }

    /// `[start, end)` of each executable segment once moved by `bias`.
    pub fn text(&self, bias: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segments.iter().filter(|s| s.flags & PF_X != 0).map(move |s| (s.vaddr + bias, s.vaddr + s.memsz + bias))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    /// An ELF with the given (type, flags, offset, vaddr, filesz, memsz)
    /// program headers at offset 64, `file_len` bytes long.
    pub(crate) fn elf(kind: u16, phdrs: &[(u32, u32, u64, u64, u64, u64)], file_len: usize) -> Vec<u8> {
        let mut f = vec![0u8; file_len];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[16..18].copy_from_slice(&kind.to_le_bytes());
        f[18..20].copy_from_slice(&EM_X86_64.to_le_bytes());
        f[24..32].copy_from_slice(&0x1040u64.to_le_bytes());
        f[32..40].copy_from_slice(&64u64.to_le_bytes());
        f[54..56].copy_from_slice(&(PHDR_SIZE as u16).to_le_bytes());
        f[56..58].copy_from_slice(&(phdrs.len() as u16).to_le_bytes());
        for (i, &(t, fl, off, va, fs, ms)) in phdrs.iter().enumerate() {
            let p = &mut f[64 + i * PHDR_SIZE..][..PHDR_SIZE];
            p[0..4].copy_from_slice(&t.to_le_bytes());
            p[4..8].copy_from_slice(&fl.to_le_bytes());
            for (o, v) in [(8, off), (16, va), (24, va), (32, fs), (40, ms)] {
                p[o..o + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        f
    }

    fn pie() -> Vec<u8> {
        let mut f = elf(
            ET_DYN,
            &[
                (PT_INTERP, 4, 0x200, 0x200, 28, 28),
                (PT_LOAD, 4, 0, 0, 0x300, 0x300),
                (PT_LOAD, 5, 0x1000, 0x1000, 0x100, 0x100),
                (PT_LOAD, 6, 0x2000, 0x3000, 0x80, 0x2000),
            ],
            0x2080,
        );
        f[0x200..0x21c].copy_from_slice(b"/lib64/ld-linux-x86-64.so.2\0");
        f[0x1000..0x1100].fill(0xcc);
        f[0x2000..0x2080].fill(0xdd);
        f
    }

    #[test]
    fn a_pie_is_parsed_with_its_interpreter_and_extent() {
        let f = pie();
        let e = Elf::parse(&f).unwrap();
        assert!(e.relocatable);
        assert_eq!(e.interp, Some("/lib64/ld-linux-x86-64.so.2"));
        assert_eq!((e.lo, e.hi, e.span()), (0, 0x5000, 0x5000));
        assert_eq!((e.entry, e.phdr, e.phnum), (0x1040, 64, 4));
        assert_eq!(e.text(0x10_0000).collect::<Vec<_>>(), [(0x10_1000, 0x10_1100)]);
    }

    #[test]
    fn copy_places_file_bytes_and_leaves_bss_zero() {
        let f = pie();
        let e = Elf::parse(&f).unwrap();
        let mut dst = vec![0u8; e.span() as usize];
        e.copy(&f, &mut dst);
        assert_eq!(&dst[..4], b"\x7fELF");
        assert!(dst[0x1000..0x1100].iter().all(|&b| b == 0xcc));
        assert!(dst[0x1100..0x3000].iter().all(|&b| b == 0));
        assert!(dst[0x3000..0x3080].iter().all(|&b| b == 0xdd));
        assert!(dst[0x3080..].iter().all(|&b| b == 0));
    }

    #[test]
    fn bad_files_are_refused() {
        assert_eq!(Elf::parse(b"#!/bin/sh\n"), Err(Error::NotElf));
        let mut f = pie();
        f[4] = 1;
        assert_eq!(Elf::parse(&f), Err(Error::WrongKind));
        // A segment past the end of the file.
        let f = elf(ET_DYN, &[(PT_LOAD, 5, 0x1000, 0x1000, 0x5000, 0x5000)], 0x2000);
        assert!(matches!(Elf::parse(&f), Err(Error::Malformed(_))));
        // Misaligned offset and address.
        let f = elf(ET_DYN, &[(PT_LOAD, 5, 0x1000, 0x1010, 0x100, 0x100)], 0x2000);
        assert!(matches!(Elf::parse(&f), Err(Error::Malformed(_))));
        let f = elf(ET_DYN, &[(PT_INTERP, 4, 0x100, 0x100, 8, 8)], 0x200);
        assert_eq!(Elf::parse(&f), Err(Error::Malformed("no loadable segment")));
        // Truncated header table.
        let mut f = elf(ET_DYN, &[(PT_LOAD, 5, 0, 0, 0x10, 0x10)], 0x200);
        f.truncate(100);
        assert!(matches!(Elf::parse(&f), Err(Error::Malformed(_))));
    }
}
