//! Guest boot: load the image, carve per-vCPU stacks, write the boot info.

pub mod image;

use std::mem::size_of;
use std::path::Path;

use vm_memory::{Bytes, GuestAddress};

use ftvm_abi::layout::{BOOT_INFO_ADDR, BOOT_INFO_SIZE, CLOCK_PAGE_ADDR, SYSTEM_AREA_END, VCPU_STACK_SIZE};
use ftvm_abi::{mem_kind, BootInfo, Device, MemRegion, ABI_VERSION, BOOT_MAGIC, PAGE_SIZE};

use crate::memory::GuestMemory;
pub use image::{ImageError, LoadedImage};

/// The smallest heap a guest is given; less than this is "too little memory".
pub const MIN_HEAP: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("too little guest memory: {needed} MiB needed for the image, {vcpus} vCPU stacks and a minimal heap, {have} MiB given")]
    TooLittleMemory { needed: u64, have: u64, vcpus: u32 },
    #[error("command line too long: {len} bytes (at most {max})")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("cannot write boot information: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

/// Where everything of a booted guest lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootLayout {
    pub image: LoadedImage,
    pub stacks_start: u64,
    pub heap_start: u64,
    pub mem_size: u64,
    pub vcpus: u32,
}

impl BootLayout {
    pub fn stack_top(&self, vcpu: u32) -> u64 {
        self.stacks_start + (vcpu as u64 + 1) * VCPU_STACK_SIZE
    }

    pub fn regions(&self) -> [MemRegion; 4] {
        let region = |base, end, kind| MemRegion { base, size: end - base, kind, reserved: 0 };
        [
            region(0, SYSTEM_AREA_END, mem_kind::RESERVED),
            region(self.image.start, self.image.end, mem_kind::IMAGE),
            region(self.stacks_start, self.stacks_start + self.vcpus as u64 * VCPU_STACK_SIZE, mem_kind::STACK),
            region(self.heap_start, self.mem_size, mem_kind::FREE),
        ]
    }
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Decide where stacks and heap go for `image`, or say why it does not fit.
pub fn plan(image: LoadedImage, mem_size: u64, vcpus: u32) -> Result<BootLayout, BootError> {
    let stacks_start = align_up(image.end, PAGE_SIZE);
    let heap_start = stacks_start + vcpus as u64 * VCPU_STACK_SIZE;
    let needed = heap_start + MIN_HEAP;
    // Hypercall argument blocks live on the stacks and must be below 4 GiB.
    if needed > mem_size || heap_start > 1 << 32 {
        return Err(BootError::TooLittleMemory { needed: needed.div_ceil(1 << 20), have: mem_size >> 20, vcpus });
    }
    Ok(BootLayout { image, stacks_start, heap_start, mem_size, vcpus })
}

/// Load `path` and write the boot info for `vcpus` vCPUs.
pub fn boot(mem: &GuestMemory, path: &Path, mem_size: u64, vcpus: u32, cmdline: &str, devices: &[Device]) -> Result<BootLayout, BootError> {
    let image = image::inspect(path, mem_size)?;
    let layout = plan(image, mem_size, vcpus)?;
    image::load(mem, path, mem_size)?;
    write_boot_info(mem, &layout, cmdline, devices)?;
    Ok(layout)
}

fn write_boot_info(mem: &GuestMemory, layout: &BootLayout, cmdline: &str, devices: &[Device]) -> Result<(), BootError> {
    let regions = layout.regions();
    let memmap_addr = BOOT_INFO_ADDR + size_of::<BootInfo>().next_multiple_of(64) as u64;
    let devices_addr = memmap_addr + (regions.len() * size_of::<MemRegion>()) as u64;
    let cmdline_addr = devices_addr + std::mem::size_of_val(devices) as u64;
    let max = (BOOT_INFO_ADDR + BOOT_INFO_SIZE - cmdline_addr) as usize;
    if cmdline.len() > max {
        return Err(BootError::CmdlineTooLong { len: cmdline.len(), max });
    }
    let info = BootInfo {
        magic: BOOT_MAGIC,
        abi_version: ABI_VERSION,
        vcpu_count: layout.vcpus,
        mem_size: layout.mem_size,
        memmap_addr,
        memmap_count: regions.len() as u32,
        device_count: devices.len() as u32,
        devices_addr,
        cmdline_addr,
        cmdline_len: cmdline.len() as u64,
        clock_addr: CLOCK_PAGE_ADDR,
    };
    // SAFETY: BootInfo, MemRegion and Device are repr(C) structs of plain
    // integers with no padding-sensitive invariants; viewing them as bytes
    // is sound.
    let bytes = |p: *const u8, len| unsafe { std::slice::from_raw_parts(p, len) };
    mem.write_slice(bytes(&info as *const _ as *const u8, size_of::<BootInfo>()), GuestAddress(BOOT_INFO_ADDR))?;
    mem.write_slice(bytes(regions.as_ptr() as *const u8, regions.len() * size_of::<MemRegion>()), GuestAddress(memmap_addr))?;
    mem.write_slice(bytes(devices.as_ptr() as *const u8, std::mem::size_of_val(devices)), GuestAddress(devices_addr))?;
    mem.write_slice(cmdline.as_bytes(), GuestAddress(cmdline_addr))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> LoadedImage {
        LoadedImage { entry: 0x20_1000, start: 0x20_0000, end: 0x21_0123 }
    }

    #[test]
    fn plan_puts_stacks_above_image_and_heap_above_stacks() {
        let l = plan(image(), 64 << 20, 2).unwrap();
        assert_eq!(l.stacks_start, 0x21_1000);
        assert_eq!(l.stack_top(1), 0x21_1000 + 2 * VCPU_STACK_SIZE);
        assert_eq!(l.heap_start, l.stack_top(1));
        let r = l.regions();
        assert_eq!(r[3].base + r[3].size, 64 << 20);
    }

    #[test]
    fn plan_rejects_too_little_memory() {
        assert!(matches!(plan(image(), 4 << 20, 4), Err(BootError::TooLittleMemory { .. })));
    }
}
