//! `syscall=patch`: the program's `syscall` instructions rewritten, as they
//! are first executed, into `call *%rax`, which is a plain call into the
//! VMM's trampoline page at address 0 (`ftvm_abi::syscall_page`) and from
//! there into the same entry.
//!
//! Why: on these hosts a `syscall` instruction traps to the hypervisor
//! before it lands at LSTAR, about 1 µs, while redis-server makes two or
//! three calls per request. A call costs nanoseconds. The rewrite needs no
//! disassembler: a system call's return address is right after its
//! two-byte instruction, and `call *%rax` (`ff d0`) is two bytes too, with
//! `rax` holding the system-call number at every `syscall` by definition
//! (zpoline, USENIX ATC '23, does the same at load time).
//!
//! What it costs in fidelity, which is why it is a switch (off by default):
//! - page 0 is mapped (read-only, executable), so a NULL read or call no
//!   longer faults;
//! - the call pushes its return address below the program's stack pointer,
//!   over the first 8 bytes of the System V red zone; code that keeps a
//!   value there across an inline `syscall` (a leaf function) would lose it;
//! - a rewritten site later reached with a number of 512 or more jumps past
//!   the sled (an `int3`, a page fault, or worse for numbers that are RAM
//!   addresses).
//!
//! A call through a null function pointer would run the sled too and look
//! like system call 0 (read). It is told apart here: the trampoline is
//! entered legitimately only from a site this module rewrote, so
//! [`site`] checks the return address against the rewritten sites and ends
//! the program, as the fault it would be without the page, otherwise.

use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering};

use ftvm_abi::Program;
use spin::{Mutex, Once};

use crate::entry;

const SYSCALL: [u8; 2] = [0x0f, 0x05];
const CALL_RAX: [u8; 2] = [0xff, 0xd0];

/// The program's executable segments, [start, end), once patching is on.
static TEXT: Once<Vec<(u64, u64)>> = Once::new();
/// Sites rewritten so far.
static PATCHED: AtomicU64 = AtomicU64::new(0);
/// System calls that came through the trampoline (no trap).
static CALLED: AtomicU64 = AtomicU64::new(0);
/// Their addresses, sorted: the only places the trampoline is called from.
static SITES: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// Turn patching on for `program` (its segments are loaded).
pub fn init(program: &Program) {
    let text = crate::text::segments(program);
    ftvm_rt::map_syscall_page(entry::ftvm_linux_syscall_entry);
    TEXT.call_once(|| text);
}

/// How the program got into the system-call entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A `syscall` instruction, or a call from a rewritten site.
    Syscall,
    /// The trampoline page, but not from a rewritten site: the program
    /// called (or jumped to) an address in page 0, a null function pointer.
    NullCall,
}

/// A system call returning to `ret` is being served: if it came from a
/// `syscall` instruction in the program's text, rewrite that instruction;
/// if it came through the trampoline page from anywhere but a rewritten
/// site, say so.
pub fn site(ret: u64) -> Entry {
    let Some(text) = TEXT.get() else { return Entry::Syscall };
    let at = ret.wrapping_sub(2);
    // Two readable bytes before `ret`? (A jump to page 0 leaves no return
    // address, so `ret` is whatever the stack held.)
    let Ok(bytes) = crate::sys::user::bytes(at, 2) else { return Entry::NullCall };
    let bytes = [bytes[0], bytes[1]];
    if bytes == SYSCALL {
        if crate::text::contains(text, at, ret) {
            let p = at as *mut [u8; 2];
            // SAFETY: the two bytes lie in an executable segment of the
            // program (checked), identity-mapped and writable from here; the
            // program runs only when this call returns (one vCPU), and x86
            // orders a store before a later fetch of the same bytes on the
            // same CPU.
            unsafe { p.write(CALL_RAX) };
            let mut sites = SITES.lock();
            if let Err(i) = sites.binary_search(&at) {
                sites.insert(i, at);
            }
            PATCHED.fetch_add(1, Ordering::Relaxed);
        }
        return Entry::Syscall;
    }
    if bytes == CALL_RAX && SITES.lock().binary_search(&at).is_ok() {
        CALLED.fetch_add(1, Ordering::Relaxed);
        return Entry::Syscall;
    }
    Entry::NullCall
}

pub fn enabled() -> bool {
    TEXT.get().is_some()
}

/// Sites rewritten so far.
pub fn patched() -> u64 {
    PATCHED.load(Ordering::Relaxed)
}

/// System calls that came through the trampoline from a rewritten site.
pub fn called() -> u64 {
    CALLED.load(Ordering::Relaxed)
}
