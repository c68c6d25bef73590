//! Integer socket options the standard library does not set or read.

use std::io;
use std::os::fd::RawFd;

/// Set option `name` at `level` of socket `fd` to `value`.
pub fn set(fd: RawFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: the caller's open socket; the value is a c_int that lives
    // across the call, with its length.
    let rc = unsafe {
        libc::setsockopt(fd, level, name, (&value as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Read option `name` at `level` of socket `fd`.
pub fn get(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the caller's open socket; `len` says how many bytes `value` has.
    let rc = unsafe { libc::getsockopt(fd, level, name, (&mut value as *mut libc::c_int).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}
