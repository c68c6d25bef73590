//! Into and out of the program: the `syscall` entry, the return by jump, and
//! the switch between threads' kernel stacks.
//!
//! On these hosts `syscall` at CPL3 jumps to LSTAR and stays at CPL3
//! (PLATFORM.md quirk 3), with `rcx` = the return address and `r11` = the
//! caller's RFLAGS (the VMM's SFMASK clears TF, DF, NT and AC). So the entry
//! below is an ordinary function call in all but name: it moves to the
//! current thread's kernel stack (the program's stack may be small and its
//! 128-byte red zone live), saves every register the Linux system-call ABI
//! preserves, including the SSE state (`fxsave64`: compiled code keeps
//! values in xmm registers across an inline `syscall`), runs
//! [`crate::sys::dispatch`], and returns to the program with a jump, as
//! `sysret` would: `rax` = result, `rcx` = return address, `r11` = RFLAGS.
//!
//! Threads run one at a time on vCPU 0 (see `sched`), so the two words the
//! entry needs before it has a stack of its own are plain globals.

use core::arch::{global_asm, naked_asm};
use core::mem::offset_of;

/// The program's registers at a system call, on the thread's kernel stack.
/// Field order is the entry's push order reversed.
#[repr(C, align(16))]
pub struct Frame {
    /// `fxsave64` image: x87, MXCSR, xmm0-15.
    pub fx: [u8; 512],
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rbp: u64,
    pub rdi: u64,
    pub rsi: u64,
    pub rdx: u64,
    pub rbx: u64,
    /// System-call number on entry, result on return.
    pub rax: u64,
    pub rflags: u64,
    pub rip: u64,
    pub rsp: u64,
}

const _: () = assert!(core::mem::size_of::<Frame>() == 512 + 16 * 8);
const _: () = assert!(offset_of!(Frame, rsp) == 512 + 15 * 8);

impl Frame {
    /// A frame that enters the program at `rip` with stack `rsp`, all
    /// other registers zero and the x87/SSE state as after `finit`.
    pub fn initial(rip: u64, rsp: u64) -> Frame {
        let mut fx = [0u8; 512];
        fx[0..2].copy_from_slice(&0x037fu16.to_le_bytes()); // FCW
        fx[24..28].copy_from_slice(&0x1f80u32.to_le_bytes()); // MXCSR
        fx[28..32].copy_from_slice(&0xffffu32.to_le_bytes()); // MXCSR_MASK
        Frame {
            fx,
            r15: 0,
            r14: 0,
            r13: 0,
            r12: 0,
            r10: 0,
            r9: 0,
            r8: 0,
            rbp: 0,
            rdi: 0,
            rsi: 0,
            rdx: 0,
            rbx: 0,
            rax: 0,
            rflags: 0x2,
            rip,
            rsp,
        }
    }

    /// System-call arguments 1 to 6.
    pub fn args(&self) -> [u64; 6] {
        [self.rdi, self.rsi, self.rdx, self.r10, self.r8, self.r9]
    }
}

/// The program's rsp between `syscall` and the switch to the kernel stack.
#[no_mangle]
static mut FTVM_LINUX_USER_RSP: u64 = 0;
/// Set by the `syscall=jmp` entry, taken (cleared) by [`take_via_jmp`].
#[no_mangle]
static mut FTVM_LINUX_VIA_JMP: u8 = 0;
/// Top of the running thread's kernel stack; `sched` sets it on every switch.
#[no_mangle]
pub(crate) static mut FTVM_LINUX_KSTACK_TOP: u64 = 0;

global_asm!(
    ".globl ftvm_linux_syscall_entry",
    ".globl ftvm_linux_return_to_user",
    ".globl ftvm_linux_jmp_entry",
    // From a `syscall=jmp` stub (see `sysjmp`): rcx = return address, rax =
    // number, as after `syscall`; r11 is made the caller's RFLAGS here, on
    // the kernel stack (pushfq on the program's stack would write into its
    // red zone), and DF cleared as the VMM's SFMASK clears it.
    "ftvm_linux_jmp_entry:",
    "mov [rip + FTVM_LINUX_USER_RSP], rsp",
    "mov rsp, [rip + FTVM_LINUX_KSTACK_TOP]",
    "pushfq",
    "pop r11",
    "cld",
    "mov byte ptr [rip + FTVM_LINUX_VIA_JMP], 1",
    "jmp 2f",
    "ftvm_linux_syscall_entry:",
    "mov [rip + FTVM_LINUX_USER_RSP], rsp",
    "mov rsp, [rip + FTVM_LINUX_KSTACK_TOP]",
    "2:",
    "push qword ptr [rip + FTVM_LINUX_USER_RSP]",
    "push rcx",
    "push r11",
    "push rax",
    "push rbx",
    "push rdx",
    "push rsi",
    "push rdi",
    "push rbp",
    "push r8",
    "push r9",
    "push r10",
    "push r12",
    "push r13",
    "push r14",
    "push r15",
    "sub rsp, 512",
    "fxsave64 [rsp]",
    "mov rdi, rsp",
    "call {dispatch}",
    // New threads start here too, with rsp at their first frame.
    "ftvm_linux_return_to_user:",
    "fxrstor64 [rsp]",
    "add rsp, 512",
    "pop r15",
    "pop r14",
    "pop r13",
    "pop r12",
    "pop r10",
    "pop r9",
    "pop r8",
    "pop rbp",
    "pop rdi",
    "pop rsi",
    "pop rdx",
    "pop rbx",
    "pop rax",
    "mov r11, [rsp]",
    "popfq",
    "pop rcx",
    "pop rsp",
    "jmp rcx",
    dispatch = sym dispatch_entry,
);

extern "C" {
    /// The address the VMM puts in LSTAR (through the image's ABI note).
    pub fn ftvm_linux_syscall_entry();
    fn ftvm_linux_return_to_user();
    /// Where `syscall=jmp` stubs continue (see `sysjmp`).
    pub fn ftvm_linux_jmp_entry();
}

/// Whether the system call being served came through a `syscall=jmp` stub
/// (not a `syscall` instruction); clears the mark for the next call.
pub fn take_via_jmp() -> bool {
    let p = &raw mut FTVM_LINUX_VIA_JMP;
    // SAFETY: one vCPU runs the program and the runtime (see the module
    // doc): nothing else touches the byte between the entry and here.
    unsafe {
        let was = p.read();
        p.write(0);
        was != 0
    }
}

extern "C" fn dispatch_entry(frame: &mut Frame) {
    crate::sys::dispatch(frame);
}

/// Leave the runtime for good on this stack: run the program from `frame`
/// (which must lie at the top of the current thread's kernel stack).
///
/// # Safety
/// `frame` must be a valid frame at `FTVM_LINUX_KSTACK_TOP - size_of::<Frame>()`.
pub unsafe fn enter(frame: *mut Frame) -> ! {
    // SAFETY: the return path pops exactly one Frame from rsp and jumps to
    // the program; the caller vouches that the frame is at the stack top.
    unsafe { core::arch::asm!("mov rsp, {0}", "jmp {1}", in(reg) frame, sym ftvm_linux_return_to_user, options(noreturn)) }
}

/// Callee-saved registers and the return address `switch` pushes: what a
/// fresh thread's kernel stack must hold below its first frame.
#[repr(C)]
pub struct SwitchFrame {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub rbx: u64,
    pub rbp: u64,
    pub ret: u64,
}

impl SwitchFrame {
    /// Ends in the entry's return path, which pops the frame above it.
    pub fn to_user() -> SwitchFrame {
        SwitchFrame { r15: 0, r14: 0, r13: 0, r12: 0, rbx: 0, rbp: 0, ret: ftvm_linux_return_to_user as *const () as u64 }
    }
}

/// Save the callee-saved registers on this stack, store rsp in `*save`,
/// continue on `next` (a stack `switch` saved, or one holding a
/// [`SwitchFrame`]).
///
/// # Safety
/// `next` must be such a stack, not in use by anything else.
#[unsafe(naked)]
pub unsafe extern "C" fn switch(save: *mut u64, next: u64) {
    naked_asm!(
        "push rbp",
        "push rbx",
        "push r12",
        "push r13",
        "push r14",
        "push r15",
        "mov [rdi], rsp",
        "mov rsp, rsi",
        "pop r15",
        "pop r14",
        "pop r13",
        "pop r12",
        "pop rbx",
        "pop rbp",
        "ret",
    )
}
