//! The calibration guest, generated in code: a few dozen bytes of x86-64
//! written by hand, wrapped in a minimal ELF64 executable with the ftvm ABI
//! note, so the calibration needs no file beside the VMM.
//!
//! The program runs `rounds` rounds. Each round waits until the host has
//! re-armed dirty tracking and raised the go word, then writes one word to
//! each of `pages` pages twice: the first pass takes a tracked first write
//! per page, the second writes the same pages, now writable. It reads the
//! TSC around each pass and stores both durations in the control page,
//! then raises the done word. After the last round it exits with status 0.
//!
//! The guest times itself rather than signalling the host between passes:
//! a port exit costs 16-19 µs here, as much as three tracked writes, and
//! its jitter would swamp the untracked pass (under 10 ns a page), while
//! two TSC reads add tens of nanoseconds to a whole pass.

use ftvm_abi::layout::SYSTEM_AREA_END;
use ftvm_abi::{note, port, ABI_VERSION, PAGE_SIZE};

/// Where the code segment (ELF headers, note and code) is loaded.
const CODE: u64 = SYSTEM_AREA_END;
/// The control page the guest and the host share: words at these offsets.
pub const CONTROL: u64 = CODE + PAGE_SIZE;
/// The host stores the round it lets the guest start (1, 2, ...).
pub const GO: u64 = CONTROL;
/// The guest stores the round it has finished.
pub const DONE: u64 = CONTROL + 8;
/// The exit status (0) the exit hypercall points at.
const STATUS: u64 = CONTROL + 16;
/// Per round, two words: TSC ticks of the tracked pass, then of the
/// untracked pass.
pub const RESULTS: u64 = CONTROL + 64;
/// The pages written: one word at the start of each.
pub const PAGES: u64 = CONTROL + PAGE_SIZE;
/// Rounds whose results fit in the control page.
pub const MAX_ROUNDS: u32 = ((PAGE_SIZE - 64) / 16) as u32;

/// One past the highest address the image occupies with `pages` pages.
pub fn end(pages: u64) -> u64 {
    PAGES + pages * PAGE_SIZE
}

/// Machine code with backward conditional jumps.
struct Code(Vec<u8>);

impl Code {
    fn emit(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }

    fn imm32(&mut self, opcode: &[u8], imm: u64) -> &mut Self {
        let imm = u32::try_from(imm).expect("calibration guest addresses and counts fit in 32 bits");
        self.emit(opcode).emit(&imm.to_le_bytes())
    }

    fn here(&self) -> usize {
        self.0.len()
    }

    /// A short conditional jump (`opcode` rel8) back to `target`.
    fn jump_back(&mut self, opcode: u8, target: usize) -> &mut Self {
        let rel = target as isize - (self.here() + 2) as isize;
        let rel = i8::try_from(rel).expect("calibration guest loops are short");
        self.emit(&[opcode, rel as u8])
    }

    /// A near conditional jump (`0f opcode` rel32) back to `target`.
    fn jump_back_near(&mut self, opcode: u8, target: usize) -> &mut Self {
        let rel = target as i64 - (self.here() + 6) as i64;
        let rel = i32::try_from(rel).expect("calibration guest is small");
        self.emit(&[0x0f, opcode]).emit(&rel.to_le_bytes())
    }

    /// `rax` = TSC once every earlier instruction and store has completed:
    /// mfence drains the stores of a pass, lfence keeps rdtsc after it.
    fn timestamp(&mut self) -> &mut Self {
        self.emit(&[0x0f, 0xae, 0xf0]) // mfence
            .emit(&[0x0f, 0xae, 0xe8]) // lfence
            .emit(&[0x0f, 0x31]) // rdtsc: edx:eax = TSC
            .emit(&[0x48, 0xc1, 0xe2, 0x20]) // shl rdx, 32
            .emit(&[0x48, 0x09, 0xd0]) // or rax, rdx
    }

    /// One pass: a word written at the start of each of `pages` pages,
    /// its duration in TSC ticks stored at `[r10 + slot]`.
    fn pass(&mut self, pages: u64, slot: u8) -> &mut Self {
        self.timestamp().emit(&[0x49, 0x89, 0xc1]); // mov r9, rax: start of the pass
        self.imm32(&[0xbf], PAGES) // mov edi, PAGES
            .imm32(&[0xb9], pages); // mov ecx, pages
        let write = self.here();
        self.emit(&[0x48, 0x89, 0x0f]) // mov [rdi], rcx: the write
            .emit(&[0x48, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00]) // add rdi, 4096
            .emit(&[0xff, 0xc9]) // dec ecx
            .jump_back(0x75, write); // jnz write
        self.timestamp()
            .emit(&[0x4c, 0x29, 0xc8]) // sub rax, r9
            .emit(&[0x49, 0x89, 0x42, slot]) // mov [r10 + slot], rax
    }
}

/// The program: see the module comment. Entered at CPL3 with a stack it
/// never uses.
pub fn program(pages: u64, rounds: u32) -> Vec<u8> {
    let mut c = Code(Vec::new());
    c.emit(&[0x45, 0x31, 0xc0]) // xor r8d, r8d: rounds finished
        .imm32(&[0x41, 0xba], RESULTS); // mov r10d, RESULTS: this round's results
    let wait = c.here();
    c.emit(&[0xf3, 0x90]) // pause: a spin-wait hint
        .imm32(&[0x48, 0x8b, 0x04, 0x25], GO) // mov rax, [GO]
        .emit(&[0x4c, 0x39, 0xc0]) // cmp rax, r8
        .jump_back(0x76, wait) // jbe wait: the host has not raised go past r8
        .emit(&[0x49, 0xff, 0xc0]); // inc r8: this round
    c.pass(pages, 0) // tracked: each page's first write since the re-arm
        .pass(pages, 8) // untracked: the same pages, now writable
        .emit(&[0x49, 0x83, 0xc2, 0x10]) // add r10, 16: next round's results
        .imm32(&[0x4c, 0x89, 0x04, 0x25], DONE) // mov [DONE], r8
        .imm32(&[0x49, 0x81, 0xf8], rounds.into()) // cmp r8, rounds
        .jump_back_near(0x82, wait) // jb wait
        .imm32(&[0xba], port::EXIT.into()) // mov edx, port::EXIT
        .imm32(&[0xb8], STATUS) // mov eax, STATUS: where the exit status is
        .emit(&[0xef]) // out dx, eax: the exit hypercall
        .emit(&[0x0f, 0x0b]); // ud2: the VM has stopped, never reached
    c.0
}

const EHDR_SIZE: u64 = 64;
const PHDR_SIZE: u64 = 56;
const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
const PF_X: u32 = 1;
const PF_W: u32 = 2;
const PF_R: u32 = 4;

struct Segment {
    kind: u32,
    flags: u32,
    offset: u64,
    addr: u64,
    file_size: u64,
    mem_size: u64,
    align: u64,
}

/// The ELF64 ET_EXEC image: headers, the ABI note and the code in one
/// loaded segment at `CODE`; the control page and the pages in a second,
/// zero-filled one (guest RAM starts zeroed).
pub fn image(pages: u64, rounds: u32) -> Vec<u8> {
    const PHNUM: u64 = 3;
    let note_offset = EHDR_SIZE + PHNUM * PHDR_SIZE;
    let mut note = Vec::new();
    note.extend_from_slice(&(note::NAME.len() as u32).to_le_bytes());
    note.extend_from_slice(&(note::DESC_SIZE as u32).to_le_bytes());
    note.extend_from_slice(&note::TYPE_ABI.to_le_bytes());
    note.extend_from_slice(note::NAME);
    note.resize(note.len().next_multiple_of(4), 0);
    // The descriptor (`note::AbiNote`): no flags (not a Linux runtime), no
    // syscall entry.
    note.extend_from_slice(&ABI_VERSION.to_le_bytes());
    note.extend_from_slice(&0u32.to_le_bytes());
    note.extend_from_slice(&0u64.to_le_bytes());
    let code_offset = (note_offset + note.len() as u64).next_multiple_of(16);
    let code = program(pages, rounds);
    let file_size = code_offset + code.len() as u64;
    let entry = CODE + code_offset;

    let mut elf = Vec::with_capacity(file_size as usize);
    elf.extend_from_slice(b"\x7fELF");
    elf.extend_from_slice(&[2, 1, 1, 0]); // ELF64, little-endian, version 1, System V
    elf.resize(16, 0);
    elf.extend_from_slice(&2u16.to_le_bytes()); // e_type: ET_EXEC
    elf.extend_from_slice(&62u16.to_le_bytes()); // e_machine: x86-64
    elf.extend_from_slice(&1u32.to_le_bytes()); // e_version
    elf.extend_from_slice(&entry.to_le_bytes());
    elf.extend_from_slice(&EHDR_SIZE.to_le_bytes()); // e_phoff
    elf.extend_from_slice(&0u64.to_le_bytes()); // e_shoff: no sections
    elf.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    elf.extend_from_slice(&(EHDR_SIZE as u16).to_le_bytes());
    elf.extend_from_slice(&(PHDR_SIZE as u16).to_le_bytes());
    elf.extend_from_slice(&(PHNUM as u16).to_le_bytes());
    elf.extend_from_slice(&[0; 6]); // e_shentsize, e_shnum, e_shstrndx
    let segments = [
        Segment { kind: PT_LOAD, flags: PF_R | PF_X, offset: 0, addr: CODE, file_size, mem_size: file_size, align: PAGE_SIZE },
        Segment {
            kind: PT_LOAD,
            flags: PF_R | PF_W,
            offset: 0,
            addr: CONTROL,
            file_size: 0,
            mem_size: end(pages) - CONTROL,
            align: PAGE_SIZE,
        },
        Segment {
            kind: PT_NOTE,
            flags: PF_R,
            offset: note_offset,
            addr: CODE + note_offset,
            file_size: note.len() as u64,
            mem_size: note.len() as u64,
            align: 4,
        },
    ];
    for s in segments {
        elf.extend_from_slice(&s.kind.to_le_bytes());
        elf.extend_from_slice(&s.flags.to_le_bytes());
        for word in [s.offset, s.addr, s.addr, s.file_size, s.mem_size, s.align] {
            elf.extend_from_slice(&word.to_le_bytes());
        }
    }
    elf.extend_from_slice(&note);
    elf.resize(code_offset as usize, 0);
    elf.extend_from_slice(&code);
    elf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_is_an_ftvm_guest_the_loader_accepts() {
        let elf = image(256, 4);
        let path = std::env::temp_dir().join(format!("ftvm-calibrate-test-{}.elf", std::process::id()));
        std::fs::write(&path, &elf).unwrap();
        let inspected = crate::boot::image::inspect(&path, 64 << 20);
        std::fs::remove_file(&path).unwrap();
        let loaded = inspected.unwrap();
        assert_eq!(loaded.note, Some(note::AbiNote { abi_version: ABI_VERSION, flags: 0, syscall_entry: 0 }));
        assert_eq!((loaded.start, loaded.end), (CODE, end(256)));
        assert!(loaded.entry > CODE && loaded.entry < CONTROL, "entry {:#x} in the code segment", loaded.entry);
    }

    #[test]
    fn program_ends_in_the_exit_hypercall() {
        let code = program(1024, 8);
        assert!(code.len() < 200, "a few dozen instructions: {} bytes", code.len());
        // mov edx, 0x502; mov eax, STATUS; out dx, eax; ud2
        let tail = [&[0xba, 0x02, 0x05, 0, 0, 0xb8][..], &(STATUS as u32).to_le_bytes(), &[0xef, 0x0f, 0x0b]].concat();
        assert!(code.ends_with(&tail));
    }
}
