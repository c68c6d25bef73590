//! Processes: what the threads of one program share (descriptors, memory,
//! signal dispositions, an address space) and the family links `fork`,
//! `wait4` and `kill` work on.
//!
//! The program the VM was started with is process 1 and keeps the VMM's
//! identity page tables; when it ends the VM ends (its children with it, as
//! a container's do when its init exits). `fork` makes processes with an
//! address space of their own (`aspace`). A process that ends becomes a
//! zombie holding its wait status until its parent reaps it with `wait4`
//! (at once if the parent ignores SIGCHLD); its children go to process 1.
//!
//! Signals between processes: `kill` carries out a signal's default action
//! (terminate, or nothing for SIGCHLD, SIGURG, SIGWINCH, SIGCONT and the
//! stop signals, which are not supported), ignores it (SIG_IGN), or leaves
//! it pending for its handler, which `signal` runs on the program's stack
//! at the end of a system call of one of the process's threads (masks are
//! not kept: a handler may run whenever a call ends); one of its blocked
//! threads is woken for it, its call returns EINTR (or is made again after
//! the handler, SA_RESTART). An ending process's threads are all woken,
//! each leaves as its system call ends, and the last one ends the process.

use alloc::collections::BTreeMap;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering};

use spin::Mutex;

use crate::aspace::AddressSpace;
use crate::errno::{Errno, ESRCH};
use crate::fd::FdTable;
use crate::mm::Memory;

/// The program the VM runs.
pub const INIT: u32 = 1;

pub const SIGKILL: u32 = 9;
pub const SIGCHLD: u32 = 17;
const SIG_DFL: u64 = 0;
const SIG_IGN: u64 = 1;
/// Signals 1..=64, and 0 which only asks whether the process exists.
pub const NSIG: usize = 65;
/// `Process::ending`'s mark, above the wait status.
const ENDING: u64 = 1 << 32;

/// A signal's disposition, as `rt_sigaction` gives it (`struct
/// k_sigaction`): SIG_DFL (0), SIG_IGN (1) or a handler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Action {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

impl Action {
    fn catches(&self) -> bool {
        self.handler > SIG_IGN
    }
}

/// What `kill` did to its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    /// Ignored, or only asked about (signal 0).
    Nothing,
    /// The process is ending.
    Ends,
    /// Pending for its handler.
    Caught,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Running,
    /// Ended, holding its wait status (as `wait4` encodes it) until reaped.
    Zombie(i32),
}

pub struct Process {
    pub pid: u32,
    pub fds: Mutex<FdTable>,
    /// None once the process has ended.
    pub mem: Mutex<Option<Memory>>,
    /// None for process 1 until its first fork (the VMM's identity tables).
    pub space: Mutex<Option<AddressSpace>>,
    /// What CR3 holds while this process runs (0: the VMM's tables).
    root: AtomicU64,
    /// Set when the process is to end (a terminating signal, `exit_group`
    /// from one of several threads): [`ENDING`] | the wait status. Each of
    /// its threads leaves at the end of its system call (blocking calls
    /// return EINTR), so every call unwinds and drops what it held; the
    /// last one ends the process. Read at the end of every system call.
    ending: AtomicU64,
    /// Signals waiting for their handlers, bit `sig - 1`.
    pending: AtomicU64,
    inner: Mutex<Inner>,
}

struct Inner {
    ppid: u32,
    status: Status,
    actions: [Action; NSIG],
}

static TABLE: Mutex<BTreeMap<u32, Arc<Process>>> = Mutex::new(BTreeMap::new());

impl Process {
    fn new(pid: u32, ppid: u32, fds: FdTable, mem: Memory, space: Option<AddressSpace>, actions: [Action; NSIG]) -> Arc<Process> {
        let root = space.as_ref().map_or(0, AddressSpace::root);
        let p = Arc::new(Process {
            pid,
            fds: Mutex::new(fds),
            mem: Mutex::new(Some(mem)),
            space: Mutex::new(space),
            root: AtomicU64::new(root),
            ending: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            inner: Mutex::new(Inner { ppid, status: Status::Running, actions }),
        });
        TABLE.lock().insert(pid, p.clone());
        p
    }

    /// Process 1, the program the VM was started with.
    pub fn init(fds: FdTable, mem: Memory) -> Arc<Process> {
        Process::new(INIT, 0, fds, mem, None, [Action::default(); NSIG])
    }

    /// A child of `self` with these copies of its descriptors, memory and
    /// address space; it inherits the signal dispositions.
    pub fn fork(&self, pid: u32, fds: FdTable, mem: Memory, space: AddressSpace) -> Arc<Process> {
        let actions = self.inner.lock().actions;
        Process::new(pid, self.pid, fds, mem, Some(space), actions)
    }

    /// What CR3 holds while this process runs (0: the VMM's tables).
    pub fn root(&self) -> u64 {
        self.root.load(Ordering::Relaxed)
    }

    /// The calling process (process 1, on the VMM's tables until now)
    /// forks: it needs tables of its own, so that the memory it shares
    /// with its children can be read-only in its space too. Returns the
    /// new root, which the caller loads.
    pub fn own_space(&self) -> u64 {
        let mut space = self.space.lock();
        let root = space.get_or_insert_with(AddressSpace::identity).root();
        self.root.store(root, Ordering::Relaxed);
        root
    }

    pub fn ppid(&self) -> u32 {
        self.inner.lock().ppid
    }

    /// The wait status it is ending with, if it is.
    pub fn ending(&self) -> Option<i32> {
        let v = self.ending.load(Ordering::Relaxed);
        (v & ENDING != 0).then_some(v as u32 as i32)
    }

    /// Mark it as ending with wait status `status`, unless it already is
    /// (the first cause is the one reported).
    pub fn begin_ending(&self, status: i32) {
        let _ = self.ending.compare_exchange(0, ENDING | u64::from(status as u32), Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The action for `sig`: set it to `new` if given; the old one.
    pub fn action(&self, sig: usize, new: Option<Action>) -> Action {
        let mut i = self.inner.lock();
        let old = i.actions[sig];
        if let Some(new) = new {
            i.actions[sig] = new;
        }
        old
    }

    /// The signals waiting for their handlers that `mask` does not block.
    pub fn pending(&self, mask: u64) -> u64 {
        self.pending.load(Ordering::Relaxed) & !mask
    }

    /// The lowest pending signal `mask` does not block, and its action now,
    /// taken off the pending set. A signal whose handler was replaced
    /// meanwhile gets the new disposition's treatment here (None unless it
    /// is still caught).
    pub fn take_signal(&self, mask: u64) -> Option<(u32, Action)> {
        let bits = self.pending(mask);
        if bits == 0 {
            return None;
        }
        let sig = bits.trailing_zeros() + 1;
        self.pending.fetch_and(!(1 << (sig - 1)), Ordering::Relaxed);
        self.treat(sig)
    }

    /// A pending signal taken by a thread: its action if caught, else the
    /// disposition's treatment now (None).
    pub fn treat(&self, sig: u32) -> Option<(u32, Action)> {
        let action = self.inner.lock().actions[sig as usize];
        if action.catches() {
            return Some((sig, action));
        }
        if action.handler == SIG_DFL && terminates(sig) {
            self.begin_ending(signaled(sig));
        }
        None
    }

    /// Whether a handler catches `sig` now (SIGKILL never is).
    pub fn catches(&self, sig: u32) -> bool {
        sig != SIGKILL && self.inner.lock().actions[sig as usize].catches()
    }

    fn catch(&self, sig: u32) {
        self.pending.fetch_or(1 << (sig - 1), Ordering::Relaxed);
    }
}

/// Processes not yet ended (zombies do not count).
pub fn running() -> usize {
    TABLE.lock().values().filter(|p| p.inner.lock().status == Status::Running).count()
}

/// Every process in the table (zombies too).
pub fn all() -> Vec<Arc<Process>> {
    TABLE.lock().values().cloned().collect()
}

pub fn get(pid: u32) -> Option<Arc<Process>> {
    TABLE.lock().get(&pid).cloned()
}

/// Default action of `sig`: true if it terminates the process.
fn terminates(sig: u32) -> bool {
    // SIGCHLD, SIGCONT, SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU, SIGURG, SIGWINCH.
    !matches!(sig, 17..=23 | 28) && sig < 32
}

/// `kill(pid, sig)`: what it did (the caller wakes the target's threads,
/// or one of them for a handler: `sched::wake_process`, `sched::wake_one`).
pub fn signal(pid: u32, sig: u32) -> Result<Sent, Errno> {
    let p = get(pid).ok_or(ESRCH)?;
    let i = p.inner.lock();
    if sig == 0 || i.status != Status::Running {
        return Ok(Sent::Nothing);
    }
    let action = i.actions[sig as usize];
    drop(i);
    if sig != SIGKILL && action.catches() {
        p.catch(sig);
        return Ok(Sent::Caught);
    }
    if sig == SIGKILL || (action.handler == SIG_DFL && terminates(sig)) {
        p.begin_ending(signaled(sig));
        return Ok(Sent::Ends);
    }
    Ok(Sent::Nothing)
}

/// The process `p` ended with wait status `status`: drop what it held,
/// hand its children to process 1, and leave a zombie for its parent (none
/// if the parent ignores SIGCHLD). Returns its address space, which the
/// scheduler frees once its tables are no longer loaded.
pub fn end(p: &Arc<Process>, status: i32) -> Option<AddressSpace> {
    // Closing descriptors may wake others (pipes): outside every lock.
    let fds = core::mem::take(&mut *p.fds.lock());
    drop(fds);
    drop(p.mem.lock().take());
    let space = p.space.lock().take();
    let ppid = {
        let mut i = p.inner.lock();
        i.status = Status::Zombie(status);
        i.ppid
    };
    let mut t = TABLE.lock();
    for c in t.values() {
        let mut ci = c.inner.lock();
        if ci.ppid == p.pid {
            ci.ppid = INIT;
        }
    }
    // SIGCHLD: ignored by default; SIG_IGN reaps at once; a handler runs.
    let action = t.get(&ppid).map(|parent| parent.inner.lock().actions[SIGCHLD as usize]);
    match action {
        Some(a) if a.handler == SIG_IGN => {
            t.remove(&p.pid);
        }
        Some(a) if a.catches() => t[&ppid].catch(SIGCHLD),
        _ => {}
    }
    space
}

/// `wait4`'s search among the children of `parent`: `pid` -1 (or 0 and
/// below: there are no process groups) for any child. Reaps a zombie:
/// Ok(Some((pid, status))); Ok(None) if children match but none ended;
/// ECHILD if none match.
pub fn reap(parent: u32, pid: i32) -> Result<Option<(u32, i32)>, Errno> {
    let mut t = TABLE.lock();
    let mut matching: Vec<(u32, Status)> = Vec::new();
    for c in t.values() {
        let ci = c.inner.lock();
        if ci.ppid == parent && c.pid != parent && (pid <= 0 || c.pid == pid as u32) {
            matching.push((c.pid, ci.status));
        }
    }
    if matching.is_empty() {
        return Err(crate::errno::ECHILD);
    }
    for (cpid, status) in matching {
        if let Status::Zombie(s) = status {
            t.remove(&cpid);
            return Ok(Some((cpid, s)));
        }
    }
    Ok(None)
}

/// The calling process replaced the 16 bytes of program text at `va`
/// (aligned) holding `old` with `new` (`sysjmp`): do the same in every
/// other process, whose copy of the text held the same bytes, so a site is
/// rewritten everywhere or nowhere. Process 1's text is its identity-mapped
/// memory (it keeps its own memory when it shares it), which a forked
/// caller reaches by loading the VMM's tables for the moment.
pub fn patch_text(va: u64, old: u128, new: u128) {
    let me = crate::sched::current_process();
    let others: Vec<Arc<Process>> = TABLE.lock().values().filter(|p| p.pid != me.pid).cloned().collect();
    for p in others {
        let patched = p.space.lock().as_mut().is_some_and(|space| space.patch(va, old, new));
        if !patched && p.pid == INIT && p.inner.lock().status == Status::Running {
            // SAFETY: the VMM's tables map the runtime as every space does;
            // the caller's own tables are loaded again right after.
            unsafe {
                crate::aspace::load(0);
                let at = va as *mut u128;
                if at.read_volatile() == old {
                    at.write_volatile(new);
                }
                crate::aspace::load(me.root());
            }
        }
    }
}

/// Wait status of a process that exited with `code`.
pub fn exited(code: i32) -> i32 {
    (code & 0xff) << 8
}

/// Wait status of a process a signal ended.
pub fn signaled(sig: u32) -> i32 {
    (sig & 0x7f) as i32
}
