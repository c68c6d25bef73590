//! vCPU identity: how many vCPUs the VM has and which one is running.
//!
//! There is no TLS (no fs base at CPL3 without a kernel), so a vCPU finds its
//! index from its stack pointer: every vCPU records the top of its entry stack
//! at `_start`, and stays on that stack for good.

use core::arch::asm;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use ftvm_abi::layout::VCPU_STACK_SIZE;

use crate::MAX_VCPUS;

/// Entry `rsp + 8` of each vCPU, 0 until that vCPU has started.
static STACK_TOP: [AtomicU64; MAX_VCPUS] = [const { AtomicU64::new(0) }; MAX_VCPUS];
static VCPU_COUNT: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn register(vcpu: usize, entry_rsp: u64) {
    STACK_TOP[vcpu].store(entry_rsp + 8, Ordering::Release);
}

pub(crate) fn set_vcpu_count(n: usize) {
    VCPU_COUNT.store(n, Ordering::Release);
}

/// Number of vCPUs of the VM.
pub fn vcpu_count() -> usize {
    VCPU_COUNT.load(Ordering::Acquire)
}

/// Index of the calling vCPU (0..vcpu_count). With a single vCPU it is 0
/// whatever the stack, so code may then run on stacks of its own (the Linux
/// personality's threads do).
pub fn vcpu_id() -> usize {
    if vcpu_count() == 1 {
        return 0;
    }
    let rsp: u64;
    // SAFETY: reads a register, touches nothing.
    unsafe { asm!("mov {}, rsp", out(reg) rsp, options(nomem, nostack, preserves_flags)) };
    for (i, top) in STACK_TOP.iter().enumerate() {
        let top = top.load(Ordering::Relaxed);
        if top != 0 && rsp < top && rsp >= top - VCPU_STACK_SIZE {
            return i;
        }
    }
    panic!("vcpu_id: rsp {rsp:#x} is on no vCPU's entry stack");
}
