//! The contract between the ftvm VMM and its guests.
//!
//! Guests are 64-bit programs entered at CPL3 with identity-mapped memory
//! (guest virtual address == guest physical address). Everything here is
//! `#[repr(C)]` plain data so the VMM and the `no_std` guest runtime agree on
//! it byte for byte. `docs/guest-abi.md` describes the same contract in prose.
#![no_std]

/// Version of this ABI; bumped on any incompatible change.
pub const ABI_VERSION: u32 = 2;

/// `BootInfo::magic`: "FTVMBOOT" in little-endian.
pub const BOOT_MAGIC: u64 = u64::from_le_bytes(*b"FTVMBOOT");

pub const PAGE_SIZE: u64 = 4096;

pub mod rootfs;

/// Fixed guest-physical layout of the system area (the first 2 MiB).
pub mod layout {
    /// Everything below this is owned by the VMM; the image is loaded above it.
    pub const SYSTEM_AREA_END: u64 = 0x20_0000;
    /// Boot information (read-only to the guest), `BOOT_INFO_SIZE` bytes.
    pub const BOOT_INFO_ADDR: u64 = 0x4000;
    pub const BOOT_INFO_SIZE: u64 = 0x4000;
    /// Clock page (read-only to the guest), see [`super::ClockPage`].
    pub const CLOCK_PAGE_ADDR: u64 = 0x8000;
    /// Stack given to each vCPU at entry, carved above the loaded image.
    pub const VCPU_STACK_SIZE: u64 = 0x10_0000;
    /// The VMM's identity page tables: the root (PML4) here, its PDPT on the
    /// next page, and every table they point to, all inside the system area.
    /// Readable (not writable) at CPL3, so a guest can build address spaces
    /// of its own from them (see [`super::AddressSpace`]).
    pub const PAGE_TABLE_ROOT: u64 = 0x9000;
}

const _: () = assert!(layout::CLOCK_PAGE_ADDR + PAGE_SIZE <= layout::SYSTEM_AREA_END);
const _: () = assert!(layout::BOOT_INFO_ADDR + layout::BOOT_INFO_SIZE <= layout::CLOCK_PAGE_ADDR);

/// Hypercall ports. A hypercall is `out %eax, %dx` with `dx` = the port and
/// `eax` = the guest-physical address of the call's argument block (below
/// 4 GiB, 8-byte aligned). The VMM writes results back into the block before the vCPU
/// continues.
pub mod port {
    /// [`super::ConsoleWrite`]
    pub const CONSOLE_WRITE: u16 = 0x500;
    /// [`super::Wait`]
    pub const WAIT: u16 = 0x501;
    /// [`super::Exit`]
    pub const EXIT: u16 = 0x502;
    /// [`super::Abort`]
    pub const ABORT: u16 = 0x503;
    /// [`super::Kick`]
    pub const KICK: u16 = 0x504;
    /// [`super::AddressSpace`]
    pub const ADDRESS_SPACE: u16 = 0x505;
    /// [`super::FaultHandler`]
    pub const FAULT_HANDLER: u16 = 0x506;
    /// Used by the VMM's ring-0 exception stubs, not by guests: `al` holds
    /// the vector.
    pub const EXCEPTION: u16 = 0x5ff;
}

/// Write `len` bytes at guest address `buf` to the VM's console.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ConsoleWrite {
    pub buf: u64,
    pub len: u64,
}

/// Block the calling vCPU until a device event or a kick arrives, or until
/// the guest clock reaches `deadline_ns` (`u64::MAX`: no deadline).
///
/// `seen` is the event sequence number the guest last observed (the value
/// returned in `seq` by its previous wait, 0 before the first); the call
/// returns at once if events happened since. It may also return early for no reason the guest
/// can see (for example when the VMM pauses the VM), so callers re-check
/// their own condition in a loop.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Wait {
    pub deadline_ns: u64,
    pub seen: u64,
    /// Out: current event sequence number.
    pub seq: u64,
}

/// Stop the VM; `status` becomes the exit status of the VMM process
/// (truncated to 0..=255).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Exit {
    pub status: u64,
}

/// Stop the VM because the guest panicked; `msg`/`len` is the message.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Abort {
    pub msg: u64,
    pub len: u64,
}

/// Wake every vCPU blocked in [`Wait`] (bumps the event sequence number).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Kick {
    pub reserved: u64,
}

/// Switch the calling vCPU to the page tables rooted at `root` (the
/// guest-physical address of a 4 KiB-aligned PML4 in RAM above the system
/// area), or back to the VMM's identity tables ([`layout::PAGE_TABLE_ROOT`])
/// when `root` is 0. The VMM loads CR3, which flushes the vCPU's TLB. The
/// tables are the guest's: they must map the system area as the VMM's do
/// (the CPU reaches the GDT, IDT, TSS and exception stubs through them),
/// and everything a hypercall's block points at must be identity-mapped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AddressSpace {
    pub root: u64,
}

/// Reflect the calling vCPU's CPL3 page faults (#PF) to `handler`, a CPL3
/// address, on the stack whose top is `stack` (16-byte aligned, in RAM above
/// the system area and writable under every page table the vCPU loads);
/// `handler` 0 restores the default, a fault that stops the VM.
///
/// On a page fault at CPL3 the VMM's ring-0 stub writes a [`PageFault`] at
/// `stack - 32`, then returns to CPL3 at `handler` with `rsp = stack - 32`
/// and every other register (RFLAGS included) as the faulting instruction
/// left them. The handler resumes the program itself (a jump to
/// `PageFault::rip` with `rsp = PageFault::rsp`). A fault at ring 0 still
/// stops the VM, as does any fault while no handler is registered: to have
/// a fault it cannot resolve reported, a handler unregisters and returns
/// to the faulting instruction, which faults again.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultHandler {
    pub handler: u64,
    pub stack: u64,
}

/// What the page-fault stub leaves for a [`FaultHandler`], at its `rsp`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageFault {
    /// The faulting address (CR2).
    pub addr: u64,
    /// The CPU's page-fault error code (bit 0 present, 1 write, 2 user, 4 fetch).
    pub error: u64,
    /// The faulting instruction.
    pub rip: u64,
    /// The stack pointer at the fault.
    pub rsp: u64,
}

const _: () = assert!(core::mem::size_of::<PageFault>() == 32);

/// Boot information at [`layout::BOOT_INFO_ADDR`], passed in `rdi` to every
/// vCPU's entry point together with the vCPU index in `rsi`. All addresses
/// are guest-physical (== guest-virtual).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BootInfo {
    pub magic: u64,
    pub abi_version: u32,
    pub vcpu_count: u32,
    pub mem_size: u64,
    pub memmap_addr: u64,
    pub memmap_count: u32,
    pub device_count: u32,
    pub devices_addr: u64,
    pub cmdline_addr: u64,
    pub cmdline_len: u64,
    pub clock_addr: u64,
    /// The Linux program a Linux-personality runtime is to run; all zero for
    /// ordinary guests (see [`Program`]).
    pub program: Program,
}

/// A static Linux program the VMM loaded next to a runtime with a Linux
/// personality (an image whose [`note::AbiNote`] has
/// [`note::FLAG_LINUX_PERSONALITY`]). Its segments are already in memory
/// (memory map region [`mem_kind::PROGRAM`]); the runtime builds the
/// process start-up stack and jumps to `entry` at CPL3.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Program {
    pub entry: u64,
    /// Address of the program headers in memory (`AT_PHDR`).
    pub phdr: u64,
    /// Number of program headers (`AT_PHNUM`) and the size of one (`AT_PHENT`).
    pub phnum: u32,
    pub phent: u32,
    /// Lowest and one-past-highest address of the loaded segments (bss included).
    pub start: u64,
    pub end: u64,
}

/// The ELF note by which the VMM tells a guest built for this ABI from an
/// unmodified Linux program: a `PT_NOTE` segment holding a note of name
/// [`note::NAME`] and type [`note::TYPE_ABI`] whose descriptor is an
/// [`note::AbiNote`]. `ftvm_rt::entry!` emits it.
pub mod note {
    /// Note name, NUL included (the ELF `namesz` is 5).
    pub const NAME: &[u8; 5] = b"ftvm\0";
    pub const TYPE_ABI: u32 = 1;
    /// The image is a runtime with a Linux personality: it runs programs
    /// without the note (`BootInfo::program`).
    pub const FLAG_LINUX_PERSONALITY: u32 = 1;

    /// Descriptor of the ABI note.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct AbiNote {
        /// [`super::ABI_VERSION`] the image was built for.
        pub abi_version: u32,
        pub flags: u32,
        /// Where `syscall` goes (the VMM sets `EFER.SCE` and `LSTAR`): on
        /// these hosts it stays at CPL3, so the guest's own handler runs
        /// natively and returns by jump. 0: `syscall` faults (#UD).
        pub syscall_entry: u64,
    }

    /// Bytes of the descriptor (`descsz`).
    pub const DESC_SIZE: usize = core::mem::size_of::<AbiNote>();
}

/// `MemRegion::kind`
pub mod mem_kind {
    /// VMM structures (GDT, IDT, TSS, page tables, boot info): not for use.
    pub const RESERVED: u32 = 1;
    /// The loaded image's segments.
    pub const IMAGE: u32 = 2;
    /// Per-vCPU entry stacks.
    pub const STACK: u32 = 3;
    /// Free RAM for the guest's heap.
    pub const FREE: u32 = 4;
    /// The segments of the Linux program ([`super::Program`]), if any.
    pub const PROGRAM: u32 = 5;
    /// A root file system image for the Linux personality ([`super::rootfs`]).
    pub const ROOTFS: u32 = 6;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemRegion {
    pub base: u64,
    pub size: u64,
    pub kind: u32,
    pub reserved: u32,
}

/// `Device::kind`
pub mod device_kind {
    pub const VIRTIO_MMIO_NET: u32 = 1;
    pub const VIRTIO_MMIO_BLOCK: u32 = 2;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Device {
    pub kind: u32,
    pub reserved: u32,
    pub mmio_base: u64,
    pub mmio_size: u64,
}

/// The virtio 1.x values that the guest's drivers and the VMM's devices
/// must agree on (section numbers are the virtio 1.2 specification's).
/// Feature bits are masks (`1 << bit`) over the 64-bit feature words the
/// transport exchanges.
pub mod virtio {
    /// The device follows virtio 1.x rather than the legacy interface (6).
    pub const F_VERSION_1: u64 = 1 << 32;
    /// Notifications are suppressed through the rings' used and available
    /// event indexes instead of their flags (2.7.10).
    pub const F_RING_EVENT_IDX: u64 = 1 << 29;

    /// Whether a driver that moved a queue's available index from `old` to
    /// `new` must notify a device whose `avail_event` is `event`: the
    /// specification's `vring_need_event` (2.7.10), true when `event` lies
    /// in `[old, new)` modulo 2^16. Notifying when the index is merely past
    /// `event` repeats the notification until the device runs again.
    pub fn need_event(event: u16, new: u16, old: u16) -> bool {
        new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
    }

    /// virtio-net (5.1).
    pub mod net {
        /// The device's MAC address is in its configuration space.
        pub const F_MAC: u64 = 1 << 5;
        /// The driver may send frames with a partial TCP/UDP checksum
        /// (header flag [`HDR_F_NEEDS_CSUM`]).
        pub const F_CSUM: u64 = 1 << 0;
        /// The driver accepts frames with a partial checksum
        /// ([`HDR_F_NEEDS_CSUM`]) or one the host already checked
        /// ([`HDR_F_DATA_VALID`]); frames with neither it checks itself.
        pub const F_GUEST_CSUM: u64 = 1 << 1;
        /// Header `flags`: the checksum at `csum_start + csum_offset` holds
        /// only the pseudo-header's sum; the rest is summed from
        /// `csum_start` to the end of the frame.
        pub const HDR_F_NEEDS_CSUM: u8 = 1;
        /// Header `flags` (received frames): the checksum was verified.
        pub const HDR_F_DATA_VALID: u8 = 2;
        /// Bytes of the `virtio_net_hdr_v1` in front of every frame on both
        /// queues: 12, because under VERSION_1 it always carries
        /// `num_buffers` (5.1.6).
        pub const HDR_LEN: usize = 12;
    }

    /// virtio-blk (5.2).
    pub mod blk {
        /// The device has a write cache that [`T_FLUSH`] writes back;
        /// without it every completed write is already durable.
        pub const F_FLUSH: u64 = 1 << 9;
        /// The unit of a request's `sector` field, whatever the device's
        /// block size.
        pub const SECTOR_SIZE: usize = 512;
        /// Bytes of the device id that [`T_GET_ID`] returns (an ASCII
        /// string, NUL-padded when shorter).
        pub const ID_LEN: usize = 20;

        /// Request type (the header's `type`): read sectors.
        pub const T_IN: u32 = 0;
        /// Request type: write sectors.
        pub const T_OUT: u32 = 1;
        /// Request type: write the device's cache back to stable storage.
        pub const T_FLUSH: u32 = 4;
        /// Request type: read the device id.
        pub const T_GET_ID: u32 = 8;

        /// Request status (the last byte the device writes): success.
        pub const S_OK: u8 = 0;
        /// Request status: the device failed the request, e.g. on a full
        /// host disk.
        pub const S_IOERR: u8 = 1;
        /// Request status: the device does not support the request type.
        pub const S_UNSUPP: u8 = 2;
    }
}

/// Clock page at [`layout::CLOCK_PAGE_ADDR`], maintained by the VMM.
///
/// Guest time in nanoseconds is
/// `ns_base + ((rdtsc() - tsc_base) as u128 * tsc_mul as u128 >> tsc_shift)`.
/// The VMM rewrites `ns_base`/`tsc_base` after a restore so that guest time
/// continues from where it stopped instead of jumping with the host TSC.
/// A writer makes `version` odd while updating; readers retry while it is odd
/// or changed across their read (a seqlock).
///
/// `realtime_base` is the host's wall clock (nanoseconds since the UNIX
/// epoch) minus guest time, set whenever the VMM (re)bases the clock: wall
/// time is guest time plus it (0 when the host's clock is unknown).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClockPage {
    pub version: u32,
    pub tsc_shift: u32,
    pub tsc_mul: u64,
    pub tsc_base: u64,
    pub ns_base: u64,
    pub realtime_base: u64,
}

impl ClockPage {
    /// Guest nanoseconds at TSC value `tsc` (saturating for TSCs before the base).
    pub fn ns_at(&self, tsc: u64) -> u64 {
        let delta = tsc.saturating_sub(self.tsc_base) as u128;
        self.ns_base + ((delta * self.tsc_mul as u128) >> self.tsc_shift) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_converts_with_base() {
        // 2 GHz: 0.5 ns per tick.
        let c = ClockPage { version: 0, tsc_shift: 32, tsc_mul: 1 << 31, tsc_base: 1000, ns_base: 7, realtime_base: 0 };
        assert_eq!(c.ns_at(1000), 7);
        assert_eq!(c.ns_at(3000), 1007);
        assert_eq!(c.ns_at(10), 7);
    }

    #[test]
    fn need_event_follows_the_specification() {
        use virtio::need_event;
        // The device asked at 5: adding entry 5 (5 -> 6) crosses it.
        assert!(need_event(5, 6, 5));
        assert!(need_event(5, 9, 3));
        // Already past it at the last check: no second notification.
        assert!(!need_event(5, 9, 6));
        // Not reached yet.
        assert!(!need_event(10, 9, 3));
        // Across the 16-bit wrap.
        assert!(need_event(65535, 2, 65530));
        assert!(!need_event(65535, 2, 0));
        // Nothing added: never.
        assert!(!need_event(5, 5, 5));
    }
}
