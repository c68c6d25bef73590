//! When to notify the device, by the virtio event-index rule.
//!
//! With `VIRTIO_F_RING_EVENT_IDX` the device writes `avail_event` (after its
//! used ring) to say "notify me once the available index passes this". The
//! driver must notify when that index lies among the entries it added since
//! it last checked: `vring_need_event(event, new, old)` of the virtio
//! specification (2.7.10). virtio-drivers 0.13's `should_notify` instead
//! answers "is the index past `avail_event`", which stays true until the
//! device runs again: every poll in between notifies once more, and each
//! notification is a VM exit (~6 µs here, even caught by ioeventfd). Under
//! load, when the device thread waits for a core, those repeats add up.
//! virtio-drivers keeps the used ring's address private, so [`Recorder`]
//! notes it as the queue is set up.

use core::sync::atomic::{fence, AtomicBool, Ordering};

use virtio_drivers::transport::mmio::MmioTransport;
use virtio_drivers::transport::{DeviceStatus, DeviceType, InterruptStatus, Transport};
use virtio_drivers::{PhysAddr, Result};
use zerocopy::{FromBytes, Immutable, IntoBytes};

/// Whether drivers notify by the exact rule (the default) or, as before,
/// whenever the index is past `avail_event` (for measuring the two).
static EXACT: AtomicBool = AtomicBool::new(true);

/// Choose the rule for devices opened from now on.
pub fn set_exact(on: bool) {
    EXACT.store(on, Ordering::Relaxed);
}

pub(crate) fn exact() -> bool {
    EXACT.load(Ordering::Relaxed)
}

/// Where `avail_event` sits in a used ring of `size` entries: after the
/// flags and index (2 bytes each) and the ring (8 bytes per entry).
pub(crate) fn avail_event_addr(device_area: PhysAddr, size: usize) -> u64 {
    device_area + 4 + 8 * size as u64
}

/// The driver's side of one queue's notifications.
pub(crate) struct Notifier {
    /// `avail_event`'s address (0: event index not negotiated).
    event: u64,
    /// Available index now (one chain per addition).
    now: u16,
    /// Available index when we last decided.
    checked: u16,
}

impl Notifier {
    pub(crate) fn new(event: u64) -> Notifier {
        Notifier { event, now: 0, checked: 0 }
    }

    pub(crate) fn added(&mut self) {
        self.now = self.now.wrapping_add(1);
    }

    /// Whether the device asked to be notified of the entries added since
    /// the last call. Without a known `avail_event`, `fallback` decides
    /// (virtio-drivers' check), and crossing the 16-bit wrap forces a
    /// notification: that check compares the indices without wrap-around,
    /// so a batch carrying the index past 65535 could look like it needs
    /// none while the device waits for one (a ~100 ms stall until the
    /// device thread's timeout).
    pub(crate) fn needed(&mut self, fallback: impl FnOnce() -> bool) -> bool {
        let (old, new) = (self.checked, self.now);
        self.checked = new;
        if self.event == 0 {
            return new < old || fallback();
        }
        // The index we published must be visible before we read the
        // device's event (virtio_mb in Linux), or both sides could miss.
        fence(Ordering::SeqCst);
        // SAFETY: `event` is the avail_event field of a used ring this
        // driver allocated and owns for the device's lifetime; the device
        // writes it, hence volatile.
        let event = unsafe { core::ptr::read_volatile(self.event as *const u16) };
        ftvm_abi::virtio::need_event(event, new, old)
    }
}

/// Where `used_event` sits in an available ring of `size` entries: after
/// the flags and index (2 bytes each) and the ring (2 bytes per entry).
pub(crate) fn used_event_addr(driver_area: PhysAddr, size: usize) -> u64 {
    driver_area + 4 + 2 * size as u64
}

/// The driver's side of one queue's used-buffer notifications (2.7.10):
/// whether the device is to wake the guest when it returns buffers.
/// virtio-drivers asks for the next one after every buffer it takes back
/// (`pop_used` writes `used_event`); a driver that takes buffers back when
/// it next looks anyway (frames sent) asks for none, and for the next one
/// only while it waits for room.
pub(crate) struct UsedEvent {
    /// `used_event`'s address (0: event index not negotiated; the device
    /// then wakes the guest for every buffer).
    addr: u64,
    /// Buffers taken back so far: the driver's used index.
    taken: u16,
    /// Whether to be woken for the next buffer returned.
    wanted: bool,
}

impl UsedEvent {
    pub(crate) fn new(addr: u64) -> UsedEvent {
        UsedEvent { addr, taken: 0, wanted: true }
    }

    /// One buffer was taken back (after virtio-drivers' `pop_used`).
    pub(crate) fn took(&mut self) {
        self.taken = self.taken.wrapping_add(1);
    }

    /// Ask to be woken for the next buffer returned, or not.
    pub(crate) fn want(&mut self, wanted: bool) {
        if wanted != self.wanted {
            self.wanted = wanted;
            self.publish();
        }
    }

    /// Write the wish into `used_event` again (after `pop_used` replaced
    /// it): the index of the next buffer, or one the device already passed,
    /// which it reaches again only after 65,536 more (one wake-up then).
    pub(crate) fn publish(&self) {
        if self.addr == 0 {
            return;
        }
        let event = if self.wanted { self.taken } else { self.taken.wrapping_sub(1) };
        // SAFETY: `addr` is the used_event field of an available ring this
        // driver allocated and owns for the device's lifetime; the device
        // reads it, hence volatile.
        unsafe { core::ptr::write_volatile(self.addr as *mut u16, event) };
        // Published before the driver looks at the used ring again
        // (virtio_mb in Linux), or a buffer returned in between wakes nobody.
        fence(Ordering::SeqCst);
    }
}

/// The MMIO transport, noting the driver area (available ring) and device
/// area (used ring) of each queue set up through it.
pub(crate) struct Recorder<'a, 'b> {
    pub inner: &'a mut MmioTransport<'b>,
    pub driver_area: [PhysAddr; 2],
    pub device_area: [PhysAddr; 2],
}

impl Transport for Recorder<'_, '_> {
    fn device_type(&self) -> DeviceType {
        self.inner.device_type()
    }
    fn read_device_features(&mut self) -> u64 {
        self.inner.read_device_features()
    }
    fn write_driver_features(&mut self, driver_features: u64) {
        self.inner.write_driver_features(driver_features)
    }
    fn max_queue_size(&mut self, queue: u16) -> u32 {
        self.inner.max_queue_size(queue)
    }
    fn notify(&mut self, queue: u16) {
        self.inner.notify(queue)
    }
    fn get_status(&self) -> DeviceStatus {
        self.inner.get_status()
    }
    fn set_status(&mut self, status: DeviceStatus) {
        self.inner.set_status(status)
    }
    fn set_guest_page_size(&mut self, guest_page_size: u32) {
        self.inner.set_guest_page_size(guest_page_size)
    }
    fn requires_legacy_layout(&self) -> bool {
        self.inner.requires_legacy_layout()
    }
    fn queue_set(&mut self, queue: u16, size: u32, descriptors: PhysAddr, driver_area: PhysAddr, device_area: PhysAddr) {
        if let Some(slot) = self.device_area.get_mut(usize::from(queue)) {
            *slot = device_area;
        }
        if let Some(slot) = self.driver_area.get_mut(usize::from(queue)) {
            *slot = driver_area;
        }
        self.inner.queue_set(queue, size, descriptors, driver_area, device_area)
    }
    fn queue_unset(&mut self, queue: u16) {
        self.inner.queue_unset(queue)
    }
    fn queue_used(&mut self, queue: u16) -> bool {
        self.inner.queue_used(queue)
    }
    fn ack_interrupt(&mut self) -> InterruptStatus {
        self.inner.ack_interrupt()
    }
    fn read_config_generation(&self) -> u32 {
        self.inner.read_config_generation()
    }
    fn read_config_space<T: FromBytes + IntoBytes>(&self, offset: usize) -> Result<T> {
        self.inner.read_config_space(offset)
    }
    fn write_config_space<T: IntoBytes + Immutable>(&mut self, offset: usize, value: T) -> Result<()> {
        self.inner.write_config_space(offset, value)
    }
}
