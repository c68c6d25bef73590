//! Dirty device-state tracking (`--device-state changed`): a vCPU's,
//! device's, the clock's or guest memory's state goes into a checkpoint
//! only if it differs from what this primary last sent the backup; the
//! backup keeps the rest from the checkpoint before (`StateDelta::over`).
//! Components are compared by their encoding, so "unchanged" is exact.
//!
//! A vCPU is compared without its time-stamp counter, which moves on even
//! while it is halted; one that differs only there carries the counter
//! alone (`VcpuDelta::Tsc`).
//!
//! Every component is still saved in the pause (reading a vCPU's registers
//! is what tells whether they changed; KVM has no dirty bit for them); what
//! is saved is the bytes on the wire.

use serde::Serialize;

use ftvm_vmm::vcpu::VcpuState;

use crate::checkpoint::{StateDelta, VcpuDelta, MSR_IA32_TSC};
use ftvm_vmm::switch;

switch! {
    /// `--device-state`: which vCPU and device state a checkpoint carries.
    pub enum States {
        /// Every component, every checkpoint.
        All = "all",
        /// Only the components that changed since the previous checkpoint.
        Changed = "changed",
    }
}

/// What the backup was last sent of each component, in `StateDelta` order
/// (memory, vCPUs, devices, clock), encoded.
pub struct SentState {
    mode: States,
    sent: Vec<Vec<u8>>,
}

impl SentState {
    pub fn new(mode: States) -> SentState {
        SentState { mode, sent: Vec::new() }
    }

    /// A new backup: it has none of it.
    pub fn reset(&mut self) {
        self.sent.clear();
    }

    /// Leave out of `delta` (whole, as saved) what the backup has already.
    pub fn filter(&mut self, delta: &mut StateDelta) {
        if self.mode == States::All {
            return;
        }
        let sent = &mut self.sent;
        let mut at = 0;
        keep_if_changed(sent, &mut at, &mut delta.memory);
        for v in &mut delta.vcpus {
            let VcpuDelta::Whole(state) = v else { continue };
            let tsc = take_tsc(state);
            let mut kept = Some(&*state);
            keep_if_changed(sent, &mut at, &mut kept);
            let unchanged = kept.is_none();
            set_tsc(state, tsc);
            if unchanged {
                *v = VcpuDelta::Tsc(tsc);
            }
        }
        for d in &mut delta.devices {
            keep_if_changed(sent, &mut at, d);
        }
        keep_if_changed(sent, &mut at, &mut delta.clock);
    }
}

/// Zero the vCPU's counter (so it takes no part in the comparison) and
/// return it.
fn take_tsc(state: &mut VcpuState) -> u64 {
    state.msrs.iter_mut().find(|m| m.index == MSR_IA32_TSC).map_or(0, |m| std::mem::take(&mut m.data))
}

fn set_tsc(state: &mut VcpuState, tsc: u64) {
    if let Some(m) = state.msrs.iter_mut().find(|m| m.index == MSR_IA32_TSC) {
        m.data = tsc;
    }
}

/// Component `*at` of the stream: left out (None) if its encoding equals
/// what was sent for it last; otherwise remembered as sent.
fn keep_if_changed<T: Serialize>(sent: &mut Vec<Vec<u8>>, at: &mut usize, component: &mut Option<T>) {
    let i = *at;
    *at += 1;
    let Some(value) = component else { return };
    let bytes = postcard::to_allocvec(value).expect("state serializes");
    if i >= sent.len() {
        sent.push(bytes);
    } else if sent[i] == bytes {
        *component = None;
    } else {
        sent[i] = bytes;
    }
}
