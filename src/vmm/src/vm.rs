//! A VM: KVM VM, guest RAM, vCPU threads, and the operations every later
//! layer (snapshots, checkpoints, replication) builds on.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use kvm_bindings::{kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::compat::CpuProfile;
use crate::arch::{cpu, layout, tables};
use crate::boot::{self, BootError, BootLayout};
use crate::clock::{self, GuestClock};
use crate::components::{ComponentError, ComponentId, Components};
use crate::devices::{DeviceConfig, DeviceError, Devices};
use crate::dirty::{bitmap::BitmapLog, ring, DirtyBackend, DirtyError, DirtyLog};
use crate::exit::VmExit;
use crate::hooks::{Console, Hooks};
use crate::memory::{GuestRam, MemoryError, PageBitmap};
use crate::persist::Persist;
use crate::run_control::{self, Events, IdlePause, Mode, RunControl};
use crate::shared::VmShared;
use crate::sync::Lock;
use crate::vcpu::{self, saveable_msrs, StateError, StateReads, Vcpu};

/// Environment variable naming the KVM device (default `/dev/kvm`).
pub const KVM_PATH_ENV: &str = "FTVM_KVM_DEVICE";

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{path} does not exist: this host has no KVM (hardware virtualization off, or the kvm module not loaded)")]
    KvmMissing { path: String },
    #[error("no permission to open {path}: run as root or add the user to the kvm group")]
    KvmPermission { path: String },
    #[error("cannot use {path}: {err}")]
    KvmOpen { path: String, err: kvm_ioctls::Error },
    #[error("KVM {op} failed: {err}")]
    Kvm { op: &'static str, err: kvm_ioctls::Error },
    #[error("{requested} vCPUs requested; this VMM supports 1 to {max} on this host")]
    BadVcpuCount { requested: u32, max: u32 },
    #[error("guest memory must be a multiple of 2 MiB between 4 MiB and {max_gib} GiB, got {mib} MiB")]
    BadMemorySize { mib: u64, max_gib: u64 },
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error(transparent)]
    Dirty(#[from] DirtyError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Component(#[from] ComponentError),
    #[error("the VM state has {got} vCPUs, this VM has {want}")]
    ShapeMismatch { got: usize, want: usize },
    #[error("the VM is running; pause it first")]
    Running,
    #[error("the VM has run already; state can only be restored into a VM that has not")]
    Started,
    #[error("{op} failed: {err}")]
    Os { op: &'static str, err: std::io::Error },
    #[error("cannot write guest memory: {0}")]
    GuestWrite(#[from] vm_memory::GuestMemoryError),
}

fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |err| VmError::Kvm { op, err }
}

/// What a VM is made of.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub mem_size: u64,
    pub vcpus: u32,
    /// Populate all of guest RAM up front.
    pub prefault: bool,
    pub dirty_backend: DirtyBackend,
    pub idle_pause: IdlePause,
    /// What a save reads of each vCPU (`--vcpu-state-reads`).
    pub vcpu_state_reads: StateReads,
    pub console: Console,
    pub devices: DeviceConfig,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            mem_size: 256 << 20,
            vcpus: 1,
            prefault: false,
            dirty_backend: DirtyBackend::Bitmap,
            idle_pause: IdlePause::default(),
            vcpu_state_reads: StateReads::default(),
            console: Console::default(),
            devices: DeviceConfig::default(),
        }
    }
}

pub struct Vm {
    shared: Arc<VmShared>,
    vcpus: Vec<Arc<Mutex<Vcpu>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    config: VmConfig,
    layout: OnceLock<BootLayout>,
    tracking: AtomicBool,
    /// Outstanding `pause` calls; a new VM is held by one until `start`.
    pause_holders: Mutex<u32>,
    /// The long-lived subset of `pause_holders` (see `hold`).
    holds: Mutex<u32>,
    /// What the vCPUs' saved state needs of a host (`arch::compat`), taken
    /// when they were made (asking a running vCPU would wait for it).
    cpu_profile: CpuProfile,
    // Kept last: the KVM system fd outlives the VM fds above.
    _kvm: Kvm,
}

fn open_kvm() -> Result<Kvm, VmError> {
    let path = std::env::var(KVM_PATH_ENV).unwrap_or_else(|_| "/dev/kvm".into());
    let c_path = std::ffi::CString::new(path.clone()).map_err(|_| VmError::KvmMissing { path: path.clone() })?;
    Kvm::new_with_path(&c_path).map_err(|err| match err.errno() {
        libc::ENOENT => VmError::KvmMissing { path },
        libc::EACCES | libc::EPERM => VmError::KvmPermission { path },
        _ => VmError::KvmOpen { path, err },
    })
}

fn check_vcpus(kvm: &Kvm, vcpus: u32) -> Result<(), VmError> {
    let max = (kvm.get_max_vcpus() as u32).min(layout::MAX_VCPUS);
    if vcpus == 0 || vcpus > max {
        return Err(VmError::BadVcpuCount { requested: vcpus, max });
    }
    Ok(())
}

fn check_memory(mem_size: u64) -> Result<(), VmError> {
    let mib = mem_size >> 20;
    if !mem_size.is_multiple_of(2 << 20) || mib < 4 || mem_size > layout::MAX_RAM_GIB << 30 {
        return Err(VmError::BadMemorySize { mib, max_gib: layout::MAX_RAM_GIB });
    }
    Ok(())
}

/// Check, before any VM exists, what [`Vm::new`] would check first: that
/// KVM can be opened, and the vCPU count and memory size where given. The
/// errors are the ones `Vm::new` returns.
pub fn check_shape(mem_size: Option<u64>, vcpus: Option<u32>) -> Result<(), VmError> {
    let kvm = open_kvm()?;
    if let Some(vcpus) = vcpus {
        check_vcpus(&kvm, vcpus)?;
    }
    if let Some(mem_size) = mem_size {
        check_memory(mem_size)?;
    }
    Ok(())
}

/// The profile of the vCPUs this host gives a VM (`arch::compat`),
/// without building one: a bare VM with one vCPU set up as [`Vm::new`]
/// sets up each of its own.
pub fn host_cpu_profile() -> Result<CpuProfile, VmError> {
    let kvm = open_kvm()?;
    let vm_fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
    let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    let vcpu = create_vcpu(&vm_fd, &supported, 0)?;
    Ok(vcpu_setup(&kvm, &vcpu)?.1)
}

/// What saving the state of `vcpu` (set up by `create_vcpu`) covers: the
/// MSRs that round-trip, and the profile of the vCPU.
fn vcpu_setup(kvm: &Kvm, vcpu: &VcpuFd) -> Result<(Vec<u32>, CpuProfile), VmError> {
    let index_list = kvm.get_msr_index_list().map_err(kvm_err("KVM_GET_MSR_INDEX_LIST"))?;
    let msrs = saveable_msrs(vcpu, index_list.as_slice());
    let cpuid = vcpu.get_cpuid2(KVM_MAX_CPUID_ENTRIES).map_err(kvm_err("KVM_GET_CPUID2"))?;
    let profile = CpuProfile::new(&cpuid, &msrs);
    Ok((msrs, profile))
}

impl Vm {
    /// The profile of this VM's vCPUs: what their saved state needs of a
    /// host that restores it (`arch::compat`).
    pub fn cpu_profile(&self) -> &CpuProfile {
        &self.cpu_profile
    }

    /// Create the VM with its memory and vCPUs, not yet running.
    pub fn new(config: VmConfig) -> Result<Vm, VmError> {
        let kvm = open_kvm()?;
        check_vcpus(&kvm, config.vcpus)?;
        check_memory(config.mem_size)?;
        let vm_fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        // Dirty-logging capabilities must be enabled before slots and vCPUs.
        let bitmap_log = match config.dirty_backend {
            DirtyBackend::Bitmap => Some(BitmapLog::new(&vm_fd, 0, config.mem_size)?),
            DirtyBackend::Ring => {
                ring::enable(&vm_fd)?;
                None
            }
        };
        let ram = GuestRam::new(config.mem_size, config.prefault)?;
        let events = Arc::new(Events::default());
        let hooks = Arc::new(Hooks::default());
        let devices = Devices::new(&config.devices, &vm_fd, config.mem_size, ram.memory().clone(), events.clone(), &hooks)?;
        tables::write_system_area(ram.memory(), config.vcpus, config.mem_size, devices.window())?;
        set_slot(&vm_fd, &ram, false)?;

        let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
        let vcpus = (0..config.vcpus).map(|i| create_vcpu(&vm_fd, &supported, i)).collect::<Result<Vec<_>, _>>()?;
        let dirty: Box<dyn DirtyLog> = match bitmap_log {
            Some(log) => Box::new(log),
            None => Box::new(ring::RingLog::new(&vcpus.iter().collect::<Vec<_>>(), ram.pages())?),
        };
        let (msrs, cpu_profile) = vcpu_setup(&kvm, &vcpus[0])?;
        let msrs: Arc<[u32]> = msrs.into();

        let tsc_khz = vcpus[0].get_tsc_khz().ok();
        let clock = GuestClock::starting_at(clock::tsc_hz(tsc_khz), 0);
        run_control::install_kick_handler().map_err(|e| VmError::Os { op: "install kick signal handler", err: e.into() })?;
        let shared = Arc::new(VmShared {
            vm_fd,
            ram,
            console: config.console.clone(),
            events,
            devices,
            hooks,
            control: RunControl::new(config.vcpus as usize, Mode::Pause),
            clock: Mutex::new(clock),
            dirty: Mutex::new(dirty),
            exit: Mutex::new(None),
            exit_event: EventFd::new(libc::EFD_NONBLOCK).map_err(|err| VmError::Os { op: "eventfd", err })?,
            threads: Mutex::new(Vec::new()),
            waiting: AtomicUsize::new(0),
            idle_pause: config.idle_pause,
        });
        let vcpus = vcpus.into_iter().map(|fd| Arc::new(Mutex::new(Vcpu::new(fd, msrs.clone(), config.vcpu_state_reads)))).collect();
        Ok(Vm {
            shared,
            vcpus,
            threads: Mutex::new(Vec::new()),
            config,
            layout: OnceLock::new(),
            tracking: AtomicBool::new(false),
            pause_holders: Mutex::new(1),
            holds: Mutex::new(0),
            cpu_profile,
            _kvm: kvm,
        })
    }

    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    pub fn ram(&self) -> &GuestRam {
        &self.shared.ram
    }

    pub fn devices(&self) -> &Devices {
        &self.shared.devices
    }

    /// Where the layers above see and steer what the VM does.
    pub fn hooks(&self) -> &Hooks {
        &self.shared.hooks
    }

    /// The guest clock as the VMM publishes it.
    pub(crate) fn guest_clock(&self) -> GuestClock {
        *self.shared.clock.locked()
    }

    /// Make the guest clock stepped (on) or running (off), published
    /// (`GuestClock::set_stepped`).
    pub fn set_clock_stepped(&self, on: bool) -> Result<(), VmError> {
        let mut clock = self.shared.clock.locked();
        clock.set_stepped(on);
        clock.publish(self.shared.ram.memory())?;
        Ok(())
    }

    /// Step a stepped guest clock to the running clock's reading now
    /// (`GuestClock::step`); a running one is left alone.
    pub fn step_clock(&self) -> Result<(), VmError> {
        self.shared.step_clock()?;
        Ok(())
    }

    pub fn layout(&self) -> Option<&BootLayout> {
        self.layout.get()
    }

    /// Load `image` (with the Linux program's root file system `rootfs`, if
    /// any) and prepare every vCPU to enter it.
    pub fn boot(&self, image: &Path, rootfs: Option<&Path>, cmdline: &str) -> Result<&BootLayout, VmError> {
        let mem = self.shared.ram.memory();
        let devices = self.shared.devices.abi_list();
        let layout = boot::boot(mem, image, rootfs, self.config.mem_size, self.config.vcpus, cmdline, &devices)?;
        let features = {
            let vcpu = self.vcpus[0].locked();
            let cpuid = vcpu.fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).map_err(kvm_err("KVM_GET_CPUID2"))?;
            let syscall_entry = layout.image.note.map(|n| n.syscall_entry).filter(|&e| e != 0);
            // Only Linux programs need their own fs base.
            let fsgsbase = layout.runs_linux() && cpu::has_fsgsbase(&cpuid);
            cpu::CpuFeatures { xcr0: cpu::xcr0_for(&cpuid), syscall_entry, fsgsbase }
        };
        for (i, vcpu) in self.vcpus.iter().enumerate() {
            let i = i as u32;
            let mut vcpu = vcpu.locked();
            cpu::setup_vcpu(&vcpu.fd, i, layout.image.entry, layout.stack_top(i), features).map_err(kvm_err("vCPU setup"))?;
            vcpu.forget_fixed();
        }
        self.shared.clock.locked().publish(mem)?;
        Ok(self.layout.get_or_init(|| layout))
    }

    /// Start the vCPU and device threads; the guest runs.
    pub fn start(&self) -> std::io::Result<()> {
        self.shared.devices.start()?;
        let mut threads = self.threads.locked();
        if !threads.is_empty() {
            return Ok(());
        }
        for (i, fd) in self.vcpus.iter().enumerate() {
            let (fd, shared) = (fd.clone(), self.shared.clone());
            let t = std::thread::Builder::new().name(format!("vcpu{i}")).spawn(move || crate::vcpu::thread_main(i as u32, fd, shared))?;
            threads.push(t);
        }
        drop(threads);
        self.resume();
        Ok(())
    }

    /// Stop every vCPU at an instruction boundary with its I/O completed.
    ///
    /// Pauses nest: a checkpoint and a snapshot may both hold the VM, and it
    /// runs again only when every holder has resumed it.
    pub fn pause(&self) {
        let mut holders = self.pause_holders.locked();
        *holders += 1;
        if *holders > 1 || self.shared.control.mode() != Mode::Run {
            return;
        }
        let in_wait = self.shared.control.request(Mode::Pause);
        self.shared.kick_for_pause(in_wait);
        self.shared.control.wait_parked();
        // After the vCPUs, so requests they issued last are still served.
        self.shared.devices.pause();
    }

    /// Release one pause (see `pause`); the VM runs when none is left.
    pub fn resume(&self) {
        let mut holders = self.pause_holders.locked();
        if *holders == 0 {
            return;
        }
        *holders -= 1;
        if *holders == 0 && self.shared.control.mode() == Mode::Pause {
            self.shared.devices.resume();
            self.shared.control.request(Mode::Run);
        }
    }

    /// Pause for an open-ended time (an operator's or a policy's pause, as
    /// opposed to a checkpoint's); `is_held` reports it.
    pub fn hold(&self) {
        *self.holds.locked() += 1;
        self.pause();
    }

    /// End one `hold`.
    pub fn release(&self) {
        let mut holds = self.holds.locked();
        if *holds > 0 {
            *holds -= 1;
            drop(holds);
            self.resume();
        }
    }

    /// Whether an operator or a policy holds the VM paused (short pauses
    /// for checkpoints do not count).
    pub fn is_held(&self) -> bool {
        *self.holds.locked() > 0
    }

    /// Whether the guest has nothing to run: every vCPU waits in the wait
    /// hypercall right now (the idle hook hears when this becomes true).
    pub fn is_idle(&self) -> bool {
        self.shared.all_waiting()
    }

    pub fn is_running(&self) -> bool {
        !self.threads.locked().is_empty() && self.shared.control.mode() == Mode::Run
    }

    /// Begin tracking the pages written from now on (guest and VMM writes).
    pub fn start_dirty_tracking(&self) -> Result<(), VmError> {
        if !self.tracking.swap(true, Ordering::SeqCst) {
            set_slot(&self.shared.vm_fd, &self.shared.ram, true)?;
        }
        self.shared.dirty.locked().start(&self.shared.vm_fd)?;
        // Forget what the VMM wrote before.
        self.shared.ram.take_vmm_dirty(&mut PageBitmap::new(self.shared.ram.pages()));
        Ok(())
    }

    /// OR into `out` every page written since tracking started or since the
    /// last collection, by the guest or by the VMM, and re-arm tracking for
    /// them except for `leave_writable` (see `DirtyLog::rearm`).
    pub fn collect_dirty(&self, out: &mut PageBitmap, leave_writable: &PageBitmap) -> Result<(), VmError> {
        self.harvest_dirty(out)?;
        self.rearm_dirty(leave_writable)
    }

    /// The first half of `collect_dirty`, for a caller that chooses what to
    /// leave writable from what was written: OR into `out` every page
    /// written since the last re-arm, by the guest or by the VMM. The VM
    /// should be paused until `rearm_dirty`: until then, the guest's writes
    /// to these pages are not tracked.
    pub fn harvest_dirty(&self, out: &mut PageBitmap) -> Result<(), VmError> {
        self.shared.dirty.locked().harvest(&self.shared.vm_fd, out)?;
        self.shared.ram.take_vmm_dirty(out);
        Ok(())
    }

    /// `harvest_dirty`, telling the writers apart: OR into `guest` the
    /// pages tracking reported (the guest's writes, and pages left
    /// writable), into `vmm` those the VMM wrote (a device's writes into
    /// guest memory). Only the first kind cost the guest a tracked first
    /// write: write prediction learns from them alone.
    pub fn harvest_dirty_by(&self, guest: &mut PageBitmap, vmm: &mut PageBitmap) -> Result<(), VmError> {
        self.shared.dirty.locked().harvest(&self.shared.vm_fd, guest)?;
        self.shared.ram.take_vmm_dirty(vmm);
        Ok(())
    }

    /// The second half of `collect_dirty`: re-arm tracking for the pages
    /// harvested, except for `leave_writable` where the backend can.
    pub fn rearm_dirty(&self, leave_writable: &PageBitmap) -> Result<(), VmError> {
        Ok(self.shared.dirty.locked().rearm(&self.shared.vm_fd, leave_writable)?)
    }

    /// The ids of this VM's components, as `save` names them.
    pub fn component_ids(&self) -> Vec<ComponentId> {
        let mut ids = vec![crate::memory::component_id()];
        ids.extend((0..self.vcpus.len()).flat_map(vcpu::component_ids));
        ids.extend(self.shared.devices.component_ids());
        ids.push(clock::component_id());
        ids
    }

    /// Whether `saved` fits this VM: its vCPUs, memory size, devices, and
    /// no component this VM does not have. Nothing is loaded.
    pub fn check_components(&self, saved: &Components) -> Result<(), VmError> {
        let vcpus = vcpu::count(saved);
        if vcpus != self.vcpus.len() {
            return Err(VmError::ShapeMismatch { got: vcpus, want: self.vcpus.len() });
        }
        self.shared.ram.fits(&saved.state(&crate::memory::component_id())?)?;
        self.shared.devices.check(saved)?;
        Ok(saved.check_ids(&self.component_ids())?)
    }

    /// Load `saved` into this VM while it is paused (it may have run): the
    /// state another VM of the same shape was saved with, its RAM already
    /// copied. Guest time continues from the saved time. Used by a
    /// consensus-ordered replica adopting its leader's state, and by
    /// `restore`. A state that does not fit (`check_components`) changes
    /// nothing; one that fits but does not load leaves the VM unusable.
    pub fn restore_paused(&self, saved: &Components) -> Result<(), VmError> {
        if self.is_running() {
            return Err(VmError::Running);
        }
        self.check_components(saved)?;
        self.shared.devices.restore_from(saved)?;
        for (i, vcpu) in self.vcpus.iter().enumerate() {
            vcpu.locked().restore(&Vcpu::state_in(saved, i)?)?;
        }
        let mut clock = self.shared.clock.locked();
        let state = saved.state(&clock::component_id())?;
        clock.restore(&state).unwrap_or_else(|never| match never {});
        clock.publish(self.shared.ram.memory())?;
        Ok(())
    }

    /// Stop the VM for good because of `reason`; `wait` then returns
    /// `VmExit::Error`.
    pub fn fail(&self, reason: String) {
        self.shared.stop(VmExit::Error(reason));
    }

    /// Ask the VM to stop (as Ctrl-C does); `wait` then returns `Stopped`.
    pub fn request_stop(&self) {
        self.shared.stop(VmExit::Stopped);
    }

    /// Readable when the VM has stopped, for event loops.
    pub fn exit_event(&self) -> &EventFd {
        &self.shared.exit_event
    }

    /// Why the VM stopped, if it has.
    pub fn exit_reason(&self) -> Option<VmExit> {
        self.shared.exit.locked().clone()
    }

    /// Block until the VM stops, then join the vCPU threads.
    pub fn wait(&self) -> VmExit {
        let fd = self.shared.exit_event.as_raw_fd();
        while self.exit_reason().is_none() {
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
        }
        self.join();
        self.exit_reason().unwrap_or(VmExit::Stopped)
    }

    fn join(&self) {
        self.shared.control.request(Mode::Stop);
        self.shared.kick_all();
        let threads: Vec<_> = self.threads.locked().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
        self.shared.devices.stop();
    }
}

impl Vm {
    /// Read every vCPU of this paused VM whole and check the state that a
    /// save with `--vcpu-state-reads changing` took as read once
    /// (`Vcpu::audit`): the first difference, as "vCPU N: WHAT".
    pub fn audit_vcpu_state(&self) -> Result<Option<String>, VmError> {
        if self.is_running() {
            return Err(VmError::Running);
        }
        for (i, vcpu) in self.vcpus.iter().enumerate() {
            if let Some(what) = vcpu.locked().audit()? {
                return Ok(Some(format!("vCPU {i}: {what}")));
            }
        }
        Ok(None)
    }
}

/// A VM is the tree of its components (`components`): guest memory, each
/// vCPU, each device, the clock, each saved by its own `Persist`.
impl Persist for Vm {
    type State = Components;
    type Error = VmError;

    /// The VM must be paused (or never started).
    fn save(&self) -> Result<Components, VmError> {
        if self.is_running() {
            return Err(VmError::Running);
        }
        let mut saved = Components::default();
        saved.save(crate::memory::component_id(), &self.shared.ram)?;
        for (i, vcpu) in self.vcpus.iter().enumerate() {
            vcpu.locked().save_into(i, &mut saved)?;
        }
        self.shared.devices.save_into(&mut saved)?;
        let clock = self.shared.clock.locked();
        saved.save(clock::component_id(), &*clock).unwrap_or_else(|never| match never {});
        Ok(saved)
    }

    /// Load state saved here or in another process into this VM, which has
    /// never run; guest time continues from the saved time.
    fn restore(&mut self, saved: &Components) -> Result<(), VmError> {
        // Only the VM holds its shared part until `start` gives it to vCPU threads.
        if Arc::get_mut(&mut self.shared).is_none() {
            return Err(VmError::Started);
        }
        self.restore_paused(saved)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.join();
    }
}

fn set_slot(vm: &VmFd, ram: &GuestRam, log_dirty: bool) -> Result<(), VmError> {
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: if log_dirty { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
        guest_phys_addr: 0,
        memory_size: ram.size(),
        userspace_addr: ram.host_base() as u64,
    };
    // SAFETY: the region is the whole guest RAM mapping, which outlives the VM
    // fd (both are owned by VmShared, and the mapping is dropped after it).
    unsafe { vm.set_user_memory_region(region) }.map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))
}

fn create_vcpu(vm: &VmFd, supported: &CpuId, index: u32) -> Result<VcpuFd, VmError> {
    let vcpu = vm.create_vcpu(index as u64).map_err(kvm_err("KVM_CREATE_VCPU"))?;
    vcpu.set_cpuid2(&cpu::cpuid_for(supported, index)).map_err(kvm_err("KVM_SET_CPUID2"))?;
    Ok(vcpu)
}
