//! The program's executable segments, read from its program headers: the
//! only bytes the system-call rewrite ([`crate::sysjmp`]) ever changes.

use alloc::vec::Vec;

use ftvm_abi::Program;

const PT_LOAD: u32 = 1;
const PF_X: u32 = 1;

/// [start, end) of each executable `PT_LOAD` segment of `program`.
pub fn segments(program: &Program) -> Vec<(u64, u64)> {
    let mut text = Vec::new();
    for i in 0..u64::from(program.phnum) {
        let ph = program.phdr + i * u64::from(program.phent);
        // SAFETY: the VMM loaded the program's headers at `phdr` (AT_PHDR),
        // in the program's memory, which the runtime owns until it starts.
        let (kind, flags, vaddr, memsz) = unsafe {
            (
                (ph as *const u32).read_unaligned(),
                ((ph + 4) as *const u32).read_unaligned(),
                ((ph + 16) as *const u64).read_unaligned(),
                ((ph + 40) as *const u64).read_unaligned(),
            )
        };
        if kind == PT_LOAD && flags & PF_X != 0 {
            text.push((vaddr, vaddr.saturating_add(memsz)));
        }
    }
    text
}

/// Whether [start, end) lies inside one of `text`'s segments.
pub fn contains(text: &[(u64, u64)], start: u64, end: u64) -> bool {
    text.iter().any(|&(s, e)| start >= s && end <= e)
}
