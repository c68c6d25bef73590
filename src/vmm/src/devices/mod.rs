//! The VM's devices: virtio-mmio slots above guest RAM, each served by its
//! own thread, which can be paused with the vCPUs and saved with the VM.

mod gate;
mod serve;
pub mod virtio;

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use kvm_ioctls::{IoEventAddress, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::components::{ComponentError, ComponentId, Components};
use crate::hooks::{FrameSink, Hooks};
use crate::memory::GuestMemory;
use crate::run_control::Events;
use crate::sync::Lock;
use gate::Gate;
pub(crate) use gate::PauseFlag;
use virtio::block::{Block, BlockError, DiskIo};
use virtio::mmio::{MmioTransport, TransportState, UsedNotify, REG_QUEUE_NOTIFY};
use virtio::net::{Net, NetConfig, NetOffload, NetState, TapError};

/// Each device's register block.
pub const MMIO_SLOT_SIZE: u64 = 0x1000;

/// Devices live in a window starting at the first GiB boundary at or above
/// the end of RAM (identity-mapped for the guest like RAM).
pub fn mmio_base(mem_size: u64) -> u64 {
    mem_size.next_multiple_of(1 << 30)
}

/// Host-side device configuration (not part of the VM's saved state).
#[derive(Clone, Debug, Default)]
pub struct DeviceConfig {
    pub net: Option<NetConfig>,
    pub disk: Option<PathBuf>,
    /// Where the disk's I/O runs (`--disk-io`).
    pub disk_io: DiskIo,
    /// What the network card offers to offload (`--net-offload`).
    pub net_offload: NetOffload,
    /// When returned buffers wake the guest (`--used-notify`).
    pub used_notify: UsedNotify,
}

impl DeviceConfig {
    /// The devices this configuration gives a VM, in slot order.
    pub fn kinds(&self) -> Vec<DeviceKind> {
        let mut kinds = Vec::new();
        if self.net.is_some() {
            kinds.push(DeviceKind::Net);
        }
        if self.disk.is_some() {
            kinds.push(DeviceKind::Block);
        }
        kinds
    }
}

/// Makes every device thread take another full pass over its queues: for a
/// hook that asked a device to wait (`accepting`) and has room again.
#[derive(Clone, Default)]
pub struct Waker(Arc<[EventFd]>);

impl Waker {
    pub fn wake(&self) {
        for doorbell in self.0.iter() {
            // A doorbell that is already rung stays rung: nothing to do.
            let _ = doorbell.write(1);
        }
    }
}

/// What a device is, as the VM's shape lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceKind {
    Net,
    Block,
}

impl DeviceKind {
    /// The virtio device ID the transport reports.
    pub fn virtio_id(self) -> u32 {
        match self {
            DeviceKind::Net => virtio_bindings::virtio_ids::VIRTIO_ID_NET,
            DeviceKind::Block => virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK,
        }
    }

    /// The kind the guest finds in its boot information.
    pub fn abi_kind(self) -> u32 {
        match self {
            DeviceKind::Net => ftvm_abi::device_kind::VIRTIO_MMIO_NET,
            DeviceKind::Block => ftvm_abi::device_kind::VIRTIO_MMIO_BLOCK,
        }
    }
}

/// The names the command line uses (`--net`, `--disk`).
impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Net => "net",
            DeviceKind::Block => "disk",
        })
    }
}

/// A list of device kinds, printed as `[net, disk]`.
pub struct KindList<'a>(pub &'a [DeviceKind]);

impl fmt::Display for KindList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        write!(f, "[{}]", names.join(", "))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error("cannot set up device plumbing ({op}): {err}")]
    Os { op: &'static str, err: std::io::Error },
    #[error("the saved VM has devices {}, this VM has {}", KindList(saved), KindList(present))]
    Mismatch { saved: Vec<DeviceKind>, present: Vec<DeviceKind> },
    #[error("cannot restore the {kind} device: {reason}")]
    Restore { kind: DeviceKind, reason: String },
    #[error(transparent)]
    Component(#[from] ComponentError),
}

/// A device model's own state (the transport's is saved beside it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ModelState {
    Net(NetState),
    Block(virtio::block::BlockState),
}

/// One device's saved state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceState {
    pub kind: DeviceKind,
    pub transport: TransportState,
    pub model: ModelState,
}

impl DeviceState {
    /// Requests the device had in flight when it was saved (a disk's
    /// pending list).
    pub fn requests_in_flight(&self) -> usize {
        match &self.model {
            ModelState::Block(b) => b.pending.len(),
            ModelState::Net(_) => 0,
        }
    }
}

struct Slot {
    base: u64,
    transport: Mutex<MmioTransport>,
    /// One doorbell per queue, written by KVM on a QueueNotify store.
    notify: Vec<EventFd>,
    stop: EventFd,
    /// What the device thread runs after each pass, unlocked.
    io: Option<Arc<dyn virtio::DeferredIo>>,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, MmioTransport> {
        self.transport.locked()
    }
}

pub struct Devices {
    slots: Vec<Arc<Slot>>,
    gate: Arc<Gate>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    mem: GuestMemory,
    events: Arc<Events>,
    tap: Option<Arc<dyn FrameSink>>,
    waker: Waker,
}

impl DeviceConfig {
    /// Check the host side of every device without building it: the TAP
    /// can be attached to (it is created if absent, as the VM would), the
    /// disk file opens for reading and writing. The errors are the ones
    /// building the devices returns.
    pub fn check(&self) -> Result<(), DeviceError> {
        if let Some(net) = &self.net {
            drop(virtio::net::Tap::open(&net.tap)?);
        }
        if let Some(disk) = &self.disk {
            Block::check_file(disk)?;
        }
        Ok(())
    }
}

impl Devices {
    pub fn new(
        config: &DeviceConfig,
        vm: &VmFd,
        mem_size: u64,
        mem: GuestMemory,
        events: Arc<Events>,
        hooks: &Arc<Hooks>,
    ) -> Result<Devices, DeviceError> {
        // In the order `DeviceConfig::kinds` lists them.
        let mut models: Vec<Box<dyn virtio::VirtioDevice>> = Vec::new();
        let mut tap = None;
        let gate = Arc::new(Gate::default());
        if let Some(net) = &config.net {
            let net = Net::new(net, config.net_offload, hooks.clone(), gate.pause_flag())?;
            tap = Some(net.tap_sink());
            models.push(Box::new(net));
        }
        if let Some(disk) = &config.disk {
            models.push(Box::new(Block::open(disk, config.disk_io, hooks.clone())?));
        }
        let os = |op| move |err| DeviceError::Os { op, err };
        let mut slots = Vec::new();
        for (i, model) in models.into_iter().enumerate() {
            let base = mmio_base(mem_size) + i as u64 * MMIO_SLOT_SIZE;
            let transport = MmioTransport::new(model, config.used_notify);
            let mut notify = Vec::new();
            for q in 0..transport.queue_count() {
                let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
                vm.register_ioevent(&evt, &IoEventAddress::Mmio(base + REG_QUEUE_NOTIFY), q as u32)
                    .map_err(|e| DeviceError::Os { op: "KVM_IOEVENTFD", err: e.into() })?;
                notify.push(evt);
            }
            let io = transport.deferred_io();
            let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
            slots.push(Arc::new(Slot { base, transport: Mutex::new(transport), notify, stop, io }));
        }
        // A device thread's pass serves every queue: ringing the first
        // doorbell is enough to bring it back.
        let doorbells = slots.iter().map(|s| s.notify[0].try_clone()).collect::<Result<Vec<_>, _>>().map_err(os("eventfd"))?;
        let waker = Waker(doorbells.into());
        Ok(Devices { slots, gate, threads: Mutex::new(Vec::new()), mem, events, tap, waker })
    }

    /// Wakes the device threads (for hooks that made a device wait).
    pub fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// Writes frames straight to the network card's TAP, bypassing the TX
    /// hook: for frames the host itself sends, and for a TX hook that
    /// forwards frames when it decides to.
    pub fn tap_sink(&self) -> Option<Arc<dyn FrameSink>> {
        self.tap.clone()
    }

    /// Device kinds in slot order (the VM's device shape).
    pub fn kinds(&self) -> Vec<DeviceKind> {
        self.slots.iter().map(|s| s.lock().kind()).collect()
    }

    /// Throw away host input that is queued but not delivered (frames
    /// waiting on a TAP of a VM that does not run yet).
    pub fn drop_queued_host_input(&self) {
        for slot in &self.slots {
            slot.lock().drop_queued_host_input();
        }
    }

    /// Read host input (a TAP) or not: off, a network card reads nothing
    /// from its TAP and its device thread does not watch it (no wake-up per
    /// frame); on again, it drops what queued meanwhile before reading.
    /// For a VM whose input comes from elsewhere (a VSMR replica that does
    /// not lead gets it from the log).
    pub fn set_host_input(&self, on: bool) {
        for slot in &self.slots {
            slot.lock().set_host_input(on);
        }
        // The device threads watch (or stop watching) the TAP at their next pass.
        self.waker.wake();
    }

    /// Deliver `frames` (each with its virtio-net header, as the TAP gives
    /// them) to the guest's network card before any frame from its TAP:
    /// input that reached another host (a primary that failed) on its way
    /// to this VM. Without a network card they are dropped.
    pub fn inject_host_input(&self, mut frames: Vec<Vec<u8>>) {
        for slot in &self.slots {
            let mut transport = slot.lock();
            if transport.kind() == DeviceKind::Net {
                transport.inject_host_input(std::mem::take(&mut frames));
            }
        }
        self.waker.wake();
    }

    /// Take back the injected frames the guest has not received yet (its
    /// receive queue had no room), in order.
    pub fn take_injected_host_input(&self) -> Vec<Vec<u8>> {
        self.slots.iter().flat_map(|s| s.lock().take_injected_host_input()).collect()
    }

    /// Whether injected frames still wait for the guest's receive
    /// buffers (the device thread has not placed them yet).
    pub fn injected_host_input_pending(&self) -> bool {
        self.slots.iter().any(|s| s.lock().injected_host_input_pending())
    }

    /// The device list for the guest's boot information.
    pub fn abi_list(&self) -> Vec<ftvm_abi::Device> {
        self.slots
            .iter()
            .map(|s| ftvm_abi::Device { kind: s.lock().kind().abi_kind(), reserved: 0, mmio_base: s.base, mmio_size: MMIO_SLOT_SIZE })
            .collect()
    }

    /// The guest-physical window the devices occupy, if any.
    pub fn window(&self) -> Option<(u64, u64)> {
        let first = self.slots.first()?;
        Some((first.base, self.slots.len() as u64 * MMIO_SLOT_SIZE))
    }

    fn slot(&self, addr: u64) -> Option<(&Slot, u64)> {
        self.slots.iter().find(|s| (s.base..s.base + MMIO_SLOT_SIZE).contains(&addr)).map(|s| (&**s, addr - s.base))
    }

    /// A vCPU read a device register; false if no device is there.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) -> bool {
        let Some((slot, offset)) = self.slot(addr) else { return false };
        slot.lock().read(offset, data);
        true
    }

    /// A vCPU wrote a device register; false if no device is there.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) -> bool {
        let Some((slot, offset)) = self.slot(addr) else { return false };
        if offset == REG_QUEUE_NOTIFY {
            // Normally KVM's ioeventfd catches this store; pass it on if not.
            if let Some(evt) = data.first().and_then(|&q| slot.notify.get(q as usize)) {
                let _ = evt.write(1);
            }
            return true;
        }
        slot.lock().write(offset, data);
        true
    }

    pub fn start(&self) -> std::io::Result<()> {
        let mut threads = self.threads.locked();
        if !threads.is_empty() {
            return Ok(());
        }
        for (i, slot) in self.slots.iter().enumerate() {
            let (slot, gate, mem, events) = (slot.clone(), self.gate.clone(), self.mem.clone(), self.events.clone());
            let t = std::thread::Builder::new().name(format!("device{i}")).spawn(move || serve::serve(&slot, &gate, &mem, &events))?;
            threads.push(t);
        }
        Ok(())
    }

    /// Stop all device work; when this returns no device touches guest
    /// memory. Disk I/O in progress outside a device's pass (`--disk-io
    /// async`) is not waited for: it never touches guest memory, and its
    /// requests stay on the disk's pending list.
    pub fn pause(&self) {
        self.gate.set(Some(true), false);
        for slot in &self.slots {
            drop(slot.lock()); // waits out work in progress
        }
    }

    pub fn resume(&self) {
        self.gate.set(Some(false), false);
        // A pass cut short by the pause (`PauseFlag`) left work that no new
        // event may announce (the TAP is watched edge-triggered).
        if self.gate.take_work_left() {
            self.waker.wake();
        }
    }

    pub fn stop(&self) {
        self.gate.set(None, true);
        for slot in &self.slots {
            let _ = slot.stop.write(1);
        }
        let threads: Vec<_> = self.threads.locked().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Devices {
    /// Each device's component, in slot order: `devices/` and its kind with
    /// its number among the devices of that kind (`devices/net0`,
    /// `devices/disk0`), so that an id names the same device whatever
    /// other devices a VM gains.
    pub fn component_ids(&self) -> Vec<ComponentId> {
        component_ids(&self.kinds())
    }

    /// Save every device (transport and model, `MmioTransport`'s state)
    /// into `out`.
    pub fn save_into(&self, out: &mut Components) -> Result<(), DeviceError> {
        for (slot, id) in self.slots.iter().zip(self.component_ids()) {
            out.save(id, &*slot.lock())?;
        }
        Ok(())
    }

    /// Whether `saved` has exactly this VM's devices.
    pub fn check(&self, saved: &Components) -> Result<(), DeviceError> {
        let ours = self.component_ids();
        let theirs: Vec<&ComponentId> = saved.ids().filter(|id| id.as_str().starts_with(DEVICES)).collect();
        if theirs.len() == ours.len() && ours.iter().all(|id| saved.contains(id)) {
            return Ok(());
        }
        let saved = theirs.into_iter().map(|id| saved.state::<DeviceState>(id).map(|d| d.kind)).collect::<Result<_, _>>()?;
        Err(DeviceError::Mismatch { saved, present: self.kinds() })
    }

    /// Load the devices' state from `saved` (`check` accepted it). Their
    /// threads must be paused (`pause`), or never started, so no request
    /// is in progress. Guest memory must be restored already: requests the
    /// devices had in flight are issued again from their buffers, before
    /// the guest runs.
    pub fn restore_from(&self, saved: &Components) -> Result<(), DeviceError> {
        for (slot, id) in self.slots.iter().zip(self.component_ids()) {
            saved.restore(&id, &mut *slot.lock())?;
        }
        for slot in &self.slots {
            slot.lock().issue_restored(&self.mem);
        }
        Ok(())
    }
}

/// Where the devices' components are in the tree.
const DEVICES: &str = "devices/";

fn component_ids(kinds: &[DeviceKind]) -> Vec<ComponentId> {
    kinds
        .iter()
        .enumerate()
        .map(|(i, kind)| {
            let nth = kinds[..i].iter().filter(|k| *k == kind).count();
            ComponentId::new(format!("{DEVICES}{kind}{nth}"))
        })
        .collect()
}

/// Requests the devices in `saved` had in flight (a disk's pending list);
/// a device whose state does not decode counts none.
pub fn requests_in_flight<'a>(saved: impl IntoIterator<Item = (&'a ComponentId, &'a [u8])>) -> u64 {
    saved
        .into_iter()
        .filter(|(id, _)| id.as_str().starts_with(DEVICES))
        .filter_map(|(_, bytes)| crate::persist::decode::<DeviceState>(bytes).ok())
        .map(|d| d.requests_in_flight() as u64)
        .sum()
}

impl Drop for Devices {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_print_as_the_command_line_names_them() {
        assert_eq!(KindList(&[DeviceKind::Net, DeviceKind::Block]).to_string(), "[net, disk]");
        let e = DeviceError::Mismatch { saved: vec![DeviceKind::Net], present: vec![] };
        assert_eq!(e.to_string(), "the saved VM has devices [net], this VM has []");
    }

    #[test]
    fn device_ids_count_within_their_kind() {
        let ids = component_ids(&[DeviceKind::Net, DeviceKind::Block, DeviceKind::Block]);
        let names: Vec<&str> = ids.iter().map(ComponentId::as_str).collect();
        assert_eq!(names, ["devices/net0", "devices/disk0", "devices/disk1"]);
    }

    #[test]
    fn kinds_match_virtio_and_the_guest_abi() {
        assert_eq!(DeviceKind::Net.virtio_id(), 1);
        assert_eq!(DeviceKind::Block.virtio_id(), 2);
        assert_ne!(DeviceKind::Net.abi_kind(), DeviceKind::Block.abi_kind());
    }
}
