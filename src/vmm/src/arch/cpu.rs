//! Initial vCPU state: long mode at CPL3 with SSE/AVX usable.

use kvm_bindings::{kvm_msr_entry, kvm_regs, kvm_segment, kvm_xcrs, CpuId, Msrs};
use kvm_ioctls::VcpuFd;

use super::layout::*;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const CR4_FSGSBASE: u64 = 1 << 16;
const CR4_OSXSAVE: u64 = 1 << 18;
const EFER_SCE: u64 = 1;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
const XCR0_X87: u64 = 1;
const XCR0_SSE: u64 = 1 << 1;
const XCR0_AVX: u64 = 1 << 2;

/// XSAVE feature bits the VM enables in XCR0, from the CPUID KVM offers.
pub fn xcr0_for(cpuid: &CpuId) -> Option<u64> {
    let leaf1 = cpuid.as_slice().iter().find(|e| e.function == 1)?;
    if leaf1.ecx & (1 << 26) == 0 {
        return None; // no XSAVE
    }
    let leaf_d = cpuid.as_slice().iter().find(|e| e.function == 0xd && e.index == 0);
    let supported = leaf_d.map_or(XCR0_X87 | XCR0_SSE, |e| e.eax as u64);
    Some(supported & (XCR0_X87 | XCR0_SSE | XCR0_AVX))
}

const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// RFLAGS bits `syscall` clears: TF, DF, NT and AC, so the guest's handler
/// starts with the flags compiled code assumes (it restores the caller's).
const SYSCALL_MASK: u64 = (1 << 8) | (1 << 10) | (1 << 14) | (1 << 18);

/// Whether the CPUID KVM offers has `rdfsbase`/`wrfsbase` (leaf 7 EBX bit 0),
/// which a Linux program's thread pointer needs at CPL3.
pub fn has_fsgsbase(cpuid: &CpuId) -> bool {
    cpuid.as_slice().iter().any(|e| e.function == 7 && e.index == 0 && e.ebx & 1 != 0)
}

/// What the guest image asks of the CPU beyond the defaults.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuFeatures {
    pub xcr0: Option<u64>,
    /// Enable `syscall` (EFER.SCE) with LSTAR = this address.
    pub syscall_entry: Option<u64>,
    /// Enable CR4.FSGSBASE.
    pub fsgsbase: bool,
}

/// CPUID for vCPU `index`: what KVM supports, with the APIC ID set so the
/// guest can tell its vCPUs apart.
pub fn cpuid_for(supported: &CpuId, index: u32) -> CpuId {
    let mut cpuid = supported.clone();
    for entry in cpuid.as_mut_slice() {
        if entry.function == 1 {
            entry.ebx = (entry.ebx & 0x00ff_ffff) | (index << 24);
        }
    }
    cpuid
}

fn segment(selector: u16, code: bool, dpl: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 11 } else { 3 },
        present: 1,
        dpl,
        db: if code { 0 } else { 1 },
        s: 1,
        l: if code { 1 } else { 0 },
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Put vCPU `index` into 64-bit mode at CPL3, entering `entry` with
/// `rdi` = boot info, `rsi` = vCPU index, `rsp` = `stack_top - 8`.
/// With `features.syscall_entry`, `syscall` jumps there, still at CPL3 on
/// these hosts (PLATFORM.md quirk 3); STAR's selectors are never loaded.
pub fn setup_vcpu(vcpu: &VcpuFd, index: u32, entry: u64, stack_top: u64, features: CpuFeatures) -> Result<(), kvm_ioctls::Error> {
    let xcr0 = features.xcr0;
    let mut sregs = vcpu.get_sregs()?;
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT | if xcr0.is_some() { CR4_OSXSAVE } else { 0 };
    if features.fsgsbase {
        sregs.cr4 |= CR4_FSGSBASE;
    }
    sregs.efer = EFER_LME | EFER_LMA;
    if features.syscall_entry.is_some() {
        sregs.efer |= EFER_SCE;
    }
    sregs.cs = segment(USER_CS, true, 3);
    let data = segment(USER_DS, false, 3);
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (GDT_ENTRIES * 8 - 1) as u16;
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 256 * 16 - 1;
    sregs.tr = kvm_segment {
        base: tss_addr(index),
        limit: TSS_LIMIT as u32,
        selector: tss_selector(index),
        type_: 11, // busy 64-bit TSS
        present: 1,
        ..Default::default()
    };
    vcpu.set_sregs(&sregs)?;
    if let Some(xcr0) = xcr0 {
        let mut xcrs = kvm_xcrs { nr_xcrs: 1, ..Default::default() };
        xcrs.xcrs[0].xcr = 0;
        xcrs.xcrs[0].value = xcr0;
        vcpu.set_xcrs(&xcrs)?;
    }
    if let Some(lstar) = features.syscall_entry {
        let msr = |index, data| kvm_msr_entry { index, data, ..Default::default() };
        let entries = [msr(MSR_STAR, u64::from(KERNEL_CS) << 32), msr(MSR_LSTAR, lstar), msr(MSR_SYSCALL_MASK, SYSCALL_MASK)];
        let msrs = Msrs::from_entries(&entries).expect("three MSRs fit");
        if vcpu.set_msrs(&msrs)? != entries.len() {
            return Err(kvm_ioctls::Error::new(libc::EINVAL));
        }
    }
    let regs = kvm_regs { rip: entry, rsp: stack_top - 8, rdi: BOOT_INFO_ADDR, rsi: index as u64, rflags: 0x2, ..Default::default() };
    vcpu.set_regs(&regs)
}
