//! The VMM's virtio-net device as a smoltcp `phy::Device`, in polling mode.
//!
//! Built on `virtio-drivers`' virtqueue rather than `VirtIONetRaw` so that
//! queue notifications can be batched: every notification is a VM exit
//! (~17 µs here), and `VirtIONetRaw` issues one per frame sent and per
//! receive buffer re-posted. Here frames and buffers are queued during a
//! poll and [`VirtioNet::notify`] kicks each queue at most once at its end.

use alloc::boxed::Box;
use alloc::vec;
use alloc::vec::Vec;
use core::cell::RefCell;

use ftvm_abi::device_kind;
use ftvm_abi::virtio::net::{F_CSUM, F_GUEST_CSUM, F_MAC, HDR_LEN};
use ftvm_abi::virtio::{F_RING_EVENT_IDX, F_VERSION_1};
use smoltcp::phy::{self, Checksum, DeviceCapabilities, Medium};
use smoltcp::time::Instant;
use virtio_drivers::queue::VirtQueue;
use virtio_drivers::transport::mmio::MmioTransport;
use virtio_drivers::transport::{DeviceStatus, DeviceType, Transport};

use super::csum;
use super::event_idx::{self, Notifier, Recorder, UsedEvent};
use super::Flow;
use crate::heap::try_zeroed;
use crate::virtio::{self, Claim, OpenError};

/// The VMM offers 256 (its QueueNumMax); a full ring of receive buffers
/// absorbs bursts while the guest is busy elsewhere.
pub const QUEUE_SIZE: usize = 256;
/// Ethernet frame without FCS at the standard 1500-byte MTU.
const MAX_FRAME: usize = 1514;
/// Header + largest frame, rounded up so buffers never share a page badly.
const BUF_LEN: usize = 2048;

const RX: u16 = 0;
const TX: u16 = 1;

/// Frames moved and frames lost, for progress detection and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    pub rx_frames: u64,
    pub tx_frames: u64,
    /// Received buffers the device reported as shorter than the header.
    pub rx_errors: u64,
    /// Received frames dropped for a wrong TCP or UDP checksum (checked
    /// by the driver under checksum offload).
    pub rx_bad_csum: u64,
    /// Frames smoltcp built that could not be queued.
    pub tx_dropped: u64,
    /// Queue notifications (each a VM exit) of the receive and transmit
    /// queues.
    pub rx_notifies: u64,
    pub tx_notifies: u64,
}

pub(crate) struct VirtioNet {
    inner: RefCell<Inner>,
    mac: [u8; 6],
}

struct Inner {
    // Field order is drop order: the transport resets the device before the
    // rings and buffers it points at are freed.
    transport: MmioTransport<'static>,
    rx: VirtQueue<virtio::Hal, QUEUE_SIZE>,
    tx: VirtQueue<virtio::Hal, QUEUE_SIZE>,
    _claim: Claim,
    /// Receive buffers owned by the device, by descriptor index (the token).
    rx_posted: Vec<Option<Box<[u8]>>>,
    /// Frames owned by the device, by token, with the length handed over.
    tx_posted: Vec<Option<(Box<[u8]>, usize)>>,
    tx_free: Vec<Box<[u8]>>,
    rx_added: bool,
    tx_added: bool,
    rx_notifier: Notifier,
    tx_notifier: Notifier,
    /// Whether the device wakes us for frames it sent: only while we wait
    /// for room in the ring or for the last frames to leave.
    tx_wake: UsedEvent,
    stats: NetStats,
    /// Checksum offload negotiated (both F_CSUM and F_GUEST_CSUM).
    csum: bool,
    /// The TCP flow of the last frame handed to smoltcp, if it was one.
    last_flow: Option<Flow>,
}

impl VirtioNet {
    /// Open and start the first network device.
    pub(crate) fn open() -> Result<VirtioNet, OpenError> {
        let (mut t, claim) = virtio::open(device_kind::VIRTIO_MMIO_NET, DeviceType::Network)?;
        // virtio 1.x 3.1.1, by hand to check FEATURES_OK (begin_init does not).
        t.set_status(DeviceStatus::empty());
        t.set_status(DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER);
        let offered = t.read_device_features();
        if offered & F_VERSION_1 == 0 || offered & F_MAC == 0 {
            return Err(OpenError::Unexpected("device lacks VERSION_1 or MAC"));
        }
        let mut features = offered & (F_VERSION_1 | F_MAC | F_RING_EVENT_IDX | F_CSUM | F_GUEST_CSUM);
        // Offload is taken both ways or not at all (one smoltcp setting).
        let csum = features & (F_CSUM | F_GUEST_CSUM) == F_CSUM | F_GUEST_CSUM;
        if !csum {
            features &= !(F_CSUM | F_GUEST_CSUM);
        }
        t.write_driver_features(features);
        let ok = DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER | DeviceStatus::FEATURES_OK;
        t.set_status(ok);
        if !t.get_status().contains(DeviceStatus::FEATURES_OK) {
            t.set_status(ok | DeviceStatus::FAILED);
            return Err(OpenError::Unexpected("device rejected the features"));
        }
        let mac = t.read_consistent(|| {
            let mut mac = [0u8; 6];
            for (i, b) in mac.iter_mut().enumerate() {
                *b = t.read_config_space(i)?;
            }
            Ok(mac)
        })?;
        let event_idx = features & F_RING_EVENT_IDX != 0;
        let mut recorder = Recorder { inner: &mut t, driver_area: [0; 2], device_area: [0; 2] };
        let rx = VirtQueue::new(&mut recorder, RX, false, event_idx)?;
        let tx = VirtQueue::new(&mut recorder, TX, false, event_idx)?;
        let [rx_area, tx_area] = recorder.device_area;
        let tx_driver_area = recorder.driver_area[usize::from(TX)];
        let notifier = |area| {
            let exact = event_idx && area != 0 && event_idx::exact();
            Notifier::new(if exact { event_idx::avail_event_addr(area, QUEUE_SIZE) } else { 0 })
        };
        let mut inner = Inner {
            transport: t,
            rx,
            tx,
            _claim: claim,
            rx_posted: (0..QUEUE_SIZE).map(|_| None).collect(),
            tx_posted: (0..QUEUE_SIZE).map(|_| None).collect(),
            // Never grows: there are at most QUEUE_SIZE TX buffers (`can_send`).
            tx_free: Vec::with_capacity(QUEUE_SIZE),
            rx_added: false,
            tx_added: false,
            rx_notifier: notifier(rx_area),
            tx_notifier: notifier(tx_area),
            tx_wake: UsedEvent::new(if event_idx && tx_driver_area != 0 {
                event_idx::used_event_addr(tx_driver_area, QUEUE_SIZE)
            } else {
                0
            }),
            stats: NetStats::default(),
            csum,
            last_flow: None,
        };
        for _ in 0..QUEUE_SIZE {
            inner.post_rx(vec![0u8; BUF_LEN].into_boxed_slice());
        }
        inner.transport.finish_init();
        inner.tx_wake.want(false);
        inner.notify();
        Ok(VirtioNet { inner: RefCell::new(inner), mac })
    }

    pub(crate) fn mac(&self) -> [u8; 6] {
        self.mac
    }

    pub(crate) fn checksum_offload(&self) -> bool {
        self.inner.borrow().csum
    }

    pub(crate) fn stats(&self) -> NetStats {
        self.inner.borrow().stats
    }

    /// Tell the device about buffers queued since the last call.
    pub(crate) fn notify(&mut self) {
        self.inner.get_mut().notify();
    }

    /// The TCP flow of the frame last received, once.
    pub(crate) fn take_flow(&mut self) -> Option<Flow> {
        self.inner.get_mut().last_flow.take()
    }

    /// Frames queued for the device that it has not sent yet.
    /// While any is, the device wakes us as it sends them (a program
    /// about to end waits for its last frames).
    pub(crate) fn tx_in_flight(&mut self) -> usize {
        let inner = self.inner.get_mut();
        inner.reclaim_tx();
        if inner.in_flight() > 0 {
            inner.tx_wake.want(true);
            inner.reclaim_tx();
        }
        inner.in_flight()
    }
}

impl Inner {
    fn post_rx(&mut self, mut buf: Box<[u8]>) {
        // Cannot fail (there are exactly QUEUE_SIZE buffers); if it did, the
        // ring would just run one buffer short.
        // SAFETY: the buffer is kept in rx_posted, untouched, until the
        // device returns it through pop_used in `receive`.
        if let Ok(token) = unsafe { self.rx.add(&[], &mut [&mut buf[..]]) } {
            self.rx_posted[usize::from(token)] = Some(buf);
            self.rx_added = true;
            self.rx_notifier.added();
        }
    }

    fn in_flight(&self) -> usize {
        self.tx_posted.iter().filter(|p| p.is_some()).count()
    }

    /// Take back the frames the device has sent.
    fn reclaim_tx(&mut self) {
        let mut took = false;
        while let Some(token) = self.tx.peek_used() {
            let Some((buf, len)) = self.tx_posted.get_mut(usize::from(token)).and_then(Option::take) else {
                // A token we never queued: the ring is corrupt; stop using it
                // rather than guess.
                return;
            };
            // SAFETY: `buf[..len]` is exactly what was queued for `token`.
            if unsafe { self.tx.pop_used(token, &[&buf[..len]], &mut []) }.is_err() {
                return;
            }
            self.tx_wake.took();
            took = true;
            self.tx_free.push(buf);
        }
        if took {
            self.tx_wake.publish();
        }
    }

    /// A free descriptor and a buffer for it. TX buffers are made as
    /// needed, while every one made is in the ring: a full heap then waits
    /// for one to come back (sends wait, as when the ring is full) instead
    /// of ending the guest.
    fn can_send(&mut self) -> bool {
        if self.has_room() {
            self.tx_wake.want(false);
            return true;
        }
        // Full: ask to be woken as the device sends a frame, then look again
        // (it may have sent one before it could see that).
        self.tx_wake.want(true);
        self.reclaim_tx();
        self.has_room()
    }

    fn has_room(&mut self) -> bool {
        if self.tx.available_desc() == 0 {
            return false;
        }
        if self.tx_free.is_empty() {
            let Some(buf) = try_zeroed(BUF_LEN) else { return false };
            self.tx_free.push(buf.into_boxed_slice());
        }
        true
    }

    fn send(&mut self, buf: Box<[u8]>, len: usize) {
        // SAFETY: the buffer is kept in tx_posted, untouched, until
        // reclaim_tx pops it with the same slice.
        match unsafe { self.tx.add(&[&buf[..len]], &mut []) } {
            Ok(token) => {
                self.tx_posted[usize::from(token)] = Some((buf, len));
                self.tx_added = true;
                self.tx_notifier.added();
                self.stats.tx_frames += 1;
            }
            Err(_) => {
                self.tx_free.push(buf);
                self.stats.tx_dropped += 1;
            }
        }
    }

    fn notify(&mut self) {
        if core::mem::take(&mut self.rx_added) && self.rx_notifier.needed(|| self.rx.should_notify()) {
            self.transport.notify(RX);
            self.stats.rx_notifies += 1;
        }
        if core::mem::take(&mut self.tx_added) && self.tx_notifier.needed(|| self.tx.should_notify()) {
            self.transport.notify(TX);
            self.stats.tx_notifies += 1;
        }
    }
}

impl phy::Device for VirtioNet {
    type RxToken<'a> = RxToken<'a>;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _timestamp: Instant) -> Option<(RxToken<'_>, TxToken<'_>)> {
        let inner = self.inner.get_mut();
        inner.reclaim_tx();
        // smoltcp may answer a frame at once (ARP, ICMP, ACK), so a frame is
        // only taken when a reply could be queued too; otherwise it waits in
        // the ring until TX completions free space.
        if !inner.can_send() {
            return None;
        }
        loop {
            let token = inner.rx.peek_used()?;
            let mut buf = inner.rx_posted.get_mut(usize::from(token))?.take()?;
            // SAFETY: `buf` is the buffer queued for `token`.
            let written = unsafe { inner.rx.pop_used(token, &[], &mut [&mut buf[..]]) }.ok()? as usize;
            if written < HDR_LEN {
                inner.stats.rx_errors += 1;
                inner.post_rx(buf);
                continue;
            }
            let len = written.min(buf.len()) - HDR_LEN;
            if inner.csum && !csum::rx_ok(buf[0], &buf[HDR_LEN..HDR_LEN + len]) {
                inner.stats.rx_bad_csum += 1;
                inner.post_rx(buf);
                continue;
            }
            inner.stats.rx_frames += 1;
            inner.last_flow = Flow::of(&buf[HDR_LEN..HDR_LEN + len]);
            let dev = &self.inner;
            return Some((RxToken { buf: Some(buf), len, dev }, TxToken { dev }));
        }
    }

    fn transmit(&mut self, _timestamp: Instant) -> Option<TxToken<'_>> {
        let inner = self.inner.get_mut();
        inner.reclaim_tx();
        if !inner.can_send() {
            return None;
        }
        Some(TxToken { dev: &self.inner })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MAX_FRAME;
        if self.checksum_offload() {
            // TCP checksums are the device's to complete (`csum`); UDP ones
            // smoltcp still computes (rare, and a computed zero would need
            // care), but checks neither: the driver did (`csum::rx_ok`).
            caps.checksum.tcp = Checksum::None;
            caps.checksum.udp = Checksum::Tx;
        }
        // Otherwise smoltcp computes and checks every checksum (the default).
        caps
    }
}

/// A received frame; its buffer goes back to the device when consumed.
pub(crate) struct RxToken<'a> {
    buf: Option<Box<[u8]>>,
    len: usize,
    dev: &'a RefCell<Inner>,
}

impl phy::RxToken for RxToken<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(mut self, f: F) -> R {
        // The buffer is out of the RefCell while `f` runs: smoltcp consumes
        // the paired TxToken (which borrows it) inside `f`.
        let r = match &self.buf {
            Some(buf) => f(&buf[HDR_LEN..HDR_LEN + self.len]),
            None => f(&[]),
        };
        if let Some(buf) = self.buf.take() {
            self.dev.borrow_mut().post_rx(buf);
        }
        r
    }
}

impl Drop for RxToken<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.dev.borrow_mut().post_rx(buf);
        }
    }
}

pub(crate) struct TxToken<'a> {
    dev: &'a RefCell<Inner>,
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        if len > MAX_FRAME {
            // Beyond the MTU smoltcp was given; build it to keep smoltcp's
            // state consistent, but do not send it.
            let r = f(&mut vec![0u8; len]);
            self.dev.borrow_mut().stats.tx_dropped += 1;
            return r;
        }
        let (buf, offload) = {
            let mut inner = self.dev.borrow_mut();
            (inner.tx_free.pop(), inner.csum)
        };
        // `transmit` and `receive` hand out a token only with a free buffer.
        let mut buf = buf.unwrap_or_else(|| vec![0u8; BUF_LEN].into_boxed_slice());
        let r = f(&mut buf[HDR_LEN..HDR_LEN + len]);
        if offload {
            csum::offload_tx(&mut buf[..HDR_LEN + len]);
        } else {
            // All-zero header: no offloads, no GSO.
            buf[..HDR_LEN].fill(0);
        }
        self.dev.borrow_mut().send(buf, HDR_LEN + len);
        r
    }
}
