//! The guest clock page.
//!
//! The guest TSC equals the host TSC here and cannot be offset (PLATFORM.md
//! quirk 4), so guests read time as a linear function of the TSC published
//! by the VMM. After a restore the VMM re-bases the function at the guest
//! time the snapshot was taken, so guest time neither jumps nor goes back.

use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress};

use ftvm_abi::layout::CLOCK_PAGE_ADDR;
use ftvm_abi::ClockPage;

use crate::components::{ComponentError, ComponentId, Components};
use crate::memory::GuestMemory;
use crate::persist::Persist;

const SHIFT: u32 = 32;

pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC has no memory effects and is always available on x86-64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// TSC ticks per second: KVM's figure when it has one, else measured.
pub fn tsc_hz(kvm_tsc_khz: Option<u32>) -> u64 {
    if let Some(khz) = kvm_tsc_khz.filter(|&k| k > 0) {
        return khz as u64 * 1000;
    }
    let (t0, c0) = (Instant::now(), rdtsc());
    std::thread::sleep(Duration::from_millis(20));
    let (t1, c1) = (Instant::now(), rdtsc());
    ((c1 - c0) as u128 * 1_000_000_000 / (t1 - t0).as_nanos()) as u64
}

/// The VMM's copy of the clock page; the guest's copy is rewritten from it.
///
/// A *stepped* clock (`set_stepped`) shows the guest one reading, `held`,
/// that moves only when the VMM steps it (`step`: to the running clock's
/// reading), not with the TSC: the guest's page then has a zero
/// multiplier. Two replicas of a VM that run the same input between two
/// steps, and whose clocks were stepped to the same reading, read the same
/// time however long each took. A guest that waits for a deadline is
/// woken when the running clock reaches it, and the clock is stepped then
/// (`VmShared::step_clock`), so its timers still fire.
#[derive(Clone, Copy, Debug)]
pub struct GuestClock {
    /// The running clock (the page as published when not stepped).
    page: ClockPage,
    /// The stepped clock's reading; None: the clock runs.
    held: Option<u64>,
}

impl GuestClock {
    /// A clock reading `ns` now.
    pub fn starting_at(tsc_hz: u64, ns: u64) -> GuestClock {
        let tsc_mul = ((1_000_000_000u128 << SHIFT) / tsc_hz as u128) as u64;
        let mut clock =
            GuestClock { page: ClockPage { version: 0, tsc_shift: SHIFT, tsc_mul, tsc_base: 0, ns_base: 0, realtime_base: 0 }, held: None };
        clock.rebase(ns);
        clock
    }

    /// The guest's reading now.
    pub fn now_ns(&self) -> u64 {
        self.held.unwrap_or_else(|| self.running_ns())
    }

    /// The running clock's reading now (the guest's unless stepped).
    fn running_ns(&self) -> u64 {
        self.page.ns_at(rdtsc())
    }

    /// Stepped (on) or running (off); turned on, it holds the reading of
    /// now. The caller publishes the page.
    pub fn set_stepped(&mut self, on: bool) {
        self.held = on.then(|| self.now_ns());
    }

    pub fn is_stepped(&self) -> bool {
        self.held.is_some()
    }

    /// A stepped clock moves to the running clock's reading (never back);
    /// a running one is unchanged. The caller publishes the page.
    pub fn step(&mut self) {
        if let Some(held) = self.held {
            self.held = Some(held.max(self.running_ns()));
        }
    }

    /// Nanoseconds per TSC tick, as the guest converts its TSC readings.
    pub fn ns_per_tick(&self) -> f64 {
        self.page.tsc_mul as f64 / (1u64 << self.page.tsc_shift) as f64
    }

    /// Host-side wait needed until the guest clock reads `deadline_ns`
    /// (a stepped one once stepped then: the running clock's wait).
    pub fn until(&self, deadline_ns: u64) -> Duration {
        Duration::from_nanos(deadline_ns.saturating_sub(self.running_ns()))
    }

    /// Continue from guest time `ns` (the time a snapshot was taken), with
    /// wall time from this host's clock (a restored or failed-over guest
    /// reads the time of day of the host it now runs on).
    pub fn rebase(&mut self, ns: u64) {
        self.page.tsc_base = rdtsc();
        self.page.ns_base = ns;
        if self.held.is_some() {
            self.held = Some(ns);
        }
        let wall = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        self.page.realtime_base = wall.saturating_sub(ns);
    }

    /// Publish the page to the guest. The version goes odd, then even, so a
    /// guest reading concurrently retries instead of mixing old and new.
    pub fn publish(&mut self, mem: &GuestMemory) -> Result<(), vm_memory::GuestMemoryError> {
        let addr = GuestAddress(CLOCK_PAGE_ADDR);
        let version: u32 = mem.read_obj(addr)?;
        mem.write_obj(version | 1, addr)?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.page.version = (version | 1).wrapping_add(1);
        let mut p = self.page;
        if let Some(held) = self.held {
            // The TSC no longer counts: the guest reads `held`.
            p.tsc_mul = 0;
            p.ns_base = held;
        }
        mem.write_obj(p.tsc_shift, GuestAddress(CLOCK_PAGE_ADDR + 4))?;
        mem.write_obj(p.tsc_mul, GuestAddress(CLOCK_PAGE_ADDR + 8))?;
        mem.write_obj(p.tsc_base, GuestAddress(CLOCK_PAGE_ADDR + 16))?;
        mem.write_obj(p.ns_base, GuestAddress(CLOCK_PAGE_ADDR + 24))?;
        mem.write_obj(p.realtime_base, GuestAddress(CLOCK_PAGE_ADDR + 32))?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        mem.write_obj(p.version, addr)
    }
}

/// The guest clock's saved state: the guest time when it was saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockState {
    pub ns: u64,
}

/// The guest clock's component.
pub fn component_id() -> ComponentId {
    ComponentId::new("clock")
}

/// The guest time `saved` was saved at.
pub fn saved_ns(saved: &Components) -> Result<u64, ComponentError> {
    saved.state::<ClockState>(&component_id()).map(|c| c.ns)
}

impl Persist for GuestClock {
    type State = ClockState;
    type Error = std::convert::Infallible;

    fn save(&self) -> Result<ClockState, Self::Error> {
        Ok(ClockState { ns: self.now_ns() })
    }

    /// Guest time continues from the saved reading (the caller publishes
    /// the page to the guest).
    fn restore(&mut self, state: &ClockState) -> Result<(), Self::Error> {
        self.rebase(state.ns);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebase_continues_from_saved_time() {
        let hz = tsc_hz(None);
        let mut clock = GuestClock::starting_at(hz, 0);
        std::thread::sleep(Duration::from_millis(5));
        let t = clock.now_ns();
        assert!(t >= 4_000_000, "5 ms sleep read as {t} ns");
        clock.rebase(1_000_000_000);
        let after = clock.now_ns();
        assert!((1_000_000_000..1_100_000_000).contains(&after));
    }

    #[test]
    fn a_stepped_clock_holds_its_reading_until_stepped() {
        let ram = crate::memory::GuestRam::new(4 << 20, false).unwrap();
        let mut clock = GuestClock::starting_at(tsc_hz(None), 7_000);
        clock.set_stepped(true);
        let held = clock.now_ns();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(clock.now_ns(), held, "the reading moved without a step");
        assert!(clock.until(held + 10_000_000) < Duration::from_millis(9), "a deadline waits for the running clock");
        clock.publish(ram.memory()).unwrap();
        let read = |off| ram.memory().read_obj::<u64>(GuestAddress(CLOCK_PAGE_ADDR + off)).unwrap();
        assert_eq!((read(8), read(24)), (0, held), "the guest's page: no multiplier, the held reading");
        clock.step();
        let stepped = clock.now_ns();
        assert!(stepped >= held + 2_000_000, "stepped from {held} to {stepped}");
        clock.rebase(held);
        assert_eq!(clock.now_ns(), held, "a restore sets the held reading");
        clock.set_stepped(false);
        std::thread::sleep(Duration::from_millis(1));
        assert!(clock.now_ns() > held, "running again");
    }

    #[test]
    fn publish_leaves_an_even_version() {
        let ram = crate::memory::GuestRam::new(4 << 20, false).unwrap();
        let mut clock = GuestClock::starting_at(2_000_000_000, 5);
        clock.publish(ram.memory()).unwrap();
        clock.publish(ram.memory()).unwrap();
        let read = |off| ram.memory().read_obj::<u64>(GuestAddress(CLOCK_PAGE_ADDR + off)).unwrap();
        assert_eq!(read(0) as u32, 4, "version");
        assert_eq!(read(8), 1 << 31, "tsc_mul");
        assert_eq!(read(24), 5, "ns_base");
        let wall = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos() as u64;
        assert!(read(32) <= wall && read(32) > wall - 60_000_000_000, "realtime_base is this host's wall clock");
    }
}
