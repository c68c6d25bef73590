//! virtio-net backed by a TAP device.

pub mod tap;

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueT};

use super::{drain, read_config_bytes, Pass, VirtioDevice, VirtioError};
use crate::devices::{DeviceError, DeviceKind, ModelState, PauseFlag};
use crate::hooks::{FrameSink, Hooks};
use crate::memory::GuestMemory;
use crate::persist::Persist;
use crate::sync::Lock;
pub use tap::{Tap, TapError, VNET_HDR_LEN};

const VIRTIO_NET_F_MAC: u64 = 1 << virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
/// The driver may leave TCP/UDP checksums partial in frames it sends.
const VIRTIO_NET_F_CSUM: u64 = 1 << virtio_bindings::virtio_net::VIRTIO_NET_F_CSUM;
/// The driver takes frames whose checksum is partial (or already checked).
const VIRTIO_NET_F_GUEST_CSUM: u64 = 1 << virtio_bindings::virtio_net::VIRTIO_NET_F_GUEST_CSUM;

crate::switch! {
    /// What the network card offers the guest's driver to leave undone
    /// (`--net-offload`).
    pub enum NetOffload {
        /// Checksum offload both ways (VIRTIO_NET_F_CSUM and GUEST_CSUM):
        /// the guest may send frames with the checksum left partial (the
        /// runtime's driver does so for TCP; the kernel completes it, or,
        /// as on a veth, a receiver on this host never needs it), and the
        /// TAP hands it frames from this host unchecksummed, marked so in
        /// the virtio-net header.
        Csum = "csum",
        /// None: the guest computes and checks every checksum.
        Off = "off",
    }
}

const RX: usize = 0;
const TX: usize = 1;
/// Largest frame with header we move (no offloads: MTU-sized frames).
const MAX_FRAME: usize = 65562;

/// The MAC address of a card given none (`--net tap=NAME`): QEMU's default,
/// in the locally administered range of its vendor prefix 52:54:00.
pub const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

/// `--net tap=NAME,mac=MAC`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    pub tap: String,
    pub mac: [u8; 6],
}

impl FromStr for NetConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (mut tap, mut mac) = (None, None);
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("tap", v)) => tap = Some(v.to_string()),
                Some(("mac", v)) => mac = Some(parse_mac(v)?),
                _ => return Err(format!("unknown --net option '{part}' (expected tap=NAME,mac=MAC)")),
            }
        }
        Ok(NetConfig { tap: tap.ok_or("--net needs tap=NAME")?, mac: mac.unwrap_or(DEFAULT_MAC) })
    }
}

fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let bad = || format!("bad MAC address '{s}' (expected six hex bytes like 52:54:00:12:34:56)");
    let parts: Vec<u8> = s.split(':').map(|p| u8::from_str_radix(p, 16)).collect::<Result<_, _>>().map_err(|_| bad())?;
    let mac: [u8; 6] = parts.try_into().map_err(|_| bad())?;
    // A card's own address must be one a frame can be sent to alone.
    if mac[0] & 1 != 0 {
        return Err(format!(
            "MAC address {s} is multicast (the low bit of its first byte is set): a network card needs a unicast address like 52:54:00:12:34:56"
        ));
    }
    if mac == [0; 6] {
        return Err(format!("MAC address {s} is all zero: a network card needs a unicast address like 52:54:00:12:34:56"));
    }
    Ok(mac)
}

/// The network card's own saved state: the MAC address the guest knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub mac: [u8; 6],
}

fn mac_string(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The TAP offloads (`TUN_F_*`) a driver that accepted `features` takes:
/// frames whose checksum it completes if it accepted GUEST_CSUM.
fn offload_flags(features: u64) -> libc::c_uint {
    if features & VIRTIO_NET_F_GUEST_CSUM != 0 {
        tap::TUN_F_CSUM
    } else {
        0
    }
}

/// The TAP offload flags to set once a driver accepted `acked`, if they
/// differ from `current`. A reset (nothing accepted) keeps them: the
/// driver's next negotiation sets what it needs.
fn offload_change(acked: u64, current: libc::c_uint) -> Option<libc::c_uint> {
    let flags = offload_flags(acked);
    (acked != 0 && flags != current).then_some(flags)
}

/// Writes frames to the TAP (shared by the device and by host senders).
struct TapWriter(Mutex<File>);

impl FrameSink for TapWriter {
    fn send(&self, frame: &[u8]) {
        if let Err(e) = self.0.locked().write(frame) {
            tracing::debug!(error = %e, "TAP write failed; frame dropped");
        }
    }
}

pub struct Net {
    tap: Tap,
    offload: NetOffload,
    tap_writer: Arc<TapWriter>,
    mac: [u8; 6],
    /// The TAP had a frame the last time we looked (it is polled edge-triggered).
    tap_readable: bool,
    /// Read the TAP (`set_host_input`); off, frames wait in the kernel's
    /// queue (which drops beyond its length) and are dropped when it turns on.
    host_input: bool,
    /// Frames the host injected, delivered before the TAP's.
    injected: VecDeque<Vec<u8>>,
    frame: Vec<u8>,
    hooks: Arc<Hooks>,
    /// A pause waits for this device's pass: stop reading the TAP.
    pausing: PauseFlag,
    /// The features the driver accepted last: a restore of the same ones
    /// (every consensus-ordered secondary's `syncvm`) changes nothing.
    acked: u64,
    /// The TAP's offload flags (`TUN_F_*`) as last set.
    tap_offload: libc::c_uint,
}

impl Net {
    pub fn new(config: &NetConfig, offload: NetOffload, hooks: Arc<Hooks>, pausing: PauseFlag) -> Result<Net, TapError> {
        let tap = Tap::open(&config.tap)?;
        // Set now (a TAP kept from an earlier VM may have others) to what
        // a driver accepting this card's offer needs, so that the
        // negotiation, or the restore that takes a VM over, need not set
        // them: a TAP ioctl takes the kernel's network configuration lock
        // (rtnl), which a loaded host's namespace teardown held for up to
        // 20 s, and the takeover waited on it. A driver that accepts less
        // gets frames already queued as the TAP made them before it
        // negotiated (partial checksums it may drop, as a lost frame).
        let tap_offload = offload_flags(Self::offered(offload));
        tap.set_offload(tap_offload)?;
        let tap_writer = Arc::new(TapWriter(Mutex::new(tap.try_clone_file()?)));
        Ok(Net {
            tap,
            offload,
            tap_writer,
            mac: config.mac,
            tap_readable: true,
            host_input: true,
            injected: VecDeque::new(),
            frame: vec![0; MAX_FRAME],
            hooks,
            pausing,
            acked: 0,
            tap_offload,
        })
    }

    fn offered(offload: NetOffload) -> u64 {
        match offload {
            NetOffload::Csum => VIRTIO_NET_F_MAC | VIRTIO_NET_F_CSUM | VIRTIO_NET_F_GUEST_CSUM,
            NetOffload::Off => VIRTIO_NET_F_MAC,
        }
    }

    /// Sends frames straight to the TAP.
    pub fn tap_sink(&self) -> Arc<dyn FrameSink> {
        self.tap_writer.clone()
    }

    /// Move frames (injected ones first, then the TAP's) into the guest's
    /// receive buffers while both exist. With no buffer left, ask the driver
    /// to kick us when it posts one.
    fn receive(&mut self, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, VirtioError> {
        let result = self.receive_pass(queues, mem);
        // Also after an error: what the filter kept of this pass must not
        // wait for the next one.
        if let Some(filter) = self.hooks.host_input() {
            filter.pass_end();
        }
        result
    }

    fn receive_pass(&mut self, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, VirtioError> {
        let proxy = self.hooks.guest_proxy();
        if let Some(p) = &proxy {
            self.injected.extend(p.take_made_up());
        }
        let q = &mut queues[RX];
        let err = |err| VirtioError::Queue { queue: RX, err };
        let mut used = false;
        while (self.tap_readable && self.host_input) || !self.injected.is_empty() {
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                if q.enable_notification(mem).map_err(err)? {
                    continue; // the driver posted buffers meanwhile
                }
                break;
            };
            if self.pausing.raised() && self.injected.is_empty() {
                // Frames still on the TAP belong to no epoch yet: they are
                // read after the pause (its resume rings the doorbell).
                q.go_to_previous_position();
                self.pausing.left_work();
                break;
            }
            if let Some(frame) = self.injected.pop_front() {
                let n = frame.len().min(MAX_FRAME);
                self.frame[..n].copy_from_slice(&frame[..n]);
                used |= deliver(chain, mem, &self.frame[..n], q)?;
                continue;
            }
            let n = match self.tap.read_frame(&mut self.frame) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    q.go_to_previous_position();
                    self.tap_readable = false;
                    continue;
                }
                Err(e) => {
                    q.go_to_previous_position();
                    return Err(e.into());
                }
            };
            // The filter sees the frame as it came (a mirror copies it so);
            // the proxy, if any, rewrites it for the guest.
            if self.hooks.host_input().is_some_and(|f| !f.admit(&self.frame[..n]))
                || proxy.as_ref().is_some_and(|p| !p.rewrite(&mut self.frame[..n]))
            {
                q.go_to_previous_position();
                continue;
            }
            used |= deliver(chain, mem, &self.frame[..n], q)?;
        }
        Ok(used)
    }

    /// Send frames until the queue is empty or the TX hook asks to wait
    /// (it bounds what it holds between two of its wake-ups).
    fn transmit(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<Pass, VirtioError> {
        let sink = self.hooks.tx();
        let mut pass = Pass::default();
        loop {
            if sink.as_ref().is_some_and(|s| !s.accepting()) {
                pass.deferred = true;
                return Ok(pass);
            }
            let Some(chain) = queue.pop_descriptor_chain(mem) else { return Ok(pass) };
            let head = chain.head_index();
            let mut reader = chain.reader(mem).map_err(|e| VirtioError::Chain(e.to_string()))?;
            let len = reader.available_bytes().min(MAX_FRAME);
            reader.read_exact(&mut self.frame[..len])?;
            if len > VNET_HDR_LEN {
                match &sink {
                    Some(sink) => sink.send(&self.frame[..len]),
                    None => self.tap_writer.send(&self.frame[..len]),
                }
            }
            queue.add_used(mem, head, 0).map_err(|err| VirtioError::Queue { queue: TX, err })?;
            pass.used = true;
        }
    }
}

/// Write `frame` into the receive buffer `chain` and hand it to the guest;
/// false (and the buffer kept) if the frame does not fit.
fn deliver(
    chain: virtio_queue::DescriptorChain<&GuestMemory>,
    mem: &GuestMemory,
    frame: &[u8],
    q: &mut Queue,
) -> Result<bool, VirtioError> {
    let head = chain.head_index();
    let mut writer = chain.writer(mem).map_err(|e| VirtioError::Chain(e.to_string()))?;
    if writer.available_bytes() < frame.len() {
        // A frame larger than the posted buffer: drop it, keep the buffer.
        tracing::debug!(len = frame.len(), room = writer.available_bytes(), "dropping oversized RX frame");
        q.go_to_previous_position();
        return Ok(false);
    }
    writer.write_all(frame)?;
    q.add_used(mem, head, frame.len() as u32).map_err(|err| VirtioError::Queue { queue: RX, err })?;
    Ok(true)
}

impl VirtioDevice for Net {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Net
    }

    fn queue_count(&self) -> usize {
        2
    }

    fn features(&self) -> u64 {
        Self::offered(self.offload)
    }

    /// Frames the guest sends need nothing from the TAP to be accepted
    /// (it takes NEEDS_CSUM frames always); what the TAP may hand the guest
    /// follows GUEST_CSUM. This holds whatever this VMM offers: a VM
    /// restored from one that offered more keeps what it negotiated.
    fn features_acked(&mut self, acked: u64) {
        if acked == self.acked {
            return;
        }
        self.acked = acked;
        if acked != 0 {
            let csum = acked & (VIRTIO_NET_F_CSUM | VIRTIO_NET_F_GUEST_CSUM) != 0;
            tracing::info!(tap = self.tap.name(), checksum_offload = csum, "network card negotiated");
        }
        let Some(flags) = offload_change(acked, self.tap_offload) else { return };
        match self.tap.set_offload(flags) {
            Ok(()) => self.tap_offload = flags,
            // The TAP may then hand over frames whose checksum the guest
            // must complete and will not: lost frames, which TCP resends.
            Err(e) => tracing::warn!(error = %e, "TAP offload not changed"),
        }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // mac[6], then status and max_virtqueue_pairs (not offered: zero).
        read_config_bytes(&self.mac, offset, data);
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, VirtioError> {
        match index {
            RX => {
                // Buffers were posted: no more kicks needed until we run out.
                queues[RX].disable_notification(mem).map_err(|err| VirtioError::Queue { queue: RX, err })?;
                self.receive(queues, mem)
            }
            TX => {
                let sent = drain(&mut queues[TX], mem, TX, |q| self.transmit(q, mem))?;
                // What a proxy made up while the guest sent (acknowledgements)
                // reaches the guest in this pass.
                let made_up = self.hooks.guest_proxy().map(|p| p.take_made_up()).unwrap_or_default();
                if made_up.is_empty() {
                    return Ok(sent);
                }
                self.injected.extend(made_up);
                Ok(self.receive(queues, mem)? | sent)
            }
            _ => Ok(false),
        }
    }

    fn host_fd(&self) -> Option<RawFd> {
        self.host_input.then(|| self.tap.as_raw_fd())
    }

    fn set_host_input(&mut self, on: bool) {
        if on && !self.host_input {
            // Not for this VM: they came while it took no input from here.
            self.tap.drain();
            self.tap_readable = true;
        }
        if on != self.host_input {
            tracing::debug!(tap = self.tap.name(), on, "TAP input");
        }
        self.host_input = on;
    }

    fn process_host(&mut self, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, VirtioError> {
        self.tap_readable = true;
        self.receive(queues, mem)
    }

    fn reset(&mut self) {
        self.tap_readable = true;
        self.features_acked(0);
    }

    fn drop_queued_host_input(&mut self) {
        self.tap.drain();
    }

    fn inject_host_input(&mut self, frames: Vec<Vec<u8>>) {
        self.injected.extend(frames);
    }

    fn take_injected_host_input(&mut self) -> Vec<Vec<u8>> {
        self.injected.drain(..).collect()
    }

    fn injected_host_input_pending(&self) -> bool {
        !self.injected.is_empty()
    }
}

impl Persist for Net {
    type State = ModelState;
    type Error = DeviceError;

    fn save(&self) -> Result<ModelState, DeviceError> {
        Ok(ModelState::Net(NetState { mac: self.mac }))
    }

    /// The guest already knows its MAC address: a card with another one
    /// would leave it answering for an address the network no longer sends
    /// it.
    fn restore(&mut self, state: &ModelState) -> Result<(), DeviceError> {
        let bad = |reason| DeviceError::Restore { kind: DeviceKind::Net, reason };
        match state {
            ModelState::Net(s) if s.mac == self.mac => Ok(()),
            ModelState::Net(s) => Err(bad(format!(
                "the saved VM's MAC address is {}, this card's is {} (--net mac=...)",
                mac_string(&s.mac),
                mac_string(&self.mac)
            ))),
            other => Err(bad(format!("saved state is not a network card's: {other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TAP opened for this card's offer needs no change when a driver
    /// accepts all of it, as every restore of such a VM does (a TAP ioctl
    /// can wait seconds for the kernel's rtnl lock, on a takeover's path).
    #[test]
    fn the_tap_offload_changes_only_when_the_driver_accepts_less() {
        for offload in [NetOffload::Csum, NetOffload::Off] {
            let opened = offload_flags(Net::offered(offload));
            assert_eq!(offload_change(Net::offered(offload), opened), None, "{offload:?}");
            assert_eq!(offload_change(0, opened), None, "a reset keeps the flags");
        }
        let csum = offload_flags(Net::offered(NetOffload::Csum));
        assert_eq!(csum, tap::TUN_F_CSUM);
        assert_eq!(offload_change(VIRTIO_NET_F_MAC, csum), Some(0), "a driver without GUEST_CSUM");
        assert_eq!(offload_change(VIRTIO_NET_F_MAC | VIRTIO_NET_F_GUEST_CSUM, 0), Some(tap::TUN_F_CSUM));
    }

    #[test]
    fn parses_net_option() {
        let c: NetConfig = "tap=tap0,mac=52:54:00:aa:bb:0c".parse().unwrap();
        assert_eq!(c.tap, "tap0");
        assert_eq!(c.mac, [0x52, 0x54, 0, 0xaa, 0xbb, 0x0c]);
        assert!("mac=52:54:00:aa:bb:0c".parse::<NetConfig>().is_err());
        assert!("tap=t,mac=52:54".parse::<NetConfig>().is_err());
        assert!("tap=t,speed=10".parse::<NetConfig>().is_err());
        assert_eq!("tap=t".parse::<NetConfig>().unwrap().mac, DEFAULT_MAC);
        for multicast in ["01:00:5e:00:00:01", "ff:ff:ff:ff:ff:ff", "33:33:00:00:00:01", "53:54:00:12:34:56"] {
            let e = format!("tap=t,mac={multicast}").parse::<NetConfig>().unwrap_err();
            assert!(e.contains("multicast"), "{e}");
        }
        assert!("tap=t,mac=00:00:00:00:00:00".parse::<NetConfig>().unwrap_err().contains("all zero"));
        assert!("tap=t,mac=02:00:00:00:00:01".parse::<NetConfig>().is_ok());
    }
}
