//! The two raw-socket calls that `frames` (a packet socket) and `netns`
//! (netlink) both make, each with its checks and `// SAFETY:` once.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A raw socket of `domain` for `protocol`, closed on exec.
pub(crate) fn raw_socket(domain: libc::c_int, protocol: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Send `bytes` on `sock` to `addr`, a `libc::sockaddr_*` of the socket's
/// family.
pub(crate) fn send_to<A>(sock: &OwnedFd, bytes: &[u8], addr: &A) -> io::Result<()> {
    // SAFETY: bytes and addr are valid for the lengths given; the kernel
    // only reads them.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            0,
            (addr as *const A).cast(),
            std::mem::size_of::<A>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
