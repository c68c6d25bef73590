//! Linux error numbers (x86-64), as system calls return them negated.

pub type Errno = u64;

pub const EPERM: Errno = 1;
pub const ENOENT: Errno = 2;
pub const EBADF: Errno = 9;
pub const ECHILD: Errno = 10;
pub const EAGAIN: Errno = 11;
pub const ENOMEM: Errno = 12;
pub const EFAULT: Errno = 14;
pub const EEXIST: Errno = 17;
pub const ENODEV: Errno = 19;
pub const ENOTDIR: Errno = 20;
pub const EISDIR: Errno = 21;
pub const EINVAL: Errno = 22;
pub const EMFILE: Errno = 24;
pub const ENOTTY: Errno = 25;
pub const ENOSPC: Errno = 28;
pub const ESPIPE: Errno = 29;
pub const EPIPE: Errno = 32;
pub const ERANGE: Errno = 34;
pub const ENAMETOOLONG: Errno = 36;
pub const ENOSYS: Errno = 38;
pub const ENOTEMPTY: Errno = 39;
pub const ENOTSOCK: Errno = 88;
pub const EPROTONOSUPPORT: Errno = 93;
pub const EAFNOSUPPORT: Errno = 97;
pub const EADDRINUSE: Errno = 98;
pub const EADDRNOTAVAIL: Errno = 99;
pub const ENETDOWN: Errno = 100;
pub const ENETUNREACH: Errno = 101;
pub const ECONNRESET: Errno = 104;
pub const EISCONN: Errno = 106;
pub const ENOTCONN: Errno = 107;
pub const ETIMEDOUT: Errno = 110;
pub const ECONNREFUSED: Errno = 111;
pub const EINPROGRESS: Errno = 115;
