//! What the VM's owner (`Vm`) and its vCPU threads share.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::clock::GuestClock;
use crate::devices::Devices;
use crate::dirty::{DirtyError, DirtyLog};
use crate::exit::VmExit;
use crate::hooks::{Console, Hooks};
use crate::memory::GuestRam;
use crate::run_control::{self, Events, IdlePause, Mode, RunControl};
use crate::sync::Lock;

/// State shared between the VM owner and its vCPU threads.
pub struct VmShared {
    pub vm_fd: VmFd,
    pub ram: GuestRam,
    pub console: Console,
    pub events: Arc<Events>,
    pub control: RunControl,
    pub devices: Devices,
    pub hooks: Arc<Hooks>,
    pub clock: Mutex<GuestClock>,
    pub dirty: Mutex<Box<dyn DirtyLog>>,
    pub exit: Mutex<Option<VmExit>>,
    pub exit_event: EventFd,
    /// The vCPU threads, with their vCPU's index.
    pub threads: Mutex<Vec<(u32, libc::pthread_t)>>,
    /// vCPUs blocked in the wait hypercall right now.
    pub(crate) waiting: AtomicUsize,
    pub idle_pause: IdlePause,
}

impl VmShared {
    pub fn clock(&self) -> GuestClock {
        *self.clock.locked()
    }

    /// A stepped guest clock moves to the running clock's reading and is
    /// published; a running one is left alone (`GuestClock::step`).
    pub fn step_clock(&self) -> Result<(), vm_memory::GuestMemoryError> {
        let mut clock = self.clock.locked();
        if clock.is_stepped() {
            clock.step();
            clock.publish(self.ram.memory())?;
        }
        Ok(())
    }

    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        self.ram.memory().read_obj(GuestAddress(addr)).ok()
    }

    pub fn register_thread(&self, index: u32, id: libc::pthread_t) {
        self.threads.locked().push((index, id));
    }

    /// A vCPU thread is ending: it must not be signalled any more (its id
    /// may be reused once it is joined).
    pub fn unregister_thread(&self, id: libc::pthread_t) {
        self.threads.locked().retain(|&(_, t)| t != id);
    }

    /// A vCPU enters the wait hypercall; the last one to do so makes the
    /// whole VM idle, which the idle hook hears about.
    pub fn enter_wait(&self) {
        // SeqCst: an observer that announces it watches, then reads
        // `all_waiting`, either sees this vCPU waiting or is called.
        if self.waiting.fetch_add(1, Ordering::SeqCst) + 1 == self.control.vcpus() {
            if let Some(observer) = self.hooks.idle() {
                observer.all_idle();
            }
        }
    }

    pub fn leave_wait(&self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether every vCPU waits in the wait hypercall right now.
    pub fn all_waiting(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) == self.control.vcpus()
    }

    /// Get every vCPU thread out of KVM_RUN and out of the wait hypercall.
    pub fn kick_all(&self) {
        self.events.wake_all();
        self.signal_all(0);
    }

    /// Get every vCPU thread that is not parked out of KVM_RUN, for a pause
    /// (`RunControl::request` came first and returned `in_wait`). With
    /// `IdlePause::Park` a thread in the wait hypercall already counts as
    /// parked and is not woken for it: a signal would only wake it to block
    /// again (two context switches a checkpoint, most checkpoints of an
    /// idle-triggered service). One that left its wait before the request
    /// may be on its way into KVM_RUN, and is signalled.
    pub fn kick_for_pause(&self, in_wait: u64) {
        match self.idle_pause {
            IdlePause::Park => self.signal_all(in_wait),
            IdlePause::Kick => self.kick_all(),
        }
    }

    /// Signal every vCPU thread but those in `skip` (bit = vCPU index).
    fn signal_all(&self, skip: u64) {
        for &(_, t) in self.threads.locked().iter().filter(|(i, _)| skip & (1 << i) == 0) {
            // SAFETY: `t` is a live vCPU thread of this VM: threads remove
            // themselves from the list (under this lock) before they end; the
            // kick signal has a handler installed, so it cannot kill the process.
            unsafe { libc::pthread_kill(t, run_control::kick_signal()) };
        }
    }

    /// Stop the VM for `exit`; the first reason recorded wins.
    pub fn stop(&self, exit: VmExit) {
        {
            let mut slot = self.exit.locked();
            if slot.is_none() {
                *slot = Some(exit);
            }
        }
        self.control.request(Mode::Stop);
        self.kick_all();
        let _ = self.exit_event.write(1);
    }

    pub fn dirty_ring_full(&self, vcpu: usize) -> Result<(), DirtyError> {
        self.dirty.locked().ring_full(&self.vm_fd, vcpu)
    }
}
