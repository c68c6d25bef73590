//! The dirty-logging ioctls kvm-ioctls does not wrap (CLEAR_DIRTY_LOG,
//! RESET_DIRTY_RINGS, the per-vCPU ring mapping), and GET_DIRTY_LOG into a
//! buffer of the caller's (kvm-ioctls allocates a new one at every call:
//! 64 KiB zeroed for 2 GiB of RAM, at every harvest).

use std::io;
use std::os::fd::AsRawFd;

use kvm_bindings::{kvm_clear_dirty_log, kvm_dirty_gfn, kvm_dirty_log, KVMIO, KVM_DIRTY_LOG_PAGE_OFFSET};
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref};
use vmm_sys_util::{ioctl_io_nr, ioctl_iow_nr, ioctl_iowr_nr};

ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);

/// The pages of `slot` written since they were last re-protected, into
/// `bitmap` (64 pages per word from page 0; it must cover the whole slot).
pub fn get_dirty_log(vm: &impl AsRawFd, slot: u32, bitmap: &mut [u64]) -> io::Result<()> {
    let mut arg = kvm_dirty_log { slot, ..Default::default() };
    arg.__bindgen_anon_1.dirty_bitmap = bitmap.as_mut_ptr().cast();
    // SAFETY: `arg` points at `bitmap`, which the caller sizes to the slot
    // (one bit per page, whole words) and which lives across the call; the
    // kernel writes only that many bytes into it.
    let ret = unsafe { ioctl_with_ref(vm, KVM_GET_DIRTY_LOG(), &arg) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}
ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);

/// Re-protect the pages whose bits are set in `bitmap` (64 pages per word,
/// starting at page 0 of `slot`).
pub fn clear_dirty_log(vm: &impl AsRawFd, slot: u32, bitmap: &mut [u64]) -> io::Result<()> {
    let mut arg = kvm_clear_dirty_log { slot, num_pages: (bitmap.len() * 64) as u32, first_page: 0, ..Default::default() };
    arg.__bindgen_anon_1.dirty_bitmap = bitmap.as_mut_ptr().cast();
    // SAFETY: `arg` points at a bitmap of exactly `num_pages` bits that lives
    // across the call; the kernel only reads it.
    let ret = unsafe { ioctl_with_ref(vm, KVM_CLEAR_DIRTY_LOG(), &arg) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Re-protect every page harvested (flagged RESET) from all vCPUs' rings.
pub fn reset_dirty_rings(vm: &impl AsRawFd) -> io::Result<u32> {
    // SAFETY: KVM_RESET_DIRTY_RINGS takes no argument.
    let ret = unsafe { ioctl(vm, KVM_RESET_DIRTY_RINGS()) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as u32)
    }
}

/// One vCPU's dirty ring, shared with the kernel.
pub struct RingMapping {
    entries: *mut kvm_dirty_gfn,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; entries are accessed with
// atomic flag handshakes as the KVM API prescribes.
unsafe impl Send for RingMapping {}

impl RingMapping {
    pub fn new(vcpu: &impl AsRawFd, len: usize) -> io::Result<RingMapping> {
        let bytes = len * std::mem::size_of::<kvm_dirty_gfn>();
        let offset = KVM_DIRTY_LOG_PAGE_OFFSET as libc::off_t * 4096;
        // SAFETY: mapping a region the kernel provides for this vCPU fd; the
        // result is checked and unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, vcpu.as_raw_fd(), offset)
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(RingMapping { entries: ptr.cast(), len })
    }

    /// Entry `i` (modulo the ring size) as (flags word, slot, offset).
    pub fn entry(&self, i: u32) -> &kvm_dirty_gfn {
        // SAFETY: the index is reduced modulo the ring length, and the
        // mapping lives as long as self.
        unsafe { &*self.entries.add(i as usize % self.len) }
    }

    /// Atomic view of entry `i`'s flags, the word shared with the kernel.
    pub fn flags(&self, i: u32) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: `flags` is the first, 4-byte aligned field of the entry;
        // the kernel and we only ever access it atomically.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(std::ptr::addr_of!(self.entry(i).flags) as *mut u32) }
    }
}

impl Drop for RingMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region mapped in `new`.
        unsafe { libc::munmap(self.entries.cast(), self.len * std::mem::size_of::<kvm_dirty_gfn>()) };
    }
}
