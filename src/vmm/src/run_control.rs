//! Pausing, resuming and stopping the vCPU threads.
//!
//! A vCPU thread runs KVM_RUN until asked to park. To get it out of the
//! kernel promptly we send it a signal whose handler sets `immediate_exit`
//! in its `kvm_run` page; a signal that lands while the thread is in user
//! space makes its next KVM_RUN return at once, so no request is missed.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvm_bindings::kvm_run;

use crate::sync::{self, Lock};

thread_local! {
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// Signal used to kick vCPU threads out of KVM_RUN.
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN.with(|r| r.get());
    if !run.is_null() {
        // SAFETY: the pointer is this thread's own kvm_run mapping, set by
        // `register_kvm_run` and valid until the thread clears it; a single
        // byte store is async-signal-safe.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
}

/// Install the kick handler (idempotent).
pub fn install_kick_handler() -> Result<(), vmm_sys_util::errno::Error> {
    vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick)
}

/// Called on the vCPU thread with its kvm_run page (null to forget it).
pub fn register_kvm_run(run: *mut kvm_run) {
    KVM_RUN.with(|r| r.set(run));
}

crate::switch! {
    /// How a pause stops a vCPU that waits in the wait hypercall (`--idle-pause`).
    pub enum IdlePause {
        /// It counts as parked where it waits, without being woken: its `out`
        /// is still pending in KVM, which advances RIP past it only when the
        /// vCPU next runs, so its saved registers are those before the wait
        /// and a restored copy waits again. An idle guest stops at no cost.
        Park = "park",
        /// It is woken, steps back over its `out` and parks like a vCPU taken
        /// out of KVM_RUN: two thread wake-ups and three vCPU ioctls per pause.
        Kick = "kick",
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Run,
    Pause,
    Stop,
}

struct State {
    mode: Mode,
    parked: usize,
    finished: usize,
    /// The vCPUs (bit = index) counted as parked while they block in the
    /// wait hypercall (`park_in_wait`).
    in_wait: u64,
}

pub struct RunControl {
    state: Mutex<State>,
    changed: Condvar,
    /// Checked by vCPU threads before each KVM_RUN (cheaper than the lock).
    leave: AtomicBool,
    vcpus: usize,
}

impl RunControl {
    pub fn new(vcpus: usize, mode: Mode) -> RunControl {
        RunControl {
            state: Mutex::new(State { mode, parked: 0, finished: 0, in_wait: 0 }),
            changed: Condvar::new(),
            leave: AtomicBool::new(mode != Mode::Run),
            vcpus,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    pub fn vcpus(&self) -> usize {
        self.vcpus
    }

    /// Whether vCPU threads should leave KVM_RUN now.
    pub fn should_leave(&self) -> bool {
        self.leave.load(Ordering::Acquire)
    }

    pub fn mode(&self) -> Mode {
        self.lock().mode
    }

    /// Ask for `mode` (Pause or Stop); the caller kicks the threads.
    /// Returns the vCPUs (bit = index) parked in the wait hypercall at the
    /// request: for a pause they need no kick, since the end of their wait
    /// (`unpark_from_wait`) sees the pause, under the same lock, and stays
    /// parked.
    pub fn request(&self, mode: Mode) -> u64 {
        let mut st = self.lock();
        if st.mode == Mode::Stop {
            return st.in_wait; // stopping is final
        }
        st.mode = mode;
        self.leave.store(mode != Mode::Run, Ordering::Release);
        self.changed.notify_all();
        st.in_wait
    }

    /// Wait until every vCPU thread has parked or finished.
    pub fn wait_parked(&self) {
        let mut st = self.lock();
        while st.parked + st.finished < self.vcpus && st.mode == Mode::Pause {
            st = sync::wait(&self.changed, st);
        }
    }

    /// vCPU side: block while paused. Returns false when the thread must end.
    pub fn park_until_run(&self) -> bool {
        let mut st = self.lock();
        let mut counted = false;
        loop {
            match st.mode {
                Mode::Run => break,
                Mode::Stop => break,
                Mode::Pause if !counted => {
                    st.parked += 1;
                    counted = true;
                    self.changed.notify_all();
                }
                Mode::Pause => {}
            }
            st = sync::wait(&self.changed, st);
        }
        if counted {
            st.parked -= 1;
        }
        st.mode == Mode::Run
    }

    /// Whether the VM is stopping for good.
    pub fn stopping(&self) -> bool {
        self.lock().mode == Mode::Stop
    }

    /// vCPU side (`IdlePause::Park`): the thread is about to block in the
    /// wait hypercall, its vCPU unlocked and not in KVM_RUN; it counts as
    /// parked until `unpark_from_wait`.
    pub fn park_in_wait(&self, index: u32) {
        let mut st = self.lock();
        st.parked += 1;
        st.in_wait |= 1 << index;
        self.changed.notify_all();
    }

    /// vCPU side: the wait ended. Stays parked while the VM is paused, then
    /// stops counting; false when the thread must end.
    pub fn unpark_from_wait(&self, index: u32) -> bool {
        let mut st = self.lock();
        while st.mode == Mode::Pause {
            st = sync::wait(&self.changed, st);
        }
        st.parked -= 1;
        st.in_wait &= !(1 << index);
        st.mode == Mode::Run
    }

    /// vCPU side: the thread is ending.
    pub fn finished(&self) {
        self.lock().finished += 1;
        self.changed.notify_all();
    }
}

/// Device events and kicks that wake vCPUs blocked in the wait hypercall.
#[derive(Default)]
pub struct Events {
    state: Mutex<EventState>,
    changed: Condvar,
}

#[derive(Default)]
struct EventState {
    seq: u64,
    /// vCPUs blocked in `wait`. A device thread signals after every pass
    /// that used buffers, mostly while no vCPU waits: `Condvar::notify_all`
    /// makes a system call whether anyone waits or not, so it is skipped
    /// then. Counted under the lock: a waiter that comes after the signal
    /// sees the new sequence before it blocks.
    waiters: usize,
}

impl Events {
    pub fn signal(&self) {
        let mut st = self.state.locked();
        st.seq += 1;
        if st.waiters > 0 {
            self.changed.notify_all();
        }
    }

    /// Wake every waiter without an event (they re-check why they wait).
    pub fn wake_all(&self) {
        let _guard = self.state.locked();
        self.changed.notify_all();
    }

    /// Block until the sequence moves past `seen`, `deadline` passes or
    /// `interrupted` says so; returns the current sequence.
    pub fn wait(&self, seen: u64, deadline: Option<Instant>, interrupted: impl Fn() -> bool) -> u64 {
        let mut st = self.state.locked();
        while st.seq == seen && !interrupted() {
            let timeout = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(t) if !t.is_zero() => t,
                    _ => break,
                },
                // Wake now and then anyway: cheap insurance against a lost wake-up.
                None => Duration::from_secs(1),
            };
            st.waiters += 1;
            st = sync::wait_timeout(&self.changed, st, timeout);
            st.waiters -= 1;
        }
        st.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_signal_wakes_a_blocked_waiter_and_costs_nothing_without_one() {
        let events = Arc::new(Events::default());
        // No waiter: the sequence moves, nobody is notified.
        events.signal();
        assert_eq!(events.wait(0, None, || false), 1, "a signal before the wait is seen at once");
        let waiter = {
            let events = events.clone();
            // A lost wake-up would leave it blocked for the hour.
            std::thread::spawn(move || events.wait(1, Some(Instant::now() + Duration::from_secs(3600)), || false))
        };
        while events.state.locked().waiters == 0 {
            std::thread::yield_now();
        }
        events.signal();
        assert_eq!(waiter.join().unwrap(), 2, "the blocked waiter woke to the new sequence");
        assert_eq!(events.state.locked().waiters, 0);
    }

    #[test]
    fn pause_waits_for_every_vcpu() {
        let ctl = Arc::new(RunControl::new(2, Mode::Run));
        ctl.request(Mode::Pause);
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let ctl = ctl.clone();
                std::thread::spawn(move || {
                    while ctl.park_until_run() {
                        while !ctl.should_leave() {
                            std::thread::yield_now();
                        }
                    }
                    ctl.finished();
                })
            })
            .collect();
        ctl.wait_parked();
        assert_eq!(ctl.lock().parked, 2);
        ctl.request(Mode::Run);
        ctl.request(Mode::Pause);
        ctl.wait_parked();
        ctl.request(Mode::Stop);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(ctl.lock().finished, 2);
    }

    #[test]
    fn a_vcpu_parked_in_its_wait_counts_as_parked_until_the_pause_ends() {
        let ctl = Arc::new(RunControl::new(1, Mode::Run));
        ctl.park_in_wait(0);
        assert_eq!(ctl.request(Mode::Pause), 1, "the pause is told vCPU 0 waits parked: it is not kicked");
        ctl.wait_parked(); // returns at once: nobody had to be woken
        let waiter = ctl.clone();
        let h = std::thread::spawn(move || waiter.unpark_from_wait(0));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!h.is_finished(), "a waiter woken during the pause must stay parked");
        assert_eq!(ctl.lock().parked, 1);
        ctl.request(Mode::Run);
        assert!(h.join().unwrap());
        assert_eq!(ctl.lock().parked, 0);
        assert_eq!(ctl.request(Mode::Pause), 0, "a vCPU out of its wait is kicked");
        ctl.request(Mode::Run);
        ctl.park_in_wait(0);
        ctl.request(Mode::Stop);
        assert!(!ctl.unpark_from_wait(0), "a stop ends the thread");
    }

    #[test]
    fn idle_pause_names_round_trip() {
        for mode in [IdlePause::Park, IdlePause::Kick] {
            assert_eq!(mode.to_string().parse::<IdlePause>(), Ok(mode));
        }
        assert!("sleep".parse::<IdlePause>().is_err());
    }

    #[test]
    fn wait_returns_on_event_or_deadline() {
        let ev = Arc::new(Events::default());
        let t0 = Instant::now();
        assert_eq!(ev.wait(0, Some(t0 + Duration::from_millis(20)), || false), 0);
        assert!(t0.elapsed() >= Duration::from_millis(20));
        let ev2 = ev.clone();
        let h = std::thread::spawn(move || ev2.wait(0, None, || false));
        std::thread::sleep(Duration::from_millis(10));
        ev.signal();
        assert_eq!(h.join().unwrap(), 1);
        assert_eq!(ev.wait(0, None, || false), 1, "already past seen");
    }
}
