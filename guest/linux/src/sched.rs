//! Threads: the program's threads run one at a time on vCPU 0 and switch
//! only when one blocks (a futex wait, a wait for I/O, a sleep) or yields.
//!
//! Why cooperative on one vCPU rather than a vCPU per thread: the programs
//! this runs (redis-server first) keep their work on one thread and park the
//! others (background I/O) in futex waits; there is no parallelism to gain
//! on a 2-core host, while vCPUs would cost a VM exit for every wake-up and
//! lock every structure of the system-call layer. Here a system call is a
//! function call, a wake-up is a list operation, and a checkpoint sees one
//! running vCPU. A thread that spins without a system call starves the
//! others (no preemption); so does one on Linux with one CPU and
//! SCHED_FIFO.
//!
//! When no thread can run, the scheduler polls the network, and if nothing
//! moved sleeps in WAIT until the earliest deadline or a device event.
//!
//! A thread that keeps making system calls for a whole time slice
//! ([`SLICE_NS`]) while others are runnable gives way at the end of one
//! ([`end_of_call`]), after a poll of the network: a forked child
//! writing a snapshot does not stop its parent from serving. One that
//! computes without system calls still keeps the vCPU.
//!
//! Threads of every process share the vCPU the same way. Switching to a
//! thread of a process with other page tables loads them (the ADDRESS_SPACE
//! hypercall, see `aspace`); threads of one process switch for free.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use alloc::vec::Vec;
use core::mem::size_of;

use ftvm_rt::time;
use spin::Mutex;

use crate::aspace::AddressSpace;
use crate::entry::{self, Frame, SwitchFrame};
use crate::errno::{Errno, EINTR};
use crate::process::{self, Process};

/// Kernel stack of a thread: the system-call layer runs on it.
const KSTACK_SIZE: usize = 128 * 1024;
/// How long a thread runs before its next system call lets others run.
const SLICE_NS: u64 = 5_000_000;
/// `end_of_call` looks at the clock on one system call in this many.
const CALLS_PER_CLOCK_READ: u32 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Woken by FUTEX_WAKE on this address (or its deadline).
    Futex(u64),
    /// Waiting for I/O readiness: re-checked whenever the network moved or
    /// another thread changed a pipe or socket (or at its deadline).
    Io,
    /// Only the deadline.
    Sleep,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Runnable,
    Blocked(Wait, u64),
    Dead,
}

pub struct Thread {
    pub tid: u32,
    /// The process it belongs to.
    pub proc: Arc<Process>,
    kstack: Box<[u8]>,
    /// rsp saved by `entry::switch` while switched out.
    ksp: u64,
    pub fs_base: u64,
    /// `set_tid_address` / CLONE_CHILD_CLEARTID: zeroed and woken at exit.
    pub clear_child_tid: u64,
    /// Signals blocked (bit `sig - 1`): sigprocmask, and a handler's own
    /// signal and `sa_mask` while it runs.
    pub sigmask: u64,
    /// Signals sent to this thread alone (tkill, tgkill: pthread_kill,
    /// pthread_cancel), for its handlers; bit `sig - 1`.
    pub own_signals: u64,
    state: State,
    /// Set by a futex wake, cleared by the waiter.
    pub woken: bool,
}

impl Thread {
    fn new(tid: u32, proc: Arc<Process>) -> Box<Thread> {
        Box::new(Thread {
            tid,
            proc,
            kstack: vec![0u8; KSTACK_SIZE].into_boxed_slice(),
            ksp: 0,
            fs_base: 0,
            clear_child_tid: 0,
            sigmask: 0,
            own_signals: 0,
            state: State::Runnable,
            woken: false,
        })
    }

    fn kstack_top(&self) -> u64 {
        // 16-byte aligned: the entry's pushes keep fxsave64's alignment.
        (self.kstack.as_ptr() as u64 + KSTACK_SIZE as u64) & !15
    }

    fn first_frame(&mut self) -> *mut Frame {
        (self.kstack_top() - size_of::<Frame>() as u64) as *mut Frame
    }
}

// Boxed: `schedule` keeps a pointer to the outgoing thread's `ksp` across
// the switch, and a dead thread moves from `threads` to `zombies` first.
#[allow(clippy::vec_box)]
struct Sched {
    threads: Vec<Box<Thread>>,
    current: usize,
    next_tid: u32,
    /// Threads that exited; their stacks are freed once another runs.
    zombies: Vec<Box<Thread>>,
    /// Address spaces of ended processes, freed once not loaded.
    dead_spaces: Vec<AddressSpace>,
    /// The page-table root loaded now (0: the VMM's).
    loaded_root: u64,
    /// Guest time at which the running thread's slice ends.
    slice_end: u64,
    /// System calls made, for reading the clock every few (`end_of_call`).
    calls: u32,
}

static SCHED: Mutex<Sched> = Mutex::new(Sched {
    threads: Vec::new(),
    current: 0,
    next_tid: 1,
    zombies: Vec::new(),
    dead_spaces: Vec::new(),
    loaded_root: 0,
    slice_end: 0,
    calls: 0,
});

/// Enter the program as the main thread of process `init`: never returns.
pub fn start(frame: Frame, init: Arc<Process>) -> ! {
    let (top, f) = {
        let mut s = SCHED.lock();
        assert!(s.threads.is_empty(), "the program is started once");
        let pid = init.pid;
        let mut t = Thread::new(pid, init);
        s.next_tid = pid + 1;
        let f = t.first_frame();
        // SAFETY: `f` is the top of the new thread's own kernel stack,
        // aligned for Frame, unused by anything else.
        unsafe { f.write(frame) };
        let top = t.kstack_top();
        s.threads.push(t);
        s.current = 0;
        (top, f)
    };
    // SAFETY: single vCPU, no system call in flight: nothing else reads it.
    unsafe { entry::FTVM_LINUX_KSTACK_TOP = top };
    // SAFETY: `f` is the frame at the top of that kernel stack.
    unsafe { entry::enter(f) }
}

/// The process of thread `tid`, if it has not exited.
pub fn process_of(tid: u32) -> Option<u32> {
    SCHED.lock().threads.iter().find(|t| t.tid == tid && t.state != State::Dead).map(|t| t.proc.pid)
}

/// Threads that have not exited.
pub fn live_threads() -> usize {
    SCHED.lock().threads.iter().filter(|t| t.state != State::Dead).count()
}

/// The running thread's id.
pub fn current_tid() -> u32 {
    let s = SCHED.lock();
    s.threads[s.current].tid
}

/// The running thread's process.
pub fn current_process() -> Arc<Process> {
    let s = SCHED.lock();
    s.threads[s.current].proc.clone()
}

/// Load the calling process's tables `root` again (or for the first time:
/// process 1's own, at its first fork), which flushes the TLB of entries
/// made read-only (`aspace`).
pub fn reload(root: u64) {
    let mut s = SCHED.lock();
    s.loaded_root = root;
    drop(s);
    // SAFETY: `root` is the calling process's live space, which maps the
    // runtime as every space does.
    unsafe { crate::aspace::load(root) };
}

/// A new id for a thread or process (they share one space, as on Linux).
pub fn next_id() -> u32 {
    let mut s = SCHED.lock();
    let id = s.next_tid;
    s.next_tid += 1;
    id
}

/// Run `f` on the running thread.
pub fn with_current<R>(f: impl FnOnce(&mut Thread) -> R) -> R {
    let mut s = SCHED.lock();
    let i = s.current;
    f(&mut s.threads[i])
}

/// A new thread of the calling process that starts by returning from the
/// system call in `parent` with 0, on stack `rsp`, with thread pointer
/// `fs_base`. Returns its tid.
pub fn spawn(parent: &Frame, rsp: u64, fs_base: u64, clear_child_tid: u64) -> u32 {
    let tid = next_id();
    spawn_in(current_process(), tid, parent, rsp, fs_base, clear_child_tid);
    tid
}

/// A new thread `tid` of `proc`, as for [`spawn`].
pub fn spawn_in(proc: Arc<Process>, tid: u32, parent: &Frame, rsp: u64, fs_base: u64, clear_child_tid: u64) {
    let mut s = SCHED.lock();
    // A new thread or process starts with its creator's signal mask.
    let sigmask = s.threads[s.current].sigmask;
    let mut t = Thread::new(tid, proc);
    t.sigmask = sigmask;
    t.fs_base = fs_base;
    t.clear_child_tid = clear_child_tid;
    let f = t.first_frame();
    let sf = (f as u64 - size_of::<SwitchFrame>() as u64) as *mut SwitchFrame;
    // SAFETY: both lie at the top of the new thread's own kernel stack
    // (Frame is 16-aligned, SwitchFrame needs 8), which nothing else uses.
    unsafe {
        core::ptr::copy_nonoverlapping(parent, f, 1);
        (*f).rax = 0;
        (*f).rsp = rsp;
        sf.write(SwitchFrame::to_user());
    }
    t.ksp = sf as u64;
    s.threads.push(t);
}

/// Block the running thread until woken (see [`Wait`]) or guest time
/// reaches `deadline` (`u64::MAX`: never). Returns when it may run again;
/// the caller re-checks its condition. EINTR when its process is ending
/// (a terminating signal, another thread's `exit_group`) or a signal waits
/// for its handler: the call is to give up.
pub fn block(wait: Wait, deadline: u64) -> Result<(), Errno> {
    if interrupted() {
        return Err(EINTR);
    }
    {
        let mut s = SCHED.lock();
        let i = s.current;
        s.threads[i].state = State::Blocked(wait, deadline);
    }
    schedule();
    if interrupted() {
        return Err(EINTR);
    }
    Ok(())
}

/// Whether the running thread's blocking call is to give up: its process
/// is ending, or a signal it does not block waits for its handler.
fn interrupted() -> bool {
    let s = SCHED.lock();
    let t = &s.threads[s.current];
    t.proc.ending().is_some() || t.proc.pending(t.sigmask) != 0 || t.own_signals & !t.sigmask != 0
}

/// Leave `sig` pending for thread `tid` alone (its process catches it),
/// waking it if it is blocked and does not block the signal; false if
/// there is no such thread.
pub fn signal_thread(tid: u32, sig: u32) -> bool {
    let mut s = SCHED.lock();
    let Some(t) = s.threads.iter_mut().find(|t| t.tid == tid && t.state != State::Dead) else { return false };
    t.own_signals |= 1 << (sig - 1);
    if matches!(t.state, State::Blocked(..)) && t.own_signals & !t.sigmask != 0 {
        t.state = State::Runnable;
    }
    true
}

/// The lowest signal sent to the running thread alone that `mask` does
/// not block, taken off its set.
pub fn take_own_signal(mask: u64) -> Option<u32> {
    with_current(|t| {
        let bits = t.own_signals & !mask;
        (bits != 0).then(|| {
            let sig = bits.trailing_zeros() + 1;
            t.own_signals &= !(1 << (sig - 1));
            sig
        })
    })
}

/// Make one blocked thread of process `pid` runnable, to run the handler
/// of a signal now pending (one thread takes it, as on Linux: waking all
/// would cut the others' calls short with EINTR and nothing to run).
pub fn wake_one(pid: u32) {
    let mut s = SCHED.lock();
    if let Some(t) =
        s.threads.iter_mut().find(|t| t.proc.pid == pid && matches!(t.state, State::Blocked(..)) && t.proc.pending(t.sigmask) != 0)
    {
        t.state = State::Runnable;
    }
}

/// Make every blocked thread of process `pid` runnable (it is ending).
pub fn wake_process(pid: u32) {
    let mut s = SCHED.lock();
    for t in s.threads.iter_mut().filter(|t| t.proc.pid == pid) {
        if let State::Blocked(..) = t.state {
            t.state = State::Runnable;
        }
    }
}

/// Let other runnable threads run first.
pub fn yield_now() {
    schedule();
}

/// The end of a system call: the wait status the running thread's process
/// is ending with, if it is (the thread is to exit); otherwise, when the
/// thread's slice is over, let the network move and other runnable threads
/// run (see the module doc) first.
pub fn end_of_call() -> Option<i32> {
    {
        let mut s = SCHED.lock();
        let killed = s.threads[s.current].proc.ending();
        // The clock is read every few calls only: a slice a few calls long
        // gives way as well, and reading it is most of this function.
        s.calls = s.calls.wrapping_add(1);
        if killed.is_some() || !s.calls.is_multiple_of(CALLS_PER_CLOCK_READ) || time::now_ns() < s.slice_end {
            return killed;
        }
    }
    if crate::net::poll() {
        wake_io();
    }
    schedule();
    current_process().ending()
}

/// Wake `n` threads waiting on futex `addr`; returns how many.
pub fn futex_wake(addr: u64, n: usize) -> usize {
    futex_waiters(addr, n, |t| {
        t.state = State::Runnable;
        t.woken = true;
    })
}

/// Move up to `n` waiters of futex `from` to futex `to`; returns how many.
pub fn futex_requeue(from: u64, to: u64, n: usize) -> usize {
    futex_waiters(from, n, |t| {
        if let State::Blocked(_, deadline) = t.state {
            t.state = State::Blocked(Wait::Futex(to), deadline);
        }
    })
}

/// `f` on each of the first `n` threads (in table order) of the calling
/// process waiting on futex `addr` (futexes are private to a process: the
/// same address is other memory in another); returns how many there were.
fn futex_waiters(addr: u64, n: usize, mut f: impl FnMut(&mut Thread)) -> usize {
    let mut s = SCHED.lock();
    let pid = s.threads[s.current].proc.pid;
    let mut count = 0;
    for t in s.threads.iter_mut().filter(|t| t.proc.pid == pid && matches!(t.state, State::Blocked(Wait::Futex(a), _) if a == addr)).take(n)
    {
        f(t);
        count += 1;
    }
    count
}

/// Something threads in [`Wait::Io`] may be waiting for happened.
pub fn wake_io() {
    let mut s = SCHED.lock();
    for t in s.threads.iter_mut() {
        if let State::Blocked(Wait::Io, _) = t.state {
            t.state = State::Runnable;
        }
    }
}

/// End the running thread (the exit system call). When it was the last of
/// its process, the process ends with wait status `status`, or the one it
/// was ending with (process 1: the program, and with it the VM, exits with
/// the status's exit code).
pub fn exit_thread(status: i32) -> ! {
    let (proc, last) = {
        let mut s = SCHED.lock();
        let i = s.current;
        s.threads[i].state = State::Dead;
        let proc = s.threads[i].proc.clone();
        let last = s.threads.iter().filter(|t| t.proc.pid == proc.pid).all(|t| t.state == State::Dead);
        (proc, last)
    };
    if last {
        end_process(&proc, proc.ending().unwrap_or(status));
    }
    // Nothing may stay on this stack: it is freed, never unwound.
    drop(proc);
    schedule();
    unreachable!("a dead thread was scheduled");
}

/// End the running thread's whole process with wait status `status`
/// (`exit_group`): its other threads leave as their system calls end (see
/// `Process::ending`), this one now. Process 1 ends the VM at once.
pub fn exit_process(status: i32) -> ! {
    let proc = current_process();
    if proc.pid == process::INIT {
        end_process(&proc, status);
    }
    proc.begin_ending(status);
    let pid = proc.pid;
    drop(proc);
    wake_process(pid);
    exit_thread(status)
}

fn end_process(proc: &Arc<Process>, status: i32) {
    if proc.pid == process::INIT {
        let signal = status & 0x7f;
        if signal != 0 {
            ftvm_rt::println!("linux: killed by signal {signal}");
        }
        let code = if signal != 0 { 128 + signal } else { (status >> 8) & 0xff };
        crate::exit_program(code);
    }
    if let Some(space) = process::end(proc, status) {
        SCHED.lock().dead_spaces.push(space);
    }
    // A SIGCHLD handler interrupts what the parent waits in.
    if let Some(parent) = process::get(proc.ppid()) {
        if parent.pending(0) != 0 {
            wake_one(parent.pid);
        }
    }
    // The parent may be in wait4.
    wake_io();
}

fn wake_expired(s: &mut Sched, now: u64) {
    for t in s.threads.iter_mut() {
        if let State::Blocked(_, deadline) = t.state {
            if deadline <= now {
                t.state = State::Runnable;
            }
        }
    }
}

/// Free the address spaces of ended processes that are not loaded, outside
/// the scheduler's lock (their frames go back to process 1's allocator,
/// which takes its own).
fn free_dead_spaces() {
    let done: Vec<AddressSpace> = {
        let mut s = SCHED.lock();
        let loaded = s.loaded_root;
        let (keep, done) = core::mem::take(&mut s.dead_spaces).into_iter().partition(|a| a.root() == loaded);
        s.dead_spaces = keep;
        done
    };
    for space in done {
        space.release();
    }
}

/// Give the vCPU to the next runnable thread (round robin), or wait until
/// one is runnable. The running thread's state says whether it may be
/// picked itself.
fn schedule() {
    loop {
        free_dead_spaces();
        let mut s = SCHED.lock();
        // Freed here, on a stack that is not theirs.
        s.zombies.retain(|_| false);
        let cur = s.current;
        wake_expired(&mut s, time::now_ns());
        let n = s.threads.len();
        let next = (1..=n).map(|k| (cur + k) % n).find(|&i| s.threads[i].state == State::Runnable);
        if let Some(next) = next {
            s.slice_end = time::now_ns().saturating_add(SLICE_NS);
            if next == cur {
                return;
            }
            let (ksp, top, fs, root) = {
                let t = &s.threads[next];
                (t.ksp, t.kstack_top(), t.fs_base, t.proc.root())
            };
            let load = root != s.loaded_root;
            s.loaded_root = root;
            let save = &mut s.threads[cur].ksp as *mut u64;
            s.current = next;
            if s.threads[cur].state == State::Dead {
                let dead = s.threads.remove(cur);
                s.zombies.push(dead);
                s.current = if cur < next { next - 1 } else { next };
            }
            drop(s);
            // SAFETY: single vCPU: only the entry reads these, and the next
            // thread's kernel stack and thread pointer are its own. A dead
            // thread's `save` slot lives in its Box, freed only after this
            // switch (zombies), by another thread.
            unsafe {
                if load {
                    // The next thread's process is alive (it has a thread),
                    // so are its tables; every process maps the runtime.
                    crate::aspace::load(root);
                }
                entry::FTVM_LINUX_KSTACK_TOP = top;
                core::arch::asm!("wrfsbase {}", in(reg) fs, options(nostack, preserves_flags));
                entry::switch(save, ksp);
            }
            // Back in this thread, under its tables: an ended process's
            // memory is free before its parent's wait returns.
            free_dead_spaces();
            return;
        }
        let deadline = s.threads.iter().filter_map(|t| if let State::Blocked(_, d) = t.state { Some(d) } else { None }).min();
        drop(s);
        let deadline = deadline.unwrap_or(u64::MAX);
        if crate::net::poll() {
            wake_io();
            continue;
        }
        crate::net::wait_idle_until(deadline);
        // A device event may have brought data: the poll above finds out.
    }
}
