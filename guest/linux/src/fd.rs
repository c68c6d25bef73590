//! The file descriptor table of the calling process: numbers to open file
//! descriptions, which `dup` and `fork` share (a description's object is
//! released when its last descriptor in any process closes), and the
//! readiness of each kind of object for epoll.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::errno::{Errno, EBADF, EMFILE};
use crate::{fs, net, pipe};

/// Most descriptors at once (RLIMIT_NOFILE).
pub const MAX_FDS: usize = 10_240;

pub const O_WRONLY: u32 = 1;
pub const O_RDWR: u32 = 2;
pub const O_CREAT: u32 = 0o100;
pub const O_EXCL: u32 = 0o200;
pub const O_TRUNC: u32 = 0o1000;
pub const O_APPEND: u32 = 0o2000;
pub const O_NONBLOCK: u32 = 0o4000;
pub const O_DIRECTORY: u32 = 0o200000;
pub const O_CLOEXEC: u32 = 0o2000000;

pub const EPOLLIN: u32 = 0x1;
pub const EPOLLOUT: u32 = 0x4;
pub const EPOLLERR: u32 = 0x8;
pub const EPOLLHUP: u32 = 0x10;
pub const EPOLLRDHUP: u32 = 0x2000;

pub enum Object {
    Stdin,
    /// stdout (1) or stderr (2): the VM console.
    Console,
    Dev(fs::Dev),
    File(fs::Ino),
    Dir(fs::Ino),
    PipeRead(u32),
    PipeWrite(u32),
    Socket(u32),
    Epoll(u32),
    EventFd(u32),
}

/// An open file description.
pub struct Desc {
    pub obj: Object,
    /// Status flags (O_APPEND, O_NONBLOCK, access mode).
    pub flags: AtomicU32,
    pub offset: AtomicU64,
}

impl Desc {
    pub fn new(obj: Object, flags: u32) -> Arc<Desc> {
        Arc::new(Desc { obj, flags: AtomicU32::new(flags & !O_CLOEXEC), offset: AtomicU64::new(0) })
    }

    pub fn nonblocking(&self) -> bool {
        self.flags.load(Ordering::Relaxed) & O_NONBLOCK != 0
    }
}

impl Drop for Desc {
    /// The last descriptor of it is gone: release the object.
    fn drop(&mut self) {
        match self.obj {
            Object::PipeRead(id) => pipe::close(id, false),
            Object::PipeWrite(id) => pipe::close(id, true),
            Object::Socket(id) => net::close(id),
            Object::Epoll(id) => crate::sys::epoll::drop_instance(id),
            Object::File(ino) => fs::release(ino),
            Object::EventFd(id) => crate::eventfd::close(id),
            _ => {}
        }
    }
}

#[derive(Clone)]
struct Slot {
    desc: Arc<Desc>,
    cloexec: bool,
}

/// One process's descriptors; a clone shares every open file description
/// (what `fork` gives the child).
#[derive(Clone, Default)]
pub struct FdTable(Vec<Option<Slot>>);

impl FdTable {
    /// stdin, and stdout and stderr on the console.
    pub fn stdio() -> FdTable {
        let console = Desc::new(Object::Console, O_WRONLY);
        FdTable(alloc::vec![
            Some(Slot { desc: Desc::new(Object::Stdin, 0), cloexec: false }),
            Some(Slot { desc: console.clone(), cloexec: false }),
            Some(Slot { desc: console, cloexec: false }),
        ])
    }
}

/// `f` on the calling process's table.
fn with_table<R>(f: impl FnOnce(&mut Vec<Option<Slot>>) -> R) -> R {
    let p = crate::sched::current_process();
    let mut t = p.fds.lock();
    f(&mut t.0)
}

pub fn get(fd: u64) -> Result<Arc<Desc>, Errno> {
    with_table(|t| t.get(fd as usize).and_then(|s| s.as_ref()).map(|s| s.desc.clone()).ok_or(EBADF))
}

/// Install `desc` at the lowest free number at or above `min`.
pub fn install_from(desc: Arc<Desc>, cloexec: bool, min: usize) -> Result<u64, Errno> {
    with_table(|t| install_in(t, desc, cloexec, min))
}

fn install_in(t: &mut Vec<Option<Slot>>, desc: Arc<Desc>, cloexec: bool, min: usize) -> Result<u64, Errno> {
    let free = (min..t.len()).find(|&i| t[i].is_none());
    let i = match free {
        Some(i) => i,
        None if t.len().max(min) < MAX_FDS => {
            while t.len() < min {
                t.push(None);
            }
            t.push(None);
            t.len() - 1
        }
        None => return Err(EMFILE),
    };
    t[i] = Some(Slot { desc, cloexec });
    Ok(i as u64)
}

pub fn install(desc: Arc<Desc>, flags: u32) -> Result<u64, Errno> {
    install_from(desc, flags & O_CLOEXEC != 0, 0)
}

/// Put `desc` at `fd`, closing what was there (dup2).
pub fn install_at(desc: Arc<Desc>, fd: u64, cloexec: bool) -> Result<u64, Errno> {
    let fd = fd as usize;
    if fd >= MAX_FDS {
        return Err(EBADF);
    }
    let old = with_table(|t| {
        while t.len() <= fd {
            t.push(None);
        }
        t[fd].replace(Slot { desc, cloexec })
    });
    if old.is_some() {
        crate::sys::epoll::forget_fd(fd as u64);
    }
    drop(old);
    Ok(fd as u64)
}

pub fn close(fd: u64) -> Result<(), Errno> {
    let slot = with_table(|t| t.get_mut(fd as usize).and_then(Option::take).ok_or(EBADF))?;
    crate::sys::epoll::forget_fd(fd);
    // Dropped outside the table lock: the object's release may take others.
    drop(slot);
    Ok(())
}

/// execve: close the descriptors marked close-on-exec.
pub fn close_on_exec() {
    let closed: Vec<(u64, Slot)> = with_table(|t| {
        t.iter_mut()
            .enumerate()
            .filter(|(_, s)| s.as_ref().is_some_and(|s| s.cloexec))
            .filter_map(|(i, s)| Some((i as u64, s.take()?)))
            .collect()
    });
    for (fd, slot) in closed {
        crate::sys::epoll::forget_fd(fd);
        drop(slot);
    }
}

pub fn cloexec(fd: u64) -> Result<bool, Errno> {
    with_table(|t| t.get(fd as usize).and_then(|s| s.as_ref()).map(|s| s.cloexec).ok_or(EBADF))
}

pub fn set_cloexec(fd: u64, on: bool) -> Result<(), Errno> {
    with_table(|t| {
        let s = t.get_mut(fd as usize).and_then(|s| s.as_mut()).ok_or(EBADF)?;
        s.cloexec = on;
        Ok(())
    })
}

/// A copy of the calling process's table for its child.
pub fn fork_table() -> FdTable {
    crate::sched::current_process().fds.lock().clone()
}

/// What the object behind `fd` is ready for (EPOLL* bits), or None if
/// `fd` is not open.
pub fn readiness(fd: u64) -> Option<u32> {
    readiness_since(fd, u32::MAX).map(|(r, _)| r)
}

/// [`readiness`] masked to `events` (EPOLLERR and EPOLLHUP always count),
/// with a stamp of when the object last became ready for them (ordering
/// descriptors that became ready between two looks of epoll, see
/// `ftvm_linux::ready_list`): sockets keep stamps; other objects say 0
/// (they then go in descriptor order, before sockets).
pub fn readiness_since(fd: u64, events: u32) -> Option<(u32, u64)> {
    let d = get(fd).ok()?;
    let mask = events | EPOLLERR | EPOLLHUP;
    let (r, since) = match d.obj {
        Object::Stdin => (EPOLLHUP, 0),
        Object::Console | Object::Dev(_) | Object::File(_) | Object::Dir(_) => (EPOLLIN | EPOLLOUT, 0),
        Object::EventFd(id) => (crate::eventfd::readiness(id), 0),
        Object::PipeRead(id) => (pipe::readiness(id, false), 0),
        Object::PipeWrite(id) => (pipe::readiness(id, true), 0),
        Object::Socket(id) => {
            let (r, since) = net::readiness(id);
            // Ready since the earliest rise among the sides it is ready on.
            let input = (r & mask & !EPOLLOUT != 0).then_some(since.input);
            let output = (r & mask & EPOLLOUT != 0).then_some(since.output);
            (r, input.into_iter().chain(output).min().unwrap_or(0))
        }
        Object::Epoll(id) => (if crate::sys::epoll::has_ready(id) { EPOLLIN } else { 0 }, 0),
    };
    Some((r & mask, since))
}
