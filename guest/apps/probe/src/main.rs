//! probe: a self-test of the guest runtime, driven by the VMM's integration
//! tests. The command line is one action word (see `guest/README.md`).
#![no_std]
#![no_main]

extern crate alloc;

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::arch::asm;
use core::fmt::Write;
use core::sync::atomic::{AtomicU64, Ordering};

use ftvm_rt::time::{self, NS_PER_MS, NS_PER_SEC};
use ftvm_rt::{println, Args, Mutex};

ftvm_rt::entry!(main);

fn main(args: &Args) -> i32 {
    let action = args.cmdline.split_ascii_whitespace().next().unwrap_or("");
    let (verb, value) = action.split_once('=').unwrap_or((action, ""));
    match (verb, value) {
        ("hello", "") => {
            println!("probe: hello vcpus={} cmdline={}", args.vcpu_count, args.cmdline);
            0
        }
        ("exit", n) => match n.parse() {
            Ok(status) => status,
            Err(_) => bad_argument(),
        },
        ("fault", kind) => fault(kind),
        ("panic", "") => panic!("probe panic {}", 42),
        ("smp", "") => smp(args.vcpu_count),
        ("alloc", "") => alloc_test(),
        ("time", "") => time_test(),
        ("ticker", spec) => ticker(spec),
        ("sse", "") => sse(),
        ("root", spec) => root(spec),
        ("reflect", kind) => reflect(kind),
        ("dirty", spec) => dirty(spec),
        ("reread", spec) => reread(spec),
        _ => {
            println!("probe: error: unknown action");
            2
        }
    }
}

fn bad_argument() -> i32 {
    println!("probe: error: bad argument");
    2
}

/// Each fault ends the VM in the VMM's exception path; returning is a bug.
fn fault(kind: &str) -> i32 {
    if !matches!(kind, "pf" | "ud" | "gp" | "int3") {
        return bad_argument();
    }
    // SAFETY: each instruction deliberately faults; the VMM stops the VM in
    // its exception handler, so nothing after it runs.
    unsafe {
        match kind {
            // Page 0 is unmapped.
            "pf" => asm!("mov qword ptr [{}], 1", in(reg) 0x10u64, options(nostack)),
            "ud" => asm!("ud2", options(nomem, nostack)),
            // A non-canonical address is a #GP whatever the page tables say.
            "gp" => {
                asm!("mov {0}, qword ptr [{0}]", inout(reg) 0x8000_0000_0000_0000u64 => _, options(nostack))
            }
            _ => asm!("int3", options(nomem, nostack)),
        }
    }
    println!("probe: error: fault={kind} returned");
    99
}

fn smp(vcpus: usize) -> i32 {
    const ROUNDS: u64 = 100_000;
    let counter = Mutex::new(0u64);
    let atomic = AtomicU64::new(0);
    ftvm_rt::run_on_all(vcpus, &|_cpu| {
        for _ in 0..ROUNDS {
            *counter.lock() += 1;
            atomic.fetch_add(1, Ordering::Relaxed);
        }
    });
    let (m, a) = (*counter.lock(), atomic.load(Ordering::Relaxed));
    println!("probe: smp ok vcpus={vcpus} counter={m} atomic={a}");
    let want = vcpus as u64 * ROUNDS;
    if m == want && a == want {
        0
    } else {
        1
    }
}

fn alloc_test() -> i32 {
    // A few MB in differently sized blocks, freed in a different order than
    // allocated so the free list has to merge holes.
    let mut blocks: Vec<Vec<u8>> = (0..64).map(|i| alloc::vec![i as u8; 1024 + i * 997]).collect();
    let big: Vec<u64> = (0..(4 << 20) / 8).collect();
    let mut text = String::new();
    let mut map = BTreeMap::new();
    for i in 0..10_000u32 {
        map.insert(i.wrapping_mul(2_654_435_761), Box::new(i));
        if i % 1000 == 0 {
            let _ = write!(text, "{i},");
        }
    }
    for i in (0..blocks.len()).rev().step_by(2) {
        drop(blocks.swap_remove(i));
    }
    let again: Vec<u8> = alloc::vec![0xa5; 1 << 20];
    let ok = blocks.iter().all(|b| b.iter().all(|&x| x == b[0]))
        && big.iter().enumerate().all(|(i, &x)| x == i as u64)
        && map.len() == 10_000
        && map.iter().all(|(k, v)| v.wrapping_mul(2_654_435_761) == *k)
        && text.starts_with("0,1000,2000,")
        && again.iter().all(|&x| x == 0xa5);
    if !ok {
        println!("probe: error: alloc mismatch");
        return 1;
    }
    println!("probe: alloc ok");
    0
}

fn time_test() -> i32 {
    let mut last = time::now_ns();
    for _ in 0..1_000_000 {
        let t = time::now_ns();
        if t < last {
            println!("probe: error: time went back from {last} to {t}");
            return 1;
        }
        last = t;
    }
    let start = time::now_ns();
    time::sleep_ns(50 * NS_PER_MS);
    let slept = time::now_ns() - start;
    if !(50 * NS_PER_MS..5 * NS_PER_SEC).contains(&slept) {
        println!("probe: error: slept {slept} ns for 50 ms");
        return 1;
    }
    println!("probe: time ok slept_ns={slept}");
    0
}

/// `dirty=STRIDE,COUNT`: write one byte into every STRIDE-th page of a fresh
/// STRIDE*COUNT-page region, so the VMM's dirty tracking can be checked
/// against exactly these pages. The region is allocated uninitialized: the
/// allocator itself writes nothing inside it.
fn dirty(spec: &str) -> i32 {
    let parsed = spec.split_once(',').and_then(|(s, c)| Some((s.parse::<usize>().ok()?, c.parse::<usize>().ok()?)));
    let Some((stride, count)) = parsed.filter(|&(s, c)| s > 0 && c > 0) else {
        return bad_argument();
    };
    let pages = stride * count;
    let layout = alloc::alloc::Layout::from_size_align(pages * 4096, 4096).expect("page-aligned layout");
    // SAFETY: non-zero size; the memory is only written below, never read.
    let base = unsafe { alloc::alloc::alloc(layout) };
    if base.is_null() {
        println!("probe: error: cannot allocate {pages} pages");
        return 1;
    }
    println!("probe: dirty base={:#x} pages={pages} stride={stride} count={count}", base as usize);
    for i in 0..count {
        // SAFETY: the offset stays inside the allocation (page i*stride,
        // byte i % 4096 of it).
        unsafe { base.add(i * stride * 4096 + i % 4096).write_volatile(i as u8 | 1) };
    }
    println!("probe: dirty done");
    0
}

/// `reread=PAGES,MS`: write every page of a fresh PAGES-page region, say so
/// (`probe: reread written`), wait MS ms (the VMM re-arms dirty tracking
/// meanwhile), then time three passes over the region, one qword a page (total ns each):
/// reads, reads again, writes. After a re-arm that revokes only write
/// permission the first reads cost what the second do, and only the writes
/// take the tracked first-write fault.
fn reread(spec: &str) -> i32 {
    let parsed = spec.split_once(',').and_then(|(p, ms)| Some((p.parse::<usize>().ok()?, ms.parse::<u64>().ok()?)));
    let Some((pages, ms)) = parsed.filter(|&(p, _)| p > 0) else {
        return bad_argument();
    };
    let layout = alloc::alloc::Layout::from_size_align(pages * 4096, 4096).expect("page-aligned layout");
    // SAFETY: non-zero size; every page is written before it is read.
    let base = unsafe { alloc::alloc::alloc(layout) } as *mut u64;
    if base.is_null() {
        println!("probe: error: cannot allocate {pages} pages");
        return 1;
    }
    let word = |i: usize| i * 512 + i % 512;
    for i in 0..pages {
        // SAFETY: word(i) lies inside page i of the allocation.
        unsafe { base.add(word(i)).write_volatile(i as u64) };
    }
    println!("probe: reread written pages={pages}");
    time::sleep_ns(ms * NS_PER_MS);
    let mut sum = 0u64;
    let mut pass = |write: bool| {
        let t0 = time::now_ns();
        for i in 0..pages {
            // SAFETY: as above; the pages were initialized by the first loop.
            unsafe {
                if write {
                    base.add(word(i)).write_volatile(i as u64 + 1);
                } else {
                    sum = sum.wrapping_add(base.add(word(i)).read_volatile());
                }
            }
        }
        time::now_ns() - t0
    };
    let (read, again, write) = (pass(false), pass(false), pass(true));
    println!("probe: reread pages={pages} read_ns={read} read_again_ns={again} write_ns={write} sum={sum}");
    0
}

/// Dirtied by the ticker so a snapshot has guest state worth restoring.
static TICK_STATE: Mutex<[u64; 512]> = Mutex::new([0; 512]);

/// `ticker=MS` or `ticker=MS,count=K`.
fn ticker(spec: &str) -> i32 {
    let (ms, count) = match spec.split_once(',') {
        None => (spec, None),
        Some((ms, rest)) => match rest.strip_prefix("count=").map(str::parse::<u64>) {
            Some(Ok(k)) => (ms, Some(k)),
            _ => return bad_argument(),
        },
    };
    let period = match ms.parse::<u64>() {
        Ok(ms) if ms > 0 => ms * NS_PER_MS,
        _ => return bad_argument(),
    };
    let start = time::now_ns();
    let mut checksum = 0u64;
    let mut n = 0u64;
    loop {
        n += 1;
        // Deadlines are absolute so ticks do not drift with print latency.
        time::sleep_until(start + n * period);
        checksum = mix(checksum ^ n);
        TICK_STATE.lock()[(n % 512) as usize] = checksum;
        println!("probe: tick n={n} t_ns={}", time::now_ns());
        if count == Some(n) {
            println!("probe: ticker done n={n} checksum={checksum:016x}");
            return 0;
        }
    }
}

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `a + b` per lane with one AVX `vaddpd` on a ymm register.
///
/// # Safety
/// The CPU and the VMM (XCR0) must enable AVX.
#[target_feature(enable = "avx")]
unsafe fn vaddpd(a: &[f64; 4], b: &[f64; 4]) -> [f64; 4] {
    let mut out = [0.0; 4];
    // SAFETY: reads 32 bytes from a and b and writes 32 to out, all live
    // arrays; vzeroupper avoids SSE/AVX transition stalls in later code.
    unsafe {
        asm!(
            "vmovupd {t}, ymmword ptr [{a}]",
            "vaddpd {t}, {t}, ymmword ptr [{b}]",
            "vmovupd ymmword ptr [{o}], {t}",
            "vzeroupper",
            a = in(reg) a.as_ptr(), b = in(reg) b.as_ptr(), o = in(reg) out.as_mut_ptr(),
            t = out(ymm_reg) _, options(nostack),
        )
    };
    out
}

/// The address-space hypercall: `copy` loads a copy of the VMM's root
/// table (its entries, so the same map) from the heap, writes through it,
/// and goes back to the VMM's tables; a number is loaded as it is (the VMM
/// refuses anything but a page of RAM above the system area).
fn root(spec: &str) -> i32 {
    #[repr(C, align(4096))]
    struct Table([u64; 512]);
    if spec == "copy" {
        // SAFETY: the VMM's root table is readable at CPL3 (guest ABI).
        let copy = Box::new(unsafe { (ftvm_rt::abi::layout::PAGE_TABLE_ROOT as *const Table).read() });
        let mut probe = Box::new(0u64);
        // SAFETY: the copy maps everything as the VMM's tables do and stays
        // alive (and loaded) only inside this block.
        unsafe {
            ftvm_rt::set_address_space(&*copy as *const Table as u64);
            core::ptr::write_volatile(&mut *probe, 42);
            ftvm_rt::set_address_space(0);
        }
        println!("probe: root copy ok value={}", *probe);
        return 0;
    }
    let parsed = match spec.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => spec.parse(),
    };
    let Ok(root) = parsed else {
        println!("probe: error: bad argument");
        return 2;
    };
    // SAFETY: 0 is the VMM's own tables; anything else the VMM must refuse
    // (what the test checks), or the probe faults, which it reports too.
    unsafe { ftvm_rt::set_address_space(root) };
    println!("probe: root {root:#x} loaded");
    0
}

// The page-fault reflection (FAULT_HANDLER): `probe_reflect(addr)`
// writes to `addr` with rbx set; the handler keeps the stub's record, what
// it saw in rbx and its own rsp, and lands back in `probe_reflect` (not at
// the faulting instruction: the probe has no memory to make writable).
core::arch::global_asm!(
    ".globl probe_reflect",
    "probe_reflect:",
    "push rbx",
    "push r12",
    "mov [rip + PROBE_SAVED_RSP], rsp",
    "lea rax, [rip + 2f]",
    "mov [rip + PROBE_LANDING], rax",
    "mov rbx, 0x12345678",
    "lea rax, [rip + 1f]",
    "mov [rip + PROBE_FAULT_AT], rax",
    "1:",
    "mov byte ptr [rdi], 1",
    "ud2",
    "2:",
    "mov rsp, [rip + PROBE_SAVED_RSP]",
    "pop r12",
    "pop rbx",
    "ret",
    ".globl probe_pf_handler",
    "probe_pf_handler:",
    "mov [rip + PROBE_SEEN_RBX], rbx",
    "mov [rip + PROBE_HANDLER_RSP], rsp",
    "mov rax, [rsp]",
    "mov [rip + PROBE_RECORD], rax",
    "mov rax, [rsp + 8]",
    "mov [rip + PROBE_RECORD + 8], rax",
    "mov rax, [rsp + 16]",
    "mov [rip + PROBE_RECORD + 16], rax",
    "mov rax, [rsp + 24]",
    "mov [rip + PROBE_RECORD + 24], rax",
    "jmp [rip + PROBE_LANDING]",
);

extern "C" {
    fn probe_reflect(addr: u64);
    fn probe_pf_handler();
}

#[no_mangle]
static mut PROBE_SAVED_RSP: u64 = 0;
#[no_mangle]
static mut PROBE_LANDING: u64 = 0;
#[no_mangle]
static mut PROBE_FAULT_AT: u64 = 0;
#[no_mangle]
static mut PROBE_SEEN_RBX: u64 = 0;
#[no_mangle]
static mut PROBE_HANDLER_RSP: u64 = 0;
#[no_mangle]
static mut PROBE_RECORD: [u64; 4] = [0; 4];

/// `ok`: a write to the read-only boot information page is reflected to
/// the handler with its record (address, error code, rip, rsp) and the
/// program's registers; `unregister`: the same write after the handler is
/// removed stops the VM as any fault; `badstack`: a stack top in the
/// system area is refused by the VMM.
fn reflect(kind: &str) -> i32 {
    #[repr(C, align(16))]
    struct Stack([u8; 16384]);
    static mut STACK: Stack = Stack([0; 16384]);
    let top = &raw const STACK as u64 + 16384;
    let handler = probe_pf_handler as *const () as u64;
    let target = ftvm_rt::abi::layout::BOOT_INFO_ADDR;
    match kind {
        "ok" => {
            // SAFETY: the handler lands back in probe_reflect on its own
            // stack, which nothing else uses; the fault is the probe's.
            unsafe {
                ftvm_rt::set_fault_handler(handler, top);
                probe_reflect(target);
                ftvm_rt::set_fault_handler(0, 0);
            }
            // SAFETY: written by the handler above, read after it ran.
            let (rec, rbx, hrsp, at, rsp) = unsafe { (PROBE_RECORD, PROBE_SEEN_RBX, PROBE_HANDLER_RSP, PROBE_FAULT_AT, PROBE_SAVED_RSP) };
            println!(
                "probe: reflect ok addr={:#x} error={:#x} rip={} rsp={} rbx={:#x} stack={}",
                rec[0],
                rec[1],
                rec[2] == at,
                rec[3] == rsp,
                rbx,
                hrsp == top - 32
            );
            0
        }
        "unregister" => {
            // SAFETY: as above; without a handler the write stops the VM.
            unsafe {
                ftvm_rt::set_fault_handler(handler, top);
                ftvm_rt::set_fault_handler(0, 0);
                probe_reflect(target);
            }
            println!("probe: error: reflect=unregister returned");
            99
        }
        "badstack" => {
            // SAFETY: the VMM refuses the registration (what the test checks).
            unsafe { ftvm_rt::set_fault_handler(handler, 0x1000) };
            println!("probe: error: reflect=badstack registered");
            99
        }
        _ => bad_argument(),
    }
}

fn sse() -> i32 {
    // Leibniz series in f64 and a product in f32: ordinary compiled SSE code.
    let mut pi = 0.0f64;
    for k in 0..100_000 {
        let term = 4.0 / (2 * k + 1) as f64;
        pi += if k % 2 == 0 { term } else { -term };
    }
    let mut prod = 1.0f32;
    for i in 1..=10 {
        prod *= i as f32 / 2.0;
    }
    // SAFETY: the VMM enables AVX for every guest (guest ABI).
    let sum = unsafe { vaddpd(&[pi, 1.0, 2.0, prod as f64], &[1.0, 2.0, 3.0, 0.5]) };
    let ok = (pi - core::f64::consts::PI).abs() < 1e-4 && prod == 3543.75 && sum == [pi + 1.0, 3.0, 5.0, prod as f64 + 0.5];
    if !ok {
        println!("probe: error: sse pi={pi} prod={prod} sum={sum:?}");
        return 1;
    }
    println!("probe: sse ok {:.6}", sum[0] + sum[1] + sum[2] + sum[3]);
    0
}
