//! virtio 1.x devices on the virtio-mmio transport.
//!
//! Guests drive the devices in polling mode: there are no interrupts. A
//! device that places used buffers bumps the VM's event sequence number,
//! which wakes vCPUs blocked in the wait hypercall.

pub mod block;
pub mod mmio;
pub mod net;
#[cfg(test)]
mod test_util;

use std::os::fd::RawFd;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use super::{DeviceError, DeviceKind, ModelState};
use crate::memory::GuestMemory;
use crate::persist::Persist;

/// Feature bits every device offers on top of its own.
pub const TRANSPORT_FEATURES: u64 =
    1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1 | 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

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

/// What a device model provides; the transport does the rest. Its state
/// (`Persist`) is saved and restored with the transport's.
pub trait VirtioDevice: Send + Persist<State = ModelState, Error = DeviceError> {
    fn kind(&self) -> DeviceKind;
    fn queue_count(&self) -> usize;
    /// Feature bits offered (the transport adds `TRANSPORT_FEATURES`).
    fn features(&self) -> u64;
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The driver kicked queue `index` (or the device is re-checking it).
    /// Returns whether any used buffer was added.
    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, VirtioError>;
    /// A host-side descriptor the device waits on (a TAP), if any. None
    /// while its host input is off (`set_host_input`): the device thread
    /// then does not watch it.
    fn host_fd(&self) -> Option<RawFd> {
        None
    }
    /// Read host input (on, the default) or leave it unread in the host's
    /// queue (off). Turned on again, the device first drops what queued
    /// meanwhile: it arrived while nobody was to take it.
    fn set_host_input(&mut self, _on: bool) {}
    /// The host-side descriptor is ready. Returns whether used buffers were added.
    fn process_host(&mut self, _queues: &mut [Queue], _mem: &GuestMemory) -> Result<bool, VirtioError> {
        Ok(false)
    }
    /// The driver finished negotiating (DRIVER_OK), or a device was
    /// restored (`acked` 0 if its driver had not finished): the features
    /// both sides use from now on.
    fn features_acked(&mut self, _acked: u64) {}
    /// The driver reset the device.
    fn reset(&mut self) {}
    /// Work the device's thread does after each pass with the device
    /// unlocked, so a pause does not wait for it (a disk's I/O with
    /// `--disk-io async`).
    fn deferred_io(&self) -> Option<Arc<dyn DeferredIo>> {
        None
    }
    /// Restored state left requests in flight (a disk's pending list):
    /// issue them again, now that guest memory is restored too.
    fn issue_restored(&mut self, _mem: &GuestMemory) {}
    /// Drop host-side input that is queued but not delivered.
    fn drop_queued_host_input(&mut self) {}
    /// Queue `frames` as host input, delivered before anything else the
    /// host sends (devices without host input ignore them).
    fn inject_host_input(&mut self, _frames: Vec<Vec<u8>>) {}
    /// Take back injected frames not delivered yet.
    fn take_injected_host_input(&mut self) -> Vec<Vec<u8>> {
        Vec::new()
    }
    /// Whether injected frames wait for the guest's receive buffers.
    fn injected_host_input_pending(&self) -> bool {
        false
    }
}

/// Work a device leaves to its thread's time outside the device's lock.
/// It must not touch guest memory: a pause does not wait for it.
pub trait DeferredIo: Send + Sync {
    /// Do what is queued; true if anything was done (the device then has
    /// results to place in a pass).
    fn run(&self) -> bool;
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

/// What one pass over a queue did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Used buffers were added.
    pub used: bool,
    /// A hook asked the device to wait (`accepting`): requests are left in
    /// the queue until the hook wakes the device.
    pub deferred: bool,
}

/// Drain a queue the way event-index suppression requires: process with
/// notifications off, then re-enable them and go again if the driver added
/// buffers in between (otherwise its next kick would never come). A pass
/// that was deferred leaves notifications off: the hook's wake-up brings
/// the device back, and the driver's kicks meanwhile would change nothing.
pub fn drain(
    queue: &mut Queue,
    mem: &GuestMemory,
    index: usize,
    mut process: impl FnMut(&mut Queue) -> Result<Pass, VirtioError>,
) -> Result<bool, VirtioError> {
    let err = |err| VirtioError::Queue { queue: index, err };
    let mut used = false;
    loop {
        queue.disable_notification(mem).map_err(err)?;
        let pass = process(queue)?;
        used |= pass.used;
        if pass.deferred || !queue.enable_notification(mem).map_err(err)? {
            return Ok(used);
        }
    }
}

#[cfg(test)]
mod tests {
    use ftvm_abi::virtio as abi;
    use virtio_bindings::{virtio_blk as blk, virtio_config as config, virtio_net as net, virtio_ring as ring};

    /// The guest drivers use ftvm-abi's copies of the virtio constants (the
    /// bindings crate needs std); they must equal the specification's.
    #[test]
    fn guest_abi_constants_match_virtio_bindings() {
        assert_eq!(abi::F_VERSION_1, 1 << config::VIRTIO_F_VERSION_1);
        assert_eq!(abi::F_RING_EVENT_IDX, 1 << ring::VIRTIO_RING_F_EVENT_IDX);
        assert_eq!(abi::net::F_MAC, 1 << net::VIRTIO_NET_F_MAC);
        assert_eq!(abi::net::F_CSUM, 1 << net::VIRTIO_NET_F_CSUM);
        assert_eq!(abi::net::F_GUEST_CSUM, 1 << net::VIRTIO_NET_F_GUEST_CSUM);
        assert_eq!(u32::from(abi::net::HDR_F_NEEDS_CSUM), net::VIRTIO_NET_HDR_F_NEEDS_CSUM);
        assert_eq!(u32::from(abi::net::HDR_F_DATA_VALID), net::VIRTIO_NET_HDR_F_DATA_VALID);
        assert_eq!(abi::net::HDR_LEN, std::mem::size_of::<net::virtio_net_hdr_v1>());
        assert_eq!(abi::net::HDR_LEN, super::net::VNET_HDR_LEN);
        assert_eq!(abi::blk::F_FLUSH, 1 << blk::VIRTIO_BLK_F_FLUSH);
        assert_eq!(abi::blk::ID_LEN, blk::VIRTIO_BLK_ID_BYTES as usize);
        assert_eq!(
            [abi::blk::T_IN, abi::blk::T_OUT, abi::blk::T_FLUSH, abi::blk::T_GET_ID],
            [blk::VIRTIO_BLK_T_IN, blk::VIRTIO_BLK_T_OUT, blk::VIRTIO_BLK_T_FLUSH, blk::VIRTIO_BLK_T_GET_ID]
        );
        assert_eq!(
            [abi::blk::S_OK, abi::blk::S_IOERR, abi::blk::S_UNSUPP].map(u32::from),
            [blk::VIRTIO_BLK_S_OK, blk::VIRTIO_BLK_S_IOERR, blk::VIRTIO_BLK_S_UNSUPP]
        );
    }
}
