//! vCPU threads: run the guest, dispatch its exits, park on request.

use std::sync::{Arc, Mutex, MutexGuard};

use kvm_ioctls::{VcpuExit, VcpuFd};

use super::Vcpu;
use crate::arch::tables::has_error_code;
use crate::exit::{GuestFault, VmExit};
use crate::hypercall::{self, Outcome, WaitCall};
use crate::run_control;
use crate::shared::VmShared;
use crate::sync::Lock;

/// KVM_EXIT_DIRTY_RING_FULL, which kvm-ioctls reports as unsupported.
const EXIT_DIRTY_RING_FULL: u32 = 31;
/// Length of the hypercall instruction, `out dx, eax` (0xef).
const OUT_DX_EAX_LEN: u64 = 1;

/// Body of vCPU thread `index`.
pub fn thread_main(index: u32, vcpu: Arc<Mutex<Vcpu>>, shared: Arc<VmShared>) {
    // SAFETY: pthread_self has no preconditions.
    let me = unsafe { libc::pthread_self() };
    shared.register_thread(index, me);
    crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Vcpu);
    while shared.control.park_until_run() {
        if let Some(exit) = run_until_asked_to_leave(index, &vcpu, &shared) {
            shared.stop(exit);
        }
    }
    shared.unregister_thread(me);
    shared.control.finished();
}

/// What an exit asks for, detached from the borrow of the vCPU.
enum Action {
    Outcome(Outcome),
    Fault,
    RingFull,
}

/// The vCPU, locked and registered for kicks while this thread holds it.
struct Held<'a> {
    vcpu: &'a Mutex<Vcpu>,
    guard: MutexGuard<'a, Vcpu>,
}

impl<'a> Held<'a> {
    fn take(vcpu: &'a Mutex<Vcpu>) -> Held<'a> {
        let mut guard = vcpu.locked();
        run_control::register_kvm_run(guard.fd.get_kvm_run());
        Held { vcpu, guard }
    }

    /// Block in the wait hypercall `call` with the vCPU unlocked and counted
    /// as parked (`IdlePause::Park`), so a pause neither wakes this thread
    /// nor waits for it. False when the thread must end.
    fn wait_parked(self, index: u32, call: &WaitCall, shared: &VmShared, io_pending: &mut bool) -> Result<(Held<'a>, bool), String> {
        let vcpu = self.vcpu;
        let restores = self.guard.restores();
        drop(self);
        shared.control.park_in_wait(index);
        let seq = call.block(shared, || shared.control.stopping());
        let run = shared.control.unpark_from_wait(index);
        let mut held = Held::take(vcpu);
        if !run {
            return Ok((held, false));
        }
        if held.guard.restores() != restores {
            // Another VM's state was loaded meanwhile: what runs next is
            // its registers, not the end of this wait.
            settle_restored(&mut held.guard.fd).map_err(|e| format!("settling a restored wait: {e}"))?;
            *io_pending = false;
        } else if let Some(seq) = seq {
            call.finish(shared, seq).map_err(|e| format!("bad wait hypercall: {e}"))?;
        }
        Ok((held, true))
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        run_control::register_kvm_run(std::ptr::null_mut());
    }
}

fn run_until_asked_to_leave(index: u32, vcpu: &Mutex<Vcpu>, shared: &VmShared) -> Option<VmExit> {
    let mut held = Held::take(vcpu);
    // Whether the last exit was an I/O exit that KVM completes only on the
    // next KVM_RUN; state must not be saved before that happens (except
    // for a wait parked in place, whose `out` is meant to run again).
    let mut io_pending = false;
    let mut sregs = SregsCache::default();
    loop {
        let restores = held.guard.restores();
        let vcpu = &mut held.guard.fd;
        if shared.control.should_leave() {
            if io_pending {
                complete_pending_io(vcpu);
            }
            return None;
        }
        let action = match vcpu.run() {
            Ok(exit) => {
                io_pending = true;
                match exit {
                    VcpuExit::IoOut(ftvm_abi::port::EXCEPTION, _) => Action::Fault,
                    VcpuExit::IoOut(port, data) => Action::Outcome(hypercall::handle(shared, index, port, data).unwrap_or_else(|| {
                        tracing::debug!(vcpu = index, port, "write to unassigned port ignored");
                        Outcome::Continue
                    })),
                    VcpuExit::IoIn(port, data) => {
                        tracing::debug!(vcpu = index, port, "read of unassigned port returns all ones");
                        data.fill(0xff);
                        Action::Outcome(Outcome::Continue)
                    }
                    VcpuExit::Unsupported(EXIT_DIRTY_RING_FULL) => Action::RingFull,
                    VcpuExit::Shutdown => stop(format!("vCPU {index}: guest triple fault (shutdown)")),
                    VcpuExit::MmioRead(addr, data) => mmio(index, addr, shared.devices.mmio_read(addr, data)),
                    VcpuExit::MmioWrite(addr, data) => mmio(index, addr, shared.devices.mmio_write(addr, data)),
                    VcpuExit::FailEntry(reason, _) => stop(format!("vCPU {index}: KVM entry failed, reason {reason:#x}")),
                    other => stop(format!("vCPU {index}: unexpected exit {other:?}")),
                }
            }
            Err(e) if e.errno() == libc::EINTR => {
                vcpu.set_kvm_immediate_exit(0);
                io_pending = false;
                continue;
            }
            Err(e) if e.errno() == libc::EAGAIN => continue,
            Err(e) => return Some(VmExit::Error(format!("vCPU {index}: KVM_RUN failed: {e}"))),
        };
        match action {
            Action::Outcome(Outcome::Continue) => {}
            Action::Outcome(Outcome::Restart) => {
                if let Err(e) = rewind_pending_out(vcpu) {
                    return Some(VmExit::Error(format!("vCPU {index}: restarting a hypercall: {e}")));
                }
                io_pending = false;
            }
            Action::Outcome(Outcome::Park(call)) => match held.wait_parked(index, &call, shared, &mut io_pending) {
                Ok((again, true)) => held = again,
                Ok((_, false)) => return None,
                Err(e) => return Some(VmExit::Error(format!("vCPU {index}: {e}"))),
            },
            Action::Outcome(Outcome::SetRoot(root)) => {
                if let Err(e) = sregs.set_cr3(vcpu, restores, root) {
                    return Some(VmExit::Error(format!("vCPU {index}: loading page-table root {root:#x}: {e}")));
                }
            }
            Action::Outcome(Outcome::Stop(exit)) => return Some(exit),
            Action::Fault => return Some(read_fault(index, vcpu, shared)),
            Action::RingFull => {
                if let Err(e) = shared.dirty_ring_full(index as usize) {
                    return Some(VmExit::Error(format!("vCPU {index}: {e}")));
                }
            }
        }
    }
}

fn mmio(index: u32, addr: u64, handled: bool) -> Action {
    if handled {
        Action::Outcome(Outcome::Continue)
    } else {
        stop(format!("vCPU {index}: access to unassigned MMIO address {addr:#x}"))
    }
}

fn stop(message: String) -> Action {
    Action::Outcome(Outcome::Stop(VmExit::Error(message)))
}

/// The vCPU's special registers as this thread last set them, with the
/// restore count they belong to. A guest at CPL3 changes none of them
/// (segments, control registers, EFER are the VMM's; CR3 only through the
/// address-space hypercall, set here), so a switch loads CR3 without
/// KVM_GET_SREGS first (about 10 µs on these hosts); loading saved state
/// (`Vcpu::restores`) makes the copy stale.
#[derive(Default)]
struct SregsCache(Option<(u64, kvm_bindings::kvm_sregs)>);

impl SregsCache {
    /// The address-space hypercall: KVM flushes the vCPU's TLB as CR3
    /// changes. The `out` stays pending and completes on the next KVM_RUN,
    /// as any other hypercall's does (RIP is not touched here).
    fn set_cr3(&mut self, vcpu: &mut VcpuFd, restores: u64, root: u64) -> Result<(), kvm_ioctls::Error> {
        let mut sregs = match self.0 {
            Some((at, sregs)) if at == restores => sregs,
            _ => vcpu.get_sregs()?,
        };
        sregs.cr3 = root;
        vcpu.set_sregs(&sregs)?;
        self.0 = Some((restores, sregs));
        Ok(())
    }
}

/// Re-enter KVM with `immediate_exit` set: KVM finishes the pending I/O
/// instruction (advancing RIP) and returns without running guest code.
fn complete_pending_io(vcpu: &mut VcpuFd) {
    vcpu.set_kvm_immediate_exit(1);
    let _ = vcpu.run();
    vcpu.set_kvm_immediate_exit(0);
}

/// The vCPU's registers were replaced while an `out` of its own was pending
/// in KVM: complete that `out` (KVM would step over the instruction at the
/// new RIP if it is the same address) and put the new registers back.
fn settle_restored(vcpu: &mut VcpuFd) -> Result<(), kvm_ioctls::Error> {
    let regs = vcpu.get_regs()?;
    complete_pending_io(vcpu);
    vcpu.set_regs(&regs)
}

/// Complete the pending `out` and step back over it, so the vCPU runs it
/// again when it next runs. Hypercalls are the one-byte `out dx, eax`
/// (`ftvm_abi::port`), and their argument block is still in guest memory.
fn rewind_pending_out(vcpu: &mut VcpuFd) -> Result<(), kvm_ioctls::Error> {
    complete_pending_io(vcpu);
    let mut regs = vcpu.get_regs()?;
    regs.rip -= OUT_DX_EAX_LEN;
    vcpu.set_regs(&regs)
}

/// Decode the exception frame the CPU pushed on the ring-0 stack.
fn read_fault(index: u32, vcpu: &VcpuFd, shared: &VmShared) -> VmExit {
    let (regs, sregs) = match (vcpu.get_regs(), vcpu.get_sregs()) {
        (Ok(r), Ok(s)) => (r, s),
        _ => return VmExit::Error(format!("vCPU {index}: guest fault, but its registers cannot be read")),
    };
    let vector = regs.rax as u8; // the stub loads the vector into al
    let read = |slot: u64| shared.read_u64(regs.rsp + slot * 8).unwrap_or(0);
    let (error_code, frame) = if has_error_code(vector) { (Some(read(0)), 1) } else { (None, 0) };
    VmExit::Fault(GuestFault {
        vcpu: index,
        vector,
        error_code,
        rip: read(frame),
        rsp: read(frame + 3),
        cr2: (vector == 14).then_some(sregs.cr2),
    })
}
