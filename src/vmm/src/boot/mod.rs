//! Guest boot: load the image, carve per-vCPU stacks, write the boot info.
//!
//! An image with the ftvm ABI note is the guest. An image without it is an
//! unmodified static Linux program: the VMM loads the runtime's Linux
//! personality (`linux.elf`, see [`linux_runtime`]) as the guest and the
//! program next to it, and tells the runtime where the program is
//! (`BootInfo::program`).

pub mod image;
pub mod rootfs;

use std::mem::size_of;
use std::path::{Path, PathBuf};

use vm_memory::{Bytes, GuestAddress};

use ftvm_abi::layout::{BOOT_INFO_ADDR, BOOT_INFO_SIZE, CLOCK_PAGE_ADDR, SYSTEM_AREA_END, VCPU_STACK_SIZE};
use ftvm_abi::note::FLAG_LINUX_PERSONALITY;
use ftvm_abi::{mem_kind, BootInfo, Device, MemRegion, Program, ABI_VERSION, BOOT_MAGIC, PAGE_SIZE};

use crate::memory::GuestMemory;
pub use image::{ImageError, LoadedImage};
pub use rootfs::RootfsError;

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
    #[error("image {image} is built for ftvm guest ABI {found}, this VMM speaks {ABI_VERSION}")]
    AbiVersion { image: String, found: u32 },
    #[error("{program} is a Linux program (no ftvm ABI note), but the Linux runtime {runtime} {why}; build it with scripts/build-images.sh or set {RUNTIME_ENV}")]
    NoLinuxRuntime { program: String, runtime: String, why: String },
    #[error("Linux program {program}: {what}")]
    Program { program: String, what: String },
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    #[error("--rootfs is for Linux programs; {image} is an ftvm guest")]
    RootfsForGuest { image: String },
}

/// Environment variable naming the Linux personality image; by default it
/// is `../images/linux.elf` next to the `ftvm` executable (where
/// `scripts/build-images.sh` puts it: `target/images/`).
pub const RUNTIME_ENV: &str = "FTVM_LINUX_RUNTIME";

/// Where the Linux personality image is expected.
pub fn linux_runtime() -> PathBuf {
    if let Some(p) = std::env::var_os(RUNTIME_ENV) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new("."));
    dir.join("../images/linux.elf")
}

/// Where everything of a booted guest lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootLayout {
    /// The image the vCPUs enter.
    pub image: LoadedImage,
    /// A Linux program loaded next to it (the image is then the Linux
    /// personality of the runtime).
    pub program: Option<LoadedImage>,
    /// Where the root file system image is (`[start, end)`), if any.
    pub rootfs: Option<(u64, u64)>,
    pub stacks_start: u64,
    pub heap_start: u64,
    pub mem_size: u64,
    pub vcpus: u32,
}

impl BootLayout {
    /// The image is the Linux personality (with a program loaded by the
    /// VMM, or one it loads itself from the root file system).
    pub fn runs_linux(&self) -> bool {
        self.image.note.is_some_and(|n| n.flags & FLAG_LINUX_PERSONALITY != 0)
    }

    pub fn stack_top(&self, vcpu: u32) -> u64 {
        self.stacks_start + (vcpu as u64 + 1) * VCPU_STACK_SIZE
    }

    pub fn regions(&self) -> Vec<MemRegion> {
        let region = |base, end, kind| MemRegion { base, size: end - base, kind, reserved: 0 };
        let mut regions = vec![region(0, SYSTEM_AREA_END, mem_kind::RESERVED), region(self.image.start, self.image.end, mem_kind::IMAGE)];
        if let Some(p) = &self.program {
            regions.push(region(p.start, p.end, mem_kind::PROGRAM));
        }
        if let Some((start, end)) = self.rootfs {
            regions.push(region(start, end, mem_kind::ROOTFS));
        }
        regions.push(region(self.stacks_start, self.stacks_start + self.vcpus as u64 * VCPU_STACK_SIZE, mem_kind::STACK));
        regions.push(region(self.heap_start, self.mem_size, mem_kind::FREE));
        regions
    }

    fn program_info(&self) -> Program {
        self.program.map_or_else(Program::default, |p| Program {
            entry: p.entry,
            phdr: p.phdr,
            phnum: p.phnum.into(),
            phent: image::PHDR_SIZE as u32,
            start: p.start,
            end: p.end,
        })
    }
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Decide where the root file system image (`rootfs_len` bytes), stacks
/// and heap go for `image` (and `program`), or say why it does not fit.
pub fn plan(image: LoadedImage, program: Option<LoadedImage>, rootfs_len: u64, mem_size: u64, vcpus: u32) -> Result<BootLayout, BootError> {
    let end = align_up(program.map_or(image.end, |p| p.end.max(image.end)), PAGE_SIZE);
    let rootfs = (rootfs_len > 0).then_some((end, end + align_up(rootfs_len, PAGE_SIZE)));
    let stacks_start = rootfs.map_or(end, |(_, e)| e);
    let heap_start = stacks_start + vcpus as u64 * VCPU_STACK_SIZE;
    let needed = heap_start + MIN_HEAP;
    // Hypercall argument blocks live on the stacks and must be below 4 GiB.
    if needed > mem_size || heap_start > 1 << 32 {
        return Err(BootError::TooLittleMemory { needed: needed.div_ceil(1 << 20), have: mem_size >> 20, vcpus });
    }
    Ok(BootLayout { image, program, rootfs, stacks_start, heap_start, mem_size, vcpus })
}

/// Load `path` (and, for a Linux program, the runtime that runs it) and
/// write the boot info for `vcpus` vCPUs. `rootfs` is a host directory
/// packed into guest memory as the Linux program's root file system; a
/// dynamically linked program needs one (the runtime loads it from there,
/// with its interpreter and libraries).
pub fn boot(
    mem: &GuestMemory,
    path: &Path,
    rootfs: Option<&Path>,
    mem_size: u64,
    vcpus: u32,
    cmdline: &str,
    devices: &[Device],
) -> Result<BootLayout, BootError> {
    let dynamic = image::is_dynamic(path)?;
    let program = if dynamic { None } else { Some(image::inspect(path, mem_size)?) };
    if let Some(note) = program.and_then(|p| p.note) {
        check_abi(path, note.abi_version)?;
        if rootfs.is_some() {
            return Err(BootError::RootfsForGuest { image: path.display().to_string() });
        }
        let layout = plan(program.expect("inspected"), None, 0, mem_size, vcpus)?;
        image::load(mem, path, mem_size)?;
        write_boot_info(mem, &layout, cmdline, devices)?;
        return Ok(layout);
    }
    // A Linux program: the runtime runs it.
    let packed = match rootfs {
        // The runtime loads a dynamic program from the rootfs; a static
        // one the VMM placed may have files there without being one.
        Some(dir) if dynamic => rootfs::pack(dir, &rootfs::program_path(dir, path)?)?,
        Some(dir) => rootfs::pack(dir, &rootfs::program_path(dir, path).unwrap_or_default())?,
        None if dynamic => {
            return Err(BootError::Program {
                program: path.display().to_string(),
                what: format!(
                    "it is dynamically linked: give its root file system with --rootfs DIR (scripts/make-rootfs.sh {} DIR)",
                    path.display()
                ),
            })
        }
        None => Vec::new(),
    };
    let runtime_path = linux_runtime();
    let runtime = linux_personality(path, &runtime_path, mem_size)?;
    if let Some(p) = &program {
        check_program(path, p, &runtime)?;
    }
    let layout = plan(runtime, program, packed.len() as u64, mem_size, vcpus)?;
    image::load(mem, &runtime_path, mem_size)?;
    if program.is_some() {
        image::load(mem, path, mem_size)?;
    }
    if let Some((start, _)) = layout.rootfs {
        mem.write_slice(&packed, GuestAddress(start))?;
    }
    write_boot_info(mem, &layout, cmdline, devices)?;
    Ok(layout)
}

fn check_abi(path: &Path, found: u32) -> Result<(), BootError> {
    if found != ABI_VERSION {
        return Err(BootError::AbiVersion { image: path.display().to_string(), found });
    }
    Ok(())
}

/// Inspect the Linux personality image that is to run `program`.
fn linux_personality(program: &Path, runtime: &Path, mem_size: u64) -> Result<LoadedImage, BootError> {
    let missing =
        |why: String| BootError::NoLinuxRuntime { program: program.display().to_string(), runtime: runtime.display().to_string(), why };
    if !runtime.exists() {
        return Err(missing("does not exist".into()));
    }
    let image = image::inspect(runtime, mem_size).map_err(|e| missing(format!("is unusable ({e})")))?;
    match image.note {
        Some(n) if n.flags & FLAG_LINUX_PERSONALITY != 0 && n.syscall_entry != 0 => {
            check_abi(runtime, n.abi_version)?;
            Ok(image)
        }
        _ => Err(missing("is not a runtime with a Linux personality".into())),
    }
}

/// What the Linux personality needs of a program.
fn check_program(path: &Path, program: &LoadedImage, runtime: &LoadedImage) -> Result<(), BootError> {
    let bad = |what: String| BootError::Program { program: path.display().to_string(), what };
    if !program.identity {
        return Err(bad("segments with physical addresses different from their virtual ones".into()));
    }
    if program.phdr == 0 {
        return Err(bad("its program headers are not inside a loadable segment".into()));
    }
    if program.start < runtime.end && runtime.start < program.end {
        return Err(bad(format!(
            "its segments {:#x}..{:#x} overlap the Linux runtime's {:#x}..{:#x} (programs must be linked at or above {:#x}, as GNU ld does by default)",
            program.start, program.end, runtime.start, runtime.end, runtime.end
        )));
    }
    Ok(())
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
        program: layout.program_info(),
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
        LoadedImage { entry: 0x20_1000, start: 0x20_0000, end: 0x21_0123, note: None, phdr: 0, phnum: 0, identity: true }
    }

    #[test]
    fn plan_puts_stacks_above_image_and_heap_above_stacks() {
        let l = plan(image(), None, 0, 64 << 20, 2).unwrap();
        assert_eq!(l.stacks_start, 0x21_1000);
        assert_eq!(l.stack_top(1), 0x21_1000 + 2 * VCPU_STACK_SIZE);
        assert_eq!(l.heap_start, l.stack_top(1));
        let r = l.regions();
        assert_eq!(r[3].base + r[3].size, 64 << 20);
    }

    #[test]
    fn plan_puts_stacks_above_the_program_too() {
        let program = LoadedImage { entry: 0x40_1000, start: 0x40_0000, end: 0x58_0123, ..image() };
        let l = plan(image(), Some(program), 0, 64 << 20, 1).unwrap();
        assert_eq!(l.stacks_start, 0x58_1000);
        let r = l.regions();
        assert_eq!(r[2], MemRegion { base: 0x40_0000, size: 0x18_0123, kind: mem_kind::PROGRAM, reserved: 0 });
        assert_eq!(l.program_info().entry, 0x40_1000);
    }

    #[test]
    fn plan_puts_the_rootfs_between_program_and_stacks() {
        let l = plan(image(), None, 0x1800, 64 << 20, 1).unwrap();
        assert_eq!(l.rootfs, Some((0x21_1000, 0x21_3000)));
        assert_eq!(l.stacks_start, 0x21_3000);
        assert!(l.regions().contains(&MemRegion { base: 0x21_1000, size: 0x2000, kind: mem_kind::ROOTFS, reserved: 0 }));
    }

    #[test]
    fn plan_rejects_too_little_memory() {
        assert!(matches!(plan(image(), None, 0, 4 << 20, 4), Err(BootError::TooLittleMemory { .. })));
    }
}
