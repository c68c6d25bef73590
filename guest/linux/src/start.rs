//! Process start-up as the Linux kernel does it: the initial stack with
//! argc, argv, envp and the auxiliary vector (System V x86-64 ABI 3.4.1).

use alloc::vec::Vec;

use ftvm_abi::Program;

use crate::entry::Frame;
use crate::random;

const AT_NULL: u64 = 0;
const AT_PHDR: u64 = 3;
const AT_PHENT: u64 = 4;
const AT_PHNUM: u64 = 5;
const AT_PAGESZ: u64 = 6;
const AT_BASE: u64 = 7;
const AT_FLAGS: u64 = 8;
const AT_ENTRY: u64 = 9;
const AT_UID: u64 = 11;
const AT_EUID: u64 = 12;
const AT_GID: u64 = 13;
const AT_EGID: u64 = 14;
const AT_PLATFORM: u64 = 15;
const AT_HWCAP: u64 = 16;
const AT_CLKTCK: u64 = 17;
const AT_SECURE: u64 = 23;
const AT_RANDOM: u64 = 25;
const AT_HWCAP2: u64 = 26;
const AT_EXECFN: u64 = 31;
const AT_SYSINFO_EHDR: u64 = 33;

/// Writes downwards from the top of the stack.
struct Stack {
    sp: u64,
    bottom: u64,
}

impl Stack {
    fn push_bytes(&mut self, bytes: &[u8]) -> u64 {
        self.sp -= bytes.len() as u64;
        assert!(self.sp >= self.bottom, "arguments and environment do not fit the initial stack");
        // SAFETY: [sp, sp + len) lies in the stack mapping, which belongs to
        // the program and is not in use yet.
        unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), self.sp as *mut u8, bytes.len()) };
        self.sp
    }

    fn push_str(&mut self, s: &str) -> u64 {
        self.push_bytes(&[0]);
        self.push_bytes(s.as_bytes())
    }
}

/// Lay out the initial stack in `[bottom, top)` and return the frame that
/// enters `program` with it; `vdso` is the address of the vDSO, if any.
pub fn initial_frame(
    program: &Program,
    argv: &[alloc::string::String],
    env: &[alloc::string::String],
    vdso: Option<u64>,
    bottom: u64,
    top: u64,
) -> Frame {
    let mut st = Stack { sp: top, bottom };
    let mut random_bytes = [0u8; 16];
    random::fill(&mut random_bytes);
    let at_random = st.push_bytes(&random_bytes);
    let platform = st.push_str("x86_64");
    let execfn = st.push_str(&argv[0]);
    let argv_ptrs: Vec<u64> = argv.iter().map(|a| st.push_str(a)).collect();
    let env_ptrs: Vec<u64> = env.iter().map(|e| st.push_str(e)).collect();
    let mut auxv = alloc::vec![
        (AT_PHDR, program.phdr),
        (AT_PHENT, u64::from(program.phent)),
        (AT_PHNUM, u64::from(program.phnum)),
        (AT_PAGESZ, crate::mm::PAGE),
        (AT_BASE, 0),
        (AT_FLAGS, 0),
        (AT_ENTRY, program.entry),
        (AT_UID, 0),
        (AT_EUID, 0),
        (AT_GID, 0),
        (AT_EGID, 0),
        (AT_PLATFORM, platform),
        (AT_HWCAP, 0),
        (AT_HWCAP2, 0),
        (AT_CLKTCK, 100),
        (AT_SECURE, 0),
        (AT_RANDOM, at_random),
        (AT_EXECFN, execfn),
    ];
    // Without it libc makes the clock system calls itself.
    if let Some(ehdr) = vdso {
        auxv.push((AT_SYSINFO_EHDR, ehdr));
    }
    auxv.push((AT_NULL, 0));
    let words = 1 + argv_ptrs.len() + 1 + env_ptrs.len() + 1 + 2 * auxv.len();
    // rsp must be 16-byte aligned at argc.
    st.sp = (st.sp - 8 * words as u64) & !15;
    assert!(st.sp >= bottom, "arguments and environment do not fit the initial stack");
    let mut w: Vec<u64> = Vec::with_capacity(words);
    w.push(argv_ptrs.len() as u64);
    w.extend(&argv_ptrs);
    w.push(0);
    w.extend(&env_ptrs);
    w.push(0);
    for &(k, v) in &auxv {
        w.extend([k, v]);
    }
    // SAFETY: [sp, sp + 8 * words) is inside the stack mapping (checked).
    unsafe { core::ptr::copy_nonoverlapping(w.as_ptr(), st.sp as *mut u64, w.len()) };
    Frame::initial(program.entry, st.sp)
}
