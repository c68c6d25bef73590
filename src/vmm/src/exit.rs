//! Why a VM stopped.

use std::fmt;

/// A CPU exception the guest took, as reported by the ring-0 stubs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestFault {
    pub vcpu: u32,
    pub vector: u8,
    pub error_code: Option<u64>,
    pub rip: u64,
    pub rsp: u64,
    /// Faulting address, for page faults.
    pub cr2: Option<u64>,
}

pub fn vector_name(vector: u8) -> &'static str {
    match vector {
        0 => "#DE divide error",
        1 => "#DB debug",
        2 => "NMI",
        3 => "#BP breakpoint",
        4 => "#OF overflow",
        5 => "#BR bound range",
        6 => "#UD invalid opcode",
        7 => "#NM device not available",
        8 => "#DF double fault",
        10 => "#TS invalid TSS",
        11 => "#NP segment not present",
        12 => "#SS stack fault",
        13 => "#GP general protection",
        14 => "#PF page fault",
        16 => "#MF x87 floating point",
        17 => "#AC alignment check",
        18 => "#MC machine check",
        19 => "#XM SIMD floating point",
        _ => "exception",
    }
}

impl fmt::Display for GuestFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "guest fault on vCPU {}: vector {} ({}) at rip {:#x}", self.vcpu, self.vector, vector_name(self.vector), self.rip)?;
        if let Some(code) = self.error_code {
            write!(f, ", error code {code:#x}")?;
        }
        if let Some(addr) = self.cr2 {
            write!(f, ", address {addr:#x}")?;
        }
        write!(f, ", rsp {:#x}", self.rsp)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmExit {
    /// The guest called the exit hypercall.
    Exited(u8),
    /// A CPU exception in the guest.
    Fault(GuestFault),
    /// The guest runtime panicked.
    Panic { vcpu: u32, message: String },
    /// The VMM stopped the VM (signal or request).
    Stopped,
    /// Something the VMM cannot continue from.
    Error(String),
}

impl VmExit {
    /// The status the VMM process exits with.
    pub fn status(&self) -> i32 {
        match self {
            VmExit::Exited(s) => *s as i32,
            VmExit::Stopped => 0,
            VmExit::Fault(_) | VmExit::Panic { .. } | VmExit::Error(_) => 1,
        }
    }
}

impl fmt::Display for VmExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmExit::Exited(s) => write!(f, "guest exited with status {s}"),
            VmExit::Fault(fault) => fault.fmt(f),
            VmExit::Panic { vcpu, message } => write!(f, "guest panicked on vCPU {vcpu}: {message}"),
            VmExit::Stopped => write!(f, "VM stopped"),
            VmExit::Error(e) => write!(f, "VM failed: {e}"),
        }
    }
}
