//! The process: identity, limits, exit, signal dispositions (see `process`
//! and `signal`), the thread pointer, randomness.

use core::sync::atomic::{AtomicU64, Ordering};

use alloc::string::String;
use alloc::vec::Vec;

use super::{user, SysResult};
use crate::entry::Frame;
use crate::errno::{Errno, E2BIG, EINVAL, EPERM, ESRCH};
use crate::{random, sched};

const ARCH_SET_GS: u64 = 0x1001;
const ARCH_SET_FS: u64 = 0x1002;
const ARCH_GET_FS: u64 = 0x1003;
const ARCH_GET_GS: u64 = 0x1004;
const RLIMIT_STACK: u64 = 3;
const RLIMIT_NOFILE: u64 = 7;
const RLIM_INFINITY: u64 = u64::MAX;

pub fn exit_group(status: u64) -> SysResult {
    sched::exit_process(crate::process::exited(status as i32))
}

pub fn arch_prctl(code: u64, addr: u64) -> SysResult {
    match code {
        ARCH_SET_FS => {
            sched::with_current(|t| t.fs_base = addr);
            // SAFETY: CR4.FSGSBASE is set by the VMM for Linux programs
            // (checked at start); the runtime itself never uses fs.
            unsafe { core::arch::asm!("wrfsbase {}", in(reg) addr, options(nostack, preserves_flags)) };
            Ok(0)
        }
        ARCH_GET_FS => {
            let fs = sched::with_current(|t| t.fs_base);
            user::write(addr, fs)?;
            Ok(0)
        }
        ARCH_SET_GS | ARCH_GET_GS => Err(EPERM),
        _ => Err(EINVAL),
    }
}

/// The actions are kept per process (what `kill`, SIGCHLD and `signal`
/// go by).
pub fn rt_sigaction(sig: u64, act: u64, old: u64, size: u64) -> SysResult {
    const SIGSTOP: u64 = 19;
    if sig == 0 || sig as usize >= crate::process::NSIG || size != 8 {
        return Err(EINVAL);
    }
    if act != 0 && (sig == u64::from(crate::process::SIGKILL) || sig == SIGSTOP) {
        return Err(EINVAL);
    }
    let new = if act != 0 {
        let [handler, flags, restorer, mask]: [u64; 4] = user::read(act)?;
        Some(crate::process::Action { handler, flags, restorer, mask })
    } else {
        None
    };
    let prev = sched::current_process().action(sig as usize, new);
    if old != 0 {
        user::write(old, [prev.handler, prev.flags, prev.restorer, prev.mask])?;
    }
    Ok(0)
}

/// Until a signal: one that ends the process, or one whose handler runs
/// (EINTR either way).
pub fn pause() -> SysResult {
    loop {
        sched::block(sched::Wait::Sleep, u64::MAX)?;
    }
}

/// tkill and tgkill: a signal to a thread of the calling process that a
/// handler catches waits for that thread (pthread_kill, and pthread_cancel's
/// SIGCANCEL, whose handler must run in the thread cancelled); any other
/// goes to the process (its default action, or nothing: `fork::kill`), which
/// is how abort() raises SIGABRT. One to another process's thread is
/// refused.
pub fn tkill(tid: u64, sig: u64) -> SysResult {
    let me = sched::current_process();
    match sched::process_of(tid as u32) {
        Some(pid) if pid == me.pid => {
            if sig != 0 && (sig as usize) < crate::process::NSIG && me.catches(sig as u32) {
                if !sched::signal_thread(tid as u32, sig as u32) {
                    return Err(ESRCH);
                }
                return Ok(0);
            }
            super::fork::kill(u64::from(me.pid), sig)
        }
        Some(_) => Err(EPERM),
        None => Err(ESRCH),
    }
}

pub fn sched_yield() -> SysResult {
    sched::yield_now();
    Ok(0)
}

pub fn sched_getaffinity(size: u64, mask: u64) -> SysResult {
    if size < 8 {
        return Err(EINVAL);
    }
    user::write(mask, 1u64)?;
    Ok(8)
}

pub fn uname(buf: u64) -> SysResult {
    let out = user::bytes_mut(buf, 6 * 65)?;
    out.fill(0);
    for (i, s) in ["Linux", "ftvm", "5.15.0-ftvm", "#1 ftvm", "x86_64", "(none)"].iter().enumerate() {
        out[i * 65..i * 65 + s.len()].copy_from_slice(s.as_bytes());
    }
    Ok(0)
}

pub fn sysinfo(buf: u64) -> SysResult {
    let out = user::bytes_mut(buf, 112)?;
    out.fill(0);
    let uptime = ftvm_rt::time::now_ns() / ftvm_rt::time::NS_PER_SEC;
    let total = super::mem::total();
    out[0..8].copy_from_slice(&uptime.to_le_bytes());
    out[32..40].copy_from_slice(&total.to_le_bytes());
    out[40..48].copy_from_slice(&(total / 2).to_le_bytes());
    out[80..82].copy_from_slice(&1u16.to_le_bytes());
    out[104..108].copy_from_slice(&1u32.to_le_bytes());
    Ok(0)
}

static UMASK: AtomicU64 = AtomicU64::new(0o022);

pub fn umask(mask: u64) -> SysResult {
    Ok(UMASK.swap(mask & 0o777, Ordering::Relaxed))
}

pub fn prctl(option: u64) -> SysResult {
    const PR_SET_NAME: u64 = 15;
    const PR_GET_NAME: u64 = 16;
    match option {
        PR_SET_NAME | PR_GET_NAME => Ok(0),
        _ => Err(EINVAL),
    }
}

fn limit(resource: u64) -> [u64; 2] {
    match resource {
        RLIMIT_NOFILE => [crate::fd::MAX_FDS as u64; 2],
        RLIMIT_STACK => [8 << 20, RLIM_INFINITY],
        _ => [RLIM_INFINITY; 2],
    }
}

pub fn getrlimit(resource: u64, out: u64) -> SysResult {
    user::write(out, limit(resource))?;
    Ok(0)
}

/// Limits are fixed: setting one is accepted if it does not ask for more.
pub fn prlimit64(pid: u64, resource: u64, new: u64, old: u64) -> SysResult {
    if pid != 0 && pid != u64::from(sched::current_process().pid) {
        return Err(crate::errno::EPERM);
    }
    if old != 0 {
        user::write(old, limit(resource))?;
    }
    if new != 0 {
        let [cur, _]: [u64; 2] = user::read(new)?;
        if cur > limit(resource)[1] {
            return Err(EPERM);
        }
    }
    Ok(0)
}

pub fn getrusage(out: u64) -> SysResult {
    let ru = user::bytes_mut(out, 144)?;
    ru.fill(0);
    let ns = ftvm_rt::time::now_ns();
    ru[0..8].copy_from_slice(&((ns / 1_000_000_000) as i64).to_le_bytes());
    ru[8..16].copy_from_slice(&(((ns % 1_000_000_000) / 1000) as i64).to_le_bytes());
    Ok(0)
}

pub fn getrandom(buf: u64, len: u64) -> SysResult {
    let out = user::bytes_mut(buf, len)?;
    random::fill(out);
    Ok(len)
}

/// execve: the program at `path` replaces this one in the same process
/// ([`crate::exec::replace`]); on success the call returns into the new
/// program's entry (the frame is replaced).
pub fn execve(frame: &mut Frame, path: u64, argv: u64, envp: u64) -> SysResult {
    let mut path = user::path(path)?;
    if !path.starts_with('/') {
        path = alloc::format!("{}/{path}", crate::fs::cwd().trim_end_matches('/'));
    }
    let (argv, env) = (strings(argv)?, strings(envp)?);
    match crate::exec::replace(&path, &argv, &env) {
        Ok(new) => {
            *frame = new;
            Ok(0)
        }
        Err(f) => Err(f.errno),
    }
}

/// A NULL-terminated array of string pointers (argv, envp).
fn strings(addr: u64) -> Result<Vec<String>, Errno> {
    const MAX: u64 = 4096;
    let mut out = Vec::new();
    if addr == 0 {
        return Ok(out);
    }
    for i in 0..MAX {
        let p: u64 = user::read(addr + 8 * i)?;
        if p == 0 {
            return Ok(out);
        }
        out.push(user::path(p)?);
    }
    Err(E2BIG)
}
