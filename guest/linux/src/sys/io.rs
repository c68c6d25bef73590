//! Reading and writing descriptors: read/write and their vector and
//! positioned forms, close, dup, fcntl, ioctl, pipe, lseek, fsync, sync.

use alloc::vec::Vec;
use core::sync::atomic::Ordering;

use super::{blocking, user, SysResult};
use crate::errno::*;
use crate::fd::{self, Desc, Object, O_APPEND, O_CLOEXEC, O_NONBLOCK};
use crate::fs::{self, Dev};
use crate::{eventfd, net, pipe, random};

/// Read into `buf` from `d`; may block unless `may_block` is false.
fn read_desc(d: &Desc, buf: &mut [u8], may_block: bool) -> Result<usize, Errno> {
    let nonblocking = d.nonblocking() || !may_block;
    match d.obj {
        Object::Stdin | Object::Console | Object::Dev(Dev::Null) => Ok(0),
        Object::Dev(Dev::Zero) => {
            buf.fill(0);
            Ok(buf.len())
        }
        Object::Dev(Dev::Random) => {
            random::fill(buf);
            Ok(buf.len())
        }
        Object::File(ino) => {
            let off = d.offset.load(Ordering::Relaxed);
            let n = fs::read_at(ino, off, buf)?;
            d.offset.store(off + n as u64, Ordering::Relaxed);
            Ok(n)
        }
        Object::Dir(_) => Err(EISDIR),
        Object::PipeRead(id) => blocking(nonblocking, u64::MAX, || pipe::read(id, buf)),
        Object::EventFd(id) => blocking(nonblocking, u64::MAX, || eventfd::read(id, buf)),
        Object::Socket(id) => blocking(nonblocking, u64::MAX, || net::recv(id, buf)),
        Object::PipeWrite(_) | Object::Epoll(_) => Err(EBADF),
    }
}

fn write_desc(d: &Desc, data: &[u8], may_block: bool) -> Result<usize, Errno> {
    let nonblocking = d.nonblocking() || !may_block;
    match d.obj {
        Object::Console => {
            // The VMM reads guest-physical memory: a forked process's
            // buffer is elsewhere, so it goes through runtime memory.
            let bounce: Vec<u8> = data.to_vec();
            ftvm_rt::console::write_bytes(&bounce);
            Ok(data.len())
        }
        Object::Dev(_) => Ok(data.len()),
        Object::File(ino) => {
            let append = d.flags.load(Ordering::Relaxed) & O_APPEND != 0;
            let at = if append { None } else { Some(d.offset.load(Ordering::Relaxed)) };
            let (n, end) = fs::write_at(ino, at, data)?;
            d.offset.store(end, Ordering::Relaxed);
            Ok(n)
        }
        Object::PipeWrite(id) => blocking(nonblocking, u64::MAX, || pipe::write(id, data)),
        Object::EventFd(id) => blocking(nonblocking, u64::MAX, || eventfd::write(id, data)),
        Object::Socket(id) => blocking(nonblocking, u64::MAX, || net::send(id, data)),
        Object::Stdin | Object::Dir(_) | Object::PipeRead(_) | Object::Epoll(_) => Err(EBADF),
    }
}

pub fn read(fd: u64, buf: u64, len: u64) -> SysResult {
    let d = fd::get(fd)?;
    let buf = user::bytes_mut(buf, len)?;
    read_desc(&d, buf, true).map(|n| n as u64)
}

pub fn write(fd: u64, buf: u64, len: u64) -> SysResult {
    let d = fd::get(fd)?;
    let data = user::bytes(buf, len)?;
    write_desc(&d, data, true).map(|n| n as u64)
}

/// Vector I/O: only the first transfer may block; a short one ends the call.
fn vectored(fd: u64, iov: u64, count: u64, write: bool) -> SysResult {
    let d = fd::get(fd)?;
    let iovs = user::iovecs(iov, count)?;
    if write && matches!(d.obj, Object::Console) {
        // One console write, so a line written in pieces stays whole.
        let mut all = Vec::new();
        for &(base, len) in &iovs {
            all.extend_from_slice(user::bytes(base, len)?);
        }
        return write_desc(&d, &all, true).map(|n| n as u64);
    }
    let mut total = 0usize;
    for &(base, len) in &iovs {
        if len == 0 {
            continue;
        }
        let r = if write {
            write_desc(&d, user::bytes(base, len)?, total == 0)
        } else {
            read_desc(&d, user::bytes_mut(base, len)?, total == 0)
        };
        match r {
            Ok(n) => {
                total += n;
                if n < len as usize {
                    break;
                }
            }
            Err(e) if total == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(total as u64)
}

pub fn readv(fd: u64, iov: u64, count: u64) -> SysResult {
    vectored(fd, iov, count, false)
}

pub fn writev(fd: u64, iov: u64, count: u64) -> SysResult {
    vectored(fd, iov, count, true)
}

pub fn pread(fd: u64, buf: u64, len: u64, off: u64) -> SysResult {
    let d = fd::get(fd)?;
    match d.obj {
        Object::File(ino) => Ok(fs::read_at(ino, off, user::bytes_mut(buf, len)?)? as u64),
        _ => Err(ESPIPE),
    }
}

pub fn pwrite(fd: u64, buf: u64, len: u64, off: u64) -> SysResult {
    let d = fd::get(fd)?;
    match d.obj {
        Object::File(ino) => Ok(fs::write_at(ino, Some(off), user::bytes(buf, len)?)?.0 as u64),
        _ => Err(ESPIPE),
    }
}

pub fn close(fd: u64) -> SysResult {
    fd::close(fd).map(|_| 0)
}

pub fn dup(fd: u64) -> SysResult {
    fd::install_from(fd::get(fd)?, false, 0)
}

pub fn dup3(old: u64, new: u64, flags: u64, dup2: bool) -> SysResult {
    let d = fd::get(old)?;
    if old == new {
        return if dup2 { Ok(new) } else { Err(EINVAL) };
    }
    fd::install_at(d, new, flags as u32 & O_CLOEXEC != 0)
}

pub fn lseek(fd: u64, off: i64, whence: u64) -> SysResult {
    let d = fd::get(fd)?;
    let Object::File(ino) = d.obj else { return Err(ESPIPE) };
    let base = match whence {
        0 => 0,
        1 => d.offset.load(Ordering::Relaxed) as i64,
        2 => fs::size(ino) as i64,
        _ => return Err(EINVAL),
    };
    let pos = base.checked_add(off).filter(|&p| p >= 0).ok_or(EINVAL)?;
    d.offset.store(pos as u64, Ordering::Relaxed);
    Ok(pos as u64)
}

pub fn fcntl(fd: u64, cmd: u64, arg: u64) -> SysResult {
    const F_DUPFD: u64 = 0;
    const F_GETFD: u64 = 1;
    const F_SETFD: u64 = 2;
    const F_GETFL: u64 = 3;
    const F_SETFL: u64 = 4;
    const F_GETLK: u64 = 5;
    const F_SETLK: u64 = 6;
    const F_SETLKW: u64 = 7;
    const F_DUPFD_CLOEXEC: u64 = 1030;
    const FD_CLOEXEC: u64 = 1;
    let d = fd::get(fd)?;
    match cmd {
        F_DUPFD | F_DUPFD_CLOEXEC => fd::install_from(d, cmd == F_DUPFD_CLOEXEC, arg as usize),
        F_GETFD => Ok(if fd::cloexec(fd)? { FD_CLOEXEC } else { 0 }),
        F_SETFD => fd::set_cloexec(fd, arg & FD_CLOEXEC != 0).map(|_| 0),
        F_GETFL => Ok(u64::from(d.flags.load(Ordering::Relaxed))),
        F_SETFL => {
            let changeable = O_APPEND | O_NONBLOCK;
            let old = d.flags.load(Ordering::Relaxed);
            d.flags.store((old & !changeable) | (arg as u32 & changeable), Ordering::Relaxed);
            Ok(0)
        }
        // Advisory locks are not kept: they never conflict.
        F_GETLK | F_SETLK | F_SETLKW => Ok(0),
        _ => Err(EINVAL),
    }
}

pub fn ioctl(fd: u64, req: u64, arg: u64) -> SysResult {
    const FIONREAD: u64 = 0x541b;
    const FIONBIO: u64 = 0x5421;
    let d = fd::get(fd)?;
    match req {
        FIONBIO => {
            let on: i32 = user::read(arg)?;
            if on != 0 {
                d.flags.fetch_or(O_NONBLOCK, Ordering::Relaxed);
            } else {
                d.flags.fetch_and(!O_NONBLOCK, Ordering::Relaxed);
            }
            Ok(0)
        }
        FIONREAD => {
            user::write(arg, 0i32)?;
            Ok(0)
        }
        // No terminals here (TCGETS, TIOCGWINSZ, ...).
        _ => Err(ENOTTY),
    }
}

pub fn pipe(fds: u64, flags: u64) -> SysResult {
    let flags = flags as u32;
    let id = pipe::create();
    let r = fd::install(Desc::new(Object::PipeRead(id), flags & O_NONBLOCK), flags)?;
    let w = match fd::install(Desc::new(Object::PipeWrite(id), (flags & O_NONBLOCK) | fd::O_WRONLY), flags) {
        Ok(w) => w,
        Err(e) => {
            let _ = fd::close(r);
            return Err(e);
        }
    };
    user::write(fds, [r as i32, w as i32])?;
    Ok(0)
}

/// fsync and fdatasync: a file on the disk is written back and its size
/// committed (`ftvm-diskfs`); anything else has nowhere to go.
pub fn fsync(fd: u64) -> SysResult {
    match fd::get(fd)?.obj {
        Object::File(ino) => fs::sync(ino).map(|_| 0),
        _ => Ok(0),
    }
}

/// sync and syncfs.
pub fn sync() -> SysResult {
    fs::sync_all().map(|_| 0)
}

pub fn ftruncate(fd: u64, len: u64) -> SysResult {
    let d = fd::get(fd)?;
    match d.obj {
        Object::File(ino) => fs::truncate(ino, len).map(|_| 0),
        _ => Err(EINVAL),
    }
}

/// eventfd2 (and eventfd, `flags` 0): EFD_SEMAPHORE 1, EFD_NONBLOCK and
/// EFD_CLOEXEC as O_NONBLOCK and O_CLOEXEC.
pub fn eventfd(initval: u64, flags: u64) -> SysResult {
    const EFD_SEMAPHORE: u32 = 1;
    let flags = flags as u32;
    if flags & !(EFD_SEMAPHORE | O_NONBLOCK | O_CLOEXEC) != 0 {
        return Err(EINVAL);
    }
    let id = eventfd::create(initval & 0xffff_ffff, flags & EFD_SEMAPHORE != 0);
    fd::install(Desc::new(Object::EventFd(id), (flags & O_NONBLOCK) | fd::O_RDWR), flags)
}
