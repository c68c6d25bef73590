//! Threads: clone with the thread flags, set_tid_address, futex, exit.

use core::sync::atomic::{AtomicU32, Ordering};

use ftvm_rt::time::now_ns;

use super::{time, user, SysResult};
use crate::entry::Frame;
use crate::errno::{EAGAIN, EINVAL, ENOSYS, ETIMEDOUT};
use crate::sched::{self, Wait};

const CLONE_VM: u64 = 0x100;
const CLONE_VFORK: u64 = 0x4000;
const CLONE_THREAD: u64 = 0x10000;
const CLONE_SETTLS: u64 = 0x80000;
const CLONE_PARENT_SETTID: u64 = 0x100000;
const CLONE_CHILD_CLEARTID: u64 = 0x200000;
const CLONE_CHILD_SETTID: u64 = 0x1000000;

const FUTEX_WAIT: u64 = 0;
const FUTEX_WAKE: u64 = 1;
const FUTEX_REQUEUE: u64 = 3;
const FUTEX_CMP_REQUEUE: u64 = 4;
const FUTEX_WAIT_BITSET: u64 = 9;
const FUTEX_WAKE_BITSET: u64 = 10;
const FUTEX_PRIVATE: u64 = 128;
const FUTEX_CLOCK_REALTIME: u64 = 256;

/// Threads (CLONE_VM with CLONE_THREAD), and without CLONE_VM a new
/// process (`fork`). A new process that shares the caller's memory
/// (CLONE_VM without CLONE_THREAD: vfork, posix_spawn) is not supported.
pub fn clone(frame: &Frame, flags: u64, stack: u64, parent_tid: u64, child_tid: u64, tls: u64) -> SysResult {
    if flags & CLONE_VM == 0 {
        let settls = (flags & CLONE_SETTLS != 0).then_some(tls);
        let settid = (flags & CLONE_CHILD_SETTID != 0).then_some(child_tid);
        let clear = if flags & CLONE_CHILD_CLEARTID != 0 { child_tid } else { 0 };
        let pid = super::fork::fork(frame, (stack != 0).then_some(stack), settls, settid, clear)?;
        if flags & CLONE_PARENT_SETTID != 0 {
            user::write(parent_tid, pid as u32)?;
        }
        return Ok(pid);
    }
    if flags & CLONE_THREAD == 0 || flags & CLONE_VFORK != 0 {
        // Reported like any call this layer does not serve.
        return super::unsupported(56);
    }
    if stack == 0 {
        return Err(EINVAL);
    }
    let fs = if flags & CLONE_SETTLS != 0 { tls } else { sched::with_current(|t| t.fs_base) };
    let clear = if flags & CLONE_CHILD_CLEARTID != 0 { child_tid } else { 0 };
    let tid = sched::spawn(frame, stack, fs, clear);
    if flags & CLONE_PARENT_SETTID != 0 {
        user::write(parent_tid, tid)?;
    }
    if flags & CLONE_CHILD_SETTID != 0 {
        user::write(child_tid, tid)?;
    }
    Ok(u64::from(tid))
}

pub fn set_tid_address(addr: u64) -> SysResult {
    sched::with_current(|t| t.clear_child_tid = addr);
    Ok(u64::from(sched::current_tid()))
}

/// End the calling thread: clear and wake its child-tid word (how
/// pthread_join learns of it), then run someone else.
pub fn exit(status: u64) -> SysResult {
    let clear = sched::with_current(|t| t.clear_child_tid);
    if clear != 0 && user::write(clear, 0u32).is_ok() {
        sched::futex_wake(clear, usize::MAX);
    }
    sched::exit_thread(crate::process::exited(status as i32))
}

fn word(addr: u64) -> Result<&'static AtomicU32, crate::errno::Errno> {
    if !addr.is_multiple_of(4) {
        return Err(EINVAL);
    }
    user::bytes(addr, 4)?;
    // SAFETY: 4 aligned bytes of guest RAM (checked), valid for the run.
    Ok(unsafe { &*(addr as *const AtomicU32) })
}

pub fn futex(addr: u64, op: u64, val: u64, timeout: u64, addr2: u64, val3: u64) -> SysResult {
    let cmd = op & !(FUTEX_PRIVATE | FUTEX_CLOCK_REALTIME);
    match cmd {
        FUTEX_WAIT | FUTEX_WAIT_BITSET => {
            let w = word(addr)?;
            let deadline = if timeout == 0 {
                u64::MAX
            } else if cmd == FUTEX_WAIT {
                now_ns().saturating_add(time::read_timespec(timeout)?)
            } else {
                // Absolute, on CLOCK_REALTIME or CLOCK_MONOTONIC.
                let abs = time::read_timespec(timeout)?;
                let now = if op & FUTEX_CLOCK_REALTIME != 0 { time::realtime_ns() } else { now_ns() };
                now_ns().saturating_add(abs.saturating_sub(now))
            };
            if w.load(Ordering::SeqCst) != val as u32 {
                return Err(EAGAIN);
            }
            sched::with_current(|t| t.woken = false);
            loop {
                sched::block(Wait::Futex(addr), deadline)?;
                if sched::with_current(|t| core::mem::take(&mut t.woken)) {
                    return Ok(0);
                }
                if now_ns() >= deadline {
                    return Err(ETIMEDOUT);
                }
            }
        }
        FUTEX_WAKE | FUTEX_WAKE_BITSET => {
            word(addr)?;
            Ok(sched::futex_wake(addr, val as usize) as u64)
        }
        FUTEX_REQUEUE | FUTEX_CMP_REQUEUE => {
            let w = word(addr)?;
            word(addr2)?;
            if cmd == FUTEX_CMP_REQUEUE && w.load(Ordering::SeqCst) != val3 as u32 {
                return Err(EAGAIN);
            }
            let woken = sched::futex_wake(addr, val as usize);
            // The fourth argument is a count here, not a timeout.
            let moved = sched::futex_requeue(addr, addr2, timeout as usize);
            Ok((woken + moved) as u64)
        }
        _ => Err(ENOSYS),
    }
}
