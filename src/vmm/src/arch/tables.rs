//! Builds the descriptor tables, TSSs, exception stubs and identity page
//! tables that let a vCPU run a 64-bit CPL3 program directly.

use vm_memory::{Bytes, GuestAddress};

use super::layout::*;
use crate::memory::GuestMemory;

const PTE_PRESENT: u64 = 1;
const PTE_WRITE: u64 = 1 << 1;
const PTE_USER: u64 = 1 << 2;
const PTE_LARGE: u64 = 1 << 7;

/// Vectors for which the CPU pushes an error code.
pub const fn has_error_code(vector: u8) -> bool {
    matches!(vector, 8 | 10..=14 | 17 | 21 | 29 | 30)
}

/// Write every system structure for `vcpus` vCPUs and `mem_size` bytes of RAM.
/// `mmio` is the device window (base, size) to map for CPL3 next to RAM.
pub fn write_system_area(
    mem: &GuestMemory,
    vcpus: u32,
    mem_size: u64,
    mmio: Option<(u64, u64)>,
) -> Result<(), vm_memory::GuestMemoryError> {
    write_gdt(mem, vcpus)?;
    write_idt_and_stubs(mem)?;
    for vcpu in 0..vcpus {
        write_tss(mem, vcpu)?;
    }
    write_page_tables(mem, mem_size, mmio)
}

fn write_gdt(mem: &GuestMemory, vcpus: u32) -> Result<(), vm_memory::GuestMemoryError> {
    let mut gdt = vec![0u64; GDT_ENTRIES as usize];
    gdt[1] = 0x00af_9a00_0000_ffff; // 0x08 ring-0 code, 64-bit (exception stubs)
    gdt[2] = 0x00cf_9200_0000_ffff; // 0x10 ring-0 data
    gdt[3] = 0x00cf_fa00_0000_ffff; // 0x18 ring-3 code, 32-bit (unused, keeps sysret layout)
    gdt[4] = 0x00cf_f200_0000_ffff; // 0x20 ring-3 data
    gdt[5] = 0x00af_fa00_0000_ffff; // 0x28 ring-3 code, 64-bit
    for vcpu in 0..vcpus {
        let (base, limit) = (tss_addr(vcpu), TSS_LIMIT);
        let idx = (tss_selector(vcpu) / 8) as usize;
        gdt[idx] = (limit & 0xffff)
            | ((base & 0xff_ffff) << 16)
            | (0x89 << 40) // present, 64-bit available TSS
            | (((limit >> 16) & 0xf) << 48)
            | (((base >> 24) & 0xff) << 56);
        gdt[idx + 1] = base >> 32;
    }
    for (i, entry) in gdt.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(GDT_ADDR + i as u64 * 8))?;
    }
    Ok(())
}

/// The stub that reports `vector` to the VMM and stops: `mov al, vector;
/// mov dx, EXCEPTION; out dx, al; jmp $`.
fn report_stub(vector: u8) -> [u8; 9] {
    let port = ftvm_abi::port::EXCEPTION.to_le_bytes();
    [0xb0, vector, 0x66, 0xba, port[0], port[1], 0xee, 0xeb, 0xfe]
}

/// The #PF stub: reflects a CPL3 page fault to the handler the vCPU
/// registered (`ftvm_abi::FaultHandler`), else reports like the others.
/// Entered with the CPU's frame at rsp (error code, rip, cs, rflags, rsp,
/// ss) and the registration above it (handler, stack top; see
/// `layout::fault_handler_slot`). Every instruction here is emulated (about
/// 0.8 µs each), hence only 24 on the reflected path (operands after the
/// two pushes are 16 bytes further up the frame):
///
/// ```text
///   cmp qword [rsp+48], 0 ; je report      no handler
///   test byte [rsp+16], 3 ; jz report      fault at ring 0
///   push rax ; push rcx
///   mov rax, [rsp+72]                      handler stack top
///   mov rcx, cr2 ;        mov [rax-32], rcx
///   mov rcx, [rsp+16] ;   mov [rax-24], rcx   error code
///   mov rcx, [rsp+24] ;   mov [rax-16], rcx   rip
///   mov rcx, [rsp+48] ;   mov [rax-8], rcx    rsp
///   sub rax, 32 ; mov [rsp+48], rax        new rsp: the PageFault
///   mov rax, [rsp+64] ; mov [rsp+24], rax  new rip: the handler
///   pop rcx ; pop rax ; add rsp, 8 ; iretq drop the error code, back to CPL3
/// report: (the reporting stub for vector 14)
/// ```
const PAGE_FAULT_STUB: [u8; 0x53] = [
    0x48, 0x83, 0x7c, 0x24, 0x30, 0x00, 0x74, 0x4b, 0xf6, 0x44, 0x24, 0x10, 0x03, 0x74, 0x44, 0x50, 0x51, 0x48, 0x8b, 0x44, 0x24, 0x48,
    0x0f, 0x20, 0xd1, 0x48, 0x89, 0x48, 0xe0, 0x48, 0x8b, 0x4c, 0x24, 0x10, 0x48, 0x89, 0x48, 0xe8, 0x48, 0x8b, 0x4c, 0x24, 0x18, 0x48,
    0x89, 0x48, 0xf0, 0x48, 0x8b, 0x4c, 0x24, 0x30, 0x48, 0x89, 0x48, 0xf8, 0x48, 0x83, 0xe8, 0x20, 0x48, 0x89, 0x44, 0x24, 0x30, 0x48,
    0x8b, 0x44, 0x24, 0x40, 0x48, 0x89, 0x44, 0x24, 0x18, 0x59, 0x58, 0x48, 0x83, 0xc4, 0x08, 0x48, 0xcf,
];

/// Every vector but #PF gets a stub that reports it to the VMM and stops.
/// Ring 0 is emulated (slow) on these hosts, so the stubs do nothing else;
/// the VMM reads the frame the CPU pushed. #PF gets [`PAGE_FAULT_STUB`],
/// which stops the same way unless the guest registered a handler.
fn write_idt_and_stubs(mem: &GuestMemory) -> Result<(), vm_memory::GuestMemoryError> {
    mem.write_slice(&PAGE_FAULT_STUB, GuestAddress(PF_STUB_ADDR))?;
    mem.write_slice(&report_stub(14), GuestAddress(PF_STUB_ADDR + PAGE_FAULT_STUB.len() as u64))?;
    for vector in 0..=255u8 {
        let report = STUBS_ADDR + vector as u64 * STUB_SIZE;
        mem.write_slice(&report_stub(vector), GuestAddress(report))?;
        let stub = if vector == 14 { PF_STUB_ADDR } else { report };
        // int3 must be reachable from CPL3 (gate DPL 3); every other gate is
        // for CPU exceptions only.
        let attrs: u64 = if vector == 3 { 0xee } else { 0x8e };
        let low = (stub & 0xffff) | ((KERNEL_CS as u64) << 16) | (attrs << 40) | (((stub >> 16) & 0xffff) << 48);
        let high = stub >> 32;
        let gate = IDT_ADDR + vector as u64 * 16;
        mem.write_obj(low, GuestAddress(gate))?;
        mem.write_obj(high, GuestAddress(gate + 8))?;
    }
    Ok(())
}

fn write_tss(mem: &GuestMemory, vcpu: u32) -> Result<(), vm_memory::GuestMemoryError> {
    let base = tss_addr(vcpu);
    mem.write_slice(&vec![0u8; TSS_STRIDE as usize], GuestAddress(base))?;
    mem.write_obj(rsp0(vcpu), GuestAddress(base + 4))?; // RSP0
    mem.write_obj(TSS_IOMAP_OFFSET as u16, GuestAddress(base + 102))?;
    // The all-zero bitmap allows every port at CPL3 (IOPL is ignored on
    // this host); the byte after it must be 0xFF.
    mem.write_obj(0xffu8, GuestAddress(base + TSS_LIMIT))?;
    Ok(())
}

/// Identity map: 4 KiB pages for the system area (supervisor-only except the
/// read-only boot info, clock page and page tables, page 0 absent so null
/// pointers fault), 2 MiB user pages for the rest of RAM.
fn write_page_tables(mem: &GuestMemory, mem_size: u64, mmio: Option<(u64, u64)>) -> Result<(), vm_memory::GuestMemoryError> {
    let user_table = PTE_PRESENT | PTE_WRITE | PTE_USER;
    mem.write_obj(PDPT_ADDR | user_table, GuestAddress(PML4_ADDR))?;
    let mapped = |addr: u64| addr < mem_size || mmio.is_some_and(|(base, size)| addr + (2 << 20) > base && addr < base + size);
    let end = mmio.map_or(mem_size, |(base, size)| mem_size.max(base + size));
    let gibs = end.div_ceil(1 << 30);
    for gib in 0..gibs {
        let pd = PD_ADDR + gib * 4096;
        mem.write_obj(pd | user_table, GuestAddress(PDPT_ADDR + gib * 8))?;
        for i in 0..512u64 {
            let addr = (gib << 30) | (i << 21);
            let entry = if addr == 0 {
                PT0_ADDR | user_table
            } else if mapped(addr) {
                addr | PTE_PRESENT | PTE_WRITE | PTE_USER | PTE_LARGE
            } else {
                0
            };
            mem.write_obj(entry, GuestAddress(pd + i * 8))?;
        }
    }
    for page in 0..512u64 {
        let addr = page * 4096;
        let entry = match addr {
            0 => 0,
            BOOT_INFO_ADDR..CLOCK_PAGE_ADDR | CLOCK_PAGE_ADDR => addr | PTE_PRESENT | PTE_USER,
            GDT_ADDR | IDT_ADDR | STUBS_ADDR | PF_STUB_ADDR => addr | PTE_PRESENT,
            // Readable by the guest, which copies them into address spaces
            // of its own (`ftvm_abi::AddressSpace`).
            _ if (PML4_ADDR..KSTACKS_ADDR).contains(&addr) => addr | PTE_PRESENT | PTE_USER,
            _ if (KSTACKS_ADDR..TSS_ADDR + MAX_VCPUS as u64 * TSS_STRIDE).contains(&addr) => addr | PTE_PRESENT | PTE_WRITE,
            _ => 0,
        };
        mem.write_obj(entry, GuestAddress(PT0_ADDR + page * 8))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GuestRam;

    fn read(mem: &GuestMemory, addr: u64) -> u64 {
        mem.read_obj(GuestAddress(addr)).unwrap()
    }

    #[test]
    fn page_tables_map_ram_and_protect_system_area() {
        let ram = GuestRam::new(6 << 20, false).unwrap();
        write_system_area(ram.memory(), 2, 6 << 20, Some((1 << 30, 0x2000))).unwrap();
        let mem = ram.memory();
        assert_eq!(read(mem, PT0_ADDR), 0, "page 0 unmapped");
        assert_eq!(read(mem, PT0_ADDR + 8 * (BOOT_INFO_ADDR / 4096)) & 7, 5, "boot info user read-only");
        assert_eq!(read(mem, PT0_ADDR + 8 * (GDT_ADDR / 4096)) & 7, 1, "gdt supervisor read-only");
        assert_eq!(read(mem, PT0_ADDR + 8 * (tss_addr(1) / 4096)) & 7, 3, "tss supervisor writable");
        assert_eq!(read(mem, PT0_ADDR + 8 * (PML4_ADDR / 4096)) & 7, 5, "page tables user read-only");
        assert_eq!(read(mem, PT0_ADDR + 8 * (PD_ADDR / 4096 + 1)) & 7, 5, "page directories user read-only");
        assert_eq!(read(mem, PT0_ADDR + 8 * (KSTACKS_ADDR / 4096)) & 7, 3, "ring-0 stacks supervisor");
        assert_eq!(read(mem, PD_ADDR + 8), (2 << 20) | 0x87);
        assert_eq!(read(mem, PD_ADDR + 16), (4 << 20) | 0x87);
        assert_eq!(read(mem, PD_ADDR + 24), 0, "beyond RAM unmapped");
        assert_eq!(read(mem, PDPT_ADDR + 8) & !0xfff, PD_ADDR + 4096, "second GiB has a directory");
        assert_eq!(read(mem, PD_ADDR + 4096), (1 << 30) | 0x87, "device window mapped");
        assert_eq!(read(mem, PD_ADDR + 4096 + 8), 0);
    }

    #[test]
    fn page_fault_gate_reaches_its_stub_which_falls_back_to_reporting() {
        let ram = GuestRam::new(4 << 20, false).unwrap();
        write_system_area(ram.memory(), 1, 4 << 20, None).unwrap();
        let mem = ram.memory();
        let gate = |v: u64| {
            let low = read(mem, IDT_ADDR + v * 16);
            (low & 0xffff) | (((low >> 48) & 0xffff) << 16) | (read(mem, IDT_ADDR + v * 16 + 8) << 32)
        };
        assert_eq!(gate(14), PF_STUB_ADDR);
        assert_eq!(gate(13), STUBS_ADDR + 13 * STUB_SIZE);
        assert_eq!(read(mem, PT0_ADDR + 8 * (PF_STUB_ADDR / 4096)) & 7, 1, "stub supervisor read-only");
        // Both `je report` (rel8 at 7 and 14) land right after the stub,
        // where the reporting code for vector 14 follows.
        let end = PAGE_FAULT_STUB.len();
        assert_eq!(8 + PAGE_FAULT_STUB[7] as usize, end);
        assert_eq!(15 + PAGE_FAULT_STUB[14] as usize, end);
        let mut after = [0u8; 9];
        mem.read_slice(&mut after, GuestAddress(PF_STUB_ADDR + end as u64)).unwrap();
        assert_eq!(after, report_stub(14));
        assert_eq!(&PAGE_FAULT_STUB[end - 2..], &[0x48, 0xcf], "ends in iretq");
    }

    #[test]
    fn tss_descriptor_points_at_tss() {
        let ram = GuestRam::new(4 << 20, false).unwrap();
        write_system_area(ram.memory(), 3, 4 << 20, None).unwrap();
        let low = read(ram.memory(), GDT_ADDR + tss_selector(2) as u64);
        let base = ((low >> 16) & 0xff_ffff) | (((low >> 56) & 0xff) << 24);
        assert_eq!(base, tss_addr(2));
        assert_eq!((low >> 40) & 0xff, 0x89);
        assert_eq!(read(ram.memory(), tss_addr(2) + 4), kstack_top(2) - 16);
    }
}
