//! Integer socket options the standard library does not set or read.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

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

/// How long TCP socket `fd` has had data in flight, unacknowledged, since
/// it was opened (`tcpi_busy_time`, Linux 4.10 and later).
pub fn tcp_busy(fd: RawFd) -> io::Result<Duration> {
    // SAFETY: tcp_info is plain integers, valid all zero.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the caller's open socket; `len` says how many bytes `info` has.
    let rc = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_busy_time) + std::mem::size_of::<u64>();
    if (len as usize) < needed {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "this kernel reports no TCP busy time"));
    }
    Ok(Duration::from_micros(info.tcpi_busy_time))
}
