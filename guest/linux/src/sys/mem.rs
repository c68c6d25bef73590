//! Memory: brk, mmap/munmap/mremap, mprotect, madvise, on the calling
//! process's region. In a forked process, memory it claims gets frames of
//! its own first (`aspace`). The runtime writes into program memory here
//! (zeroing what is released, copying a file or a moved mapping in), so
//! every such range is unshared first (`aspace::unshare`), before the
//! allocator's lock is taken: unsharing may take process 1's allocator
//! (the copy's frame) and, in process 1, its own chunks' other sharers.
//!
//! A private file mapping is a copy: the file's bytes are copied into
//! fresh memory, the rest of the last page left zero (memory is one
//! identity map, so there is no page to share with the file). That is what
//! a dynamic linker needs of libraries; shared file mappings, whose writes
//! would have to reach the file, are refused.

use super::SysResult;
use crate::errno::{Errno, EACCES, EBADF, EINVAL, ENODEV, ENOMEM};
use crate::fd::{self, Object};
use crate::fs;
use crate::mm::Memory;

const MAP_SHARED: u64 = 0x01;
const MAP_PRIVATE: u64 = 0x02;
const MAP_FIXED: u64 = 0x10;
const MAP_ANONYMOUS: u64 = 0x20;
const MAP_FIXED_NOREPLACE: u64 = 0x100000;
const MREMAP_MAYMOVE: u64 = 1;
const MADV_DONTNEED: u64 = 4;
const PROT_EXEC: u64 = 4;

fn with<R>(f: impl FnOnce(&mut Memory) -> R) -> R {
    let p = crate::sched::current_process();
    let mut m = p.mem.lock();
    f(m.as_mut().expect("a running process has memory"))
}

/// Make `[start, end)` of the calling process's region usable: frames for
/// a forked process's chunks that have none (process 1's memory is the
/// identity-mapped region itself), and none of it shared (the runtime
/// may copy data in: a file, a moved mapping, a loaded program).
fn back(start: u64, end: u64) -> Result<(), Errno> {
    crate::aspace::unshare(start, end.saturating_sub(start))?;
    let p = crate::sched::current_process();
    let mut space = p.space.lock();
    match space.as_mut() {
        Some(s) if start < end => s.back(start, end),
        _ => Ok(()),
    }
}

/// A copy of the calling process's memory allocator and what it claimed,
/// for `fork`.
pub fn fork_memory() -> Memory {
    with(|m| m.for_child())
}

pub fn brk(addr: u64) -> SysResult {
    let (old, (base, end)) = with(|m| (m.brk(0), m.bounds()));
    let top = crate::mm::page_up(old);
    if addr > top {
        back(top, crate::mm::page_up(addr).min(end))?;
    } else if addr >= base {
        // Shrinking zeroes what is given up.
        crate::aspace::unshare(crate::mm::page_up(addr), top.saturating_sub(crate::mm::page_up(addr)))?;
    }
    Ok(with(|m| m.brk(addr)))
}

/// Claim `[addr, addr + len)` (or `len` bytes wherever they fit) in the
/// calling process's region, with frames behind it, writable by the
/// runtime (which may copy data in).
fn claim(addr: u64, len: u64, fixed: bool) -> SysResult {
    if fixed {
        // MAP_FIXED zeroes what it replaces.
        crate::aspace::unshare(addr, crate::mm::page_up(len))?;
    }
    let at = with(|m| m.map(addr, len, fixed))?;
    if let Err(e) = back(at, at + crate::mm::page_up(len)) {
        with(|m| m.unclaim(at, len));
        return Err(e);
    }
    Ok(at)
}

/// execve: the old program's memory is all given up.
pub fn reset() -> Result<(), Errno> {
    let (base, end) = with(|m| m.bounds());
    crate::aspace::unshare(base, end - base)?;
    with(|m| m.reset());
    Ok(())
}

/// Fresh zero memory of `len` bytes wherever it fits (the loader's).
pub fn reserve(len: u64) -> Result<u64, Errno> {
    claim(0, len, false)
}

pub fn mmap(addr: u64, len: u64, prot: u64, flags: u64, fd: u64, offset: u64) -> SysResult {
    if flags & (MAP_SHARED | MAP_PRIVATE) == 0 {
        return Err(EINVAL);
    }
    let fixed = flags & (MAP_FIXED | MAP_FIXED_NOREPLACE) != 0;
    if flags & MAP_ANONYMOUS != 0 {
        return claim(addr, len, fixed);
    }
    if flags & MAP_SHARED != 0 {
        // No page cache to share with the file.
        return Err(ENODEV);
    }
    if !offset.is_multiple_of(crate::mm::PAGE) {
        return Err(EINVAL);
    }
    let ino = match fd::get(fd).map_err(|_| EBADF)?.obj {
        Object::File(ino) => ino,
        Object::Dev(_) => return claim(addr, len, fixed),
        _ => return Err(EACCES),
    };
    let start = claim(addr, len, fixed)?;
    let size = fs::size(ino);
    let n = size.saturating_sub(offset).min(len);
    // SAFETY: [start, start + len) was just mapped for the program; n <= len.
    let dst = unsafe { core::slice::from_raw_parts_mut(start as *mut u8, n as usize) };
    if let Err(e) = fs::read_at(ino, offset, dst) {
        let _ = with(|m| m.unmap(start, len));
        return Err(e);
    }
    if prot & PROT_EXEC != 0 {
        crate::sysjmp::add_text(start, start + n);
    }
    Ok(start)
}

pub fn munmap(addr: u64, len: u64) -> SysResult {
    crate::aspace::unshare(addr, crate::mm::page_up(len))?;
    with(|m| m.unmap(addr, len)).map(|_| 0)
}

/// Every page is readable, writable and executable (one identity map for
/// runtime and program); protections are accepted and not enforced.
pub fn mprotect(addr: u64, _len: u64, _prot: u64) -> SysResult {
    if !addr.is_multiple_of(crate::mm::PAGE) {
        return Err(EINVAL);
    }
    Ok(0)
}

pub fn mremap(old: u64, old_len: u64, new_len: u64, flags: u64) -> SysResult {
    if flags & !MREMAP_MAYMOVE != 0 {
        return Err(EINVAL);
    }
    let may_move = flags & MREMAP_MAYMOVE != 0;
    let remap = || -> SysResult {
        // Back (and unshare) the place it may move to first: the move
        // copies into it (found as the move would find it).
        if may_move {
            let probe = with(|m| {
                let probe = m.map(0, new_len, false)?;
                m.unclaim(probe, new_len);
                Ok::<u64, Errno>(probe)
            })?;
            back(probe, probe + crate::mm::page_up(new_len))?;
        }
        // The old range is zeroed where it shrinks or moves away.
        let span = crate::mm::page_up(old_len.max(new_len));
        crate::aspace::unshare(old, span)?;
        let end = with(|m| m.bounds().1);
        back(old, old.saturating_add(crate::mm::page_up(new_len)).min(end))?;
        with(|m| m.remap(old, old_len, new_len, may_move))
    };
    remap().map_err(|e| if e == EINVAL { EINVAL } else { ENOMEM })
}

pub fn madvise(addr: u64, len: u64, advice: u64) -> SysResult {
    if advice == MADV_DONTNEED {
        crate::aspace::unshare(addr, crate::mm::page_up(len))?;
        with(|m| m.discard(addr, len))?;
    }
    Ok(0)
}

/// Bytes of memory the program may use (for sysinfo).
pub fn total() -> u64 {
    with(|m| m.size())
}
