//! epoll (level-triggered; EPOLLONESHOT honoured, EPOLLET served as
//! level-triggered) and poll/ppoll, over the readiness of descriptors.
//! Ready descriptors are reported in the order they became ready, as Linux
//! does (`ftvm_linux::ready_list`).

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use ftvm_linux::ready_list::ReadyList;
use ftvm_rt::time::now_ns;
use spin::Mutex;

use super::{time, user, SysResult};
use crate::errno::*;
use crate::fd::{self, Desc, Object, EPOLLERR, EPOLLHUP};
use crate::sched::{self, Wait};

const EPOLL_CTL_ADD: u64 = 1;
const EPOLL_CTL_DEL: u64 = 2;
const EPOLL_CTL_MOD: u64 = 3;
const EPOLLONESHOT: u32 = 1 << 30;
const EPOLL_CLOEXEC: u64 = 0o2000000;
const POLLNVAL: i16 = 0x20;

/// One descriptor of an interest list.
#[derive(Clone, Copy)]
struct Entry {
    events: u32,
    data: u64,
    /// An EPOLLONESHOT descriptor already reported: nothing until
    /// EPOLL_CTL_MOD arms it again.
    disarmed: bool,
}

#[derive(Default)]
struct Instance {
    interest: BTreeMap<u64, Entry>,
    ready: ReadyList,
}

static EPOLLS: Mutex<(u32, BTreeMap<u32, Instance>)> = Mutex::new((0, BTreeMap::new()));
/// The process that made each instance: its interest lists name that
/// process's descriptors, so only that process's closes remove entries (a
/// forked child closing its copies leaves the parent's instance alone).
static OWNERS: Mutex<BTreeMap<u32, u32>> = Mutex::new(BTreeMap::new());

pub fn create(flags: u64) -> SysResult {
    let id = {
        let mut e = EPOLLS.lock();
        e.0 += 1;
        let id = e.0;
        e.1.insert(id, Instance::default());
        id
    };
    OWNERS.lock().insert(id, sched::current_process().pid);
    let flags = if flags & EPOLL_CLOEXEC != 0 { fd::O_CLOEXEC } else { 0 };
    fd::install(Desc::new(Object::Epoll(id), flags | fd::O_RDWR), flags)
}

pub fn drop_instance(id: u32) {
    EPOLLS.lock().1.remove(&id);
    OWNERS.lock().remove(&id);
}

/// `fd` was closed: it leaves the calling process's interest lists.
pub fn forget_fd(fd: u64) {
    let pid = sched::current_process().pid;
    let owners = OWNERS.lock();
    for (id, instance) in EPOLLS.lock().1.iter_mut() {
        if owners.get(id) == Some(&pid) {
            instance.interest.remove(&fd);
            instance.ready.remove(fd);
        }
    }
}

fn epoll_id(epfd: u64) -> Result<u32, Errno> {
    match fd::get(epfd)?.obj {
        Object::Epoll(id) => Ok(id),
        _ => Err(EINVAL),
    }
}

pub fn ctl(epfd: u64, op: u64, fd: u64, event: u64) -> SysResult {
    let id = epoll_id(epfd)?;
    if fd == epfd {
        return Err(EINVAL);
    }
    fd::get(fd)?;
    let ev = if op == EPOLL_CTL_DEL {
        None
    } else {
        let raw = user::bytes(event, 12)?;
        let events = u32::from_le_bytes(raw[0..4].try_into().expect("4 bytes"));
        let data = u64::from_le_bytes(raw[4..12].try_into().expect("8 bytes"));
        Some(Entry { events, data, disarmed: false })
    };
    let mut e = EPOLLS.lock();
    let instance = e.1.get_mut(&id).ok_or(EBADF)?;
    match (op, ev) {
        (EPOLL_CTL_ADD, Some(ev)) => {
            if instance.interest.contains_key(&fd) {
                return Err(EEXIST);
            }
            instance.interest.insert(fd, ev);
        }
        (EPOLL_CTL_MOD, Some(ev)) => *instance.interest.get_mut(&fd).ok_or(ENOENT)? = ev,
        (EPOLL_CTL_DEL, None) => {
            instance.interest.remove(&fd).ok_or(ENOENT)?;
            instance.ready.remove(fd);
        }
        _ => return Err(EINVAL),
    }
    Ok(0)
}

/// Bring instance `id`'s ready list up to date; with `max` > 0, take up to
/// `max` (fd, events, data) off its head, as epoll_wait reports them.
fn collect(id: u32, max: usize) -> Vec<(u64, u32, u64)> {
    let list: Vec<(u64, Entry)> = match EPOLLS.lock().1.get(&id) {
        Some(i) => i.interest.iter().filter(|(_, e)| !e.disarmed).map(|(&f, &e)| (f, e)).collect(),
        None => return Vec::new(),
    };
    // Asked without the lock: an epoll descriptor's readiness is its own
    // instance's ready list.
    // (fd, since) and the events, in descriptor order (the interest list's).
    let mut stamps = Vec::new();
    let mut events = Vec::new();
    for (f, entry) in list {
        let Some((r, since)) = fd::readiness_since(f, entry.events) else { continue };
        if r != 0 {
            stamps.push((f, since));
            events.push(r);
        }
    }
    let mut e = EPOLLS.lock();
    let Some(instance) = e.1.get_mut(&id) else { return Vec::new() };
    instance.ready.update(&stamps);
    let mut ready = Vec::new();
    for f in instance.ready.take(max) {
        let Ok(i) = stamps.binary_search_by_key(&f, |&(f, _)| f) else { continue };
        let Some(entry) = instance.interest.get_mut(&f) else { continue };
        ready.push((f, events[i], entry.data));
        if entry.events & EPOLLONESHOT != 0 {
            entry.disarmed = true;
        } else {
            instance.ready.requeue(f);
        }
    }
    ready
}

pub fn has_ready(id: u32) -> bool {
    collect(id, 0);
    EPOLLS.lock().1.get(&id).is_some_and(|i| !i.ready.is_empty())
}

pub fn wait(epfd: u64, events: u64, max: u64, timeout_ms: i32) -> SysResult {
    let id = epoll_id(epfd)?;
    if max == 0 || max > 1 << 20 {
        return Err(EINVAL);
    }
    let out = user::bytes_mut(events, max * 12)?;
    let deadline = time::timeout_ms(timeout_ms);
    loop {
        poll_network();
        let ready = collect(id, max as usize);
        if !ready.is_empty() {
            for (i, &(_, r, data)) in ready.iter().enumerate() {
                out[i * 12..i * 12 + 4].copy_from_slice(&r.to_le_bytes());
                out[i * 12 + 4..i * 12 + 12].copy_from_slice(&data.to_le_bytes());
            }
            return Ok(ready.len() as u64);
        }
        if now_ns() >= deadline {
            return Ok(0);
        }
        sched::block(Wait::Io, deadline)?;
    }
}

/// Move the network before looking at readiness. What arrives may be for
/// another thread's socket: wake the threads waiting for I/O, or one blocked
/// in its own `epoll_wait` would sleep on data already taken in (acknowledged
/// to its peer, which then sends nothing more) until some other frame came.
fn poll_network() {
    if crate::net::poll() {
        sched::wake_io();
    }
}

fn poll_until(fds: u64, n: u64, deadline: u64) -> SysResult {
    if n > fd::MAX_FDS as u64 {
        return Err(EINVAL);
    }
    let raw = user::bytes_mut(fds, n * 8)?;
    loop {
        poll_network();
        let mut count = 0;
        for p in raw.chunks_exact_mut(8) {
            let f = i32::from_le_bytes(p[0..4].try_into().expect("4 bytes"));
            let events = i16::from_le_bytes(p[4..6].try_into().expect("2 bytes"));
            let revents = if f < 0 {
                0
            } else {
                match fd::readiness(f as u64) {
                    None => POLLNVAL,
                    Some(r) => (r as i16) & (events | EPOLLERR as i16 | EPOLLHUP as i16),
                }
            };
            p[6..8].copy_from_slice(&revents.to_le_bytes());
            if revents != 0 {
                count += 1;
            }
        }
        if count > 0 || now_ns() >= deadline {
            return Ok(count);
        }
        sched::block(Wait::Io, deadline)?;
    }
}

pub fn poll(fds: u64, n: u64, deadline: u64) -> SysResult {
    poll_until(fds, n, deadline)
}

pub fn ppoll(fds: u64, n: u64, ts: u64) -> SysResult {
    let deadline = if ts == 0 { u64::MAX } else { now_ns().saturating_add(time::read_timespec(ts)?) };
    poll_until(fds, n, deadline)
}
