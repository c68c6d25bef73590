//! Glue between `virtio-drivers` and this runtime: the DMA [`Hal`] for
//! identity-mapped guest RAM, and opening the VMM's virtio-mmio devices.
//!
//! Guest-physical equals guest-virtual and there is no IOMMU, so DMA memory
//! is ordinary heap memory and sharing a buffer with a device is free.

use core::alloc::Layout;
use core::fmt;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, Ordering};

use alloc::alloc::{alloc_zeroed, dealloc};
use ftvm_abi::Device;
use virtio_drivers::transport::mmio::{MmioError, MmioTransport, MmioVersion, VirtIOHeader};
use virtio_drivers::transport::{DeviceType, Transport};
use virtio_drivers::{BufferDirection, PhysAddr, PAGE_SIZE};

/// The [`virtio_drivers::Hal`] of ftvm guests.
pub struct Hal;

fn dma_layout(pages: usize) -> Option<Layout> {
    let size = pages.checked_mul(PAGE_SIZE)?;
    if size == 0 {
        return None;
    }
    Layout::from_size_align(size, PAGE_SIZE).ok()
}

// SAFETY: dma_alloc returns zeroed, page-aligned memory of `pages` pages
// owned by nobody else until dma_dealloc; its physical address is its
// virtual address (identity map, no IOMMU), and so is every shared buffer's.
unsafe impl virtio_drivers::Hal for Hal {
    fn dma_alloc(pages: usize, _direction: BufferDirection) -> (PhysAddr, NonNull<u8>) {
        let Some(layout) = dma_layout(pages) else {
            return (0, NonNull::dangling());
        };
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        match NonNull::new(ptr) {
            Some(p) => (p.as_ptr() as PhysAddr, p),
            // Dma::new turns a zero address into Error::DmaError.
            None => (0, NonNull::dangling()),
        }
    }

    unsafe fn dma_dealloc(_paddr: PhysAddr, vaddr: NonNull<u8>, pages: usize) -> i32 {
        let Some(layout) = dma_layout(pages) else {
            return -1;
        };
        // SAFETY: the caller passes back what dma_alloc returned for `pages`,
        // which came from the global allocator with this very layout.
        unsafe { dealloc(vaddr.as_ptr(), layout) };
        0
    }

    unsafe fn mmio_phys_to_virt(paddr: PhysAddr, _size: usize) -> NonNull<u8> {
        NonNull::new(paddr as *mut u8).expect("virtio MMIO at address 0")
    }

    unsafe fn share(buffer: NonNull<[u8]>, _direction: BufferDirection) -> PhysAddr {
        buffer.cast::<u8>().as_ptr() as PhysAddr
    }

    unsafe fn unshare(_paddr: PhysAddr, _buffer: NonNull<[u8]>, _direction: BufferDirection) {}
}

/// Why a device could not be opened.
#[derive(Debug)]
pub enum OpenError {
    /// The boot info lists no (unclaimed) device of this kind.
    NoDevice,
    /// The register block is not a virtio-mmio device.
    Transport(MmioError),
    /// It is virtio-mmio, but not version 2 or not the expected device type.
    Unexpected(&'static str),
    /// The driver could not set the device up (features, queues, config).
    Init(virtio_drivers::Error),
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            OpenError::NoDevice => f.write_str("no such device"),
            OpenError::Transport(e) => write!(f, "virtio-mmio: {e}"),
            OpenError::Unexpected(what) => write!(f, "virtio-mmio: {what}"),
            OpenError::Init(e) => write!(f, "device setup: {e}"),
        }
    }
}

impl From<virtio_drivers::Error> for OpenError {
    fn from(e: virtio_drivers::Error) -> Self {
        OpenError::Init(e)
    }
}

/// Devices (by index in the boot info list) that a driver owns: two drivers
/// on one register block would fight over its queues.
static CLAIMED: AtomicU64 = AtomicU64::new(0);

/// Ownership of one device; dropping it lets the device be opened again.
/// Keep it after the transport in a driver struct so the device is reset
/// (transport drop) before someone else can claim it.
#[derive(Debug)]
pub(crate) struct Claim(u64);

impl Drop for Claim {
    fn drop(&mut self) {
        CLAIMED.fetch_and(!self.0, Ordering::AcqRel);
    }
}

/// Open the first unclaimed device of boot-info `kind` (an
/// [`ftvm_abi::device_kind`]) as a modern virtio-mmio transport of `ty`.
pub(crate) fn open(kind: u32, ty: DeviceType) -> Result<(MmioTransport<'static>, Claim), OpenError> {
    let mut result = Err(OpenError::NoDevice);
    for (i, dev) in crate::devices().iter().enumerate().take(64) {
        let bit = 1u64 << i;
        if dev.kind != kind || CLAIMED.fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            continue;
        }
        let claim = Claim(bit);
        result = transport(dev, ty).map(|t| (t, claim));
        if result.is_ok() {
            break;
        }
    }
    result
}

fn transport(dev: &Device, ty: DeviceType) -> Result<MmioTransport<'static>, OpenError> {
    let header = NonNull::new(dev.mmio_base as *mut VirtIOHeader).ok_or(OpenError::Unexpected("device at address 0"))?;
    if !dev.mmio_base.is_multiple_of(PAGE_SIZE as u64) {
        return Err(OpenError::Unexpected("register block not page-aligned"));
    }
    // SAFETY: the VMM maps `mmio_size` bytes of device registers at
    // `mmio_base` (identity, user-accessible) for the VM's lifetime, and the
    // claim taken by the caller makes this the only transport on them.
    let t = unsafe { MmioTransport::new(header, dev.mmio_size as usize) }.map_err(OpenError::Transport)?;
    if t.version() != MmioVersion::Modern {
        return Err(OpenError::Unexpected("legacy (version 1) transport"));
    }
    if t.device_type() != ty {
        return Err(OpenError::Unexpected("wrong device type"));
    }
    Ok(t)
}
