//! The checkpoint on the wire: `epoch u64 | bundle`, where the bundle's
//! state is the VM's state (each component whole, or left out when it is
//! what the previous checkpoint carried) plus the epoch's disk writes, and
//! its pages are the epoch's dirty pages (see `ftvm_vmm::pages`).

use serde::{Deserialize, Serialize};

use ftvm_vmm::clock::ClockState;
use ftvm_vmm::devices::DeviceState;
use ftvm_vmm::memory::MemoryState;
use ftvm_vmm::pages::{Bundle, Cursor};
use ftvm_vmm::vcpu::VcpuState;
use ftvm_vmm::VmState;

use crate::output::DiskWrite;
use crate::protocol::ProtocolError;

/// What a checkpoint carries besides pages.
#[derive(Debug, Serialize, Deserialize)]
pub struct CheckpointState {
    pub vm: StateDelta,
    /// The guest's disk writes of the epoch, in the order they completed.
    pub disk: Vec<DiskWrite>,
    /// The fake-ACK proxy's flows and stored data at the freeze
    /// (`--fake-ack on`), whole or as changes over the previous
    /// checkpoint's (`fakeack::delta`): a backup that takes over sends what
    /// the peer has not acknowledged and runs the proxy on.
    pub fake_ack: Option<crate::fakeack::delta::Carried>,
}

/// The VM's state as a checkpoint carries it: every component (guest
/// memory's, each vCPU's, each device's, the clock's) whole, or `None`
/// when it is exactly what the previous checkpoint of the stream left the
/// backup with (`--device-state changed`). The first checkpoint to a
/// backup carries every component.
#[derive(Debug, Serialize, Deserialize)]
pub struct StateDelta {
    pub memory: Option<MemoryState>,
    pub vcpus: Vec<VcpuDelta>,
    pub devices: Vec<Option<DeviceState>>,
    pub clock: Option<ClockState>,
}

/// One vCPU's state in a checkpoint. Its time-stamp counter moves on even
/// while it is halted, and all vCPUs' counters must stay in step: a vCPU
/// otherwise unchanged carries its counter alone.
#[derive(Debug, Serialize, Deserialize)]
pub enum VcpuDelta {
    Whole(Box<VcpuState>),
    /// As the previous checkpoint left it, but for `IA32_TSC`.
    Tsc(u64),
}

/// The time-stamp counter MSR.
pub const MSR_IA32_TSC: u32 = 0x10;

impl StateDelta {
    /// Every component of `state`.
    pub fn whole(state: VmState) -> StateDelta {
        StateDelta {
            memory: Some(state.memory),
            vcpus: state.vcpus.into_iter().map(|v| VcpuDelta::Whole(Box::new(v))).collect(),
            devices: state.devices.into_iter().map(Some).collect(),
            clock: Some(state.clock),
        }
    }

    /// Components left out (a vCPU that carries only its counter counts).
    pub fn omitted(&self) -> usize {
        let missing = |o: bool| usize::from(!o);
        missing(self.memory.is_some())
            + self.vcpus.iter().filter(|v| matches!(v, VcpuDelta::Tsc(_))).count()
            + self.devices.iter().filter(|d| d.is_none()).count()
            + missing(self.clock.is_some())
    }

    /// Whether this delta makes a whole state on top of `base` (the state
    /// the last checkpoint left): the same number of vCPUs and devices, and
    /// nothing left out without a base.
    pub fn check(&self, base: Option<&VmState>) -> Result<(), String> {
        match base {
            None if self.omitted() > 0 => Err("it leaves out state this backup never received".into()),
            Some(b) if b.vcpus.len() != self.vcpus.len() || b.devices.len() != self.devices.len() => Err(format!(
                "it has {} vCPUs and {} devices, the previous one {} and {}",
                self.vcpus.len(),
                self.devices.len(),
                b.vcpus.len(),
                b.devices.len()
            )),
            _ => Ok(()),
        }
    }

    /// The whole state: this delta over `base`, which `check` accepted.
    pub fn over(self, base: Option<VmState>) -> VmState {
        let Some(mut base) = base else {
            let whole = "checked: nothing left out without a base";
            return VmState {
                memory: self.memory.expect(whole),
                vcpus: self
                    .vcpus
                    .into_iter()
                    .map(|v| match v {
                        VcpuDelta::Whole(v) => *v,
                        VcpuDelta::Tsc(_) => unreachable!("{whole}"),
                    })
                    .collect(),
                devices: self.devices.into_iter().map(|d| d.expect(whole)).collect(),
                clock: self.clock.expect(whole),
            };
        };
        if let Some(m) = self.memory {
            base.memory = m;
        }
        for (slot, v) in base.vcpus.iter_mut().zip(self.vcpus) {
            match v {
                VcpuDelta::Whole(v) => *slot = *v,
                VcpuDelta::Tsc(tsc) => slot.msrs.iter_mut().filter(|m| m.index == MSR_IA32_TSC).for_each(|m| m.data = tsc),
            }
        }
        for (slot, d) in base.devices.iter_mut().zip(self.devices) {
            if let Some(d) = d {
                *slot = d;
            }
        }
        if let Some(c) = self.clock {
            base.clock = c;
        }
        base
    }
}

/// A received checkpoint, fully parsed and checked against the replica it
/// is for, before anything is applied.
pub struct Checkpoint<'a> {
    pub epoch: u64,
    pub state: CheckpointState,
    pub pages: Bundle<'a>,
    /// The fake-ACK proxy's whole state after this checkpoint: made by the
    /// apply's stage from `state.fake_ack` over what the replica holds.
    pub fake_ack: Option<crate::fakeack::State>,
}

impl<'a> Checkpoint<'a> {
    pub fn parse(payload: &'a [u8], ram_pages: u64, disk_size: u64) -> Result<Checkpoint<'a>, ProtocolError> {
        let mut c = Cursor::new(payload);
        let epoch = c.u64()?;
        let pages = Bundle::parse(&mut c, ram_pages).map_err(|e| ProtocolError::Corrupt(format!("checkpoint {epoch}: {e}")))?;
        if !c.is_empty() {
            return Err(ProtocolError::Corrupt(format!("checkpoint {epoch} has trailing bytes")));
        }
        let state: CheckpointState = crate::protocol::decode(pages.state)?;
        if let Some(w) = state.disk.iter().find(|w| w.offset.checked_add(w.data.len() as u64).is_none_or(|e| e > disk_size)) {
            return Err(ProtocolError::Corrupt(format!(
                "checkpoint {epoch} writes {} bytes at disk offset {}, beyond the {disk_size}-byte disk",
                w.data.len(),
                w.offset
            )));
        }
        Ok(Checkpoint { epoch, state, pages, fake_ack: None })
    }
}
