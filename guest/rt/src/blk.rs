//! A disk on the VMM's virtio-blk device: synchronous sector reads and
//! writes, flush, and the device id.
//!
//! One request is in flight at a time and the caller sleeps in WAIT until the
//! device completes it (there are no interrupts; the VMM bumps the event
//! sequence number when it places a used buffer). Device errors, IOERR from a
//! full host disk included, come back as [`Error`] values.
//!
//! The requests are built here on `virtio-drivers`' virtqueue rather than
//! with its `VirtIOBlk`, whose blocking calls spin on the used ring and
//! whose argument checks panic.

use core::fmt;

use ftvm_abi::device_kind;
use ftvm_abi::virtio::blk::{F_FLUSH, S_IOERR, S_OK, S_UNSUPP, T_FLUSH, T_GET_ID, T_IN, T_OUT};
use ftvm_abi::virtio::{F_RING_EVENT_IDX, F_VERSION_1};
use virtio_drivers::queue::VirtQueue;
use virtio_drivers::transport::mmio::MmioTransport;
use virtio_drivers::transport::{DeviceStatus, DeviceType, Transport};

use crate::time;
use crate::virtio::{self, Claim, OpenError};

pub use ftvm_abi::virtio::blk::{ID_LEN, SECTOR_SIZE};

/// One request at a time needs three descriptors; the VMM offers more.
const QUEUE_SIZE: usize = 16;
/// Larger transfers are split so that no single request pins an unbounded
/// amount of VMM work.
const MAX_REQUEST_BYTES: usize = 256 * 1024;
/// A lost wakeup costs at most this much latency.
const POLL_NS: u64 = 10 * time::NS_PER_MS;

#[derive(Debug)]
pub enum Error {
    /// No usable block device.
    Open(OpenError),
    /// The device failed the request (VIRTIO_BLK_S_IOERR), e.g. the host
    /// disk is full.
    Io,
    /// The device does not support the request (VIRTIO_BLK_S_UNSUPP).
    Unsupported,
    /// A status byte virtio-blk does not define.
    BadStatus(u8),
    /// The buffer is not a multiple of [`SECTOR_SIZE`].
    BadLength(usize),
    /// The request reaches past the end of the disk.
    OutOfRange { sector: u64, sectors: u64 },
    /// The virtqueue misbehaved (the device used an unexpected buffer).
    Queue(virtio_drivers::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Error::Open(e) => write!(f, "block device: {e}"),
            Error::Io => f.write_str("I/O error"),
            Error::Unsupported => f.write_str("request not supported by the device"),
            Error::BadStatus(s) => write!(f, "bad request status {s}"),
            Error::BadLength(n) => write!(f, "length {n} is not a multiple of {SECTOR_SIZE}"),
            Error::OutOfRange { sector, sectors } => {
                write!(f, "sectors {sector}+{sectors} beyond the end of the disk")
            }
            Error::Queue(e) => write!(f, "virtqueue: {e}"),
        }
    }
}

impl From<OpenError> for Error {
    fn from(e: OpenError) -> Self {
        Error::Open(e)
    }
}

/// The data part of a request.
enum Data<'a> {
    None,
    In(&'a mut [u8]),
    Out(&'a [u8]),
}

pub struct Disk {
    // Field order is drop order: the transport resets the device before the
    // queue memory it points at is freed, and before the claim is released.
    transport: MmioTransport<'static>,
    queue: VirtQueue<virtio::Hal, QUEUE_SIZE>,
    _claim: Claim,
    capacity: u64,
    can_flush: bool,
}

impl Disk {
    /// Open the first block device of the VM.
    pub fn open() -> Result<Disk, Error> {
        let (mut t, claim) = virtio::open(device_kind::VIRTIO_MMIO_BLOCK, DeviceType::Block)?;
        // virtio 1.x 3.1.1; done by hand because virtio-drivers' begin_init
        // cannot express FLUSH and does not check FEATURES_OK.
        t.set_status(DeviceStatus::empty());
        t.set_status(DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER);
        let offered = t.read_device_features();
        if offered & F_VERSION_1 == 0 {
            return Err(OpenError::Unexpected("device does not offer VERSION_1").into());
        }
        let features = offered & (F_VERSION_1 | F_FLUSH | F_RING_EVENT_IDX);
        t.write_driver_features(features);
        let ok = DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER | DeviceStatus::FEATURES_OK;
        t.set_status(ok);
        if !t.get_status().contains(DeviceStatus::FEATURES_OK) {
            t.set_status(ok | DeviceStatus::FAILED);
            return Err(OpenError::Unexpected("device rejected the features").into());
        }
        // Config space: le64 capacity at 0, read as two 32-bit halves as
        // virtio-mmio requires for 64-bit fields.
        let capacity = t.read_consistent(|| {
            let lo: u32 = t.read_config_space(0)?;
            let hi: u32 = t.read_config_space(4)?;
            Ok(u64::from(hi) << 32 | u64::from(lo))
        });
        let capacity = capacity.map_err(OpenError::Init)?;
        let queue = VirtQueue::new(&mut t, 0, false, features & F_RING_EVENT_IDX != 0).map_err(OpenError::Init)?;
        t.finish_init();
        Ok(Disk { transport: t, queue, _claim: claim, capacity, can_flush: features & F_FLUSH != 0 })
    }

    /// Size of the disk in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity
    }

    /// Read `buf.len()` bytes (a multiple of 512) starting at `sector`.
    pub fn read(&mut self, sector: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.check(sector, buf.len())?;
        for (i, chunk) in buf.chunks_mut(MAX_REQUEST_BYTES).enumerate() {
            let at = sector + (i * MAX_REQUEST_BYTES / SECTOR_SIZE) as u64;
            self.request(T_IN, at, Data::In(chunk))?;
        }
        Ok(())
    }

    /// Write `buf` (a multiple of 512 bytes) starting at `sector`. Returns
    /// once the device has completed the write; durability across a host
    /// crash needs [`Disk::flush`].
    pub fn write(&mut self, sector: u64, buf: &[u8]) -> Result<(), Error> {
        self.check(sector, buf.len())?;
        for (i, chunk) in buf.chunks(MAX_REQUEST_BYTES).enumerate() {
            let at = sector + (i * MAX_REQUEST_BYTES / SECTOR_SIZE) as u64;
            self.request(T_OUT, at, Data::Out(chunk))?;
        }
        Ok(())
    }

    /// Make completed writes durable. Without the FLUSH feature the device
    /// writes through and there is nothing to do.
    pub fn flush(&mut self) -> Result<(), Error> {
        if !self.can_flush {
            return Ok(());
        }
        self.request(T_FLUSH, 0, Data::None)
    }

    /// The device's id string (ASCII, NUL-padded).
    pub fn id(&mut self) -> Result<[u8; ID_LEN], Error> {
        let mut id = [0u8; ID_LEN];
        self.request(T_GET_ID, 0, Data::In(&mut id))?;
        Ok(id)
    }

    fn check(&self, sector: u64, len: usize) -> Result<(), Error> {
        if !len.is_multiple_of(SECTOR_SIZE) {
            return Err(Error::BadLength(len));
        }
        let sectors = (len / SECTOR_SIZE) as u64;
        match sector.checked_add(sectors) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(Error::OutOfRange { sector, sectors }),
        }
    }

    fn request(&mut self, kind: u32, sector: u64, data: Data<'_>) -> Result<(), Error> {
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&kind.to_le_bytes());
        header[8..].copy_from_slice(&sector.to_le_bytes());
        // Not a defined status: a device that completes the request without
        // writing one is reported, not taken for success.
        let mut status = [0xffu8];
        match data {
            // virtqueues reject empty buffers; there is nothing to transfer.
            Data::In([]) | Data::Out([]) => return Ok(()),
            Data::None => self.submit(&[&header], &mut [&mut status])?,
            Data::In(buf) => self.submit(&[&header], &mut [buf, &mut status])?,
            Data::Out(buf) => self.submit(&[&header, buf], &mut [&mut status])?,
        }
        match status[0] {
            S_OK => Ok(()),
            S_IOERR => Err(Error::Io),
            S_UNSUPP => Err(Error::Unsupported),
            s => Err(Error::BadStatus(s)),
        }
    }

    /// Queue one descriptor chain, notify, and sleep until the device has
    /// used it.
    fn submit<'a>(&mut self, inputs: &'a [&'a [u8]], outputs: &'a mut [&'a mut [u8]]) -> Result<(), Error> {
        // SAFETY: the buffers stay borrowed (and untouched) until pop_used
        // below hands them back: this function does not return in between.
        let token = unsafe { self.queue.add(inputs, &mut *outputs) }.map_err(Error::Queue)?;
        if self.queue.should_notify() {
            self.transport.notify(0);
        }
        // Checked before each WAIT, which returns at once if the device
        // placed the buffer since the previous WAIT.
        while !self.queue.can_pop() {
            time::wait(time::now_ns().saturating_add(POLL_NS));
        }
        // SAFETY: the same buffers as passed to add for this token.
        unsafe { self.queue.pop_used(token, inputs, outputs) }.map_err(Error::Queue)?;
        Ok(())
    }
}
