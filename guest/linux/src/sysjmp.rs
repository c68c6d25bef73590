//! `syscall=jmp` (the default): system calls without the `syscall` trap,
//! page 0 left unmapped and the red zone untouched.
//!
//! On these hosts a `syscall` instruction traps to the hypervisor before it
//! lands at LSTAR (1-5 µs). So the first time a site traps, the runtime,
//! which then knows its address and number, looks at the 5 bytes before it.
//! When they are one whole instruction that can run anywhere and leaves
//! the flags alone, it copies that instruction into a per-site stub in its
//! own memory and overwrites it in the program with `jmp rel32` to the
//! stub. The `0f 05` bytes stay: code that jumps to the `syscall` itself
//! still traps and is served. The stub is
//!
//! ```text
//!     <the instruction(s) from the jmp to the syscall>  ; mov $nr,%eax
//!     lea  site+2(%rip), %rcx          ; the return address, as `syscall`
//!     jmp  ftvm_linux_jmp_entry        ; RFLAGS into r11 on the kernel stack
//! ```
//!
//! No push on the program's stack (the red zone is intact) and nothing
//! mapped at page 0 (a NULL read or call faults as on Linux).
//!
//! Forked processes have copies of the program's text; a rewrite made in
//! one is made in all of them (`process::patch_text`), so a site is
//! rewritten everywhere once, as the one table of sites seen assumes.
//!
//! Recognised instructions before a `syscall` at `site`:
//! - `mov $imm32,%eax` (`b8 imm32`) with imm32 equal to the number the site
//!   trapped with (`mov` to eax zero-extends, so rax == imm32 exactly), and
//!   the byte before `b8` not a REX or legacy prefix nor `0f` (then `b8`
//!   would be part of a longer instruction: `41 b8` is `mov $imm,%r8d`,
//!   `0f b8` is popcnt). musl's inline `__syscall0`..`6` with a constant
//!   number compile to this.
//! - musl's `__syscall_cp_asm` (read, write, epoll_pwait and every other
//!   cancellable call of a program linked with `pthread_cancel`, such as
//!   redis-server): the whole routine, 42 bytes fixed by musl's assembly
//!   source, matches byte for byte, so its instruction boundaries are
//!   known. The rewritten instruction is one of its last three 5-byte
//!   moves (`mov %r11,8(%rsp)`, `mov 16(%rsp),%r9`, `mov 8(%rsp),%r8`:
//!   the nearest the `syscall` that lies within 16 aligned bytes; being 5
//!   bytes apart, one always does), and the stub runs it and the moves
//!   after it; the number is already in rax.
//! - glibc 2.36's `read` and `epoll_wait` (Debian 12's libc.so.6, which a
//!   dynamically linked program maps; its text is added by `mmap` with
//!   PROT_EXEC), on the path a program with threads takes: `read` sets its
//!   number with `xor %eax,%eax`, 2 bytes, so there is no `mov` to
//!   replace, and `epoll_wait`'s `mov` crosses a 16-byte boundary. Their
//!   bytes from the `sub $0x28,%rsp` to the `syscall` (44 and 54) match
//!   byte for byte but the `call` displacement, so the instruction
//!   boundaries are known, and the rewritten instruction is one of two
//!   5-byte loads from the stack (whichever lies within 16 aligned bytes);
//!   the stub runs it and everything after it up to the `syscall`
//!   (position-independent; nothing jumps into those bytes).
//!
//! What could still go wrong, and why it is accepted:
//! - Without disassembling from a known boundary, `b8 imm32` could be the
//!   tail of a longer instruction (a ModRM, SIB, displacement or immediate
//!   byte `b8` followed by 4 bytes equal to the number). The site must then
//!   also have trapped with rax equal to those 4 bytes, and the excluded
//!   prefixes rule out the encodings where that is natural (`mov` to
//!   r8d-r15d). Compilers emit `mov $nr,%eax` right before `syscall` for
//!   exactly this case; we found no other in musl or redis-server.
//! - Code that jumps into the middle of the 5 bytes (overlapping
//!   instructions, hand-written tricks) or reads its own text would see
//!   the `jmp`. Not done by compiled code.
//! - A site where a path jumps to the `mov` with the intent of a different
//!   number cannot exist: the `mov` sets the number.
//!
//! Sites without a recognised instruction keep trapping; at exit the
//! runtime prints how many calls trapped and how many sites were left
//! (`linux: syscall=jmp calls=... trapped=...`).
//!
//! Cross-modification: threads run on vCPU 0 only today, but the rewrite
//! is written so that a concurrent executor on another vCPU sees either the
//! old `mov` or the whole new `jmp`, never a mix: the 5 bytes are replaced
//! by one `lock cmpxchg16b` of the aligned 16 bytes that contain them
//! (sites whose 5 bytes cross a 16-byte boundary are skipped). A locked
//! access to an aligned 16-byte block is atomic and lies within one cache
//! line, so another processor's instruction fetch of that line observes it
//! entirely before or entirely after (x86 keeps instruction fetch coherent
//! with stores by snooping, and a processor executing from a line another
//! one writes discards what it fetched). The stub is written before the
//! locked write, which orders all earlier stores, so a processor that
//! fetches the `jmp` finds a complete stub. The other 11 bytes are written
//! back unchanged, and under the module's lock, so no concurrent rewrite is
//! lost; the compare fails (and the site is left alone) if anything else
//! changed them meanwhile.

use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering};

use spin::{Mutex, Once};

use crate::entry;

/// Bytes per stub (at most 20 moved + 12, padded with `int3`).
const STUB_SIZE: usize = 32;
/// Stubs available: redis-server has 203 `syscall` instructions.
const STUB_COUNT: usize = 2048;
const SYSCALL: [u8; 2] = [0x0f, 0x05];
const MOV_EAX: u8 = 0xb8;
const JMP_REL32: u8 = 0xe9;
const INT3: u8 = 0xcc;

/// musl 1.2's `__syscall_cp_asm` (src/thread/x86_64/syscall_cp.s) up to
/// and including the `ret` after its `syscall`.
const MUSL_SYSCALL_CP_ASM: [u8; 42] = [
    0x8b, 0x07, // mov (%rdi),%eax
    0x85, 0xc0, // test %eax,%eax
    0x75, 0x24, // jne __cp_cancel
    0x49, 0x89, 0xfb, // mov %rdi,%r11
    0x48, 0x89, 0xf0, // mov %rsi,%rax
    0x48, 0x89, 0xd7, // mov %rdx,%rdi
    0x48, 0x89, 0xce, // mov %rcx,%rsi
    0x4c, 0x89, 0xc2, // mov %r8,%rdx
    0x4d, 0x89, 0xca, // mov %r9,%r10
    0x4c, 0x8b, 0x44, 0x24, 0x08, // mov 8(%rsp),%r8
    0x4c, 0x8b, 0x4c, 0x24, 0x10, // mov 16(%rsp),%r9
    0x4c, 0x89, 0x5c, 0x24, 0x08, // mov %r11,8(%rsp)
    0x0f, 0x05, // syscall
    0xc3, // ret
];
/// Where its `syscall` is.
const MUSL_SITE: u64 = 39;
/// Where its 5-byte, position-independent moves start (`mov %r11,8(%rsp)`,
/// `mov 16(%rsp),%r9`, `mov 8(%rsp),%r8`): what the `jmp` may replace.
const MUSL_MOVES: [u64; 3] = [34, 29, 24];

/// A routine recognised whole around its `syscall`: its bytes from a known
/// instruction boundary to the end of the `syscall`, those not compared
/// (a `call` displacement, which depends on the build's layout), the
/// number it makes the call with, and where two of its position-independent
/// 5-byte instructions start (everything from one of them to the `syscall`
/// is what the stub runs; nothing jumps into those bytes). They are 5 to
/// 11 bytes apart, so when the first crosses a 16-byte boundary the second
/// does not.
struct Routine {
    bytes: &'static [u8],
    wild: core::ops::Range<usize>,
    nr: u64,
    moves: [u64; 2],
}

impl Routine {
    fn site(&self) -> u64 {
        self.bytes.len() as u64 - 2
    }

    fn matches(&self, b: &[u8]) -> bool {
        b.len() == self.bytes.len() && b.iter().zip(self.bytes).enumerate().all(|(i, (x, y))| self.wild.contains(&i) || x == y)
    }
}

/// glibc 2.36's (Debian 12's libc.so.6) cancellable calls that a server
/// makes per request, on the path a program with threads takes (from the
/// `sub $0x28,%rsp` after the single-thread test): `read`, whose number is
/// set by `xor %eax,%eax` (no `mov` to replace), and `epoll_wait`, whose
/// `mov $232,%eax` crosses a 16-byte boundary.
const GLIBC_ROUTINES: [Routine; 2] = [
    Routine {
        bytes: &[
            0x48, 0x83, 0xec, 0x28, // sub $0x28,%rsp
            0x48, 0x89, 0x54, 0x24, 0x18, // mov %rdx,0x18(%rsp)
            0x48, 0x89, 0x74, 0x24, 0x10, // mov %rsi,0x10(%rsp)
            0x89, 0x7c, 0x24, 0x08, // mov %edi,0x8(%rsp)
            0xe8, 0, 0, 0, 0, // call __pthread_enable_asynccancel
            0x48, 0x8b, 0x54, 0x24, 0x18, // mov 0x18(%rsp),%rdx
            0x48, 0x8b, 0x74, 0x24, 0x10, // mov 0x10(%rsp),%rsi
            0x41, 0x89, 0xc0, // mov %eax,%r8d
            0x8b, 0x7c, 0x24, 0x08, // mov 0x8(%rsp),%edi
            0x31, 0xc0, // xor %eax,%eax
            0x0f, 0x05, // syscall
        ],
        wild: 19..23,
        nr: 0,
        moves: [28, 23],
    },
    Routine {
        bytes: &[
            0x48, 0x83, 0xec, 0x28, // sub $0x28,%rsp
            0x89, 0x54, 0x24, 0x18, // mov %edx,0x18(%rsp)
            0x48, 0x89, 0x74, 0x24, 0x10, // mov %rsi,0x10(%rsp)
            0x89, 0x7c, 0x24, 0x0c, // mov %edi,0xc(%rsp)
            0x89, 0x4c, 0x24, 0x1c, // mov %ecx,0x1c(%rsp)
            0xe8, 0, 0, 0, 0, // call __pthread_enable_asynccancel
            0x44, 0x8b, 0x54, 0x24, 0x1c, // mov 0x1c(%rsp),%r10d
            0x8b, 0x54, 0x24, 0x18, // mov 0x18(%rsp),%edx
            0x41, 0x89, 0xc0, // mov %eax,%r8d
            0x48, 0x8b, 0x74, 0x24, 0x10, // mov 0x10(%rsp),%rsi
            0x8b, 0x7c, 0x24, 0x0c, // mov 0xc(%rsp),%edi
            0xb8, 0xe8, 0x00, 0x00, 0x00, // mov $232,%eax
            0x0f, 0x05, // syscall
        ],
        wild: 22..26,
        nr: 232,
        moves: [38, 47],
    },
];

#[repr(C, align(4096))]
struct Pool([[u8; STUB_SIZE]; STUB_COUNT]);

/// The stubs, in the runtime image (executable: the identity map sets no
/// NX bit), within ±2 GiB of the program, which the VMM loads next to it.
static mut POOL: Pool = Pool([[0; STUB_SIZE]; STUB_COUNT]);

struct State {
    /// The program's executable segments.
    text: Vec<(u64, u64)>,
    /// Sites seen trapping, sorted: each is looked at once.
    seen: Vec<u64>,
    /// Stubs handed out.
    used: usize,
}

static STATE: Once<Mutex<State>> = Once::new();

/// Why a site was left trapping, or what it was rewritten after.
#[derive(Clone, Copy)]
enum Outcome {
    Mov = 0,
    Musl,
    Glibc,
    /// No recognised instruction before the `syscall`.
    Unknown,
    /// The 5 bytes cross a 16-byte boundary (no single atomic write).
    Unaligned,
    /// Out of stubs, or the stub is beyond a rel32 from the site.
    NoRoom,
    /// The bytes changed between the read and the write.
    Raced,
}
const OUTCOMES: usize = 7;

static OUTCOME: [AtomicU64; OUTCOMES] = [const { AtomicU64::new(0) }; OUTCOMES];
static CALLS: AtomicU64 = AtomicU64::new(0);
static JUMPED: AtomicU64 = AtomicU64::new(0);

/// Turn rewriting on for the program's executable ranges `text` (loaded).
pub fn init(text: Vec<(u64, u64)>) {
    STATE.call_once(|| Mutex::new(State { text, seen: Vec::new(), used: 0 }));
}

/// execve: the new program's executable ranges replace the old one's.
pub fn set_text(text: Vec<(u64, u64)>) {
    if let Some(state) = STATE.get() {
        let mut st = state.lock();
        st.text = text;
        st.seen.clear();
    }
}

/// More executable code: a library the program's interpreter mapped.
pub fn add_text(start: u64, end: u64) {
    if let Some(state) = STATE.get() {
        state.lock().text.push((start, end));
    }
}

/// Count one system call; `via_jmp` if it came through a stub.
pub fn count(via_jmp: bool) {
    CALLS.fetch_add(1, Ordering::Relaxed);
    if via_jmp {
        JUMPED.fetch_add(1, Ordering::Relaxed);
    }
}

/// System calls served so far, and how many came through stubs.
pub fn calls() -> (u64, u64) {
    (CALLS.load(Ordering::Relaxed), JUMPED.load(Ordering::Relaxed))
}

/// A `syscall` instruction returning to `ret` trapped with number `nr`:
/// the first time a site does, rewrite it if it can be.
pub fn trapped(ret: u64, nr: u64) {
    let Some(state) = STATE.get() else { return };
    let mut st = state.lock();
    let site = ret.wrapping_sub(2);
    if site < 5 || !crate::text::contains(&st.text, site - 5, ret) {
        return;
    }
    match st.seen.binary_search(&site) {
        Ok(_) => return,
        Err(i) => st.seen.insert(i, site),
    }
    let outcome = st.rewrite(site, nr);
    OUTCOME[outcome as usize].fetch_add(1, Ordering::Relaxed);
}

impl State {
    fn rewrite(&mut self, site: u64, nr: u64) -> Outcome {
        let Some((kind, at)) = recognise(site, nr) else { return Outcome::Unknown };
        if !crate::text::contains(&self.text, at, site + 2) {
            return Outcome::Unknown;
        }
        let block = at & !15;
        if at + 5 > block + 16 {
            return Outcome::Unaligned;
        }
        if self.used == STUB_COUNT {
            return Outcome::NoRoom;
        }
        let pool = &raw mut POOL;
        // SAFETY: an index below STUB_COUNT into the pool, which only this
        // function (under the lock) writes.
        let stub = unsafe { (*pool).0.as_mut_ptr().add(self.used) };
        let stub_addr = stub as u64;
        // The instructions from `at` to the `syscall`, then lea and jmp.
        let moved = (site - at) as usize;
        if moved + 12 > STUB_SIZE {
            return Outcome::NoRoom;
        }
        let (lea, jmp) = (moved, moved + 7);
        let rel = |from: u64, to: u64| i32::try_from(to.wrapping_sub(from) as i64).ok();
        let (Some(jump), Some(ret), Some(entry)) = (
            rel(at + 5, stub_addr),
            rel(stub_addr + jmp as u64, site + 2),
            rel(stub_addr + jmp as u64 + 5, entry::ftvm_linux_jmp_entry as *const () as u64),
        ) else {
            return Outcome::NoRoom;
        };
        // Text in a chunk shared with another process (copy-on-write) is
        // unshared first, as any write of the runtime's into the program.
        if crate::aspace::unshare(block, 16).is_err() {
            return Outcome::NoRoom;
        }
        let mut code = [INT3; STUB_SIZE];
        // SAFETY: program text (checked above), mapped in the calling process.
        code[..moved].copy_from_slice(unsafe { core::slice::from_raw_parts(at as *const u8, moved) });
        code[lea..lea + 3].copy_from_slice(&[0x48, 0x8d, 0x0d]); // lea disp32(%rip),%rcx
        code[lea + 3..jmp].copy_from_slice(&ret.to_le_bytes());
        code[jmp] = JMP_REL32;
        code[jmp + 1..jmp + 5].copy_from_slice(&entry.to_le_bytes());
        // SAFETY: a stub no site jumps to yet (handed out once, here).
        unsafe { stub.write(code) };
        self.used += 1;
        // SAFETY: 16 aligned bytes around program text (the block lies in
        // the page of the 5 bytes), mapped in the calling process and
        // writable from here (unshared above).
        let old = unsafe { core::ptr::read_volatile(block as *const u128) };
        let mut bytes = old.to_le_bytes();
        let off = (at - block) as usize;
        bytes[off] = JMP_REL32;
        bytes[off + 1..off + 5].copy_from_slice(&jump.to_le_bytes());
        let new = u128::from_le_bytes(bytes);
        // SAFETY: as above; one locked 16-byte compare-and-exchange (see the
        // module doc for why a concurrent executor sees old or new only).
        let prev = unsafe { cas16(block as *mut u128, old, new) };
        if prev != old {
            return Outcome::Raced;
        }
        crate::process::patch_text(block, old, new);
        kind
    }
}

/// Whether a `syscall` at `site` that trapped with `nr` can be rewritten:
/// what it is, and the address of the whole 5-byte instruction that the
/// `jmp` replaces (the stub runs it and anything between it and the
/// `syscall`).
fn recognise(site: u64, nr: u64) -> Option<(Outcome, u64)> {
    use crate::sys::user::bytes;
    if let Ok(b) = bytes(site.wrapping_sub(MUSL_SITE), MUSL_SYSCALL_CP_ASM.len() as u64) {
        if b == MUSL_SYSCALL_CP_ASM {
            // Its three 5-byte moves, nearest the `syscall` first: 5 apart,
            // so at least one lies within 16 aligned bytes.
            let start = site - MUSL_SITE;
            let at = MUSL_MOVES.iter().map(|&k| start + k).find(|&at| at % 16 <= 11).unwrap_or(site - 5);
            return Some((Outcome::Musl, at));
        }
    }
    for r in GLIBC_ROUTINES.iter().filter(|r| r.nr == nr) {
        if bytes(site.wrapping_sub(r.site()), r.bytes.len() as u64).is_ok_and(|b| r.matches(b)) {
            let start = site - r.site();
            let at = r.moves.iter().map(|&k| start + k).find(|&at| at % 16 <= 11)?;
            return Some((Outcome::Glibc, at));
        }
    }
    let b = bytes(site.wrapping_sub(6), 8).ok()?;
    if b[6..] != SYSCALL || b[1] != MOV_EAX {
        return None;
    }
    let imm = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    (u64::from(imm) == nr && !extends_opcode(b[0])).then_some((Outcome::Mov, site - 5))
}

/// Whether `b`, right before a `b8`, could make the `b8` part of a longer
/// instruction: a REX or legacy prefix, or the two-byte opcode escape.
fn extends_opcode(b: u8) -> bool {
    matches!(b, 0x40..=0x4f | 0x0f | 0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3 | 0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65)
}

/// `lock cmpxchg16b`: returns what `*p` held (equal to `old` when `new` was
/// written).
///
/// # Safety
/// `p` must be 16-byte aligned and valid for reads and writes.
unsafe fn cas16(p: *mut u128, old: u128, new: u128) -> u128 {
    let (mut lo, mut hi) = (old as u64, (old >> 64) as u64);
    // SAFETY: CMPXCHG16B exists on every x86-64 CPU these hosts run
    // (CPUID CX16); the pointer contract is the caller's. rbx is reserved
    // by the compiler, so the new low half goes through another register
    // and rbx is restored after.
    unsafe {
        core::arch::asm!(
            "xchg {new_lo}, rbx",
            "lock cmpxchg16b [{p}]",
            "mov rbx, {new_lo}",
            p = in(reg) p,
            new_lo = inout(reg) new as u64 => _,
            in("rcx") (new >> 64) as u64,
            inout("rax") lo,
            inout("rdx") hi,
            options(nostack),
        );
    }
    u128::from(lo) | (u128::from(hi) << 64)
}

/// The exit line: calls, traps, and what happened to the sites that trapped.
pub fn report() -> alloc::string::String {
    let (calls, jumped) = calls();
    let n = |o: Outcome| OUTCOME[o as usize].load(Ordering::Relaxed);
    alloc::format!(
        "sites_rewritten={} (mov={} musl_cp={} glibc={}) sites_trapping={} (unknown={} unaligned={} no_room={} raced={}) calls={calls} jumped={jumped}",
        n(Outcome::Mov) + n(Outcome::Musl) + n(Outcome::Glibc),
        n(Outcome::Mov),
        n(Outcome::Musl),
        n(Outcome::Glibc),
        n(Outcome::Unknown) + n(Outcome::Unaligned) + n(Outcome::NoRoom) + n(Outcome::Raced),
        n(Outcome::Unknown),
        n(Outcome::Unaligned),
        n(Outcome::NoRoom),
        n(Outcome::Raced),
    )
}
