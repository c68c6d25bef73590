//! Processes: fork (and vfork, and clone without CLONE_VM), wait4,
//! waitid, kill.
//! The process table and its rules are in `process`, the address spaces in
//! `aspace`.

use super::{blocking, user, SysResult};
use crate::aspace::AddressSpace;
use crate::entry::Frame;
use crate::errno::{EINVAL, ESRCH};
use crate::process::{self, NSIG};
use crate::{fd, sched};

const WNOHANG: u64 = 1;

/// The program's image, `[start, end)`, which a child gets a copy of.
static IMAGE: spin::Once<(u64, u64)> = spin::Once::new();

pub fn init(image_start: u64, image_end: u64) {
    IMAGE.call_once(|| (image_start, image_end));
}

/// A new process running a copy of the calling one: its memory (`aspace`),
/// its descriptors (sharing their open file descriptions) and the calling
/// thread, which returns 0 in the child, on stack `rsp` (0: the caller's)
/// with thread pointer `tls` (None: the caller's). Returns the child's pid.
pub fn fork(frame: &Frame, rsp: Option<u64>, tls: Option<u64>, child_tid: Option<u64>, clear_tid: u64) -> SysResult {
    let parent = sched::current_process();
    let mem = super::mem::fork_memory();
    let &image = IMAGE.get().expect("image known at start");
    let root = parent.own_space();
    let space = {
        let mut guard = parent.space.lock();
        let mine = guard.as_mut().expect("own_space made it");
        AddressSpace::fork(mine, image, mem.bounds(), &mem.used())
    };
    // Entries of the parent's that were writable are read-only now (or the
    // space is new): load it again, which drops what the TLB kept.
    sched::reload(root);
    let space = space?;
    let pid = sched::next_id();
    let child = parent.fork(pid, fd::fork_table(), mem, space);
    if let Some(addr) = child_tid {
        // CLONE_CHILD_SETTID: in the child's memory, which the caller's
        // tables do not show; written through the child's frame (its own
        // copy: the write unshares the chunk).
        child.space.lock().as_mut().expect("a forked process has a space").write_u32(addr, pid)?;
    }
    let fs = tls.unwrap_or_else(|| sched::with_current(|t| t.fs_base));
    sched::spawn_in(child, pid, frame, rsp.unwrap_or(frame.rsp), fs, clear_tid);
    Ok(u64::from(pid))
}

/// wait4 (and waitpid): reap a child that ended, blocking until one does
/// unless WNOHANG. No resource usage is kept: `rusage` reads as zeros.
pub fn wait4(pid: u64, status: u64, options: u64, rusage: u64) -> SysResult {
    let me = sched::current_process().pid;
    let pid = pid as i32;
    let found = blocking(options & WNOHANG != 0, u64::MAX, || match process::reap(me, pid)? {
        Some(found) => Ok(Some(found)),
        None if options & WNOHANG != 0 => Ok(None),
        None => Err(crate::errno::EAGAIN),
    })?;
    let Some((child, st)) = found else { return Ok(0) };
    if status != 0 {
        user::write(status, st)?;
    }
    if rusage != 0 {
        user::bytes_mut(rusage, 144)?.fill(0);
    }
    Ok(u64::from(child))
}

/// waitid for P_ALL and P_PID with WEXITED (and WNOHANG): the child's
/// siginfo as Linux fills it (CLD_EXITED or CLD_KILLED). WNOWAIT,
/// WSTOPPED and WCONTINUED are not supported (EINVAL).
pub fn waitid(idtype: u64, id: u64, info: u64, options: u64) -> SysResult {
    const P_ALL: u64 = 0;
    const P_PID: u64 = 1;
    const WEXITED: u64 = 4;
    const CLD_EXITED: i32 = 1;
    const CLD_KILLED: i32 = 2;
    if options & !(WNOHANG | WEXITED) != 0 || options & WEXITED == 0 {
        return Err(EINVAL);
    }
    let pid = match idtype {
        P_ALL => -1,
        P_PID => id as i32,
        _ => return Err(EINVAL),
    };
    let me = sched::current_process().pid;
    let found = blocking(options & WNOHANG != 0, u64::MAX, || match process::reap(me, pid)? {
        Some(found) => Ok(Some(found)),
        None if options & WNOHANG != 0 => Ok(None),
        None => Err(crate::errno::EAGAIN),
    })?;
    if info != 0 {
        // si_signo, si_errno, si_code, pad, si_pid, si_uid, si_status.
        let out = user::bytes_mut(info, 128)?;
        out.fill(0);
        if let Some((child, st)) = found {
            let (code, status) = if st & 0x7f != 0 { (CLD_KILLED, st & 0x7f) } else { (CLD_EXITED, (st >> 8) & 0xff) };
            out[0..4].copy_from_slice(&(process::SIGCHLD as i32).to_le_bytes());
            out[8..12].copy_from_slice(&code.to_le_bytes());
            out[16..20].copy_from_slice(&(child as i32).to_le_bytes());
            out[24..28].copy_from_slice(&status.to_le_bytes());
        }
    }
    Ok(0)
}

/// kill(pid, sig) for one process (no process groups: 0 and negative pids
/// are refused with ESRCH, as if the group were empty).
pub fn kill(pid: u64, sig: u64) -> SysResult {
    let (pid, sig) = (pid as i32, sig as u32);
    if sig as usize >= NSIG {
        return Err(EINVAL);
    }
    if pid <= 0 {
        return Err(ESRCH);
    }
    match process::signal(pid as u32, sig)? {
        process::Sent::Nothing => {}
        process::Sent::Ends => sched::wake_process(pid as u32),
        process::Sent::Caught => sched::wake_one(pid as u32),
    }
    Ok(0)
}
