//! Guest time from the VMM's clock page, and blocking waits.
//!
//! The guest TSC is the host TSC and jumps across a restore, so time is
//! always `ClockPage::ns_at(rdtsc)`; the VMM rewrites the page's bases so the
//! result stays monotonic.

use core::arch::x86_64::{_mm_lfence, _rdtsc};
use core::ptr::{addr_of, read_volatile};
use core::sync::atomic::{compiler_fence, AtomicPtr, AtomicU64, Ordering};

use ftvm_abi::ClockPage;

use crate::vcpu::vcpu_id;
use crate::{hypercall, MAX_VCPUS};

pub const NS_PER_MS: u64 = 1_000_000;
pub const NS_PER_SEC: u64 = 1_000_000_000;

static CLOCK: AtomicPtr<ClockPage> = AtomicPtr::new(core::ptr::null_mut());

/// Last event sequence number each vCPU observed from WAIT. Passing it back
/// makes a WAIT return at once if a kick arrived after the caller's last
/// look at its condition, which is what makes sleeping race-free.
static SEEN: [AtomicU64; MAX_VCPUS] = [const { AtomicU64::new(0) }; MAX_VCPUS];

/// WAIT hypercalls made (each one a VM exit to the VMM), for diagnostics.
static WAITS: AtomicU64 = AtomicU64::new(0);

/// How many WAIT hypercalls this guest has made.
pub fn waits() -> u64 {
    WAITS.load(Ordering::Relaxed)
}

pub(crate) fn init(clock: *const ClockPage) {
    CLOCK.store(clock as *mut ClockPage, Ordering::Release);
}

/// Nanoseconds of guest time.
pub fn now_ns() -> u64 {
    let (c, tsc) = read_clock();
    c.ns_at(tsc)
}

/// The host's wall clock, nanoseconds since the UNIX epoch: guest time plus
/// the page's `realtime_base` (rebased with guest time after a restore or a
/// failover, so it follows the host the VM runs on).
pub fn realtime_ns() -> u64 {
    let (c, tsc) = read_clock();
    c.ns_at(tsc).saturating_add(c.realtime_base)
}

/// A consistent copy of the clock page and a TSC reading taken with it.
fn read_clock() -> (ClockPage, u64) {
    let page = CLOCK.load(Ordering::Acquire);
    assert!(!page.is_null(), "now_ns before the clock page is known");
    loop {
        // SAFETY: `page` is the VMM's clock page (boot info `clock_addr`),
        // mapped readable for the guest's lifetime; volatile because the VMM
        // rewrites it behind the compiler's back.
        let (v1, c) = unsafe {
            let v1 = read_volatile(addr_of!((*page).version));
            compiler_fence(Ordering::Acquire);
            let c = ClockPage {
                version: v1,
                tsc_shift: read_volatile(addr_of!((*page).tsc_shift)),
                tsc_mul: read_volatile(addr_of!((*page).tsc_mul)),
                tsc_base: read_volatile(addr_of!((*page).tsc_base)),
                ns_base: read_volatile(addr_of!((*page).ns_base)),
                realtime_base: read_volatile(addr_of!((*page).realtime_base)),
            };
            (v1, c)
        };
        // SAFETY: lfence/rdtsc are available at CPL3 on every x86-64 the VMM
        // runs on (CR4.TSD clear); lfence keeps rdtsc from running ahead of
        // the page reads, so consecutive readings never go backwards.
        let tsc = unsafe {
            _mm_lfence();
            _rdtsc()
        };
        compiler_fence(Ordering::Acquire);
        // SAFETY: a clock page read, sound as the first one in this loop.
        let v2 = unsafe { read_volatile(addr_of!((*page).version)) };
        if v1 & 1 == 0 && v1 == v2 {
            return (c, tsc);
        }
        core::hint::spin_loop();
    }
}

/// Block until guest time reaches `deadline_ns` (`u64::MAX`: none), a kick or
/// device event arrives, or the VMM wakes the vCPU for its own reasons. Callers
/// re-check their condition afterwards.
pub fn wait(deadline_ns: u64) {
    let slot = &SEEN[vcpu_id()];
    WAITS.fetch_add(1, Ordering::Relaxed);
    let seq = hypercall::wait(deadline_ns, slot.load(Ordering::Relaxed));
    slot.store(seq, Ordering::Relaxed);
}

/// Sleep until guest time reaches `deadline_ns`.
pub fn sleep_until(deadline_ns: u64) {
    while now_ns() < deadline_ns {
        wait(deadline_ns);
    }
}

/// Sleep for at least `ns` nanoseconds of guest time.
pub fn sleep_ns(ns: u64) {
    sleep_until(now_ns().saturating_add(ns));
}
