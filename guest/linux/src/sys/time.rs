//! Time: clocks from the VMM's clock page (guest time, monotonic across
//! snapshots and failover), sleeping in the scheduler.

use core::sync::atomic::{AtomicU64, Ordering};

use ftvm_rt::time::{now_ns, NS_PER_SEC};

use super::{user, SysResult};
use crate::errno::{EFAULT, EINVAL};
use crate::sched::{self, Wait};

const CLOCK_REALTIME: u64 = 0;
const CLOCK_MONOTONIC: u64 = 1;
const CLOCK_PROCESS_CPUTIME_ID: u64 = 2;
const CLOCK_THREAD_CPUTIME_ID: u64 = 3;
const CLOCK_MONOTONIC_RAW: u64 = 4;
const CLOCK_REALTIME_COARSE: u64 = 5;
const CLOCK_MONOTONIC_COARSE: u64 = 6;
const CLOCK_BOOTTIME: u64 = 7;
const TIMER_ABSTIME: u64 = 1;

/// CLOCK_REALTIME at guest time 0 when the `epoch=` runtime option set it;
/// `u64::MAX`: the host's wall clock from the clock page.
static EPOCH_NS: AtomicU64 = AtomicU64::new(u64::MAX);

pub fn set_epoch(ns: Option<u64>) {
    EPOCH_NS.store(ns.unwrap_or(u64::MAX), Ordering::Relaxed);
}

pub fn realtime_ns() -> u64 {
    match EPOCH_NS.load(Ordering::Relaxed) {
        u64::MAX => ftvm_rt::time::realtime_ns(),
        epoch => epoch + now_ns(),
    }
}

fn clock_ns(clock: u64) -> Result<u64, crate::errno::Errno> {
    match clock {
        CLOCK_REALTIME | CLOCK_REALTIME_COARSE => Ok(realtime_ns()),
        CLOCK_MONOTONIC | CLOCK_MONOTONIC_RAW | CLOCK_MONOTONIC_COARSE | CLOCK_BOOTTIME => Ok(now_ns()),
        // One vCPU runs everything: the process's CPU time is close enough
        // to guest time.
        CLOCK_PROCESS_CPUTIME_ID | CLOCK_THREAD_CPUTIME_ID => Ok(now_ns()),
        _ => Err(EINVAL),
    }
}

fn write_timespec(addr: u64, ns: u64) -> Result<(), crate::errno::Errno> {
    user::write(addr, [(ns / NS_PER_SEC) as i64, (ns % NS_PER_SEC) as i64])
}

/// A `struct timespec` as nanoseconds.
pub fn read_timespec(addr: u64) -> Result<u64, crate::errno::Errno> {
    let [sec, nsec]: [i64; 2] = user::read(addr)?;
    if sec < 0 || !(0..1_000_000_000).contains(&nsec) {
        return Err(EINVAL);
    }
    Ok((sec as u64).saturating_mul(NS_PER_SEC).saturating_add(nsec as u64))
}

/// Absolute deadline for a timeout in milliseconds (negative: none).
pub fn timeout_ms(ms: i32) -> u64 {
    if ms < 0 {
        u64::MAX
    } else {
        now_ns().saturating_add(ms as u64 * 1_000_000)
    }
}

pub fn clock_gettime(clock: u64, ts: u64) -> SysResult {
    let ns = clock_ns(clock)?;
    write_timespec(ts, ns)?;
    Ok(0)
}

pub fn clock_getres(ts: u64) -> SysResult {
    if ts != 0 {
        write_timespec(ts, 1)?;
    }
    Ok(0)
}

pub fn gettimeofday(tv: u64) -> SysResult {
    if tv != 0 {
        let ns = realtime_ns();
        user::write(tv, [(ns / NS_PER_SEC) as i64, ((ns % NS_PER_SEC) / 1000) as i64])?;
    }
    Ok(0)
}

pub fn time(out: u64) -> SysResult {
    let secs = realtime_ns() / NS_PER_SEC;
    if out != 0 {
        user::write(out, secs as i64).map_err(|_| EFAULT)?;
    }
    Ok(secs)
}

fn sleep_until(deadline: u64) -> Result<(), crate::errno::Errno> {
    while now_ns() < deadline {
        sched::block(Wait::Sleep, deadline)?;
    }
    Ok(())
}

pub fn nanosleep(req: u64, _rem: u64) -> SysResult {
    let ns = read_timespec(req)?;
    sleep_until(now_ns().saturating_add(ns))?;
    Ok(0)
}

pub fn clock_nanosleep(clock: u64, flags: u64, req: u64, _rem: u64) -> SysResult {
    let ns = read_timespec(req)?;
    let now = clock_ns(clock)?;
    let delay = if flags & TIMER_ABSTIME != 0 { ns.saturating_sub(now) } else { ns };
    sleep_until(now_ns().saturating_add(delay))?;
    Ok(0)
}
