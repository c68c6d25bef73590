//! Raw hypercalls: `out %eax, %dx` with `eax` = address of the argument block.
//!
//! The VMM reads the block when the `out` exits and writes results back into
//! it before the vCPU resumes, so the asm must not be `nomem`/`readonly`: the
//! compiler has to store the block before and reload it after.

use core::arch::asm;

use ftvm_abi::{port, Abort, AddressSpace, ConsoleWrite, Exit, FaultHandler, Kick, Wait};

/// # Safety
/// `block` must be the argument block type the VMM expects on `port`, and
/// every address inside it must be valid for the access the call implies.
unsafe fn call<T>(port: u16, block: &mut T) {
    let addr = block as *mut T as u64;
    // Stack and image live below 4 GiB (ABI); a truncated address would make
    // the VMM read some other memory.
    debug_assert!(addr >> 32 == 0);
    // SAFETY: `out` to a hypercall port only exits to the VMM, which accesses
    // `block` (exclusively borrowed here) per the ABI; the missing `nomem`
    // makes the compiler treat the block as read and written.
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") addr as u32, options(nostack, preserves_flags)) };
}

pub fn console_write(bytes: &[u8]) {
    let mut b = ConsoleWrite { buf: bytes.as_ptr() as u64, len: bytes.len() as u64 };
    // SAFETY: the block describes a live, readable byte slice.
    unsafe { call(port::CONSOLE_WRITE, &mut b) };
}

/// Returns the VMM's event sequence number (see [`ftvm_abi::Wait`]).
pub fn wait(deadline_ns: u64, seen: u64) -> u64 {
    let mut b = Wait { deadline_ns, seen, seq: 0 };
    // SAFETY: the block holds no addresses, so the VMM touches only the
    // block itself (it writes `seq`).
    unsafe { call(port::WAIT, &mut b) };
    b.seq
}

pub fn kick() {
    let mut b = Kick::default();
    // SAFETY: the block holds no addresses, so the VMM touches only the
    // block itself.
    unsafe { call(port::KICK, &mut b) };
}

/// Load the page tables rooted at `root` (0: the VMM's identity tables);
/// see [`ftvm_abi::AddressSpace`].
///
/// # Safety
/// `root` must be a PML4 whose tables map the system area as the VMM's do
/// and identity-map everything the caller touches afterwards (its code,
/// stack and data), for as long as it stays loaded.
pub unsafe fn set_address_space(root: u64) {
    let mut b = AddressSpace { root };
    // SAFETY: the block holds only the root, which the caller vouches for.
    unsafe { call(port::ADDRESS_SPACE, &mut b) };
}

/// Reflect the calling vCPU's CPL3 page faults to `handler` on the stack
/// whose top is `stack` (`handler` 0: stop the VM on them again); see
/// [`ftvm_abi::FaultHandler`].
///
/// # Safety
/// `handler` must be code that resumes the program as the ABI says, and
/// `stack` the top of memory nothing else uses, writable under every page
/// table the vCPU loads.
pub unsafe fn set_fault_handler(handler: u64, stack: u64) {
    let mut b = FaultHandler { handler, stack };
    // SAFETY: the block holds only the two addresses, which the caller
    // vouches for; the VMM writes nothing back.
    unsafe { call(port::FAULT_HANDLER, &mut b) };
}

/// Asks the VMM to stop the VM; it does not resume this vCPU normally.
pub fn exit(status: u64) {
    let mut b = Exit { status };
    // SAFETY: the block holds no addresses, so the VMM touches only the
    // block itself.
    unsafe { call(port::EXIT, &mut b) };
}

/// Like [`exit`], reporting a guest panic with `msg`.
pub fn abort(msg: &[u8]) {
    let mut b = Abort { msg: msg.as_ptr() as u64, len: msg.len() as u64 };
    // SAFETY: the block describes a live, readable byte slice.
    unsafe { call(port::ABORT, &mut b) };
}
