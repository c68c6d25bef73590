//! Memory: brk, anonymous mmap/munmap/mremap, mprotect, madvise.

use spin::Mutex;

use super::SysResult;
use crate::errno::{EINVAL, ENODEV, ENOMEM};
use crate::mm::Memory;

const MAP_SHARED: u64 = 0x01;
const MAP_PRIVATE: u64 = 0x02;
const MAP_FIXED: u64 = 0x10;
const MAP_ANONYMOUS: u64 = 0x20;
const MAP_FIXED_NOREPLACE: u64 = 0x100000;
const MREMAP_MAYMOVE: u64 = 1;
const MADV_DONTNEED: u64 = 4;

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

pub fn mmap(addr: u64, len: u64, _prot: u64, flags: u64, fd: u64, _offset: u64) -> SysResult {
    if flags & MAP_ANONYMOUS == 0 && fd as i32 != -1 {
        // File mappings are not supported (no page cache to share).
        return Err(ENODEV);
    }
    if flags & (MAP_SHARED | MAP_PRIVATE) == 0 {
        return Err(EINVAL);
    }
    let fixed = flags & (MAP_FIXED | MAP_FIXED_NOREPLACE) != 0;
    with(|m| m.map(addr, len, fixed))
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
