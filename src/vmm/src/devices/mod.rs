//! The VM's devices: virtio-mmio slots above guest RAM, each served by its
//! own thread, which can be paused with the vCPUs and saved with the VM.

pub mod virtio;

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use kvm_ioctls::{IoEventAddress, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemory;
use crate::vcpu::control::Events;
use virtio::block::{Block, BlockError};
use virtio::mmio::{MmioTransport, TransportState, REG_QUEUE_NOTIFY};
use virtio::block_journal::DiskJournal;
use virtio::net::{Net, NetConfig, OutputBuffer, TapError};

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
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error("cannot set up device plumbing ({op}): {err}")]
    Os { op: &'static str, err: std::io::Error },
    #[error("the saved VM has devices {saved:?}, this VM has {present:?}")]
    Mismatch { saved: Vec<u32>, present: Vec<u32> },
    #[error("cannot restore device state: {0}")]
    Restore(String),
}

/// One device's saved state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceState {
    pub device_type: u32,
    pub transport: TransportState,
}

/// Lets the pauser stop every device thread between two pieces of work.
#[derive(Default)]
struct Gate {
    state: Mutex<(bool, bool)>, // (paused, stopping)
    changed: Condvar,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, (bool, bool)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Block while paused; false once stopping.
    fn wait_running(&self) -> bool {
        let mut st = self.lock();
        while st.0 && !st.1 {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        !st.1
    }

    fn paused(&self) -> bool {
        self.lock().0
    }

    fn set(&self, paused: Option<bool>, stopping: bool) {
        let mut st = self.lock();
        if let Some(p) = paused {
            st.0 = p;
        }
        st.1 |= stopping;
        self.changed.notify_all();
    }
}

struct Slot {
    base: u64,
    transport: Mutex<MmioTransport>,
    /// One doorbell per queue, written by KVM on a QueueNotify store.
    notify: Vec<EventFd>,
    stop: EventFd,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, MmioTransport> {
        self.transport.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct Devices {
    slots: Vec<Arc<Slot>>,
    gate: Arc<Gate>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    mem: GuestMemory,
    events: Arc<Events>,
    output: Arc<OutputBuffer>,
    journal: Arc<DiskJournal>,
}

impl Devices {
    pub fn new(config: &DeviceConfig, vm: &VmFd, mem_size: u64, mem: GuestMemory, events: Arc<Events>) -> Result<Devices, DeviceError> {
        let output = Arc::new(OutputBuffer::default());
        let journal = Arc::new(DiskJournal::default());
        let mut models: Vec<Box<dyn virtio::VirtioDevice>> = Vec::new();
        if let Some(net) = &config.net {
            models.push(Box::new(Net::new(net, output.clone())?));
        }
        if let Some(disk) = &config.disk {
            models.push(Box::new(Block::open(disk, journal.clone())?));
        }
        let os = |op| move |err| DeviceError::Os { op, err };
        let mut slots = Vec::new();
        for (i, model) in models.into_iter().enumerate() {
            let base = mmio_base(mem_size) + i as u64 * MMIO_SLOT_SIZE;
            let transport = MmioTransport::new(model);
            let mut notify = Vec::new();
            for q in 0..transport.queue_count() {
                let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
                vm.register_ioevent(&evt, &IoEventAddress::Mmio(base + REG_QUEUE_NOTIFY), q as u32)
                    .map_err(|e| DeviceError::Os { op: "KVM_IOEVENTFD", err: e.into() })?;
                notify.push(evt);
            }
            let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
            slots.push(Arc::new(Slot { base, transport: Mutex::new(transport), notify, stop }));
        }
        Ok(Devices { slots, gate: Arc::new(Gate::default()), threads: Mutex::new(Vec::new()), mem, events, output, journal })
    }

    /// Network output: held per epoch while the VM is protected.
    pub fn output(&self) -> &Arc<OutputBuffer> {
        &self.output
    }

    /// Disk writes per epoch, for the backup's disk replica.
    pub fn disk_journal(&self) -> &Arc<DiskJournal> {
        &self.journal
    }

    /// Device types in slot order (the VM's device shape).
    pub fn types(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.lock().device_type()).collect()
    }

    /// Throw away host-side input queued so far (see `VirtioDevice::discard_host_input`).
    pub fn discard_host_input(&self) {
        for slot in &self.slots {
            slot.lock().discard_host_input();
        }
    }

    /// The device list for the guest's boot information.
    pub fn abi_list(&self) -> Vec<ftvm_abi::Device> {
        self.slots
            .iter()
            .map(|s| ftvm_abi::Device {
                kind: match s.lock().device_type() {
                    virtio::TYPE_NET => ftvm_abi::device_kind::VIRTIO_MMIO_NET,
                    _ => ftvm_abi::device_kind::VIRTIO_MMIO_BLOCK,
                },
                reserved: 0,
                mmio_base: s.base,
                mmio_size: MMIO_SLOT_SIZE,
            })
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
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        if !threads.is_empty() {
            return Ok(());
        }
        for (i, slot) in self.slots.iter().enumerate() {
            let (slot, gate, mem, events) = (slot.clone(), self.gate.clone(), self.mem.clone(), self.events.clone());
            let t = std::thread::Builder::new().name(format!("device{i}")).spawn(move || serve(&slot, &gate, &mem, &events))?;
            threads.push(t);
        }
        Ok(())
    }

    /// Stop all device work; when this returns no device touches guest memory.
    pub fn pause(&self) {
        self.gate.set(Some(true), false);
        for slot in &self.slots {
            drop(slot.lock()); // waits out work in progress
        }
    }

    pub fn resume(&self) {
        self.gate.set(Some(false), false);
    }

    pub fn save(&self) -> Vec<DeviceState> {
        self.slots
            .iter()
            .map(|s| {
                let t = s.lock();
                DeviceState { device_type: t.device_type(), transport: t.save() }
            })
            .collect()
    }

    pub fn restore(&self, states: &[DeviceState]) -> Result<(), DeviceError> {
        let present = self.types();
        let saved: Vec<u32> = states.iter().map(|s| s.device_type).collect();
        if present != saved {
            return Err(DeviceError::Mismatch { saved, present });
        }
        for (slot, state) in self.slots.iter().zip(states) {
            slot.lock().restore(&state.transport).map_err(|e| DeviceError::Restore(e.to_string()))?;
        }
        Ok(())
    }

    pub fn stop(&self) {
        self.gate.set(None, true);
        for slot in &self.slots {
            let _ = slot.stop.write(1);
        }
        let threads: Vec<_> = self.threads.lock().unwrap_or_else(|p| p.into_inner()).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Devices {
    fn drop(&mut self) {
        self.stop();
    }
}

const TOKEN_HOST: u64 = 1 << 32;
const TOKEN_STOP: u64 = 2 << 32;

/// A device thread: wait for doorbells or host I/O, then give the device a
/// full pass (every queue and the host side), so no kick that arrived while
/// paused is lost.
fn serve(slot: &Slot, gate: &Gate, mem: &GuestMemory, events: &Events) {
    let Ok(epoll) = Epoll::new() else {
        tracing::error!("device thread cannot create epoll");
        return;
    };
    let add = |fd, set, token| epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(set, token));
    let mut ok = add(slot.stop.as_raw_fd(), EventSet::IN, TOKEN_STOP).is_ok();
    for (q, evt) in slot.notify.iter().enumerate() {
        ok &= add(evt.as_raw_fd(), EventSet::IN, q as u64).is_ok();
    }
    if let Some(fd) = slot.lock().host_fd() {
        ok &= add(fd, EventSet::IN | EventSet::EDGE_TRIGGERED, TOKEN_HOST).is_ok();
    }
    if !ok {
        tracing::error!("device thread cannot watch its descriptors");
        return;
    }
    let mut ready = vec![EpollEvent::default(); 8];
    while gate.wait_running() {
        match epoll.wait(100, &mut ready) {
            Ok(n) if ready[..n].iter().any(|e| e.data() == TOKEN_STOP) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::error!(error = %e, "device thread epoll failed");
                return;
            }
        }
        let mut transport = slot.lock();
        if gate.paused() {
            continue; // doorbells stay pending; the pass after resume serves them
        }
        for evt in &slot.notify {
            let _ = evt.read();
        }
        let mut used = false;
        let mut result = Ok(());
        for q in 0..transport.queue_count() {
            match transport.process_queue(q, mem) {
                Ok(u) => used |= u,
                Err(e) => result = Err(e),
            }
        }
        match transport.process_host(mem) {
            Ok(u) => used |= u,
            Err(e) => result = Err(e),
        }
        if let Err(e) = result {
            tracing::error!(error = %e, "device failed; marking it FAILED for the driver");
            transport.fail();
        }
        drop(transport);
        if used {
            events.signal();
        }
    }
}
