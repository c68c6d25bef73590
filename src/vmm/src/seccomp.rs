//! Least privilege: a seccomp filter for each kind of thread (rust-vmm's
//! `seccompiler`, as Firecracker does).
//!
//! Each thread installs the filter of its kind when it starts
//! ([`install`]). A thread inherits the filter of the thread that created
//! it, and the kernel applies every filter a thread has, so a thread that
//! creates threads of other kinds (the VMM's main thread, the replication
//! threads that build and start a backup's VM) needs what its children need
//! too; the narrow filters are those of the threads that run guest-driven
//! code or face clients: vCPUs, devices, the control socket and metrics.
//! The lists come from `strace -f` of real runs (VMs with net and disk,
//! snapshots, the control API, primary and backup, failover, etcd,
//! authenticated channels) and the whole test suite runs under them; they
//! are documented in `docs/seccomp.md`.
//!
//! A system call outside its thread's list raises SIGSYS; the handler
//! prints one line naming the thread and the call and ends the process
//! with status [`EXIT_STATUS`]. Filters are off until [`enable`] (the
//! `ftvm` command enables them unless `--no-seccomp`); `FTVM_SECCOMP=log`
//! allows and logs (to the kernel log) what would have been refused, for
//! finding a missing entry.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter};

/// Exit status after a refused system call (128 + SIGSYS, as a shell reports it).
pub const EXIT_STATUS: i32 = 128 + libc::SIGSYS;

/// The kinds of thread, each with its own list of allowed system calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    /// The VMM's main thread: event loop, VM creation, snapshots; creates
    /// every other thread.
    Vmm,
    /// Runs a vCPU (KVM_RUN and state ioctls).
    Vcpu,
    /// Serves a virtio device's queues (TAP, disk file).
    Device,
    /// Acknowledgements and heartbeats: I/O on sockets already open, a
    /// real-time priority. (The threads that checkpoint, re-protect, or
    /// follow a primary and take its VM over create threads and VMs: they
    /// keep the filter of the thread that created them, the VMM's.)
    Replication,
    /// A control-socket client or the metrics exporter.
    Api,
}

impl ThreadKind {
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Device => "device",
            ThreadKind::Replication => "replication",
            ThreadKind::Api => "api",
        }
    }

    /// The system calls this kind may make.
    pub fn allowed(self) -> Vec<Syscall> {
        let mut list: Vec<Syscall> = EVERY_THREAD.to_vec();
        match self {
            ThreadKind::Vcpu => list.extend_from_slice(VCPU),
            ThreadKind::Device => list.extend_from_slice(DEVICE),
            ThreadKind::Api => list.extend_from_slice(API),
            ThreadKind::Replication => {
                list.extend_from_slice(API);
                list.extend_from_slice(REPLICATION);
            }
            // It creates threads of every kind.
            ThreadKind::Vmm => {
                for part in [VCPU, DEVICE, API, REPLICATION, VMM] {
                    list.extend_from_slice(part);
                }
            }
        }
        list.sort_unstable_by_key(|s| s.1);
        list.dedup_by_key(|s| s.1);
        list
    }
}

/// A system call: its name and number.
pub type Syscall = (&'static str, i64);

macro_rules! syscalls {
    ($($name:ident),* $(,)?) => { &[$((stringify!($name), libc::$name)),*] };
}

/// Every Rust thread: memory, locks, signals (vCPU kicks, thread exit),
/// time, logging to stderr.
const EVERY_THREAD: &[Syscall] = syscalls![
    SYS_brk,
    SYS_mmap,
    SYS_munmap,
    SYS_mremap,
    SYS_mprotect,
    SYS_madvise,
    SYS_futex,
    SYS_exit,
    SYS_exit_group,
    SYS_rt_sigreturn,
    SYS_rt_sigprocmask,
    SYS_sigaltstack,
    SYS_restart_syscall,
    SYS_sched_yield,
    SYS_sched_getaffinity,
    SYS_gettid,
    SYS_getpid,
    SYS_tgkill,
    SYS_write,
    SYS_writev,
    SYS_close,
    SYS_getrandom,
    SYS_clock_gettime,
    SYS_clock_nanosleep,
    SYS_nanosleep,
    SYS_prctl,
    SYS_rseq,
];

/// KVM_RUN and the vCPU state ioctls.
const VCPU: &[Syscall] = syscalls![SYS_ioctl];

/// Queues over eventfds and epoll; the TAP and the disk file; a protected
/// VM's frames copied to the backup over UDP (frame mirroring).
const DEVICE: &[Syscall] = syscalls![
    SYS_sendto,
    SYS_epoll_create1,
    SYS_epoll_ctl,
    SYS_epoll_wait,
    SYS_epoll_pwait,
    SYS_read,
    SYS_readv,
    SYS_pread64,
    SYS_preadv,
    SYS_pwrite64,
    SYS_pwritev,
    SYS_fdatasync,
    SYS_fsync,
    SYS_fcntl,
    SYS_sendto,
];

/// One client on a socket that is already open.
const API: &[Syscall] = syscalls![
    SYS_accept4,
    SYS_read,
    SYS_recvfrom,
    SYS_recvmsg,
    SYS_sendto,
    SYS_sendmsg,
    SYS_setsockopt,
    SYS_getsockopt,
    SYS_poll,
    SYS_ppoll,
    SYS_shutdown,
    SYS_fcntl,
];

/// Beyond the socket I/O of [`API`]: heartbeat threads run at real-time
/// priority on a chosen CPU; the acknowledgement reader releases output to
/// the TAP (write) and wakes devices (eventfd writes); a replica's
/// consensus thread keeps its term and vote (`--raft-state`: pwrite, fdatasync).
const REPLICATION: &[Syscall] = syscalls![
    SYS_pwrite64,
    SYS_fdatasync,
    SYS_sched_setscheduler,
    SYS_sched_getscheduler,
    SYS_sched_setaffinity,
    SYS_sched_getparam,
    SYS_sched_get_priority_max,
    SYS_sched_get_priority_min,
    SYS_setpriority,
    SYS_getpriority,
    SYS_dup,
    SYS_epoll_wait,
    SYS_epoll_pwait,
    // SIOCGSTAMPNS: when each heartbeat reached this host (the release gate).
    SYS_ioctl,
];

/// Building VMs (KVM, memfd, TAP, disk), sockets (replication, heartbeats,
/// the arbiter's HTTP), snapshots, threads.
const VMM: &[Syscall] = syscalls![
    SYS_openat,
    SYS_open,
    SYS_access,
    SYS_newfstatat,
    SYS_fstat,
    SYS_statx,
    SYS_lseek,
    SYS_ftruncate,
    SYS_fallocate,
    SYS_rename,
    SYS_renameat,
    SYS_unlink,
    SYS_unlinkat,
    SYS_mkdir,
    SYS_readlink,
    // Listing a Linux program's root file system (--rootfs DIR).
    SYS_getdents64,
    SYS_getcwd,
    SYS_dup,
    SYS_dup3,
    SYS_pipe2,
    SYS_memfd_create,
    SYS_eventfd2,
    SYS_ioctl,
    SYS_socket,
    SYS_socketpair,
    SYS_bind,
    SYS_listen,
    SYS_connect,
    // Host names in addresses: glibc's resolver sends its A and AAAA
    // queries in one call.
    SYS_sendmmsg,
    SYS_getsockname,
    SYS_getpeername,
    SYS_select,
    SYS_pselect6,
    SYS_epoll_create1,
    SYS_epoll_ctl,
    SYS_epoll_wait,
    SYS_epoll_pwait,
    SYS_clone,
    SYS_clone3,
    SYS_set_robust_list,
    SYS_rt_sigaction,
    SYS_sched_setaffinity,
    SYS_sched_setscheduler,
    SYS_sched_getscheduler,
    SYS_sched_getparam,
    SYS_sched_get_priority_max,
    SYS_sched_get_priority_min,
    SYS_setpriority,
    SYS_getpriority,
    SYS_prlimit64,
    SYS_getrlimit,
    SYS_uname,
    SYS_getuid,
    SYS_geteuid,
    SYS_getgid,
    SYS_getegid,
    // `--user`: the main thread drops root once, alone (ftvm's `privilege`);
    // a process that is no longer root can set only its own IDs again.
    SYS_setgroups,
    SYS_setresgid,
    SYS_setresuid,
    SYS_sysinfo,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_seccomp,
];

/// 0: off, 1: refuse, 2: allow and log.
static MODE: AtomicU8 = AtomicU8::new(0);
const OFF: u8 = 0;
const TRAP: u8 = 1;
const LOG: u8 = 2;

thread_local! {
    /// The kind of this thread, for the SIGSYS message.
    static KIND: Cell<&'static str> = const { Cell::new("inherited") };
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the {kind} thread's seccomp filter: {err}")]
    Build { kind: &'static str, err: seccompiler::BackendError },
    #[error("cannot install the {kind} thread's seccomp filter: {err}")]
    Install { kind: &'static str, err: seccompiler::Error },
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(std::io::Error),
}

/// Turn filters on for the threads that install them from now on (with
/// `FTVM_SECCOMP=log`: allow and log instead of refusing).
pub fn enable() -> Result<(), SeccompError> {
    let log = std::env::var("FTVM_SECCOMP").is_ok_and(|v| v == "log");
    if !log {
        install_handler()?;
    }
    prime_allocator();
    MODE.store(if log { LOG } else { TRAP }, Ordering::SeqCst);
    Ok(())
}

/// glibc's malloc reads `/proc/sys/vm/overcommit_memory` (an `openat`) the
/// first time a thread arena gives memory back to the kernel
/// (`shrink_heap`), in whichever thread frees last: a filtered thread that
/// forbids `openat` (a replica's consensus thread, say) would be stopped
/// for it, at a moment that depends on how much the process allocated.
/// glibc keeps the answer: make that first time happen here, before any
/// filter, in a thread of its own (so in an arena other than the main one).
///
/// Call it first thing in a process (`enable` calls it too): once the
/// process has freed a large allocation, glibc raises its trim threshold
/// (up to 64 MiB) and these small pieces no longer make a heap shrink, so
/// the first read would be left for a filtered thread (seen when the
/// per-page costs measured at start had freed 8 MiB buffers before).
pub fn prime_allocator() {
    let primed = std::thread::Builder::new().name("malloc-prime".into()).spawn(|| {
        // Pieces below the mmap threshold come from the arena's heap; freed
        // together they leave a top chunk large enough to be trimmed.
        let pieces: Vec<Vec<u8>> = (0..128).map(|_| vec![1u8; 16 << 10]).collect();
        drop(std::hint::black_box(pieces));
    });
    if let Ok(t) = primed {
        let _ = t.join();
    }
}

pub fn enabled() -> bool {
    MODE.load(Ordering::SeqCst) != OFF
}

/// Install `kind`'s filter on the calling thread (nothing when filters are off).
pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    let mode = MODE.load(Ordering::SeqCst);
    if mode == OFF {
        return Ok(());
    }
    KIND.with(|k| k.set(kind.name()));
    let program = program(kind, mode)?;
    seccompiler::apply_filter(program).map_err(|err| SeccompError::Install { kind: kind.name(), err })?;
    tracing::debug!(kind = kind.name(), "seccomp filter installed");
    forbidden_call_for_tests(kind);
    Ok(())
}

/// [`install`], or one line on stderr and exit status 1: a thread must not
/// run without the filter it was meant to have.
pub fn install_or_exit(kind: ThreadKind) {
    if let Err(e) = install(kind) {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "ftvm: error: {e}");
        std::process::exit(1);
    }
}

/// The compiled filter of each kind, built once.
fn program(kind: ThreadKind, mode: u8) -> Result<&'static BpfProgram, SeccompError> {
    static PROGRAMS: [OnceLock<BpfProgram>; 5] = [const { OnceLock::new() }; 5];
    let slot = &PROGRAMS[kind as usize];
    if let Some(p) = slot.get() {
        return Ok(p);
    }
    let rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> = kind.allowed().iter().map(|&(_, nr)| (nr, Vec::new())).collect();
    let refuse = if mode == LOG { SeccompAction::Log } else { SeccompAction::Trap };
    let build = |err| SeccompError::Build { kind: kind.name(), err };
    let arch = std::env::consts::ARCH.try_into().map_err(build)?;
    let filter = SeccompFilter::new(rules, refuse, SeccompAction::Allow, arch).map_err(build)?;
    let program: BpfProgram = filter.try_into().map_err(build)?;
    Ok(slot.get_or_init(|| program))
}

/// `FTVM_TEST_FAULT=forbidden-syscall:KIND`: right after installing its
/// filter, a thread of that kind makes a call no list allows;
/// `FTVM_TEST_FAULT=panic:KIND`: it panics (tests only).
fn forbidden_call_for_tests(kind: ThreadKind) {
    let asked = std::env::var("FTVM_TEST_FAULT").ok();
    if asked.as_deref().and_then(|f| f.strip_prefix("forbidden-syscall:")) == Some(kind.name()) {
        tracing::warn!(kind = kind.name(), "test fault: making a forbidden system call");
        // SAFETY: personality(0xffffffff) only queries the persona.
        unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu64) };
    }
    if asked.as_deref().and_then(|f| f.strip_prefix("panic:")) == Some(kind.name()) {
        panic!("test fault: a {} thread panics under its filter", kind.name());
    }
}

fn install_handler() -> Result<(), SeccompError> {
    // SAFETY: a zeroed sigaction is a valid starting point; the handler is
    // an `extern "C"` function of the SA_SIGINFO signature.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigsys as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) != 0 {
            return Err(SeccompError::Handler(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Where the kernel puts the system call number in a SIGSYS siginfo
/// (`si_syscall`, after `si_call_addr` in the union at offset 16).
const SI_SYSCALL_OFFSET: usize = 24;

/// One line on stderr, then the process ends. Only async-signal-safe work:
/// no allocation, no locks; write(2) and exit_group(2) are on every list.
extern "C" fn on_sigsys(_signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SIGSYS from seccomp,
    // whose `si_syscall` int is at this offset on x86-64.
    let nr = unsafe { *(info as *const u8).add(SI_SYSCALL_OFFSET).cast::<libc::c_int>() };
    let kind = KIND.with(|k| k.get());
    let mut name = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes and a NUL into `name`.
    unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(16)];
    let mut line = Line::default();
    line.push(b"ftvm: error: thread ");
    line.push(name);
    line.push(b" (");
    line.push(kind.as_bytes());
    line.push(b" filter) made system call ");
    line.number(nr as i64);
    if let Some(name) = name_of(nr as i64) {
        line.push(b" (");
        line.push(name.as_bytes());
        line.push(b")");
    }
    line.push(b", which its seccomp filter forbids (docs/seccomp.md; --no-seccomp turns the filters off)\n");
    // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffer is valid.
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len);
        libc::_exit(EXIT_STATUS);
    }
}

/// The name of a system call on any list, or the test's forbidden one.
fn name_of(nr: i64) -> Option<&'static str> {
    if nr == libc::SYS_personality {
        return Some("personality");
    }
    [EVERY_THREAD, VCPU, DEVICE, API, REPLICATION, VMM]
        .iter()
        .flat_map(|l| l.iter())
        .find(|s| s.1 == nr)
        .map(|s| s.0.trim_start_matches("SYS_"))
}

/// A fixed buffer for the signal handler's message.
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Default for Line {
    fn default() -> Line {
        Line { buf: [0; 256], len: 0 }
    }
}

impl Line {
    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    fn number(&mut self, mut n: i64) {
        if n < 0 {
            self.push(b"-");
            n = -n;
        }
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_builds_and_narrow_kinds_cannot_open_files() {
        for kind in [ThreadKind::Vmm, ThreadKind::Vcpu, ThreadKind::Device, ThreadKind::Replication, ThreadKind::Api] {
            program(kind, TRAP).unwrap();
            let allowed = kind.allowed();
            let has = |nr| allowed.iter().any(|s| s.1 == nr);
            assert!(has(libc::SYS_futex) && has(libc::SYS_exit) && !has(libc::SYS_execve) && !has(libc::SYS_personality));
            let narrow = kind != ThreadKind::Vmm;
            assert_eq!(has(libc::SYS_openat), !narrow, "{kind:?}");
            assert_eq!(has(libc::SYS_socket), !narrow, "{kind:?}");
        }
        // Threads that create others allow what those need (filters stack).
        let vmm = ThreadKind::Vmm.allowed();
        for kind in [ThreadKind::Vcpu, ThreadKind::Device, ThreadKind::Api, ThreadKind::Replication] {
            assert!(kind.allowed().iter().all(|s| vmm.contains(s)), "{kind:?}");
        }
    }

    #[test]
    fn the_message_names_the_call() {
        let mut line = Line::default();
        line.number(-135);
        line.number(0);
        assert_eq!(&line.buf[..line.len], b"-1350");
        assert_eq!(name_of(libc::SYS_ioctl), Some("ioctl"));
    }
}
