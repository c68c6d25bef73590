//! A vDSO: the clock calls as plain function calls into the runtime.
//!
//! On these hosts a `syscall` instruction costs about 1 µs (it traps to the
//! hypervisor before it lands at LSTAR), and a program like redis-server
//! reads the clock twice per request. Linux answers those calls without a
//! system call through its vDSO, an ELF object it maps into every process
//! and names in the auxiliary vector (`AT_SYSINFO_EHDR`); libc looks the
//! functions up in its dynamic symbol table and calls them. This module
//! builds such an object at start-up: an ELF header, a `PT_LOAD` and a
//! `PT_DYNAMIC` program header, a dynamic section, a SysV hash table, a
//! symbol table and its strings, whose symbols are the functions below in
//! the runtime's own text (the program shares the runtime's address space
//! and runs at the same privilege, so a call is just a call). They read the
//! VMM's clock page like the system calls do, so the time they give is the
//! same, monotonic across snapshots and failover.
//!
//! The object's addresses are absolute (its `PT_LOAD` is at its own
//! address, so the load bias is 0). Its symbols carry no version
//! (`DT_VERSYM`): musl and glibc accept unversioned symbols when looking
//! for `LINUX_2.6` ones.
//!
//! The `vdso=off` runtime option leaves `AT_SYSINFO_EHDR` out: libc then
//! makes the system calls instead.

use alloc::vec::Vec;

use crate::errno::{Errno, EFAULT};
use crate::sys::{time, user};

const PAGE: usize = 4096;
const EHDR: usize = 64;
const PHDR: usize = 56;
const SYM: usize = 24;
const DYN: usize = 16;

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PF_X: u32 = 1;
const PF_R: u32 = 4;
const DT_NULL: u64 = 0;
const DT_HASH: u64 = 4;
const DT_STRTAB: u64 = 5;
const DT_SYMTAB: u64 = 6;
const DT_STRSZ: u64 = 10;
const DT_SYMENT: u64 = 11;
/// STB_GLOBAL << 4 | STT_FUNC.
const GLOBAL_FUNC: u8 = 0x12;
/// The values are absolute addresses.
const SHN_ABS: u16 = 0xfff1;

/// The functions the object exports, with the names Linux's x86-64 vDSO
/// gives them.
fn symbols() -> [(&'static str, u64); 4] {
    [
        ("__vdso_clock_gettime", vdso_clock_gettime as *const () as u64),
        ("__vdso_gettimeofday", vdso_gettimeofday as *const () as u64),
        ("__vdso_time", vdso_time as *const () as u64),
        ("__vdso_getcpu", vdso_getcpu as *const () as u64),
    ]
}

/// Build the object and return its address for `AT_SYSINFO_EHDR`. It is
/// never freed.
pub fn build() -> u64 {
    let syms = symbols();
    // Strings: a leading NUL (name 0 is the empty name), then each name.
    let mut strtab = alloc::vec![0u8];
    let mut name_off = Vec::new();
    for (name, _) in syms {
        name_off.push(strtab.len() as u32);
        strtab.extend_from_slice(name.as_bytes());
        strtab.push(0);
    }
    // Symbol 0 is the null symbol.
    let nsyms = syms.len() + 1;
    // Layout: headers, dynamic section, hash table, symbols, strings.
    let dyn_off = EHDR + 2 * PHDR;
    let dyn_len = 6 * DYN;
    let hash_off = dyn_off + dyn_len;
    let nbucket = nsyms;
    let hash_len = 4 * (2 + nbucket + nsyms);
    let sym_off = (hash_off + hash_len).next_multiple_of(8);
    let str_off = sym_off + nsyms * SYM;
    let len = str_off + strtab.len();
    assert!(len <= PAGE, "the vDSO fits one page");

    let mut image = Image(page());
    let base = image.0.as_ptr() as u64;
    // ELF header: 64-bit, little-endian, version 1, a shared object for x86-64.
    image.put(0, &[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    image.u16(16, 3); // ET_DYN
    image.u16(18, 62); // EM_X86_64
    image.u32(20, 1);
    image.u64(32, EHDR as u64); // e_phoff
    image.u16(52, EHDR as u16);
    image.u16(54, PHDR as u16);
    image.u16(56, 2); // e_phnum
    image.u16(58, 64); // e_shentsize (no sections)
    image.phdr(EHDR, PT_LOAD, PF_R | PF_X, 0, base, len, PAGE);
    image.phdr(EHDR + PHDR, PT_DYNAMIC, PF_R, dyn_off, base + dyn_off as u64, dyn_len, 8);
    let dynamic = [
        (DT_HASH, base + hash_off as u64),
        (DT_STRTAB, base + str_off as u64),
        (DT_SYMTAB, base + sym_off as u64),
        (DT_STRSZ, strtab.len() as u64),
        (DT_SYMENT, SYM as u64),
        (DT_NULL, 0),
    ];
    for (i, (tag, val)) in dynamic.into_iter().enumerate() {
        image.u64(dyn_off + i * DYN, tag);
        image.u64(dyn_off + i * DYN + 8, val);
    }
    // SysV hash table: bucket[hash % nbucket] is a chain's first symbol,
    // chain[i] the next one after symbol i (0 ends a chain).
    image.u32(hash_off, nbucket as u32);
    image.u32(hash_off + 4, nsyms as u32);
    let bucket = |b: usize| hash_off + 8 + 4 * b;
    let chain = |i: usize| hash_off + 8 + 4 * nbucket + 4 * i;
    for (i, (name, addr)) in syms.iter().enumerate() {
        let index = i + 1;
        let s = sym_off + index * SYM;
        image.u32(s, name_off[i]);
        image.put(s + 4, &[GLOBAL_FUNC, 0]);
        image.u16(s + 6, SHN_ABS);
        image.u64(s + 8, *addr);
        let b = bucket(elf_hash(name.as_bytes()) as usize % nbucket);
        // Prepend to the bucket's chain.
        let head = image.get_u32(b);
        image.u32(chain(index), head);
        image.u32(b, index as u32);
    }
    image.put(str_off, &strtab);
    base
}

/// A zeroed page of runtime memory, never freed.
fn page() -> &'static mut [u8] {
    let layout = core::alloc::Layout::from_size_align(PAGE, PAGE).expect("valid layout");
    // SAFETY: a non-zero-sized layout; the block is ours for good (never
    // freed), and zeroed, so it is initialised as a byte slice.
    unsafe {
        let p = alloc::alloc::alloc_zeroed(layout);
        assert!(!p.is_null(), "out of memory building the vDSO");
        core::slice::from_raw_parts_mut(p, PAGE)
    }
}

/// The SysV ELF symbol hash.
fn elf_hash(name: &[u8]) -> u32 {
    let mut h: u32 = 0;
    for &c in name {
        h = (h << 4).wrapping_add(u32::from(c));
        let g = h & 0xf000_0000;
        if g != 0 {
            h ^= g >> 24;
        }
        h &= !g;
    }
    h
}

struct Image(&'static mut [u8]);

impl Image {
    fn put(&mut self, off: usize, bytes: &[u8]) {
        self.0[off..off + bytes.len()].copy_from_slice(bytes);
    }
    fn u16(&mut self, off: usize, v: u16) {
        self.put(off, &v.to_le_bytes());
    }
    fn u32(&mut self, off: usize, v: u32) {
        self.put(off, &v.to_le_bytes());
    }
    fn u64(&mut self, off: usize, v: u64) {
        self.put(off, &v.to_le_bytes());
    }
    fn get_u32(&self, off: usize) -> u32 {
        u32::from_le_bytes(self.0[off..off + 4].try_into().expect("4 bytes"))
    }
    #[allow(clippy::too_many_arguments)]
    fn phdr(&mut self, off: usize, kind: u32, flags: u32, offset: usize, vaddr: u64, len: usize, align: usize) {
        self.u32(off, kind);
        self.u32(off + 4, flags);
        self.u64(off + 8, offset as u64);
        self.u64(off + 16, vaddr);
        self.u64(off + 24, vaddr);
        self.u64(off + 32, len as u64);
        self.u64(off + 40, len as u64);
        self.u64(off + 48, align as u64);
    }
}

/// A system call's result as the vDSO functions return it: 0 or -errno.
fn ret(r: Result<u64, Errno>) -> i64 {
    match r {
        Ok(v) => v as i64,
        Err(e) => -(e as i64),
    }
}

extern "C" fn vdso_clock_gettime(clock: i32, ts: u64) -> i64 {
    ret(time::clock_gettime(clock as u32 as u64, ts))
}

extern "C" fn vdso_gettimeofday(tv: u64, _tz: u64) -> i64 {
    ret(time::gettimeofday(tv))
}

extern "C" fn vdso_time(out: u64) -> i64 {
    ret(time::time(out))
}

/// One vCPU runs every thread: always CPU 0 of node 0.
extern "C" fn vdso_getcpu(cpu: u64, node: u64) -> i64 {
    for p in [cpu, node] {
        if p != 0 && user::write(p, 0u32).is_err() {
            return -(EFAULT as i64);
        }
    }
    0
}
