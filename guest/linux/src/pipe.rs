//! Pipes: a bounded byte queue between a read end and a write end.

use alloc::collections::{BTreeMap, VecDeque};

use spin::Mutex;

use crate::errno::{Errno, EAGAIN, EPIPE};
use crate::fd::{EPOLLERR, EPOLLHUP, EPOLLIN, EPOLLOUT};
use crate::sched;

/// Linux's default pipe capacity.
const CAPACITY: usize = 64 * 1024;

struct Pipe {
    buf: VecDeque<u8>,
    reader: bool,
    writer: bool,
}

static PIPES: Mutex<(u32, BTreeMap<u32, Pipe>)> = Mutex::new((0, BTreeMap::new()));

pub fn create() -> u32 {
    let mut p = PIPES.lock();
    p.0 += 1;
    let id = p.0;
    p.1.insert(id, Pipe { buf: VecDeque::new(), reader: true, writer: true });
    id
}

pub fn close(id: u32, write_end: bool) {
    let mut p = PIPES.lock();
    let gone = match p.1.get_mut(&id) {
        Some(pipe) => {
            if write_end {
                pipe.writer = false;
            } else {
                pipe.reader = false;
            }
            !pipe.reader && !pipe.writer
        }
        None => false,
    };
    if gone {
        p.1.remove(&id);
    }
    drop(p);
    sched::wake_io();
}

/// Read what is there; `Ok(0)` at end of file (no writer left).
pub fn read(id: u32, out: &mut [u8]) -> Result<usize, Errno> {
    let mut p = PIPES.lock();
    let pipe = p.1.get_mut(&id).ok_or(EPIPE)?;
    if pipe.buf.is_empty() {
        return if pipe.writer { Err(EAGAIN) } else { Ok(0) };
    }
    let n = out.len().min(pipe.buf.len());
    for (o, b) in out.iter_mut().zip(pipe.buf.drain(..n)) {
        *o = b;
    }
    drop(p);
    sched::wake_io();
    Ok(n)
}

pub fn write(id: u32, data: &[u8]) -> Result<usize, Errno> {
    let mut p = PIPES.lock();
    let pipe = p.1.get_mut(&id).ok_or(EPIPE)?;
    if !pipe.reader {
        return Err(EPIPE);
    }
    let n = data.len().min(CAPACITY - pipe.buf.len());
    if n == 0 {
        return Err(EAGAIN);
    }
    pipe.buf.extend(&data[..n]);
    drop(p);
    sched::wake_io();
    Ok(n)
}

pub fn readiness(id: u32, write_end: bool) -> u32 {
    let p = PIPES.lock();
    let Some(pipe) = p.1.get(&id) else { return EPOLLERR };
    if write_end {
        if !pipe.reader {
            EPOLLERR
        } else if pipe.buf.len() < CAPACITY {
            EPOLLOUT
        } else {
            0
        }
    } else {
        let mut r = if pipe.buf.is_empty() { 0 } else { EPOLLIN };
        if !pipe.writer {
            r |= EPOLLHUP;
        }
        r
    }
}
