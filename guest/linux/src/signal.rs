//! Running signal handlers: at the end of a system call the calling thread
//! takes a signal pending for its process (`process`) and returns into the
//! handler instead, with the frame Linux builds on x86-64 below the red zone
//! (return address = the `sa_restorer` libc gives, `ucontext` with the
//! registers and the x87/SSE state, `siginfo`); the restorer's
//! `rt_sigreturn` puts the registers back. A call the signal interrupted
//! (EINTR) is made again after the handler with SA_RESTART, by returning to
//! its `syscall` instruction (a rewritten site keeps its `0f 05`, which
//! traps and is served). Each thread has a signal mask (sigprocmask); a
//! blocked signal stays pending until unblocked, and while a handler runs
//! its signal (unless SA_NODEFER) and `sa_mask` are blocked too, until its
//! `rt_sigreturn` puts the old mask back. A signal sent to one thread
//! (tkill, tgkill) waits for that thread, and is taken before its
//! process's. Not supported: alternate stacks (the handler runs on the
//! interrupted stack).

use crate::entry::Frame;
use crate::errno::{Errno, EFAULT, EINTR};
use crate::process;
use crate::sched;
use crate::sys::user;

const SA_RESTORER: u64 = 0x0400_0000;
const SA_NODEFER: u64 = 0x4000_0000;
const SA_RESTART: u64 = 0x1000_0000;
const SA_RESETHAND: u64 = 0x8000_0000;
/// rt_sigreturn, pause, nanosleep, clock_nanosleep: never restarted.
const NOT_RESTARTED: [u64; 4] = [15, 34, 35, 230];
/// `struct ucontext`: flags, link, stack (24), sigcontext (32 words), mask.
const UC_SIZE: u64 = 40 + 32 * 8 + 8;
const MCONTEXT: u64 = 40;
const INFO_SIZE: u64 = 128;
const FX_SIZE: u64 = 512;
const RED_ZONE: u64 = 128;
/// Flags a handler's return may change (CF PF AF ZF SF DF OF); bit 1 is
/// always set.
const USER_FLAGS: u64 = 0xcd5;
const USER_CS: u64 = 0x2b;

/// At the end of system call `nr` (result in `frame.rax`): run the handler
/// of a pending signal, if any, when this thread returns to the program.
pub fn deliver(frame: &mut Frame, nr: u64) {
    let p = sched::current_process();
    let mask = sched::with_current(|t| t.sigmask);
    // The thread's own signals first, as Linux takes them.
    let taken = match sched::take_own_signal(mask) {
        Some(sig) => p.treat(sig),
        None => p.take_signal(mask),
    };
    let Some((sig, action)) = taken else { return };
    if action.flags & SA_RESTORER == 0 {
        // No way back from the handler (libc always gives one).
        return;
    }
    if frame.rax == (EINTR as i64).wrapping_neg() as u64 && action.flags & SA_RESTART != 0 && !NOT_RESTARTED.contains(&nr) {
        frame.rax = nr;
        frame.rip -= 2;
    }
    if action.flags & SA_RESETHAND != 0 {
        p.action(sig as usize, Some(process::Action::default()));
    }
    if push_frame(frame, sig, &action, mask).is_err() {
        // As Linux does when the stack cannot take the frame.
        p.begin_ending(process::signaled(SIGSEGV));
        return;
    }
    let own = if action.flags & SA_NODEFER != 0 { 0 } else { bit(sig) };
    sched::with_current(|t| t.sigmask = unblockable(mask | action.mask | own));
}

fn bit(sig: u32) -> u64 {
    1 << (sig - 1)
}

/// `mask` without SIGKILL and SIGSTOP, which cannot be blocked.
pub fn unblockable(mask: u64) -> u64 {
    mask & !(bit(process::SIGKILL) | bit(19))
}

/// rt_sigprocmask: the calling thread's mask (SIG_BLOCK, SIG_UNBLOCK,
/// SIG_SETMASK). A pending signal it unblocks runs its handler as the call
/// ends.
pub fn sigprocmask(how: u64, set: u64, old: u64, size: u64) -> Result<u64, Errno> {
    if size != 8 {
        return Err(crate::errno::EINVAL);
    }
    let cur = sched::with_current(|t| t.sigmask);
    let new = if set != 0 {
        let set: u64 = user::read(set)?;
        Some(match how {
            0 => cur | set,
            1 => cur & !set,
            2 => set,
            _ => return Err(crate::errno::EINVAL),
        })
    } else {
        None
    };
    if old != 0 {
        user::write(old, cur)?;
    }
    if let Some(new) = new {
        sched::with_current(|t| t.sigmask = unblockable(new));
    }
    Ok(0)
}

const SIGSEGV: u32 = 11;

fn push_frame(frame: &mut Frame, sig: u32, action: &process::Action, mask: u64) -> Result<(), Errno> {
    let fx = (frame.rsp.checked_sub(RED_ZONE + FX_SIZE).ok_or(EFAULT)?) & !63;
    // The handler is entered as after a call: rsp + 8 16-byte aligned.
    let start = ((fx - (8 + UC_SIZE + INFO_SIZE)) & !15) - 8;
    let (uc, info) = (start + 8, start + 8 + UC_SIZE);
    user::bytes_mut(fx, FX_SIZE)?.copy_from_slice(&frame.fx);
    let gregs: [u64; 24] = [
        frame.r8,
        frame.r9,
        frame.r10,
        frame.rflags, // r11, as `syscall` left it
        frame.r12,
        frame.r13,
        frame.r14,
        frame.r15,
        frame.rdi,
        frame.rsi,
        frame.rbp,
        frame.rbx,
        frame.rdx,
        frame.rax,
        frame.rip, // rcx, as `syscall` left it
        frame.rsp,
        frame.rip,
        frame.rflags,
        USER_CS,
        0,
        0,
        0,
        0,
        fx,
    ];
    let out = user::bytes_mut(start, 8 + UC_SIZE + INFO_SIZE)?;
    out.fill(0);
    out[0..8].copy_from_slice(&action.restorer.to_le_bytes());
    // uc_stack.ss_flags = SS_DISABLE.
    out[8 + 24..8 + 28].copy_from_slice(&2u32.to_le_bytes());
    for (i, g) in gregs.iter().enumerate() {
        let at = (8 + MCONTEXT) as usize + i * 8;
        out[at..at + 8].copy_from_slice(&g.to_le_bytes());
    }
    // uc_sigmask: what rt_sigreturn puts back.
    let m = (8 + UC_SIZE - 8) as usize;
    out[m..m + 8].copy_from_slice(&mask.to_le_bytes());
    let si = (8 + UC_SIZE) as usize;
    out[si..si + 4].copy_from_slice(&(sig as i32).to_le_bytes());
    frame.rsp = start;
    frame.rip = action.handler;
    frame.rdi = u64::from(sig);
    frame.rsi = info;
    frame.rdx = uc;
    frame.rax = 0;
    // DF clear on entry, as the ABI wants; TF too.
    frame.rflags &= !(0x400 | 0x100);
    Ok(())
}

/// rt_sigreturn: back to where the handler interrupted, from the frame at
/// the program's stack (the restorer's `ret` popped the return address, so
/// rsp points at the ucontext). Returns what rax held there.
pub fn sigreturn(frame: &mut Frame) -> Result<u64, Errno> {
    let uc = frame.rsp;
    let g: [u64; 24] = user::read(uc + MCONTEXT)?;
    let fx = g[23];
    if fx != 0 {
        let mut area = [0u8; FX_SIZE as usize];
        area.copy_from_slice(user::bytes(fx, FX_SIZE)?);
        // MXCSR's reserved bits would make fxrstor fault.
        let mxcsr = u32::from_le_bytes(area[24..28].try_into().expect("4 bytes")) & 0xffff;
        area[24..28].copy_from_slice(&mxcsr.to_le_bytes());
        frame.fx = area;
    }
    frame.r8 = g[0];
    frame.r9 = g[1];
    frame.r10 = g[2];
    frame.r12 = g[4];
    frame.r13 = g[5];
    frame.r14 = g[6];
    frame.r15 = g[7];
    frame.rdi = g[8];
    frame.rsi = g[9];
    frame.rbp = g[10];
    frame.rbx = g[11];
    frame.rdx = g[12];
    frame.rsp = g[15];
    frame.rip = g[16];
    frame.rflags = (g[17] & USER_FLAGS) | 0x2;
    let mask: u64 = user::read(uc + UC_SIZE - 8)?;
    sched::with_current(|t| t.sigmask = unblockable(mask));
    Ok(g[13])
}
