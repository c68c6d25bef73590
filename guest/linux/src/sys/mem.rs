//! Memory: brk, mmap/munmap/mremap, mprotect, madvise.
//!
//! A private file mapping is a copy: the file's bytes are copied into
//! fresh memory, the rest of the last page left zero (memory is one
//! identity map, so there is no page to share with the file). That is what
//! a dynamic linker needs of libraries; shared file mappings, whose writes
//! would have to reach the file, are refused.

use spin::Mutex;

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

static MEMORY: Mutex<Option<Memory>> = Mutex::new(None);

pub fn init(m: Memory) {
    *MEMORY.lock() = Some(m);
}

fn with<R>(f: impl FnOnce(&mut Memory) -> R) -> R {
    f(MEMORY.lock().as_mut().expect("memory initialised"))
}

pub fn brk(addr: u64) -> SysResult {
    Ok(with(|m| m.brk(addr)))
}

/// execve: the old program's memory is all given up.
pub fn reset() {
    with(|m| m.reset())
}

/// Fresh zero memory of `len` bytes wherever it fits (the loader's).
pub fn reserve(len: u64) -> Result<u64, Errno> {
    with(|m| m.map(0, len, false))
}

pub fn mmap(addr: u64, len: u64, prot: u64, flags: u64, fd: u64, offset: u64) -> SysResult {
    if flags & (MAP_SHARED | MAP_PRIVATE) == 0 {
        return Err(EINVAL);
    }
    let fixed = flags & (MAP_FIXED | MAP_FIXED_NOREPLACE) != 0;
    if flags & MAP_ANONYMOUS != 0 {
        return with(|m| m.map(addr, len, fixed));
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
        Object::Dev(_) => return with(|m| m.map(addr, len, fixed)),
        _ => return Err(EACCES),
    };
    let start = with(|m| m.map(addr, len, fixed))?;
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
    with(|m| m.remap(old, old_len, new_len, flags & MREMAP_MAYMOVE != 0)).map_err(|e| if e == EINVAL { EINVAL } else { ENOMEM })
}

pub fn madvise(addr: u64, len: u64, advice: u64) -> SysResult {
    if advice == MADV_DONTNEED {
        with(|m| m.discard(addr, len))?;
    }
    Ok(0)
}

/// Bytes of memory the program may use (for sysinfo).
pub fn total() -> u64 {
    with(|m| m.size())
}
