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

crate::switch! {
    /// When the buffers a device returns wake the guest (`--used-notify`).
    pub enum UsedNotify {
        /// As its driver asks through the event index (`used_event`,
        /// VIRTIO_RING_F_EVENT_IDX; every time without it): a driver that
        /// takes a queue's used buffers back when it next looks anyway (the
        /// frames it sent) is not woken for them, one wake-up and VM entry
        /// per reply fewer.
        Asked = "asked",
        /// Whenever a pass returned a buffer on any queue.
        Always = "always",
    }
}

pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    queues: Vec<Queue>,
    regs: TransportState,
    used_notify: UsedNotify,
}

impl MmioTransport {
    pub fn new(device: Box<dyn VirtioDevice>, used_notify: UsedNotify) -> MmioTransport {
        let queues = (0..device.queue_count()).map(|_| Queue::new(QUEUE_SIZE).expect("valid queue size")).collect();
        MmioTransport { device, queues, regs: TransportState::default(), used_notify }
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

    pub fn inject_host_input(&mut self, frames: Vec<Vec<u8>>) {
        self.device.inject_host_input(frames);
    }

    pub fn take_injected_host_input(&mut self) -> Vec<Vec<u8>> {
        self.device.take_injected_host_input()
    }

    pub fn injected_host_input_pending(&self) -> bool {
        self.device.injected_host_input_pending()
    }

    pub fn host_fd(&self) -> Option<std::os::fd::RawFd> {
        self.device.host_fd()
    }

    pub fn set_host_input(&mut self, on: bool) {
        self.device.set_host_input(on);
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
            REG_QUEUE_DESC_LOW
            | REG_QUEUE_DESC_HIGH
            | REG_QUEUE_DRIVER_LOW
            | REG_QUEUE_DRIVER_HIGH
            | REG_QUEUE_DEVICE_LOW
            | REG_QUEUE_DEVICE_HIGH
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
        let was_active = self.active();
        self.regs.status = v;
        if !was_active && self.active() {
            self.device.features_acked(self.regs.acked_features);
        }
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
        let used = self.device.process_queue(index, &mut self.queues, mem)?;
        self.wake_wanted(used, mem)
    }

    /// Serve the device's host side (frames from its TAP). Like
    /// `process_queue`: whether the guest is to be woken.
    pub fn process_host(&mut self, mem: &GuestMemory) -> Result<bool, VirtioError> {
        if !self.active() {
            return Ok(false);
        }
        let used = self.device.process_host(&mut self.queues, mem)?;
        self.wake_wanted(used, mem)
    }

    /// Whether buffers just returned (`used`) are to wake the guest: with
    /// `UsedNotify::Asked`, whether its driver asked to hear of any of them
    /// on some queue. Asks every ready queue, so that each one's count of
    /// buffers returned since it was last asked starts again.
    fn wake_wanted(&mut self, used: bool, mem: &GuestMemory) -> Result<bool, VirtioError> {
        if !used || self.used_notify == UsedNotify::Always {
            return Ok(used);
        }
        let mut wanted = false;
        for (queue, q) in self.queues.iter_mut().enumerate().filter(|(_, q)| q.ready()) {
            wanted |= q.needs_notification(mem).map_err(|err| VirtioError::Queue { queue, err })?;
        }
        Ok(wanted)
    }

    pub fn deferred_io(&self) -> Option<std::sync::Arc<dyn super::DeferredIo>> {
        self.device.deferred_io()
    }

    /// Issue the requests a restored device had in flight (see
    /// `VirtioDevice::issue_restored`).
    pub fn issue_restored(&mut self, mem: &GuestMemory) {
        if self.active() {
            self.device.issue_restored(mem);
        }
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
        let bad = |reason: String| DeviceError::Restore { kind: self.kind(), reason };
        if state.kind != self.kind() {
            return Err(bad(format!("the saved device is a {} device", state.kind)));
        }
        let saved = &state.transport;
        if saved.queues.len() != self.queues.len() {
            return Err(bad(format!("{} saved queues, the device has {}", saved.queues.len(), self.queues.len())));
        }
        self.queues = saved.queues.iter().map(|q| q.to_queue()).collect::<Result<_, _>>().map_err(|e| bad(format!("queue: {e}")))?;
        self.regs = TransportState { queues: Vec::new(), ..saved.clone() };
        self.device.restore(&state.model)?;
        // The host side follows what the restored driver negotiated (none
        // yet if it had not finished).
        self.device.features_acked(if self.active() { self.regs.acked_features } else { 0 });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use virtio_bindings::virtio_blk as blk;
    use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_F_VERSION_1};

    use super::*;
    use crate::devices::virtio::block::DiskIo;
    use crate::devices::virtio::test_util::{guest_ram, offer_block_request, pattern, read_reg, write_reg, Driver, TempDisk, NO_STATUS};
    use crate::hooks::Hooks;
    use crate::memory::GuestRam;

    const DISK_SECTORS: u64 = 8;
    // What a virtio-blk transport offers: the disk's flush, and the
    // transport's event index (EVENT_IDX above) and version 1.
    const FLUSH: u64 = 1 << blk::VIRTIO_BLK_F_FLUSH;
    const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
    const S_OK: u8 = blk::VIRTIO_BLK_S_OK as u8;

    fn disk() -> TempDisk {
        TempDisk::with_contents(&pattern(DISK_SECTORS as usize * 512, 1))
    }

    fn transport(disk: &TempDisk) -> MmioTransport {
        disk.transport(Arc::new(Hooks::default()))
    }

    /// A transport on `disk` that a driver in `ram` has negotiated and set up.
    fn started<'m>(ram: &'m GuestRam, disk: &TempDisk) -> (MmioTransport, Driver<'m>) {
        let mut transport = transport(disk);
        let driver = Driver::new(ram.memory());
        driver.start(&mut transport);
        (transport, driver)
    }

    /// A transport set up as `started`, its driver gone: for tests of the
    /// registers alone (its disk file is open; the image is removed).
    fn negotiated() -> MmioTransport {
        let ram = guest_ram();
        let disk = disk();
        started(&ram, &disk).0
    }

    fn saved_registers(transport: &MmioTransport) -> TransportState {
        transport.save().expect("save transport").transport
    }

    fn offered_half(transport: &mut MmioTransport, half: u32) -> u32 {
        write_reg(transport, REG_DEVICE_FEATURES_SEL, half);
        read_reg(transport, REG_DEVICE_FEATURES)
    }

    fn ack_half(transport: &mut MmioTransport, half: u32, bits: u32) {
        write_reg(transport, REG_DRIVER_FEATURES_SEL, half);
        write_reg(transport, REG_DRIVER_FEATURES, bits);
    }

    /// Queue 0 of a transport set up by hand: every address has a high half,
    /// so a lost half shows.
    fn set_up_queue_by_hand(transport: &mut MmioTransport) {
        write_reg(transport, REG_QUEUE_SEL, 0);
        write_reg(transport, REG_QUEUE_NUM, 64);
        for (offset, value) in [
            (REG_QUEUE_DESC_LOW, 0x1000),
            (REG_QUEUE_DESC_HIGH, 0x1),
            (REG_QUEUE_DRIVER_LOW, 0x2000),
            (REG_QUEUE_DRIVER_HIGH, 0x2),
            (REG_QUEUE_DEVICE_LOW, 0x3000),
            (REG_QUEUE_DEVICE_HIGH, 0x3),
        ] {
            write_reg(transport, offset, value);
        }
        write_reg(transport, REG_QUEUE_READY, 1);
    }

    const QUEUE_SET_UP_BY_HAND: SavedQueue = SavedQueue {
        max_size: QUEUE_SIZE,
        size: 64,
        ready: true,
        next_avail: 0,
        next_used: 0,
        event_idx: true,
        desc_table: 0x1_0000_1000,
        avail_ring: 0x2_0000_2000,
        used_ring: 0x3_0000_3000,
    };

    fn fresh_queue() -> SavedQueue {
        SavedQueue::of(&Queue::new(QUEUE_SIZE).expect("valid queue size"))
    }

    #[test]
    fn identifies_itself_as_a_version_2_block_device() {
        let disk = disk();
        let transport = transport(&disk);
        assert_eq!(read_reg(&transport, REG_MAGIC), 0x7472_6976);
        assert_eq!(read_reg(&transport, REG_VERSION), 2);
        assert_eq!(read_reg(&transport, REG_DEVICE_ID), virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK);
        assert_eq!(read_reg(&transport, REG_VENDOR_ID), 0x4654_564d);
        // Registers are little-endian: a narrow read gets the first letters.
        let mut two = [0u8; 2];
        transport.read(REG_MAGIC, &mut two);
        assert_eq!(&two, b"vi");
    }

    #[test]
    fn offers_device_and_transport_features_by_halves() {
        let disk = disk();
        let mut transport = transport(&disk);
        assert_eq!(offered_half(&mut transport, 0), (FLUSH | EVENT_IDX) as u32);
        assert_eq!(offered_half(&mut transport, 1), (VERSION_1 >> 32) as u32);
        assert_eq!(offered_half(&mut transport, 2), 0);
    }

    #[test]
    fn acks_only_offered_features_half_by_half() {
        let disk = disk();
        let mut transport = transport(&disk);
        ack_half(&mut transport, 0, u32::MAX);
        ack_half(&mut transport, 1, u32::MAX);
        assert_eq!(saved_registers(&transport).acked_features, FLUSH | EVENT_IDX | VERSION_1);
        // Each half replaces its own bits only.
        ack_half(&mut transport, 0, 0);
        assert_eq!(saved_registers(&transport).acked_features, VERSION_1);
        // There is no third half.
        ack_half(&mut transport, 2, u32::MAX);
        assert_eq!(saved_registers(&transport).acked_features, VERSION_1);
    }

    /// Once the driver is OK, what it negotiated stands: feature acks and
    /// queue setup are ignored.
    #[test]
    fn feature_acks_and_queue_setup_are_ignored_once_the_driver_is_ok() {
        let mut transport = negotiated();
        let running = saved_registers(&transport);
        assert_eq!(running.acked_features, FLUSH | EVENT_IDX | VERSION_1);
        assert!(running.queues[0].ready);
        ack_half(&mut transport, 0, 0);
        ack_half(&mut transport, 1, 0);
        write_reg(&mut transport, REG_QUEUE_SEL, 0);
        write_reg(&mut transport, REG_QUEUE_NUM, 32);
        write_reg(&mut transport, REG_QUEUE_DESC_LOW, 0x8000);
        write_reg(&mut transport, REG_QUEUE_DRIVER_HIGH, 0x8);
        write_reg(&mut transport, REG_QUEUE_DEVICE_LOW, 0x9000);
        write_reg(&mut transport, REG_QUEUE_READY, 0);
        let after = saved_registers(&transport);
        assert_eq!((after.acked_features, after.queues), (running.acked_features, running.queues));
    }

    #[test]
    fn queue_registers_set_up_the_selected_queue() {
        let disk = disk();
        let mut transport = transport(&disk);
        // The queue takes event-index suppression from the features acked
        // before it is made ready.
        ack_half(&mut transport, 0, EVENT_IDX as u32);
        write_reg(&mut transport, REG_QUEUE_SEL, 0);
        assert_eq!(read_reg(&transport, REG_QUEUE_NUM_MAX), u32::from(QUEUE_SIZE));
        assert_eq!(read_reg(&transport, REG_QUEUE_READY), 0);
        set_up_queue_by_hand(&mut transport);
        assert_eq!(read_reg(&transport, REG_QUEUE_READY), 1);
        assert_eq!(saved_registers(&transport).queues, [QUEUE_SET_UP_BY_HAND]);
        write_reg(&mut transport, REG_QUEUE_READY, 0);
        assert_eq!(read_reg(&transport, REG_QUEUE_READY), 0);
    }

    #[test]
    fn a_queue_the_device_lacks_reads_zero_and_ignores_writes() {
        let disk = disk();
        let mut transport = transport(&disk);
        write_reg(&mut transport, REG_QUEUE_SEL, 1);
        assert_eq!(read_reg(&transport, REG_QUEUE_NUM_MAX), 0);
        write_reg(&mut transport, REG_QUEUE_NUM, 64);
        write_reg(&mut transport, REG_QUEUE_DESC_LOW, 0x1000);
        write_reg(&mut transport, REG_QUEUE_READY, 1);
        assert_eq!(read_reg(&transport, REG_QUEUE_READY), 0);
        assert_eq!(saved_registers(&transport).queues, [fresh_queue()]);
    }

    #[test]
    fn status_zero_resets_registers_and_queues() {
        let ram = guest_ram();
        let disk = disk();
        let (mut transport, mut driver) = started(&ram, &disk);
        offer_block_request(&mut driver, blk::VIRTIO_BLK_T_FLUSH, 0, &[]);
        assert!(transport.process_queue(0, ram.memory()).expect("flush served"));
        let before = saved_registers(&transport);
        assert_ne!(before.queues, [fresh_queue()], "the queue was set up and used");
        assert_eq!((before.device_features_sel, before.driver_features_sel), (1, 1), "negotiation left the selectors on the high half");

        write_reg(&mut transport, REG_STATUS, 0);
        assert_eq!(read_reg(&transport, REG_STATUS), 0);
        assert!(!transport.active());
        assert_eq!(saved_registers(&transport), TransportState { queues: vec![fresh_queue()], ..TransportState::default() });
        // A request offered now is not the device's business.
        let ignored = offer_block_request(&mut driver, blk::VIRTIO_BLK_T_FLUSH, 0, &[]);
        assert!(!transport.process_queue(0, ram.memory()).expect("nothing to do"));
        assert_eq!(driver.bytes(ignored.status), [NO_STATUS]);
    }

    #[test]
    fn a_failed_device_processes_nothing() {
        let ram = guest_ram();
        let disk = disk();
        let before = disk.contents();
        let (mut transport, mut driver) = started(&ram, &disk);
        let status_before = read_reg(&transport, REG_STATUS);
        let data = driver.readable(&pattern(512, 7));
        let write = offer_block_request(&mut driver, blk::VIRTIO_BLK_T_OUT, 0, &[data]);

        transport.fail();
        assert_eq!(read_reg(&transport, REG_STATUS), status_before | VIRTIO_CONFIG_S_FAILED);
        assert!(!transport.active());
        assert!(!transport.process_queue(0, ram.memory()).expect("nothing to do"));
        assert!(driver.used().is_empty());
        assert_eq!(driver.bytes(write.status), [NO_STATUS]);
        assert_eq!(disk.contents(), before);
    }

    #[test]
    fn config_space_holds_the_capacity_and_zeros_past_it() {
        let disk = disk();
        let mut transport = transport(&disk);
        // Twelve bytes: the 8-byte capacity and 4 past the block's fields.
        let mut config = [0xffu8; 12];
        transport.read(REG_CONFIG, &mut config);
        assert_eq!(config, [DISK_SECTORS as u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(read_reg(&transport, REG_CONFIG + 0x40), 0);
        // The block device's config space is read-only.
        write_reg(&mut transport, REG_CONFIG, 0x1234);
        assert_eq!(read_reg(&transport, REG_CONFIG), DISK_SECTORS as u32);
    }

    #[test]
    fn unknown_and_write_only_registers_read_zero() {
        let mut transport = negotiated();
        let registers = saved_registers(&transport);
        // 0x18, 0x28, 0x3c and 0x40 are holes or legacy (version 1) registers.
        for offset in [0x18, 0x28, 0x3c, 0x40, 0xf0] {
            assert_eq!(read_reg(&transport, offset as u64), 0, "register {offset:#x}");
            write_reg(&mut transport, offset as u64, 0xdead_beef);
        }
        assert_eq!(saved_registers(&transport), registers, "writes to unknown registers change nothing");
        // Set to non-zero values by the driver, but not readable.
        for offset in [REG_DRIVER_FEATURES, REG_QUEUE_NUM, REG_QUEUE_DESC_LOW, REG_QUEUE_DRIVER_LOW, REG_QUEUE_DEVICE_LOW] {
            assert_eq!(read_reg(&transport, offset), 0, "register {offset:#x}");
        }
        // Polling guests: no interrupts and a config space that never changes.
        assert_eq!(read_reg(&transport, REG_INTERRUPT_STATUS), 0);
        assert_eq!(read_reg(&transport, REG_CONFIG_GENERATION), 0);
    }

    #[test]
    fn a_restored_transport_matches_the_saved_one_and_carries_on() {
        let ram = guest_ram();
        let disk = disk();
        let (mut original, mut driver) = started(&ram, &disk);
        let written = pattern(512, 9);
        let data = driver.readable(&written);
        offer_block_request(&mut driver, blk::VIRTIO_BLK_T_OUT, 1, &[data]);
        assert!(original.process_queue(0, ram.memory()).expect("write served"));
        let saved = original.save().expect("save");
        assert_eq!((saved.transport.queues[0].next_avail, saved.transport.queues[0].next_used), (1, 1));

        // Through the snapshot encoding, as a restore in a new process sees it.
        let decoded: DeviceState = crate::persist::decode(&crate::persist::encode(&saved)).expect("decode");
        let mut restored = transport(&disk);
        restored.restore(&decoded).expect("restore");
        assert_eq!(restored.save().expect("save restored"), saved);
        assert!(restored.active());
        for offset in [REG_STATUS, REG_QUEUE_NUM_MAX, REG_QUEUE_READY, REG_DEVICE_FEATURES] {
            assert_eq!(read_reg(&restored, offset), read_reg(&original, offset), "register {offset:#x}");
        }

        // The restored queue goes on from where the saved one stopped.
        let readback = driver.writable(512, 0);
        let read = offer_block_request(&mut driver, blk::VIRTIO_BLK_T_IN, 1, &[readback]);
        // Served; whether it wakes the guest is the driver's `used_event`
        // (this test driver never moves it from 0, so only the first did).
        restored.process_queue(0, ram.memory()).expect("read served");
        assert_eq!(driver.bytes(read.status), [S_OK]);
        assert_eq!(driver.bytes(readback), written);
        assert_eq!(driver.used().len(), 2);
    }

    /// With the event index a pass wakes the guest only for the buffers its
    /// driver asked to hear of (`used_event`); with `UsedNotify::Always`
    /// for every one.
    #[test]
    fn used_buffers_wake_the_guest_as_its_driver_asks() {
        for (mode, wakes) in [(UsedNotify::Asked, [true, false, true]), (UsedNotify::Always, [true, true, true])] {
            let ram = guest_ram();
            let disk = disk();
            let mut transport = disk.transport_notifying(DiskIo::Sync, Arc::new(Hooks::default()), mode);
            let mut driver = Driver::new(ram.memory());
            driver.start(&mut transport);
            let mut woke = Vec::new();
            for i in 0..3u16 {
                if i == 2 {
                    // The driver took buffers 0 and 1 back and asks for the next.
                    driver.ask_for_used(2);
                }
                let data = driver.writable(512, 0);
                let read = offer_block_request(&mut driver, blk::VIRTIO_BLK_T_IN, 1, &[data]);
                woke.push(transport.process_queue(0, ram.memory()).expect("served"));
                assert_eq!(driver.bytes(read.status), [S_OK], "{mode:?} request {i}");
            }
            // used_event starts at 0: the first buffer is asked for, the second not.
            assert_eq!(woke, wakes, "{mode:?}");
        }
    }

    #[test]
    fn restore_rejects_another_device_kind() {
        let disk = disk();
        let mut saved = transport(&disk).save().expect("save");
        saved.kind = DeviceKind::Net;
        let err = transport(&disk).restore(&saved).expect_err("a net device's state on a disk");
        assert!(matches!(&err, DeviceError::Restore { reason, .. } if reason.contains("net device")), "{err}");
    }

    #[test]
    fn restore_rejects_a_wrong_queue_count() {
        let disk = disk();
        let saved = transport(&disk).save().expect("save");
        for queues in [vec![], vec![fresh_queue(); 2]] {
            let count = queues.len();
            let state = DeviceState { transport: TransportState { queues, ..saved.transport.clone() }, ..saved.clone() };
            let err = transport(&disk).restore(&state).expect_err("wrong queue count");
            let expected = format!("{count} saved queues, the device has 1");
            assert!(matches!(&err, DeviceError::Restore { kind: DeviceKind::Block, reason } if *reason == expected), "{err}");
        }
    }

    #[test]
    fn restore_rejects_an_impossible_queue() {
        let disk = disk();
        let mut saved = transport(&disk).save().expect("save");
        saved.transport.queues[0].size = 3; // not a power of two
        let err = transport(&disk).restore(&saved).expect_err("bad queue size");
        assert!(matches!(&err, DeviceError::Restore { reason, .. } if reason.starts_with("queue")), "{err}");
    }

    /// Status holds what the driver wrote; short of DRIVER_OK the device
    /// does not run.
    #[test]
    fn status_reads_back_what_the_driver_wrote() {
        let disk = disk();
        let mut transport = transport(&disk);
        write_reg(&mut transport, REG_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER);
        assert_eq!(read_reg(&transport, REG_STATUS), VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER);
        assert!(!transport.active());
    }
}
