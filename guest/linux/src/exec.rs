//! Loading a program from the runtime's file system, as Linux's `execve`
//! does: a position-independent program (PIE, or static-pie) is copied to a
//! free range of the program's memory, its interpreter (`PT_INTERP`,
//! glibc's `ld-linux-x86-64.so.2`) to another, and the auxiliary vector
//! tells the interpreter where both are; the interpreter then maps the
//! libraries itself with `mmap` of their files.
//!
//! The runtime rather than the VMM loads them: the files are in the
//! runtime's file system (the root file system image), the same loader
//! serves the program's own `execve`, and the addresses are chosen where
//! `mmap` would put them. Programs linked at fixed addresses (ET_EXEC) are
//! placed by the VMM at boot and are not loaded here: their addresses lie
//! below the program's memory.

use alloc::borrow::Cow;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use ftvm_elf::stack::*;
use ftvm_elf::{Elf, PHDR_SIZE};

use crate::entry::Frame;
use crate::errno::{Errno, EACCES, EAGAIN, ENOEXEC};
use crate::{fd, fs, sched, start, sysjmp};

/// A program in memory, ready to be entered.
pub struct Loaded {
    /// Where execution starts: the interpreter's entry, or the program's.
    pub entry: u64,
    /// The auxiliary entries about the image (`AT_PHDR`, `AT_BASE`, ...).
    pub auxv: Vec<(u64, u64)>,
    /// Executable ranges of the program and its interpreter.
    pub text: Vec<(u64, u64)>,
}

/// Why a program could not be loaded: the errno `execve` returns, and a
/// sentence for the console.
pub struct Failed {
    pub errno: Errno,
    pub why: String,
}

fn failed(errno: Errno, why: String) -> Failed {
    Failed { errno, why }
}

/// The path last executed (`/proc/self/exe`).
static EXE: spin::Mutex<String> = spin::Mutex::new(String::new());
/// The vDSO every program gets (`AT_SYSINFO_EHDR`), if any.
static VDSO: spin::Once<Option<u64>> = spin::Once::new();

pub fn init(vdso: Option<u64>) {
    VDSO.call_once(|| vdso);
}

pub fn exe() -> String {
    EXE.lock().clone()
}

/// The program the VMM placed is `path` (`/proc/self/exe`).
pub fn set_exe(path: &str) {
    *EXE.lock() = path.into();
}

/// Where the loader takes fresh zero memory of a length: the starting
/// program's allocator (before there is a process), or the calling process's.
pub type Reserve<'a> = &'a mut dyn FnMut(u64) -> Result<u64, crate::errno::Errno>;

/// Copy `elf` (the bytes `file`) to a free range; returns the load bias.
fn place(path: &str, elf: &Elf, file: &[u8], reserve: Reserve) -> Result<u64, Failed> {
    if !elf.relocatable {
        return Err(failed(
            ENOEXEC,
            format!(
                "{path} is linked at fixed addresses (ET_EXEC); only position-independent programs (PIE) are loaded from the file system"
            ),
        ));
    }
    let span = elf.span();
    let at = reserve(span).map_err(|e| failed(e, format!("{path}: no room for {} KiB: errno {e}", span >> 10)))?;
    // SAFETY: [at, at + span) was just reserved for the program and is
    // zero (fresh mappings are); nothing else refers to it yet.
    let dst = unsafe { core::slice::from_raw_parts_mut(at as *mut u8, span as usize) };
    elf.copy(file, dst);
    Ok(at - elf.lo)
}

fn read(path: &str) -> Result<Cow<'static, [u8]>, Failed> {
    fs::contents(path).map_err(|e| failed(e, format!("cannot read {path}: errno {e}")))
}

fn parse<'a>(path: &str, file: &'a [u8]) -> Result<Elf<'a>, Failed> {
    Elf::parse(file).map_err(|e| failed(if e == ftvm_elf::Error::NotElf { ENOEXEC } else { EACCES }, format!("{path}: {e}")))
}

/// Load the program at `path` (and its interpreter) into fresh memory.
pub fn load(path: &str, reserve: Reserve) -> Result<Loaded, Failed> {
    let file = read(path)?;
    let elf = parse(path, &file)?;
    let bias = place(path, &elf, &file, reserve)?;
    let mut text: Vec<(u64, u64)> = elf.text(bias).collect();
    let (entry, base) = match elf.interp {
        Some(interp_path) => {
            let ifile = read(interp_path)?;
            let interp = parse(interp_path, &ifile)?;
            if interp.interp.is_some() {
                return Err(failed(ENOEXEC, format!("interpreter {interp_path} asks for an interpreter itself")));
            }
            let ibias = place(interp_path, &interp, &ifile, reserve)?;
            text.extend(interp.text(ibias));
            // AT_BASE is the interpreter's load bias, as Linux gives it.
            (interp.entry + ibias, ibias)
        }
        None => (elf.entry + bias, 0),
    };
    let mut auxv = alloc::vec![
        (AT_PHDR, elf.phdr + bias),
        (AT_PHENT, PHDR_SIZE as u64),
        (AT_PHNUM, u64::from(elf.phnum)),
        (AT_BASE, base),
        (AT_ENTRY, elf.entry + bias),
    ];
    auxv.extend(common_auxv());
    *EXE.lock() = path.into();
    Ok(Loaded { entry, auxv, text })
}

/// The auxiliary entries every program gets, whoever loaded it.
pub fn common_auxv() -> Vec<(u64, u64)> {
    // As Linux: AT_HWCAP is CPUID leaf 1's EDX.
    let hwcap = core::arch::x86_64::__cpuid(1).edx;
    let mut auxv = alloc::vec![
        (AT_PAGESZ, crate::mm::PAGE),
        (AT_FLAGS, 0),
        (AT_UID, 0),
        (AT_EUID, 0),
        (AT_GID, 0),
        (AT_EGID, 0),
        (AT_HWCAP, u64::from(hwcap)),
        (AT_HWCAP2, 0),
        (AT_CLKTCK, 100),
        (AT_SECURE, 0),
    ];
    // Without it libc makes the clock system calls itself.
    if let Some(ehdr) = VDSO.get().copied().flatten() {
        auxv.push((AT_SYSINFO_EHDR, ehdr));
    }
    auxv
}

/// execve, in a program that runs alone: replace the running program with
/// the one at `path` and return the frame that enters it. Everything that
/// can fail is checked while the old program is still there to be told
/// (a file that is not there, not an ELF, not position-independent, other
/// threads still running); after that its memory is released, the
/// descriptors marked close-on-exec are closed and the new image is loaded.
pub fn replace(path: &str, argv: &[String], env: &[String]) -> Result<Frame, Failed> {
    let file = read(path)?;
    let elf = parse(path, &file)?;
    if !elf.relocatable {
        return Err(failed(EACCES, format!("{path} is linked at fixed addresses (ET_EXEC)")));
    }
    if let Some(interp) = elf.interp {
        let ifile = read(interp)?;
        parse(interp, &ifile)?;
    }
    // The loaded text is every process's (`sysjmp`): a program that runs
    // alone is replaced, one beside other threads or processes is not.
    if sched::live_threads() > 1 || crate::process::running() > 1 {
        return Err(failed(
            EAGAIN,
            format!("execve {path}: other threads or processes are running (execve from a program that runs alone only)"),
        ));
    }
    drop(file);
    // No way back from here: a failure ends the program, as on Linux.
    let fatal = |f: Failed| -> ! {
        ftvm_rt::println!("linux: execve {path}: {}", f.why);
        crate::exit_program(127)
    };
    crate::sys::mem::reset().unwrap_or_else(|e| fatal(failed(e, format!("cannot release the old memory: errno {e}"))));
    fd::close_on_exec();
    let stack =
        crate::sys::mem::reserve(crate::MAIN_STACK).unwrap_or_else(|e| fatal(failed(e, format!("no room for the stack: errno {e}"))));
    let loaded = load(path, &mut crate::sys::mem::reserve).unwrap_or_else(|f| fatal(f));
    sysjmp::set_text(loaded.text);
    sched::with_current(|t| {
        t.fs_base = 0;
        t.clear_child_tid = 0;
    });
    start::initial_frame(loaded.entry, &loaded.auxv, argv, env, path, stack, stack + crate::MAIN_STACK)
        .map_err(|why| fatal(failed(EAGAIN, why)))
}
