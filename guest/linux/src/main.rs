//! `linux.elf`: the Linux personality of the ftvm guest runtime.
//!
//! The VMM boots this image when `ftvm run --image` is given an unmodified
//! static x86-64 Linux program (an ELF without the ftvm ABI note), after
//! loading that program's segments next to it (`BootInfo::program`, see
//! `docs/guest-abi.md`). This runtime sets aside the program's memory,
//! brings up the devices the command line asks for, lays out the Linux
//! start-up stack and jumps to the program's entry at CPL3. From then on the
//! program's `syscall` instructions land in [`entry`] and are served by
//! [`sys`]: memory, time, threads (cooperative, [`sched`]), processes
//! ([`process`], each forked one in an address space of its own,
//! [`aspace`]; signals, [`signal`]), files, pipes, sockets over the
//! runtime's TCP/IP stack, and epoll.
//!
//! Command line: `RUNTIME-OPTIONS -- [NAME=VALUE...] PROGRAM ARGS...`
//! ([`cmdline`]); runtime options are in [`options`].
#![no_std]
#![no_main]

extern crate alloc;

mod aspace;
mod cmdline;
mod disk;
mod entry;
mod eventfd;
mod exec;
mod fd;
mod filedata;
mod fs;
mod net;
mod options;
mod pagefault;
mod pipe;
mod process;
mod random;
mod sched;
mod signal;
mod start;
mod sys;
mod sysjmp;
mod text;
mod vdso;

use core::alloc::Layout;

use ftvm_linux::{errno, mm};
use ftvm_rt::{println, Args};

ftvm_rt::entry!(main, linux_syscall_entry = entry::ftvm_linux_syscall_entry);

/// The initial thread's stack, as Linux's default RLIMIT_STACK.
pub const MAIN_STACK: u64 = 8 << 20;
/// Program memory is carved out of the heap on this boundary (the VMM maps
/// RAM with 2 MiB pages).
const REGION_ALIGN: usize = 2 << 20;

fn main(args: &Args) -> i32 {
    match run(args) {
        Ok(never) => match never {},
        Err(msg) => {
            println!("linux: error: {msg}");
            2
        }
    }
}

fn run(args: &Args) -> Result<core::convert::Infallible, alloc::string::String> {
    use alloc::format;
    let program = args.program;
    let image = rootfs_image(args)?;
    if program.entry == 0 && image.is_none() {
        return Err("no Linux program was loaded (run one with ftvm run --image PROGRAM)".into());
    }
    if args.vcpu_count != 1 {
        return Err(format!("Linux programs run on one vCPU (threads are scheduled in the runtime), the VM has {}", args.vcpu_count));
    }
    let ram_end = args.memmap.iter().map(|r| r.base + r.size).max().unwrap_or(0);
    sys::user::init(ram_end);
    let cmd = cmdline::parse(args.cmdline)?;
    let opts = options::Options::parse(&cmd.options)?;

    // The program's share of the heap, taken before anything else is
    // allocated so that it is untouched (zero) memory.
    let heap = args.heap.size;
    let runtime_share = opts.runtime_mem.unwrap_or((heap / 4).clamp(16 << 20, 128 << 20));
    let size =
        heap.checked_sub(runtime_share + REGION_ALIGN as u64).ok_or_else(|| format!("too little memory: {} MiB of heap", heap >> 20))?;
    let size = size & !(REGION_ALIGN as u64 - 1);
    if size < MAIN_STACK * 2 {
        return Err(format!("too little memory for the program: {} MiB", size >> 20));
    }
    let layout = Layout::from_size_align(size as usize, REGION_ALIGN).expect("valid layout");
    // SAFETY: a non-zero-sized layout; the block is never freed.
    let base = unsafe { alloc::alloc::alloc(layout) } as u64;
    if base == 0 {
        return Err("cannot set aside the program's memory".into());
    }
    // The allocator kept its bookkeeping in the first bytes of the heap,
    // which may be the start of this block: the rest was never touched.
    // SAFETY: the first page of the block we own.
    unsafe { core::ptr::write_bytes(base as *mut u8, 0, mm::PAGE as usize) };
    let mut memory = mm::Memory::new(base, base + size);
    aspace::init(base, base + size);
    pagefault::init();
    let stack = memory.map(0, MAIN_STACK, false).map_err(|e| format!("cannot map the stack: errno {e}"))?;
    sys::fork::init(program.start, program.end);
    sys::time::set_epoch(opts.epoch_ns);
    fs::init(&opts, image.as_ref())?;
    ftvm_rt::net::set_exact_notify(opts.exact_notify);
    if let Some(net) = opts.net {
        net::init(net).map_err(|e| format!("network: {e}"))?;
    }
    let vdso = opts.vdso.then(vdso::build);
    exec::init(vdso);
    // A program the VMM placed (static, fixed addresses), or one loaded
    // here from the root file system (position-independent, and its
    // interpreter).
    let (entry, auxv, text, execfn) = if program.entry != 0 {
        let mut auxv = alloc::vec![
            (ftvm_elf::stack::AT_PHDR, program.phdr),
            (ftvm_elf::stack::AT_PHENT, u64::from(program.phent)),
            (ftvm_elf::stack::AT_PHNUM, u64::from(program.phnum)),
            (ftvm_elf::stack::AT_BASE, 0),
            (ftvm_elf::stack::AT_ENTRY, program.entry),
        ];
        auxv.extend(exec::common_auxv());
        exec::set_exe(&cmd.argv[0]);
        (program.entry, auxv, text::segments(&program), cmd.argv[0].clone())
    } else {
        let path = image.as_ref().map(|i| i.exec()).unwrap_or_default();
        let loaded = exec::load(path, &mut |len| memory.map(0, len, false)).map_err(|f| f.why)?;
        (loaded.entry, loaded.auxv, loaded.text, path.into())
    };
    match opts.syscall {
        options::SyscallMode::Trap => {}
        options::SyscallMode::Jmp => sysjmp::init(text),
    }
    SYSCALL_MODE.call_once(|| opts.syscall);
    let frame = start::initial_frame(entry, &auxv, &cmd.argv, &cmd.env, &execfn, stack, stack + MAIN_STACK)?;
    sched::start(frame, process::Process::init(fd::FdTable::stdio(), memory))
}

/// The root file system image the VMM placed in memory, if any.
fn rootfs_image(args: &Args) -> Result<Option<ftvm_abi::rootfs::Archive<'static>>, alloc::string::String> {
    let Some(region) = args.memmap.iter().find(|r| r.kind == ftvm_abi::mem_kind::ROOTFS) else { return Ok(None) };
    // SAFETY: the VMM wrote the image to this region of guest RAM, which
    // nothing else uses and which stays mapped for the whole run.
    let bytes = unsafe { core::slice::from_raw_parts(region.base as *const u8, region.size as usize) };
    ftvm_abi::rootfs::Archive::parse(bytes).map(Some).map_err(|e| alloc::format!("root file system image: {e}"))
}

/// How system calls reach the entry, once the program runs.
static SYSCALL_MODE: spin::Once<options::SyscallMode> = spin::Once::new();

/// The program is done (exit_group, or its last thread exited).
pub fn exit_program(status: i32) -> ! {
    // As the kernel writes dirty pages back eventually: what the program
    // wrote to the disk's files is on the disk when the VM stops.
    if let Err(e) = fs::sync_all() {
        println!("linux: writing files back to the disk at exit failed: errno {e}");
    }
    // How the program's system calls came in: what `syscall=` is worth.
    if let Some(mode) = SYSCALL_MODE.get() {
        let (calls, jumped) = sysjmp::calls();
        let trapped = calls - jumped;
        match mode {
            options::SyscallMode::Jmp => println!("linux: syscall=jmp trapped={trapped} {}", sysjmp::report()),
            options::SyscallMode::Trap => println!("linux: syscall=trap trapped={trapped} calls={calls}"),
        }
    }
    // As Linux closes a dead process's sockets: peers see FIN or RST, not
    // a connection that stays up with nobody behind it.
    net::close_all();
    // Where the VM exits of the network path come from.
    if let Some(counts) = net::report() {
        println!("linux: net {counts}");
    }
    ftvm_rt::exit(status & 0xff)
}
