//! Where the VMM puts its x86-64 structures inside the 2 MiB system area.
//!
//! Only the boot info and clock pages and the page tables are visible to
//! CPL3 (read-only); the rest is supervisor-only so a guest bug cannot
//! corrupt its own IDT or TSS.

pub use ftvm_abi::layout::{BOOT_INFO_ADDR, BOOT_INFO_SIZE, CLOCK_PAGE_ADDR, PAGE_TABLE_ROOT as PML4_ADDR, SYSTEM_AREA_END};

pub const GDT_ADDR: u64 = 0x1000;
pub const IDT_ADDR: u64 = 0x2000;
/// 256 exception stubs of [`STUB_SIZE`] bytes each.
pub const STUBS_ADDR: u64 = 0x3000;
pub const STUB_SIZE: u64 = 16;
pub const PDPT_ADDR: u64 = 0xa000;
/// 4 KiB page table for the first 2 MiB (the system area itself).
pub const PT0_ADDR: u64 = 0xb000;
/// One page directory per GiB of guest-physical address space.
pub const PD_ADDR: u64 = 0xc000;
pub const MAX_MEM_GIB: u64 = 64;
/// RAM leaves the last GiB of the mapped space for the device window.
pub const MAX_RAM_GIB: u64 = MAX_MEM_GIB - 1;
/// Ring-0 stacks on which the CPU pushes exception frames, one page each.
pub const KSTACKS_ADDR: u64 = 0x5_0000;
/// One TSS per vCPU: 104-byte header, 8 KiB I/O bitmap, 0xFF terminator.
pub const TSS_ADDR: u64 = 0x8_0000;
pub const TSS_STRIDE: u64 = 0x3000;
pub const TSS_IOMAP_OFFSET: u64 = 104;
pub const TSS_LIMIT: u64 = TSS_IOMAP_OFFSET + 8192;
pub const MAX_VCPUS: u32 = 32;
/// The page-fault stub (`tables::PAGE_FAULT_STUB`), after the TSSs.
pub const PF_STUB_ADDR: u64 = TSS_ADDR + MAX_VCPUS as u64 * TSS_STRIDE;
const _: () = assert!(TSS_LIMIT < TSS_STRIDE);

pub const fn kstack_top(vcpu: u32) -> u64 {
    KSTACKS_ADDR + (vcpu as u64 + 1) * 0x1000
}

/// Where a vCPU's registered page-fault handler and its stack top are kept
/// (`ftvm_abi::FaultHandler`): the top 16 bytes of its ring-0 stack, above
/// where the CPU pushes exception frames, so the stub finds them at a fixed
/// offset from its stack pointer.
pub const fn fault_handler_slot(vcpu: u32) -> u64 {
    kstack_top(vcpu) - 16
}

/// The ring-0 stack pointer the TSS gives the CPU: below the handler slot.
pub const fn rsp0(vcpu: u32) -> u64 {
    fault_handler_slot(vcpu)
}

pub const fn tss_addr(vcpu: u32) -> u64 {
    TSS_ADDR + vcpu as u64 * TSS_STRIDE
}

// Selectors (GDT index << 3 | RPL).
pub const KERNEL_CS: u16 = 0x08;
pub const USER_DS: u16 = 0x20 | 3;
pub const USER_CS: u16 = 0x28 | 3;
pub const fn tss_selector(vcpu: u32) -> u16 {
    0x30 + 16 * vcpu as u16
}
pub const GDT_ENTRIES: u64 = 6 + 2 * MAX_VCPUS as u64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_do_not_overlap() {
        let regions = [
            (GDT_ADDR, GDT_ENTRIES * 8),
            (IDT_ADDR, 4096),
            (STUBS_ADDR, 256 * STUB_SIZE),
            (BOOT_INFO_ADDR, BOOT_INFO_SIZE),
            (CLOCK_PAGE_ADDR, 4096),
            (PML4_ADDR, 4096),
            (PDPT_ADDR, 4096),
            (PT0_ADDR, 4096),
            (PD_ADDR, MAX_MEM_GIB * 4096),
            (KSTACKS_ADDR, MAX_VCPUS as u64 * 4096),
            (TSS_ADDR, MAX_VCPUS as u64 * TSS_STRIDE),
            (PF_STUB_ADDR, 4096),
        ];
        for (i, a) in regions.iter().enumerate() {
            assert!(a.0 + a.1 <= SYSTEM_AREA_END);
            for b in &regions[i + 1..] {
                assert!(a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0, "{a:x?} overlaps {b:x?}");
            }
        }
    }
}
