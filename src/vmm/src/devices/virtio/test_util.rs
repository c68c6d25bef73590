//! Helpers for the virtio device tests: guest RAM, disk images in temporary
//! files, and a driver that sets up a transport and offers requests the way
//! a guest would, with virtio-queue's `MockSplitQueue` writing the
//! descriptor table and the available ring.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_bindings::virtio_mmio as reg;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress};

use super::block::{Block, DiskIo};
use super::mmio::{MmioTransport, UsedNotify};
use crate::hooks::Hooks;
use crate::memory::{GuestMemory, GuestRam};

/// Guest RAM of the tests: rings in the first pages, buffers above.
const RAM_SIZE: u64 = 1 << 20;
/// Entries of the one queue the driver sets up (QueueNum).
pub const QUEUE_LEN: u16 = 16;
/// Descriptor table and available ring, laid out by the mock.
const RINGS: GuestAddress = GuestAddress(0x1000);
/// The used ring, on a page of its own: the mock's own used ring starts
/// `QUEUE_LEN` bytes after the available ring's entries begin, inside the
/// `2 * QUEUE_LEN + 2` bytes those take, so a device writing it would
/// overwrite available entries from the ninth on (rust-vmm/vm-virtio#400).
const USED_RING: GuestAddress = GuestAddress(0x3000);
/// Where the driver's data buffers start.
const BUFFERS: u64 = 0x10000;

pub fn guest_ram() -> GuestRam {
    GuestRam::new(RAM_SIZE, false).expect("guest RAM")
}

/// A 32-bit register read, as a guest's `mov` does it. The buffer starts
/// out all ones so that bytes the transport leaves alone show.
pub fn read_reg(transport: &MmioTransport, offset: impl Into<u64>) -> u32 {
    let mut value = [0xffu8; 4];
    transport.read(offset.into(), &mut value);
    u32::from_le_bytes(value)
}

pub fn write_reg(transport: &mut MmioTransport, offset: impl Into<u64>, value: u32) {
    transport.write(offset.into(), &value.to_le_bytes());
}

/// A raw disk image in a temporary file, removed when dropped.
pub struct TempDisk {
    path: PathBuf,
}

impl TempDisk {
    pub fn with_contents(contents: &[u8]) -> TempDisk {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!("ftvm-virtio-test-{}-{}.img", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let path = std::env::temp_dir().join(name);
        fs::write(&path, contents).expect("write temporary disk image");
        TempDisk { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn contents(&self) -> Vec<u8> {
        fs::read(&self.path).expect("read temporary disk image")
    }

    /// A virtio-blk transport over this image, its I/O on the caller's thread.
    pub fn transport(&self, hooks: Arc<Hooks>) -> MmioTransport {
        self.transport_with(DiskIo::Sync, hooks)
    }

    /// A virtio-blk transport over this image with its I/O run as `io` says.
    pub fn transport_with(&self, io: DiskIo, hooks: Arc<Hooks>) -> MmioTransport {
        self.transport_notifying(io, hooks, UsedNotify::default())
    }

    pub fn transport_notifying(&self, io: DiskIo, hooks: Arc<Hooks>, used_notify: UsedNotify) -> MmioTransport {
        MmioTransport::new(Box::new(Block::open(&self.path, io, hooks).expect("open temporary disk image")), used_notify)
    }
}

impl Drop for TempDisk {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Bytes that do not repeat every sector (or any power of two), so a
/// misplaced copy shows; `seed` makes patterns that differ from each other.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(0x9e37_79b9) >> 24) as u8 ^ seed).collect()
}

/// A guest buffer that one descriptor points at.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    device_writes: bool,
}

/// The guest side of queue 0 of one device.
pub struct Driver<'m> {
    mem: &'m GuestMemory,
    rings: MockSplitQueue<'m, GuestMemory>,
    next_desc: u16,
    next_buf: u64,
}

impl<'m> Driver<'m> {
    pub fn new(mem: &'m GuestMemory) -> Driver<'m> {
        Driver { mem, rings: MockSplitQueue::create(mem, RINGS, QUEUE_LEN), next_desc: 0, next_buf: BUFFERS }
    }

    /// Acknowledge the device and accept every feature it offers.
    pub fn negotiate(&self, transport: &mut MmioTransport) {
        write_reg(transport, reg::VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER);
        for half in 0..2 {
            write_reg(transport, reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, half);
            let offered = read_reg(transport, reg::VIRTIO_MMIO_DEVICE_FEATURES);
            write_reg(transport, reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, half);
            write_reg(transport, reg::VIRTIO_MMIO_DRIVER_FEATURES, offered);
        }
        write_reg(transport, reg::VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK);
    }

    /// Point queue 0 at this driver's rings and mark it ready.
    pub fn set_up_queue(&self, transport: &mut MmioTransport) {
        let split = |addr: GuestAddress| (addr.0 as u32, (addr.0 >> 32) as u32);
        write_reg(transport, reg::VIRTIO_MMIO_QUEUE_SEL, 0);
        write_reg(transport, reg::VIRTIO_MMIO_QUEUE_NUM, u32::from(QUEUE_LEN));
        for (addr, low, high) in [
            (self.rings.desc_table_addr(), reg::VIRTIO_MMIO_QUEUE_DESC_LOW, reg::VIRTIO_MMIO_QUEUE_DESC_HIGH),
            (self.rings.avail_addr(), reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW, reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH),
            (USED_RING, reg::VIRTIO_MMIO_QUEUE_USED_LOW, reg::VIRTIO_MMIO_QUEUE_USED_HIGH),
        ] {
            let (lo, hi) = split(addr);
            write_reg(transport, low, lo);
            write_reg(transport, high, hi);
        }
        write_reg(transport, reg::VIRTIO_MMIO_QUEUE_READY, 1);
    }

    /// The whole initialisation sequence, ending in DRIVER_OK.
    pub fn start(&self, transport: &mut MmioTransport) {
        self.negotiate(transport);
        self.set_up_queue(transport);
        let status = read_reg(transport, reg::VIRTIO_MMIO_STATUS);
        write_reg(transport, reg::VIRTIO_MMIO_STATUS, status | VIRTIO_CONFIG_S_DRIVER_OK);
    }

    fn alloc(&mut self, len: u32) -> u64 {
        let addr = self.next_buf;
        // Keep buffers apart so an overrun lands in no other buffer.
        self.next_buf = (addr + u64::from(len) + 64).next_multiple_of(64);
        assert!(self.next_buf <= RAM_SIZE, "test buffers exceed guest RAM");
        addr
    }

    /// A buffer the device reads, holding `bytes`.
    pub fn readable(&mut self, bytes: &[u8]) -> Buf {
        let addr = self.alloc(bytes.len() as u32);
        self.mem.write_slice(bytes, GuestAddress(addr)).expect("buffer in guest RAM");
        Buf { addr, len: bytes.len() as u32, device_writes: false }
    }

    /// A buffer the device writes, filled with `fill` so untouched bytes show.
    pub fn writable(&mut self, len: u32, fill: u8) -> Buf {
        let addr = self.alloc(len);
        self.mem.write_slice(&vec![fill; len as usize], GuestAddress(addr)).expect("buffer in guest RAM");
        Buf { addr, len, device_writes: true }
    }

    /// Offer `bufs` as one descriptor chain; returns its head index.
    pub fn offer(&mut self, bufs: &[Buf]) -> u16 {
        let head = self.next_desc;
        assert!(usize::from(head) + bufs.len() <= usize::from(QUEUE_LEN), "test chains exceed the descriptor table");
        let descs: Vec<RawDescriptor> = bufs
            .iter()
            .enumerate()
            .map(|(i, buf)| {
                let index = head + i as u16;
                let last = i + 1 == bufs.len();
                let flags = if buf.device_writes { VRING_DESC_F_WRITE as u16 } else { 0 } | if last { 0 } else { VRING_DESC_F_NEXT as u16 };
                RawDescriptor::from(Descriptor::new(buf.addr, buf.len, flags, if last { 0 } else { index + 1 }))
            })
            .collect();
        self.rings.add_desc_chains(&descs, head).expect("descriptors in guest RAM");
        self.next_desc += bufs.len() as u16;
        head
    }

    /// The bytes a buffer holds now.
    pub fn bytes(&self, buf: Buf) -> Vec<u8> {
        let mut bytes = vec![0u8; buf.len as usize];
        self.mem.read_slice(&mut bytes, GuestAddress(buf.addr)).expect("buffer in guest RAM");
        bytes
    }

    /// Set the bytes of `buf` to `byte`.
    pub fn fill(&self, buf: Buf, byte: u8) {
        self.mem.write_slice(&vec![byte; buf.len as usize], GuestAddress(buf.addr)).expect("buffer in guest RAM");
    }

    /// Forget the used ring's entries (its index back to 0).
    pub fn clear_used(&self) {
        self.mem.write_obj(0u16, USED_RING.unchecked_add(2)).expect("used ring in guest RAM");
    }

    /// The used ring's entries so far: (chain head, bytes written).
    /// Ask to hear of the used buffer at index `idx` (`used_event`, after
    /// the available ring's entries).
    pub fn ask_for_used(&self, idx: u16) {
        let at = self.rings.avail_addr().unchecked_add(4 + 2 * u64::from(QUEUE_LEN));
        self.mem.write_obj(idx, at).expect("available ring in guest RAM");
    }

    pub fn used(&self) -> Vec<(u32, u32)> {
        let read_u32 = |offset: u64| self.mem.read_obj::<u32>(USED_RING.unchecked_add(offset)).expect("used ring in guest RAM");
        let idx = self.mem.read_obj::<u16>(USED_RING.unchecked_add(2)).expect("used ring in guest RAM");
        (0..u64::from(idx)).map(|i| (read_u32(4 + 8 * i), read_u32(8 + 8 * i))).collect()
    }
}

/// The 16-byte virtio-blk request header.
pub fn block_header(kind: u32, sector: u64) -> Vec<u8> {
    let mut header = Vec::with_capacity(16);
    header.extend_from_slice(&kind.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes()); // reserved
    header.extend_from_slice(&sector.to_le_bytes());
    header
}

/// A request the driver offered.
#[derive(Clone, Copy, Debug)]
pub struct Offered {
    /// The chain's head descriptor, which its used entry names.
    pub head: u16,
    /// The status byte's buffer.
    pub status: Buf,
}

/// Offer a virtio-blk request: header, `data`, then a status byte (filled
/// with `NO_STATUS`, a value no status has).
pub fn offer_block_request(driver: &mut Driver, kind: u32, sector: u64, data: &[Buf]) -> Offered {
    let header = driver.readable(&block_header(kind, sector));
    let status = driver.writable(1, NO_STATUS);
    let chain: Vec<Buf> = std::iter::once(header).chain(data.iter().copied()).chain([status]).collect();
    Offered { head: driver.offer(&chain), status }
}

/// What a status byte holds until the device writes it.
pub const NO_STATUS: u8 = 0xee;
