//! The guest's port-I/O hypercalls (see `ftvm_abi::port`).
//!
//! The port's 32-bit data is the guest address of an argument block; the VMM
//! reads arguments from it and writes results back through the guest memory
//! API, which marks the pages in the VMM dirty bitmap.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use ftvm_abi::port;

use crate::exit::VmExit;
use crate::run_control::IdlePause;
use crate::shared::VmShared;

/// Longest console write or panic message accepted in one call.
const MAX_TEXT: u64 = 64 * 1024;

pub enum Outcome {
    Continue,
    /// Run the hypercall again once the vCPU next runs, as if it had never
    /// been made: the guest sees no return (see `wait`).
    Restart,
    /// The wait hypercall, to be waited out by the vCPU thread with its
    /// vCPU unlocked and counted as parked (`IdlePause::Park`).
    Park(WaitCall),
    /// Load this CR3 into the calling vCPU (the address-space hypercall).
    SetRoot(u64),
    Stop(VmExit),
}

fn read_u64(shared: &VmShared, addr: u64) -> Result<u64, String> {
    shared.ram.memory().read_obj(GuestAddress(addr)).map_err(|_| format!("argument block at {addr:#x} is outside guest memory"))
}

fn read_text(shared: &VmShared, buf: u64, len: u64) -> Result<Vec<u8>, String> {
    if len > MAX_TEXT {
        return Err(format!("text of {len} bytes exceeds the {MAX_TEXT}-byte limit"));
    }
    let mut bytes = vec![0u8; len as usize];
    shared.ram.memory().read_slice(&mut bytes, GuestAddress(buf)).map_err(|_| format!("text at {buf:#x}+{len} is outside guest memory"))?;
    Ok(bytes)
}

/// Handle `out` to a hypercall port; `None` if `port` is not one.
pub fn handle(shared: &VmShared, vcpu: u32, port: u16, data: &[u8]) -> Option<Outcome> {
    if !(port::CONSOLE_WRITE..=port::FAULT_HANDLER).contains(&port) {
        return None;
    }
    let Ok(addr) = <[u8; 4]>::try_from(data).map(u32::from_le_bytes) else {
        let e = format!("vCPU {vcpu}: hypercall on port {port:#x} must be a 32-bit out, was {} bytes", data.len());
        return Some(Outcome::Stop(VmExit::Error(e)));
    };
    let result = match port {
        port::CONSOLE_WRITE => console_write(shared, addr as u64),
        port::WAIT => wait(shared, addr as u64),
        port::EXIT => read_u64(shared, addr as u64).map(|s| Outcome::Stop(VmExit::Exited(s as u8))),
        port::ABORT => abort(shared, vcpu, addr as u64),
        port::ADDRESS_SPACE => address_space(shared, addr as u64),
        port::FAULT_HANDLER => fault_handler(shared, vcpu, addr as u64),
        _ => {
            shared.events.signal();
            Ok(Outcome::Continue)
        }
    };
    Some(result.unwrap_or_else(|e| Outcome::Stop(VmExit::Error(format!("vCPU {vcpu}: bad hypercall {port:#x}: {e}")))))
}

fn console_write(shared: &VmShared, addr: u64) -> Result<Outcome, String> {
    let (buf, len) = (read_u64(shared, addr)?, read_u64(shared, addr + 8)?);
    let text = read_text(shared, buf, len)?;
    match shared.hooks.console() {
        Some(sink) => sink.write(&text),
        None => shared.console.write(&text),
    }
    Ok(Outcome::Continue)
}

fn abort(shared: &VmShared, vcpu: u32, addr: u64) -> Result<Outcome, String> {
    let (msg, len) = (read_u64(shared, addr)?, read_u64(shared, addr + 8)?);
    let message = String::from_utf8_lossy(&read_text(shared, msg, len)?).into_owned();
    Ok(Outcome::Stop(VmExit::Panic { vcpu, message }))
}

/// The page-table root to load: 0 is the VMM's own tables. A guest root
/// must be a whole page of RAM above the system area (the CPU would walk
/// anything else as tables); what the guest put in it is the guest's affair,
/// as its tables are on any machine.
fn address_space(shared: &VmShared, addr: u64) -> Result<Outcome, String> {
    let root = read_u64(shared, addr)?;
    if root == 0 {
        return Ok(Outcome::SetRoot(ftvm_abi::layout::PAGE_TABLE_ROOT));
    }
    let in_ram = |a: u64| shared.ram.memory().address_in_range(GuestAddress(a));
    if !root.is_multiple_of(ftvm_abi::PAGE_SIZE)
        || root < ftvm_abi::layout::SYSTEM_AREA_END
        || !in_ram(root)
        || !in_ram(root + ftvm_abi::PAGE_SIZE - 1)
    {
        return Err(format!("page-table root {root:#x} is not a page of RAM above the system area"));
    }
    Ok(Outcome::SetRoot(root))
}

/// Register (or, with handler 0, remove) the calling vCPU's page-fault
/// handler: written where its ring-0 #PF stub reads it
/// (`layout::fault_handler_slot`), guest memory like any other, so
/// checkpoints and snapshots carry it. The stub writes the fault's record
/// below the stack top at ring 0, so the top must be RAM above the system
/// area (a bad one would fault in ring 0 and stop the VM there).
fn fault_handler(shared: &VmShared, vcpu: u32, addr: u64) -> Result<Outcome, String> {
    let (handler, stack) = (read_u64(shared, addr)?, read_u64(shared, addr + 8)?);
    let record = std::mem::size_of::<ftvm_abi::PageFault>() as u64;
    let in_ram = |a: u64| shared.ram.memory().address_in_range(GuestAddress(a));
    if handler != 0 && (!stack.is_multiple_of(16) || stack < ftvm_abi::layout::SYSTEM_AREA_END + record || !in_ram(stack - 1)) {
        return Err(format!("fault handler stack top {stack:#x} is not 16-byte aligned RAM above the system area"));
    }
    let stack = if handler == 0 { 0 } else { stack };
    let slot = crate::arch::layout::fault_handler_slot(vcpu);
    let mem = shared.ram.memory();
    mem.write_obj(handler, GuestAddress(slot)).and_then(|()| mem.write_obj(stack, GuestAddress(slot + 8))).map_err(|e| e.to_string())?;
    Ok(Outcome::Continue)
}

/// A wait hypercall's arguments: wake when the event sequence moves past
/// `seen` or at `deadline`.
pub struct WaitCall {
    addr: u64,
    seen: u64,
    deadline: Option<std::time::Instant>,
}

impl WaitCall {
    fn read(shared: &VmShared, addr: u64) -> Result<WaitCall, String> {
        let (deadline_ns, seen) = (read_u64(shared, addr)?, read_u64(shared, addr + 8)?);
        let deadline = (deadline_ns != u64::MAX).then(|| std::time::Instant::now() + shared.clock().until(deadline_ns));
        Ok(WaitCall { addr, seen, deadline })
    }

    /// Block until an event or the deadline (the sequence to return), or
    /// until `interrupted` says so (None).
    pub fn block(&self, shared: &VmShared, interrupted: impl Fn() -> bool) -> Option<u64> {
        shared.enter_wait();
        let seq = shared.events.wait(self.seen, self.deadline, interrupted);
        shared.leave_wait();
        let woken = seq != self.seen || self.due();
        woken.then_some(seq)
    }

    /// Whether the deadline has passed.
    fn due(&self) -> bool {
        self.deadline.is_some_and(|d| std::time::Instant::now() >= d)
    }

    /// Return `seq` to the guest, which runs on from here (never inside a
    /// pause: its state is saved after this, or it resumes first). A
    /// stepped clock that the deadline passed is stepped first: the guest
    /// would otherwise wait for the same reading again at once, for ever.
    /// (Not in `block`: a parked wait ends inside a pause, after the
    /// pause took the VM's state and pages.)
    pub fn finish(&self, shared: &VmShared, seq: u64) -> Result<(), String> {
        if self.due() {
            shared.step_clock().map_err(|e| format!("stepping the guest clock: {e}"))?;
        }
        shared.ram.memory().write_obj(seq, GuestAddress(self.addr + 16)).map_err(|e| e.to_string())
    }
}

/// With `IdlePause::Park` the vCPU thread blocks, with its vCPU unlocked
/// (`Outcome::Park`). With `Kick`, a wait the VMM cuts short for its own
/// reasons (a checkpoint's pause, a stop) is restarted rather than
/// returned: an idle vCPU then keeps exactly the registers it had, so a
/// checkpoint finds it unchanged, and the guest is not woken once per
/// checkpoint for nothing.
fn wait(shared: &VmShared, addr: u64) -> Result<Outcome, String> {
    let call = WaitCall::read(shared, addr)?;
    if shared.idle_pause == IdlePause::Park {
        return Ok(Outcome::Park(call));
    }
    match call.block(shared, || shared.control.should_leave()) {
        Some(seq) => call.finish(shared, seq).map(|()| Outcome::Continue),
        None => Ok(Outcome::Restart),
    }
}
