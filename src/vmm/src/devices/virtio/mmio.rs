//! The virtio-mmio (version 2) register block in front of a device model.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED};
use virtio_bindings::virtio_mmio as reg;
use virtio_queue::{Queue, QueueT};

use super::{SavedQueue, VirtioDevice, VirtioError, QUEUE_SIZE, TRANSPORT_FEATURES};
use crate::devices::{DeviceError, DeviceKind, DeviceState};
use crate::memory::GuestMemory;
use crate::persist::Persist;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR: u32 = 0x4654_564d; // "FTVM"
const EVENT_IDX: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

// Register offsets, as u64 for matching MMIO offsets.
const REG_MAGIC: u64 = reg::VIRTIO_MMIO_MAGIC_VALUE as u64;
const REG_VERSION: u64 = reg::VIRTIO_MMIO_VERSION as u64;
const REG_DEVICE_ID: u64 = reg::VIRTIO_MMIO_DEVICE_ID as u64;
const REG_VENDOR_ID: u64 = reg::VIRTIO_MMIO_VENDOR_ID as u64;
const REG_DEVICE_FEATURES: u64 = reg::VIRTIO_MMIO_DEVICE_FEATURES as u64;
const REG_DEVICE_FEATURES_SEL: u64 = reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL as u64;
const REG_DRIVER_FEATURES: u64 = reg::VIRTIO_MMIO_DRIVER_FEATURES as u64;
const REG_DRIVER_FEATURES_SEL: u64 = reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL as u64;
const REG_QUEUE_SEL: u64 = reg::VIRTIO_MMIO_QUEUE_SEL as u64;
const REG_QUEUE_NUM_MAX: u64 = reg::VIRTIO_MMIO_QUEUE_NUM_MAX as u64;
const REG_QUEUE_NUM: u64 = reg::VIRTIO_MMIO_QUEUE_NUM as u64;
const REG_QUEUE_READY: u64 = reg::VIRTIO_MMIO_QUEUE_READY as u64;
pub const REG_QUEUE_NOTIFY: u64 = reg::VIRTIO_MMIO_QUEUE_NOTIFY as u64;
const REG_INTERRUPT_STATUS: u64 = reg::VIRTIO_MMIO_INTERRUPT_STATUS as u64;
const REG_INTERRUPT_ACK: u64 = reg::VIRTIO_MMIO_INTERRUPT_ACK as u64;
const REG_STATUS: u64 = reg::VIRTIO_MMIO_STATUS as u64;
const REG_QUEUE_DESC_LOW: u64 = reg::VIRTIO_MMIO_QUEUE_DESC_LOW as u64;
const REG_QUEUE_DESC_HIGH: u64 = reg::VIRTIO_MMIO_QUEUE_DESC_HIGH as u64;
const REG_QUEUE_DRIVER_LOW: u64 = reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW as u64;
const REG_QUEUE_DRIVER_HIGH: u64 = reg::VIRTIO_MMIO_QUEUE_AVAIL_HIGH as u64;
const REG_QUEUE_DEVICE_LOW: u64 = reg::VIRTIO_MMIO_QUEUE_USED_LOW as u64;
const REG_QUEUE_DEVICE_HIGH: u64 = reg::VIRTIO_MMIO_QUEUE_USED_HIGH as u64;
const REG_CONFIG_GENERATION: u64 = reg::VIRTIO_MMIO_CONFIG_GENERATION as u64;
const REG_CONFIG: u64 = reg::VIRTIO_MMIO_CONFIG as u64;

/// Register state of the transport, saved with the VM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub acked_features: u64,
    pub queue_sel: u32,
    pub status: u32,
    pub queues: Vec<SavedQueue>,
}

pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    queues: Vec<Queue>,
    regs: TransportState,
}

impl MmioTransport {
    pub fn new(device: Box<dyn VirtioDevice>) -> MmioTransport {
        let queues = (0..device.queue_count()).map(|_| Queue::new(QUEUE_SIZE).expect("valid queue size")).collect();
        MmioTransport { device, queues, regs: TransportState::default() }
    }

    pub fn kind(&self) -> DeviceKind {
        self.device.kind()
    }

    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    fn offered_features(&self) -> u64 {
        self.device.features() | TRANSPORT_FEATURES
    }

    /// The driver finished setting up and the device may touch the queues.
    pub fn active(&self) -> bool {
        self.regs.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 && self.regs.status & VIRTIO_CONFIG_S_FAILED == 0
    }

    pub fn drop_queued_host_input(&mut self) {
        self.device.drop_queued_host_input();
    }

    pub fn host_fd(&self) -> Option<std::os::fd::RawFd> {
        self.device.host_fd()
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.regs.queue_sel as usize)
    }

    pub fn read(&self, offset: u64, data: &mut [u8]) {
        if offset >= REG_CONFIG {
            self.device.read_config(offset - REG_CONFIG, data);
            return;
        }
        let q = self.queues.get(self.regs.queue_sel as usize);
        let value: u32 = match offset {
            REG_MAGIC => MAGIC,
            REG_VERSION => VERSION,
            REG_DEVICE_ID => self.device.kind().virtio_id(),
            REG_VENDOR_ID => VENDOR,
            REG_DEVICE_FEATURES => match self.regs.device_features_sel {
                0 => self.offered_features() as u32,
                1 => (self.offered_features() >> 32) as u32,
                _ => 0,
            },
            REG_QUEUE_NUM_MAX => q.map_or(0, |q| q.max_size() as u32),
            REG_QUEUE_READY => q.is_some_and(|q| q.ready()) as u32,
            // Polling guests: nothing is ever signalled through interrupts.
            REG_INTERRUPT_STATUS => 0,
            REG_STATUS => self.regs.status,
            REG_CONFIG_GENERATION => 0,
            _ => {
                tracing::debug!(offset, "read of unknown virtio-mmio register");
                0
            }
        };
        let bytes = value.to_le_bytes();
        let n = data.len().min(4);
        data[..n].copy_from_slice(&bytes[..n]);
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= REG_CONFIG {
            return; // no writable config fields in our devices
        }
        let mut bytes = [0u8; 4];
        let n = data.len().min(4);
        bytes[..n].copy_from_slice(&data[..n]);
        let v = u32::from_le_bytes(bytes);
        let setup = !self.active();
        match offset {
            REG_DEVICE_FEATURES_SEL => self.regs.device_features_sel = v,
            REG_DRIVER_FEATURES_SEL => self.regs.driver_features_sel = v,
            REG_DRIVER_FEATURES if setup => {
                let shift = match self.regs.driver_features_sel {
                    0 => 0,
                    1 => 32,
                    _ => return,
                };
                let mask = 0xffff_ffffu64 << shift;
                let acked = (self.regs.acked_features & !mask) | ((v as u64) << shift);
                self.regs.acked_features = acked & self.offered_features();
            }
            REG_QUEUE_SEL => self.regs.queue_sel = v,
            REG_QUEUE_NUM if setup => {
                if let Some(q) = self.selected() {
                    q.set_size(v as u16);
                }
            }
            REG_QUEUE_READY if setup => {
                let event_idx = self.regs.acked_features & EVENT_IDX != 0;
                if let Some(q) = self.selected() {
                    q.set_event_idx(event_idx);
                    q.set_ready(v == 1);
                }
            }
            REG_QUEUE_DESC_LOW | REG_QUEUE_DESC_HIGH | REG_QUEUE_DRIVER_LOW | REG_QUEUE_DRIVER_HIGH
            | REG_QUEUE_DEVICE_LOW | REG_QUEUE_DEVICE_HIGH
                if setup =>
            {
                let high = offset & 4 != 0;
                let (lo, hi) = if high { (None, Some(v)) } else { (Some(v), None) };
                if let Some(q) = self.selected() {
                    match offset & !4 {
                        REG_QUEUE_DESC_LOW => q.set_desc_table_address(lo, hi),
                        REG_QUEUE_DRIVER_LOW => q.set_avail_ring_address(lo, hi),
                        _ => q.set_used_ring_address(lo, hi),
                    }
                }
            }
            REG_INTERRUPT_ACK => {}
            REG_STATUS => self.set_status(v),
            // Without an ioeventfd (or before it is registered), kicks land
            // here; the device thread re-checks every queue when woken.
            REG_QUEUE_NOTIFY => {}
            _ => tracing::debug!(offset, value = v, "ignored virtio-mmio register write"),
        }
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        self.regs.status = v;
    }

    fn reset(&mut self) {
        for q in &mut self.queues {
            q.reset();
        }
        self.device.reset();
        self.regs = TransportState::default();
    }

    pub fn process_queue(&mut self, index: usize, mem: &GuestMemory) -> Result<bool, VirtioError> {
        if !self.active() || !self.queues.get(index).is_some_and(|q| q.ready()) {
            return Ok(false);
        }
        self.device.process_queue(index, &mut self.queues, mem)
    }

    pub fn process_host(&mut self, mem: &GuestMemory) -> Result<bool, VirtioError> {
        if !self.active() {
            return Ok(false);
        }
        self.device.process_host(&mut self.queues, mem)
    }

    /// A device error the driver must see: the device stops working.
    pub fn fail(&mut self) {
        self.regs.status |= VIRTIO_CONFIG_S_FAILED;
    }
}

impl Persist for MmioTransport {
    type State = DeviceState;
    type Error = DeviceError;

    fn save(&self) -> Result<DeviceState, DeviceError> {
        let transport = TransportState { queues: self.queues.iter().map(SavedQueue::of).collect(), ..self.regs.clone() };
        Ok(DeviceState { kind: self.kind(), transport, model: self.device.save()? })
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), DeviceError> {
        let bad = |reason: String| DeviceError::Restore { kind: state.kind, reason };
        if state.kind != self.kind() {
            return Err(bad(format!("the saved device is a {} device", state.kind)));
        }
        let saved = &state.transport;
        if saved.queues.len() != self.queues.len() {
            return Err(bad(format!("{} saved queues, the device has {}", saved.queues.len(), self.queues.len())));
        }
        self.queues = saved.queues.iter().map(|q| q.to_queue()).collect::<Result<_, _>>().map_err(|e| bad(format!("queue: {e}")))?;
        self.regs = TransportState { queues: Vec::new(), ..saved.clone() };
        self.device.restore(&state.model)
    }
}
