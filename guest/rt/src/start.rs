//! From the VMM's entry to `main`: every vCPU arrives here at once.

use ftvm_abi::{BootInfo, Device, MemRegion, ABI_VERSION, BOOT_MAGIC};
use spin::Once;

use crate::{exit, heap, panic, smp, time, vcpu, MAX_VCPUS};

static DEVICES: Once<&'static [Device]> = Once::new();

/// The devices the VMM attached (boot info device list); empty before
/// `main` starts.
pub fn devices() -> &'static [Device] {
    DEVICES.get().copied().unwrap_or(&[])
}

/// What `main` learns about its VM.
#[derive(Clone, Copy, Debug)]
pub struct Args {
    /// The command line the VMM was given for the guest.
    pub cmdline: &'static str,
    pub vcpu_count: usize,
    /// The whole memory map from the boot info.
    pub memmap: &'static [MemRegion],
    /// The FREE region the global allocator manages (size 0: no heap).
    pub heap: MemRegion,
    /// The Linux program the VMM loaded for a Linux personality (all zero
    /// otherwise).
    pub program: ftvm_abi::Program,
}

impl Args {
    /// FREE regions of guest RAM (including the heap's).
    pub fn free_regions(&self) -> impl Iterator<Item = &'static MemRegion> {
        self.memmap.iter().filter(|r| r.kind == ftvm_abi::mem_kind::FREE)
    }
}

/// Called by the `_start` that [`crate::entry!`] defines, with the VMM's
/// `rdi`/`rsi`, the entry `rsp` and the application's main.
///
/// # Safety
/// Only the VMM's entry may call it: `boot` must point to the boot info and
/// `entry_rsp` must be the untouched entry stack pointer of vCPU `vcpu`.
#[doc(hidden)]
// `main` is only ever a Rust function's address loaded by our own `_start`.
#[allow(improper_ctypes_definitions)]
pub unsafe extern "C" fn __start(boot: *const BootInfo, vcpu: u64, entry_rsp: u64, main: fn(&Args) -> i32) -> ! {
    let vcpu = vcpu as usize;
    // SAFETY: the VMM passes the address of the boot info page, mapped
    // readable and never changed while the guest runs.
    let boot: &'static BootInfo = unsafe { &*boot };
    let sane = boot.magic == BOOT_MAGIC && boot.abi_version == ABI_VERSION;
    if vcpu != 0 {
        if !sane || vcpu >= MAX_VCPUS {
            // vCPU 0 reports bad boot info; a vCPU beyond our tables must
            // not run anything (vCPU 0 aborts on the count as well).
            panic::park();
        }
        vcpu::register(vcpu, entry_rsp);
        time::init(boot.clock_addr as *const _);
        smp::secondary_loop(vcpu);
    }
    vcpu::register(0, entry_rsp);
    assert!(sane, "bad boot info: magic {:#x} abi_version {} (expected {:#x} {})", boot.magic, boot.abi_version, BOOT_MAGIC, ABI_VERSION);
    let vcpu_count = boot.vcpu_count as usize;
    assert!((1..=MAX_VCPUS).contains(&vcpu_count), "{vcpu_count} vCPUs, the runtime supports 1..={MAX_VCPUS}");
    time::init(boot.clock_addr as *const _);
    vcpu::set_vcpu_count(vcpu_count);
    DEVICES.call_once(|| device_list(boot));
    let args = Args { cmdline: cmdline(boot), vcpu_count, memmap: memmap(boot), heap: MemRegion::default(), program: boot.program };
    let args = Args { heap: heap::init(args.memmap), ..args };
    exit(main(&args))
}

fn memmap(boot: &BootInfo) -> &'static [MemRegion] {
    // SAFETY: the VMM writes `memmap_count` regions at `memmap_addr`.
    unsafe { boot_array(boot.memmap_addr, boot.memmap_count, "memory map") }
}

fn device_list(boot: &BootInfo) -> &'static [Device] {
    // SAFETY: the VMM writes `device_count` devices at `devices_addr`.
    unsafe { boot_array(boot.devices_addr, boot.device_count, "device list") }
}

/// An array the boot information points at.
///
/// # Safety
/// `count` values of `T` must live at `addr` for the whole run.
unsafe fn boot_array<T>(addr: u64, count: u32, what: &str) -> &'static [T] {
    if count == 0 {
        return &[];
    }
    assert!(addr != 0 && addr.is_multiple_of(8), "bad {what} address {addr:#x}");
    // SAFETY: the caller vouches for the contents; the VMM never changes
    // them while the guest runs (alignment checked above).
    unsafe { core::slice::from_raw_parts(addr as *const T, count as usize) }
}

fn cmdline(boot: &BootInfo) -> &'static str {
    let (addr, len) = (boot.cmdline_addr, boot.cmdline_len as usize);
    if len == 0 {
        return "";
    }
    assert!(addr != 0, "command line of {len} bytes at address 0");
    // SAFETY: the VMM places `len` bytes at `addr` in memory it never changes
    // while the guest runs.
    let bytes = unsafe { core::slice::from_raw_parts(addr as *const u8, len) };
    core::str::from_utf8(bytes).expect("command line is not UTF-8")
}
