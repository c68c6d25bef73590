//! The ftvm virtual machine monitor core.
//!
//! A [`vm::Vm`] owns guest RAM (a memfd), the KVM VM and one thread per vCPU.
//! Guests are 64-bit programs entered at CPL3 (see `docs/guest-abi.md`); they
//! talk to the VMM through port-I/O hypercalls. The VM can be paused, its
//! complete state saved and restored in another process, and the pages it
//! dirties tracked through KVM's dirty bitmap or dirty ring.

pub mod arch;
pub mod boot;
pub mod calibrate;
pub mod clock;
pub mod components;
pub mod devices;
pub mod dirty;
pub mod exit;
pub mod hooks;
mod hypercall;
pub mod memory;
pub mod pages;
pub mod persist;
mod run_control;
pub mod seccomp;
mod shared;
pub mod snapshot;
mod switch;
pub mod sync;
pub mod vcpu;
pub mod vm;

pub use calibrate::{CalibrationError, FirstWriteCost};
pub use components::{ComponentId, Components};
pub use dirty::DirtyBackend;
pub use exit::{GuestFault, VmExit};
pub use hooks::{Console, Hooks};
pub use memory::PageBitmap;
pub use persist::Persist;
pub use run_control::IdlePause;
pub use vcpu::StateReads;
pub use vm::{Vm, VmConfig, VmError};
