//! Page faults of the program, handled at CPL3: the write faults of
//! copy-on-write memory (`aspace`).
//!
//! The VMM's ring-0 #PF stub reflects a CPL3 page fault to the handler this
//! module registers (`ftvm_abi::FaultHandler`): it leaves a
//! `ftvm_abi::PageFault` record at the top of [`STACK`] and continues at
//! [`ftvm_linux_fault_entry`] on that stack, every register of the program
//! intact. Ring 0 is emulated about 5000x slower than CPL3 here, so the
//! stub only does that; everything else happens below, at native speed.
//!
//! The entry saves every register and the x87/SSE state (`fxsave64`, as
//! the system-call entry does: the runtime's code uses nothing wider),
//! calls [`on_fault`], restores them and jumps back to the faulting
//! instruction with the program's rsp: the program's stack, red zone and
//! all, is never touched (it may be the very memory that faulted). A fault
//! the handler does not resolve (a null pointer, a write to memory no one
//! shares, a fault inside the runtime itself, or inside this handler) is
//! handed back to the VMM: the handler unregisters itself and the
//! instruction runs again, faults again and stops the VM with the same
//! `guest fault ... vector 14` line as without a handler.
//!
//! A copy-on-write fault with no memory left for the copy kills the
//! process (`aspace`): its thread continues at a system call instead of
//! the faulting instruction, and leaves at its end.
//!
//! One vCPU runs the program (`sched`), so one stack and one return slot
//! serve every process and thread: a fault never interrupts another.

use core::arch::global_asm;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use ftvm_abi::PageFault;

use crate::aspace::Fault;

/// Page-fault error code bits: the page was present, the access a write,
/// made at CPL3. A copy-on-write fault has all three.
const WRITE_PROTECTION: u64 = 0b111;
const STACK_SIZE: usize = 64 << 10;

#[repr(C, align(16))]
struct Stack([u8; STACK_SIZE]);

/// The handler's stack: runtime memory, identity-mapped and writable in
/// every address space, never shared.
static mut STACK: Stack = Stack([0; STACK_SIZE]);
/// Where the entry jumps back to (it has no register to spare).
#[no_mangle]
static mut FTVM_LINUX_FAULT_RIP: u64 = 0;

/// Set while a fault is being handled: a fault inside the handler is not
/// resolved (it would run on the same stack) but reported.
static BUSY: AtomicBool = AtomicBool::new(false);
/// The last fault that found its chunk writable already (its address's
/// chunk) and how many such faults it had in a row: the first drops the
/// TLB's stale entry for the address, so more mean the change is never
/// seen.
static STALE: [AtomicU64; 2] = [const { AtomicU64::new(0) }; 2];
const MAX_STALE: u64 = 3;

global_asm!(
    ".globl ftvm_linux_fault_entry",
    "ftvm_linux_fault_entry:",
    // rsp = the PageFault record, 16-byte aligned; 16 pushes keep it so.
    "pushfq",
    "push rax",
    "push rbx",
    "push rcx",
    "push rdx",
    "push rsi",
    "push rdi",
    "push rbp",
    "push r8",
    "push r9",
    "push r10",
    "push r11",
    "push r12",
    "push r13",
    "push r14",
    "push r15",
    "sub rsp, 512",
    "fxsave64 [rsp]",
    "lea rdi, [rsp + 640]",
    "cld",
    "call {handler}",
    "fxrstor64 [rsp]",
    "add rsp, 512",
    "pop r15",
    "pop r14",
    "pop r13",
    "pop r12",
    "pop r11",
    "pop r10",
    "pop r9",
    "pop r8",
    "pop rbp",
    "pop rdi",
    "pop rsi",
    "pop rdx",
    "pop rcx",
    "pop rbx",
    "pop rax",
    "popfq",
    // Back at the record: its rip to the return slot (memory to memory,
    // no register, no flag changed), its rsp loaded, and away.
    "push qword ptr [rsp + 16]",
    "pop qword ptr [rip + FTVM_LINUX_FAULT_RIP]",
    "mov rsp, [rsp + 24]",
    "jmp qword ptr [rip + FTVM_LINUX_FAULT_RIP]",
    // Where a thread of a process killed at a fault goes instead of back:
    // any system call, at whose end the ending process's thread leaves.
    ".globl ftvm_linux_fault_leave",
    "ftvm_linux_fault_leave:",
    "mov eax, 39",
    "syscall",
    "ud2",
    handler = sym on_fault,
);

extern "C" {
    fn ftvm_linux_fault_entry();
    fn ftvm_linux_fault_leave();
    static __image_start: u8;
    static __image_end: u8;
}

/// Have the VMM reflect the program's page faults here (vCPU 0, at start).
pub fn init() {
    let top = &raw const STACK as u64 + STACK_SIZE as u64;
    // SAFETY: the entry resumes the program as the ABI asks, and STACK is
    // used by nothing else, identity-mapped in every space.
    unsafe { ftvm_rt::set_fault_handler(ftvm_linux_fault_entry as *const () as u64, top) };
}

/// Whether `rip` is the runtime's own code (which may hold locks, and
/// must have unshared what it writes: a fault there is a bug).
fn in_runtime(rip: u64) -> bool {
    // Linker symbols: only their addresses are used.
    let (start, end) = (&raw const __image_start as u64, &raw const __image_end as u64);
    (start..end).contains(&rip)
}

extern "C" fn on_fault(pf: &mut PageFault) {
    if BUSY.swap(true, Ordering::Relaxed) {
        give_up();
        return;
    }
    let ours = pf.error & WRITE_PROTECTION == WRITE_PROTECTION && !in_runtime(pf.rip);
    let resolved = ours
        && match crate::aspace::write_fault(pf.addr) {
            Fault::Resolved => {
                STALE[0].store(u64::MAX, Ordering::Relaxed);
                true
            }
            Fault::Stale => {
                // One handler at a time (BUSY): plain loads and stores.
                let chunk = pf.addr >> 21;
                let times = if STALE[0].swap(chunk, Ordering::Relaxed) == chunk { STALE[1].load(Ordering::Relaxed) + 1 } else { 1 };
                STALE[1].store(times, Ordering::Relaxed);
                times <= MAX_STALE
            }
            Fault::NoMemory => {
                // No memory for this process's copy: killed (SIGKILL), as
                // Linux's OOM killer would; it leaves through a system call.
                let p = crate::sched::current_process();
                ftvm_rt::println!("linux: out of memory for a copy-on-write copy: process {} killed", p.pid);
                p.begin_ending(crate::process::signaled(crate::process::SIGKILL));
                crate::sched::wake_process(p.pid);
                pf.rip = ftvm_linux_fault_leave as *const () as u64;
                true
            }
            Fault::NotOurs => false,
        };
    if resolved {
        BUSY.store(false, Ordering::Relaxed);
    } else {
        give_up();
    }
}

/// Leave the fault to the VMM: the instruction runs again without a
/// handler and stops the VM with the fault's own report.
fn give_up() {
    // SAFETY: 0 restores the VMM's default.
    unsafe { ftvm_rt::set_fault_handler(0, 0) };
}
