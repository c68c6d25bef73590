//! The system-call layer: [`dispatch`] runs one call for the entry stub,
//! with the handlers grouped by subject in the submodules.
//!
//! A call this layer does not implement returns `ENOSYS`; the first time
//! each happens the runtime prints `linux: unsupported system call N (name)`
//! on the console, so a program that misbehaves says why.

pub mod epoll;
mod file;
pub mod fork;
mod io;
pub mod mem;
mod names;
mod net;
mod proc;
mod thread;
pub mod time;
pub mod user;

use core::sync::atomic::{AtomicU64, Ordering};

use crate::entry::Frame;
use crate::errno::{Errno, EAGAIN, ENOSYS};
use crate::sched;

pub type SysResult = Result<u64, Errno>;

pub fn dispatch(frame: &mut Frame) {
    let via_jmp = crate::entry::take_via_jmp();
    crate::sysjmp::count(via_jmp);
    if !via_jmp {
        crate::sysjmp::trapped(frame.rip, frame.rax);
    }
    let nr = frame.rax;
    let a = frame.args();
    let r = match nr {
        0 => io::read(a[0], a[1], a[2]),
        1 => io::write(a[0], a[1], a[2]),
        2 => file::open(file::AT_FDCWD, a[0], a[1], a[2]),
        3 => io::close(a[0]),
        4 | 6 => file::stat(file::AT_FDCWD, a[0], a[1], 0),
        5 => file::fstat(a[0], a[1]),
        7 => epoll::poll(a[0], a[1], time::timeout_ms(a[2] as i32)),
        8 => io::lseek(a[0], a[1] as i64, a[2]),
        9 => mem::mmap(a[0], a[1], a[2], a[3], a[4], a[5]),
        10 => mem::mprotect(a[0], a[1], a[2]),
        11 => mem::munmap(a[0], a[1]),
        12 => mem::brk(a[0]),
        13 => proc::rt_sigaction(a[0], a[1], a[2], a[3]),
        14 => crate::signal::sigprocmask(a[0], a[1], a[2], a[3]),
        15 => crate::signal::sigreturn(frame),
        16 => io::ioctl(a[0], a[1], a[2]),
        17 => io::pread(a[0], a[1], a[2], a[3]),
        18 => io::pwrite(a[0], a[1], a[2], a[3]),
        19 => io::readv(a[0], a[1], a[2]),
        20 => io::writev(a[0], a[1], a[2]),
        21 => file::access(file::AT_FDCWD, a[0]),
        22 => io::pipe(a[0], 0),
        24 => proc::sched_yield(),
        25 => mem::mremap(a[0], a[1], a[2], a[3]),
        26 => Ok(0),
        28 => mem::madvise(a[0], a[1], a[2]),
        32 => io::dup(a[0]),
        33 => io::dup3(a[0], a[1], 0, true),
        34 => proc::pause(),
        35 => time::nanosleep(a[0], a[1]),
        39 => Ok(u64::from(sched::current_process().pid)),
        41 => net::socket(a[0], a[1], a[2]),
        42 => net::connect(a[0], a[1], a[2]),
        43 => net::accept(a[0], a[1], a[2], 0),
        44 => net::sendto(a[0], a[1], a[2], a[3], a[4], a[5]),
        45 => net::recvfrom(a[0], a[1], a[2], a[3], a[4], a[5]),
        46 => net::sendmsg(a[0], a[1], a[2]),
        47 => net::recvmsg(a[0], a[1], a[2]),
        48 => net::shutdown(a[0], a[1]),
        49 => net::bind(a[0], a[1], a[2]),
        50 => net::listen(a[0], a[1]),
        51 => net::getsockname(a[0], a[1], a[2], false),
        52 => net::getsockname(a[0], a[1], a[2], true),
        54 => net::setsockopt(a[0], a[1], a[2], a[3], a[4]),
        55 => net::getsockopt(a[0], a[1], a[2], a[3], a[4]),
        56 => thread::clone(frame, a[0], a[1], a[2], a[3], a[4]),
        57 | 58 => fork::fork(frame, None, None, None, 0),
        59 => proc::execve(frame, a[0], a[1], a[2]),
        60 => thread::exit(a[0]),
        61 => fork::wait4(a[0], a[1], a[2], a[3]),
        62 => fork::kill(a[0], a[1]),
        // tkill, tgkill: a signal to a thread of the calling process is one
        // to the process (abort() raises SIGABRT this way).
        200 => proc::tkill(a[0], a[1]),
        234 => proc::tkill(a[1], a[2]),
        63 => proc::uname(a[0]),
        72 => io::fcntl(a[0], a[1], a[2]),
        73 => Ok(0),
        74 | 75 => io::fsync(a[0]),
        77 => io::ftruncate(a[0], a[1]),
        79 => file::getcwd(a[0], a[1]),
        80 => file::chdir(a[0]),
        82 => file::rename(file::AT_FDCWD, a[0], file::AT_FDCWD, a[1]),
        83 => file::mkdir(file::AT_FDCWD, a[0]),
        84 => file::unlink(file::AT_FDCWD, a[0], file::AT_REMOVEDIR),
        87 => file::unlink(file::AT_FDCWD, a[0], 0),
        89 => file::readlink(file::AT_FDCWD, a[0], a[1], a[2]),
        267 => file::readlink(a[0], a[1], a[2], a[3]),
        90..=94 | 132 | 280 => Ok(0),
        95 => proc::umask(a[0]),
        96 => time::gettimeofday(a[0]),
        97 => proc::getrlimit(a[0], a[1]),
        98 => proc::getrusage(a[1]),
        99 => proc::sysinfo(a[0]),
        102 | 104 | 107 | 108 => Ok(0),
        // setuid, setgid, setpgid, setsid, setgroups, setresuid, setresgid:
        // one user (root), nothing to change.
        105 | 106 | 109 | 112 | 116 | 117 | 119 => Ok(0),
        110 => Ok(u64::from(sched::current_process().ppid())),
        111 => Ok(u64::from(sched::current_process().pid)),
        131 => Ok(0),
        157 => proc::prctl(a[0]),
        158 => proc::arch_prctl(a[0], a[1]),
        160 => Ok(0),
        162 => io::sync(),
        186 => Ok(u64::from(sched::current_tid())),
        201 => time::time(a[0]),
        202 => thread::futex(a[0], a[1], a[2], a[3], a[4], a[5]),
        203 => Ok(0),
        204 => proc::sched_getaffinity(a[1], a[2]),
        213 | 291 => epoll::create(if nr == 291 { a[0] } else { 0 }),
        217 => file::getdents64(a[0], a[1], a[2]),
        218 => thread::set_tid_address(a[0]),
        228 => time::clock_gettime(a[0], a[1]),
        229 => time::clock_getres(a[1]),
        230 => time::clock_nanosleep(a[0], a[1], a[2], a[3]),
        231 => proc::exit_group(a[0]),
        232 => epoll::wait(a[0], a[1], a[2], a[3] as i32),
        233 => epoll::ctl(a[0], a[1], a[2], a[3]),
        247 => fork::waitid(a[0], a[1], a[2], a[3]),
        257 => file::open(a[0], a[1], a[2], a[3]),
        258 => file::mkdir(a[0], a[1]),
        262 => file::stat(a[0], a[1], a[2], a[3]),
        263 => file::unlink(a[0], a[1], a[2]),
        264 | 316 => file::rename(a[0], a[1], a[2], a[3]),
        269 | 439 => file::access(a[0], a[1]),
        271 => epoll::ppoll(a[0], a[1], a[2]),
        273 => Ok(0),
        281 => epoll::wait(a[0], a[1], a[2], a[3] as i32),
        284 => io::eventfd(a[0], 0),
        288 => net::accept(a[0], a[1], a[2], a[3]),
        290 => io::eventfd(a[0], a[1]),
        292 => io::dup3(a[0], a[1], a[2], false),
        293 => io::pipe(a[0], a[1]),
        302 => proc::prlimit64(a[0], a[1], a[2], a[3]),
        306 => io::sync(),
        318 => proc::getrandom(a[0], a[1]),
        324 => Ok(0),
        // rseq: glibc registers one at start and does without it; clone3:
        // glibc's pthread_create falls back to clone.
        334 | 435 => Err(ENOSYS),
        _ => unsupported(nr),
    };
    frame.rax = match r {
        Ok(v) => v,
        Err(e) => (e as i64).wrapping_neg() as u64,
    };
    crate::signal::deliver(frame, nr);
    // The process is ending: the call has unwound, the thread leaves here.
    if let Some(status) = sched::end_of_call() {
        sched::exit_thread(status);
    }
}

/// One bit per system-call number already reported.
static REPORTED: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

pub fn unsupported(nr: u64) -> SysResult {
    let (word, bit) = ((nr / 64) as usize, nr % 64);
    let first = match REPORTED.get(word) {
        Some(w) => w.fetch_or(1 << bit, Ordering::Relaxed) & (1 << bit) == 0,
        None => true,
    };
    if first {
        ftvm_rt::println!("linux: unsupported system call {nr} ({}), returning ENOSYS", names::name(nr));
    }
    Err(ENOSYS)
}

/// Run `attempt` until it does not say EAGAIN, blocking the thread in
/// between unless `nonblocking`, or until guest time reaches `deadline`
/// (then EAGAIN).
pub fn blocking<R>(nonblocking: bool, deadline: u64, mut attempt: impl FnMut() -> Result<R, Errno>) -> Result<R, Errno> {
    loop {
        match attempt() {
            Err(EAGAIN) if !nonblocking => {
                if ftvm_rt::time::now_ns() >= deadline {
                    return Err(EAGAIN);
                }
                sched::block(sched::Wait::Io, deadline)?;
            }
            r => return r,
        }
    }
}
