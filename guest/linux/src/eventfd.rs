//! eventfd: a 64-bit counter that `write` adds to and `read` takes (all of
//! it, or one with EFD_SEMAPHORE), blocking while it is zero. Event loops
//! such as libevent's (memcached's worker threads) wake each other with it.

use alloc::collections::BTreeMap;

use spin::Mutex;

use crate::errno::{Errno, EAGAIN, EBADF, EINVAL};
use crate::fd::{EPOLLIN, EPOLLOUT};
use crate::sched;

/// The most the counter holds.
const MAX: u64 = u64::MAX - 1;

struct Counter {
    value: u64,
    semaphore: bool,
}

static COUNTERS: Mutex<(u32, BTreeMap<u32, Counter>)> = Mutex::new((0, BTreeMap::new()));

pub fn create(initial: u64, semaphore: bool) -> u32 {
    let mut c = COUNTERS.lock();
    c.0 += 1;
    let id = c.0;
    c.1.insert(id, Counter { value: initial, semaphore });
    id
}

pub fn close(id: u32) {
    COUNTERS.lock().1.remove(&id);
}

/// Take the counter (8 bytes into `out`); EAGAIN while it is zero.
pub fn read(id: u32, out: &mut [u8]) -> Result<usize, Errno> {
    if out.len() < 8 {
        return Err(EINVAL);
    }
    let mut c = COUNTERS.lock();
    let counter = c.1.get_mut(&id).ok_or(EBADF)?;
    if counter.value == 0 {
        return Err(EAGAIN);
    }
    let taken = if counter.semaphore { 1 } else { counter.value };
    counter.value -= taken;
    drop(c);
    out[..8].copy_from_slice(&taken.to_le_bytes());
    sched::wake_io();
    Ok(8)
}

/// Add the 8-byte value in `data`; EAGAIN while it would pass the maximum.
pub fn write(id: u32, data: &[u8]) -> Result<usize, Errno> {
    let add = data.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).ok_or(EINVAL)?;
    if add == u64::MAX {
        return Err(EINVAL);
    }
    let mut c = COUNTERS.lock();
    let counter = c.1.get_mut(&id).ok_or(EBADF)?;
    if MAX - counter.value < add {
        return Err(EAGAIN);
    }
    counter.value += add;
    drop(c);
    sched::wake_io();
    Ok(8)
}

pub fn readiness(id: u32) -> u32 {
    let c = COUNTERS.lock();
    let Some(counter) = c.1.get(&id) else { return 0 };
    let mut r = 0;
    if counter.value > 0 {
        r |= EPOLLIN;
    }
    if counter.value < MAX {
        r |= EPOLLOUT;
    }
    r
}
