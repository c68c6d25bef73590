//! The program's memory as the system calls see it: pointers the program
//! passes are checked against guest RAM above the system area (the program
//! shares the runtime's identity-mapped address space) and then used
//! directly. A pointer into the runtime's own memory is not refused; the
//! program is trusted as much as a process is with its own address space.
//! Every path by which the runtime writes program memory comes through
//! [`bytes_mut`] or [`write`] (or unshares itself, `sys::mem`), which break
//! copy-on-write sharing first (`aspace`).

use alloc::string::String;
use core::mem::size_of;

use ftvm_abi::layout::SYSTEM_AREA_END;
use spin::Once;

use crate::errno::{Errno, EFAULT, ENAMETOOLONG};

static RAM_END: Once<u64> = Once::new();

pub fn init(ram_end: u64) {
    RAM_END.call_once(|| ram_end);
}

fn check(addr: u64, len: usize) -> Result<(), Errno> {
    let end = addr.checked_add(len as u64).ok_or(EFAULT)?;
    if len == 0 {
        return Ok(());
    }
    if addr < SYSTEM_AREA_END || end > *RAM_END.get().unwrap_or(&0) {
        return Err(EFAULT);
    }
    Ok(())
}

pub fn bytes<'a>(addr: u64, len: u64) -> Result<&'a [u8], Errno> {
    check(addr, len as usize)?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: inside guest RAM (checked), which is mapped for the whole run.
    Ok(unsafe { core::slice::from_raw_parts(addr as *const u8, len as usize) })
}

/// Program memory the runtime writes into: shared (copy-on-write) chunks
/// in it are unshared first, so the write never faults (`aspace::unshare`).
pub fn bytes_mut<'a>(addr: u64, len: u64) -> Result<&'a mut [u8], Errno> {
    check(addr, len as usize)?;
    if len == 0 {
        return Ok(&mut []);
    }
    crate::aspace::unshare(addr, len)?;
    // SAFETY: inside guest RAM (checked); the program handed it to the call.
    Ok(unsafe { core::slice::from_raw_parts_mut(addr as *mut u8, len as usize) })
}

pub fn read<T: Copy>(addr: u64) -> Result<T, Errno> {
    check(addr, size_of::<T>())?;
    // SAFETY: inside guest RAM (checked); unaligned reads are fine.
    Ok(unsafe { (addr as *const T).read_unaligned() })
}

pub fn write<T>(addr: u64, v: T) -> Result<(), Errno> {
    check(addr, size_of::<T>())?;
    crate::aspace::unshare(addr, size_of::<T>() as u64)?;
    // SAFETY: inside guest RAM (checked); the program handed it to the call.
    unsafe { (addr as *mut T).write_unaligned(v) };
    Ok(())
}

/// A NUL-terminated path (at most 4096 bytes, UTF-8 lossy).
pub fn path(addr: u64) -> Result<String, Errno> {
    const MAX: u64 = 4096;
    let mut out = alloc::vec::Vec::new();
    for i in 0..MAX {
        let b: u8 = read(addr + i)?;
        if b == 0 {
            return Ok(String::from_utf8_lossy(&out).into_owned());
        }
        out.push(b);
    }
    Err(ENAMETOOLONG)
}

/// The `struct iovec` array at `addr`: (base, len) pairs.
pub fn iovecs(addr: u64, count: u64) -> Result<alloc::vec::Vec<(u64, u64)>, Errno> {
    if count > 1024 {
        return Err(crate::errno::EINVAL);
    }
    (0..count).map(|i| Ok((read::<u64>(addr + 16 * i)?, read::<u64>(addr + 16 * i + 8)?))).collect()
}
