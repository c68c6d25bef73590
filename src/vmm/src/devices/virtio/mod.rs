//! virtio 1.x devices on the virtio-mmio transport.
//!
//! Guests drive the devices in polling mode: there are no interrupts. A
//! device that places used buffers bumps the VM's event sequence number,
//! which wakes vCPUs blocked in the wait hypercall.

pub mod block;
pub mod block_journal;
pub mod mmio;
pub mod net;

use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use crate::memory::GuestMemory;

pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
pub const VIRTIO_F_RING_EVENT_IDX: u64 = 1 << 29;

pub const TYPE_NET: u32 = 1;
pub const TYPE_BLOCK: u32 = 2;

/// Largest queue any device offers.
pub const QUEUE_SIZE: u16 = 256;

#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    #[error("virtqueue {queue}: {err}")]
    Queue { queue: usize, err: virtio_queue::Error },
    #[error("descriptor chain: {0}")]
    Chain(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What a device model provides; the transport does the rest.
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
    fn queue_count(&self) -> usize;
    /// Feature bits offered (the transport adds VERSION_1 and EVENT_IDX).
    fn features(&self) -> u64;
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The driver kicked queue `index` (or the device is re-checking it).
    /// Returns whether any used buffer was added.
    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, VirtioError>;
    /// A host-side descriptor the device waits on (a TAP), if any.
    fn host_fd(&self) -> Option<RawFd> {
        None
    }
    /// The host-side descriptor is ready. Returns whether used buffers were added.
    fn process_host(&mut self, _queues: &mut [Queue], _mem: &GuestMemory) -> Result<bool, VirtioError> {
        Ok(false)
    }
    /// The driver reset the device.
    fn reset(&mut self) {}
    /// Drop host-side input queued while the VM was not running (a backup
    /// keeps only what arrived since the last checkpoint it applied).
    fn discard_host_input(&mut self) {}
}

/// Copy the part of a device's config space at `offset` into `data`;
/// bytes beyond the fields the device has read as zero.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = config.get(offset as usize + i).copied().unwrap_or(0);
    }
}

/// A virtqueue's state as saved in snapshots and checkpoints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedQueue {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl SavedQueue {
    pub fn of(q: &Queue) -> SavedQueue {
        SavedQueue {
            max_size: q.max_size(),
            size: q.size(),
            ready: q.ready(),
            next_avail: q.next_avail(),
            next_used: q.next_used(),
            event_idx: q.event_idx_enabled(),
            desc_table: q.desc_table(),
            avail_ring: q.avail_ring(),
            used_ring: q.used_ring(),
        }
    }

    pub fn to_queue(self) -> Result<Queue, virtio_queue::Error> {
        Queue::try_from(QueueState {
            max_size: self.max_size,
            next_avail: self.next_avail,
            next_used: self.next_used,
            event_idx_enabled: self.event_idx,
            size: self.size,
            ready: self.ready,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        })
    }
}

/// Drain a queue the way event-index suppression requires: process with
/// notifications off, then re-enable them and go again if the driver added
/// buffers in between (otherwise its next kick would never come).
pub fn drain(
    queue: &mut Queue,
    mem: &GuestMemory,
    index: usize,
    mut process: impl FnMut(&mut Queue) -> Result<bool, VirtioError>,
) -> Result<bool, VirtioError> {
    let err = |err| VirtioError::Queue { queue: index, err };
    let mut used = false;
    loop {
        queue.disable_notification(mem).map_err(err)?;
        used |= process(queue)?;
        if !queue.enable_notification(mem).map_err(err)? {
            return Ok(used);
        }
    }
}
