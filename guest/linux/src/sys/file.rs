//! Files by name: open, stat, access, the working directory, unlink,
//! rename, mkdir and directory listing, on the runtime's file system.

use alloc::string::String;
use core::sync::atomic::Ordering;

use super::{user, SysResult};
use crate::errno::*;
use crate::fd::{self, Desc, Object, O_CREAT, O_DIRECTORY, O_EXCL, O_TRUNC};
use crate::fs::{self, Opened, Stat, S_IFCHR, S_IFIFO, S_IFSOCK};

pub const AT_FDCWD: u64 = -100i64 as u64;
pub const AT_REMOVEDIR: u64 = 0x200;
const AT_EMPTY_PATH: u64 = 0x1000;

/// A path relative to `dirfd`: only the working directory is supported as
/// a base (and any absolute path).
fn resolve(dirfd: u64, path: u64) -> Result<String, Errno> {
    let p = user::path(path)?;
    if p.starts_with('/') || dirfd as i32 == AT_FDCWD as i32 {
        Ok(p)
    } else {
        Err(EINVAL)
    }
}

pub fn open(dirfd: u64, path: u64, flags: u64, _mode: u64) -> SysResult {
    let path = resolve(dirfd, path)?;
    let flags = flags as u32;
    let opened = fs::open(&path, flags & O_CREAT != 0, flags & O_EXCL != 0, flags & O_TRUNC != 0)?;
    let obj = match opened {
        Opened::File(ino) if flags & O_DIRECTORY != 0 => {
            fs::release(ino);
            return Err(ENOTDIR);
        }
        Opened::File(ino) => Object::File(ino),
        Opened::Dir(ino) => Object::Dir(ino),
        Opened::Dev(d) => Object::Dev(d),
    };
    fd::install(Desc::new(obj, flags), flags)
}

fn write_stat(out: u64, st: &Stat) -> Result<(), Errno> {
    let b = user::bytes_mut(out, 144)?;
    b.fill(0);
    let put = |b: &mut [u8], off: usize, v: u64| b[off..off + 8].copy_from_slice(&v.to_le_bytes());
    put(b, 0, 0x2a); // st_dev
    put(b, 8, st.ino);
    put(b, 16, st.nlink);
    b[24..28].copy_from_slice(&st.mode.to_le_bytes());
    put(b, 48, st.size);
    put(b, 56, 4096); // st_blksize
    put(b, 64, st.size.div_ceil(512));
    for off in [72, 88, 104] {
        put(b, off, st.mtime_ns / 1_000_000_000);
        put(b, off + 8, st.mtime_ns % 1_000_000_000);
    }
    Ok(())
}

pub fn fstat(fd: u64, out: u64) -> SysResult {
    let d = fd::get(fd)?;
    let other = |mode| Stat { mode, size: 0, ino: 0, nlink: 1, mtime_ns: 0 };
    let st = match d.obj {
        Object::File(ino) | Object::Dir(ino) => fs::stat_ino(ino).ok_or(EBADF)?,
        Object::Stdin | Object::Console | Object::Dev(_) => other(S_IFCHR | 0o620),
        Object::PipeRead(_) | Object::PipeWrite(_) => other(S_IFIFO | 0o600),
        Object::Socket(_) => other(S_IFSOCK | 0o777),
        Object::Epoll(_) | Object::EventFd(_) => other(0o600),
    };
    write_stat(out, &st)?;
    Ok(0)
}

pub fn stat(dirfd: u64, path: u64, out: u64, flags: u64) -> SysResult {
    if flags & AT_EMPTY_PATH != 0 && user::path(path)?.is_empty() {
        return fstat(dirfd, out);
    }
    let path = resolve(dirfd, path)?;
    let st = fs::stat_path(&path)?;
    write_stat(out, &st)?;
    Ok(0)
}

pub fn access(dirfd: u64, path: u64) -> SysResult {
    let path = resolve(dirfd, path)?;
    fs::stat_path(&path).map(|_| 0)
}

pub fn getcwd(buf: u64, size: u64) -> SysResult {
    let cwd = fs::cwd();
    let len = cwd.len() as u64 + 1;
    if size < len {
        return Err(ERANGE);
    }
    let out = user::bytes_mut(buf, len)?;
    out[..cwd.len()].copy_from_slice(cwd.as_bytes());
    out[cwd.len()] = 0;
    Ok(len)
}

pub fn chdir(path: u64) -> SysResult {
    fs::chdir(&user::path(path)?).map(|_| 0)
}

pub fn unlink(dirfd: u64, path: u64, flags: u64) -> SysResult {
    let path = resolve(dirfd, path)?;
    fs::unlink(&path, flags & AT_REMOVEDIR != 0).map(|_| 0)
}

pub fn rename(olddir: u64, old: u64, newdir: u64, new: u64) -> SysResult {
    let (old, new) = (resolve(olddir, old)?, resolve(newdir, new)?);
    fs::rename(&old, &new).map(|_| 0)
}

pub fn mkdir(dirfd: u64, path: u64) -> SysResult {
    fs::mkdir(&resolve(dirfd, path)?).map(|_| 0)
}

pub fn getdents64(fd: u64, buf: u64, len: u64) -> SysResult {
    let d = fd::get(fd)?;
    let Object::Dir(ino) = d.obj else { return Err(ENOTDIR) };
    let out = user::bytes_mut(buf, len)?;
    let entries = fs::list(ino);
    let mut index = d.offset.load(Ordering::Relaxed) as usize;
    let mut at = 0;
    while let Some((name, ino, kind)) = entries.get(index) {
        let reclen = (19 + name.len() + 1).next_multiple_of(8);
        if at + reclen > out.len() {
            if at == 0 {
                return Err(EINVAL);
            }
            break;
        }
        let rec = &mut out[at..at + reclen];
        rec.fill(0);
        rec[0..8].copy_from_slice(&u64::from(*ino).to_le_bytes());
        rec[8..16].copy_from_slice(&(index as u64 + 1).to_le_bytes());
        rec[16..18].copy_from_slice(&(reclen as u16).to_le_bytes());
        rec[18] = *kind;
        rec[19..19 + name.len()].copy_from_slice(name.as_bytes());
        at += reclen;
        index += 1;
    }
    d.offset.store(index as u64, Ordering::Relaxed);
    Ok(at as u64)
}

/// readlink/readlinkat: the only link is `/proc/self/exe`, the program
/// last executed; any other existing path is not a link.
pub fn readlink(dirfd: u64, path: u64, buf: u64, size: u64) -> SysResult {
    let path = resolve(dirfd, path)?;
    if path != "/proc/self/exe" {
        fs::stat_path(&path)?;
        return Err(EINVAL);
    }
    let target = crate::exec::exe();
    if target.is_empty() {
        return Err(ENOENT);
    }
    let n = target.len().min(size as usize);
    user::bytes_mut(buf, n as u64)?.copy_from_slice(&target.as_bytes()[..n]);
    Ok(n as u64)
}
