//! What every role's VMM shares while it runs: the control socket, the
//! seccomp filters, `--user`, the metrics exporter and the stop signals,
//! served from one epoll loop until the VM stops. Each role (`roles`) starts
//! its own VM or replication on top and adds its own events.

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use ftvm_primary_backup::{Finished, Primary};
use ftvm_replication::StatusCell;
use ftvm_vmm::seccomp::{self, ThreadKind};
use ftvm_vmm::snapshot::{self, SnapshotError};
use ftvm_vmm::{DirtyBackend, IdlePause, Persist, StateReads, Vm, VmConfig, VmExit};

use crate::api::access::{Access, Group};
use crate::api::server::{Action, ApiContext, ApiServer};
use crate::api::Response;
use crate::error::{os, RunError};
use crate::exporter::Exporter;
use crate::output::errln;
use crate::signals;

/// How this host runs the VM, whatever the role.
pub struct HostOptions {
    pub prefault: bool,
    pub dirty_backend: DirtyBackend,
    pub idle_pause: IdlePause,
    pub vcpu_state_reads: StateReads,
    pub api_socket: Option<PathBuf>,
    /// Let this group's members use the control socket too.
    pub api_group: Option<String>,
    /// Filter the VMM's system calls (docs/seccomp.md).
    pub seccomp: bool,
    /// Serve Prometheus metrics here.
    pub metrics_listen: Option<String>,
    pub devices: ftvm_vmm::devices::DeviceConfig,
    /// Run as this user once the VM's devices and the control socket are open.
    pub user: Option<crate::privilege::User>,
}

/// Where a VM of this process's own comes from.
pub enum Guest {
    /// `rootfs`: a host directory, the Linux program's root file system.
    Image {
        image: PathBuf,
        rootfs: Option<PathBuf>,
        mem_size: u64,
        vcpus: u32,
        cmdline: String,
    },
    Snapshot(PathBuf),
}

/// Epoll tokens of the runtime's events; a role's start at [`ROLE_EVENTS`].
const EXIT: u64 = 0;
const SIGNAL: u64 = 1;
const API: u64 = 2;
const API_REQUESTS: u64 = 4;
pub const ROLE_EVENTS: u64 = 8;

/// Building a VM longer than this is logged.
const SLOW_BUILD: std::time::Duration = std::time::Duration::from_secs(1);

/// What a role adds to the runtime's loop.
pub trait Role {
    /// Said when the VMM is stopped before it has a VM (a backup, a witness).
    fn stopped_without_vm(&self) -> &'static str {
        "ftvm: stopped"
    }

    /// One of the role's own events (a token from [`ROLE_EVENTS`] on);
    /// `Some(status)` ends the VMM with that exit status.
    fn event(&mut self, _rt: &mut Runtime, _token: u64) -> Result<Option<i32>, RunError> {
        Ok(None)
    }

    /// A control request's action, before the runtime's own handling of it.
    fn request(&mut self, _rt: &mut Runtime, _action: &Action) -> Result<(), RunError> {
        Ok(())
    }
}

/// A role whose VM is its own from the start and that adds no event.
pub struct OwnVm;

impl Role for OwnVm {}

/// The runtime of one VMM: what its loop watches and what it serves.
pub struct Runtime {
    epoll: Epoll,
    stop_signal: &'static EventFd,
    api: Option<ApiServer>,
    exporter: Option<Exporter>,
    pub vm: Option<Arc<Vm>>,
    pub primary: Option<Primary>,
    status: Option<StatusCell>,
    /// A VSMR replica's group (`ftvm replica-replace`, members in `status`).
    replica: Option<ftvm_vsmr::membership::Control>,
    /// `ftvm switchover`: the VM stops to be handed over to the backup.
    switching_over: bool,
}

impl Runtime {
    /// Bind the control socket, install the filters, build `guest`'s VM
    /// (not yet running) while this is the only thread, so that `--user`
    /// drops root before any other thread starts; then the exporter and
    /// the stop signals.
    pub fn start(host: &HostOptions, guest: Option<&Guest>) -> Result<(Runtime, Option<Vm>), RunError> {
        // Before the filters: the socket is made its owner's (umask, chown, chmod).
        let api = host.api_socket.as_ref().map(|p| bind_api(p, host)).transpose()?;
        if host.seccomp {
            // This thread creates every other: its filter is the widest, and
            // each thread narrows it to its kind's as it starts.
            seccomp::enable()?;
            seccomp::install(ThreadKind::Vmm)?;
        }
        let built = guest.map(|g| build(g, host)).transpose()?;
        if let Some(user) = &host.user {
            user.become_it()?;
        }
        let exporter = host.metrics_listen.as_deref().map(Exporter::start).transpose()?;
        let stop_signal = signals::install().map_err(os("install signal handlers"))?;
        let epoll = Epoll::new().map_err(os("epoll"))?;
        let rt = Runtime { epoll, stop_signal, api, exporter, vm: None, primary: None, status: None, replica: None, switching_over: false };
        rt.watch(stop_signal.as_raw_fd(), SIGNAL)?;
        if let Some(api) = &rt.api {
            rt.watch(api.listener().as_raw_fd(), API)?;
            rt.watch(api.requests_event().as_raw_fd(), API_REQUESTS)?;
        }
        Ok((rt, built))
    }

    /// Wake the loop when `fd` is readable, with `token`.
    pub fn watch(&self, fd: RawFd, token: u64) -> Result<(), RunError> {
        self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token)).map_err(os("epoll_ctl"))
    }

    /// `vm` (started) is the VM now: the loop ends when it exits.
    pub fn adopt(&mut self, vm: Arc<Vm>) -> Result<(), RunError> {
        self.watch(vm.exit_event().as_raw_fd(), EXIT)?;
        self.vm = Some(vm);
        Ok(())
    }

    /// Report `status` (`ftvm status`, the exporter) from now on.
    pub fn report(&mut self, status: StatusCell) {
        self.status = Some(status);
        if let Some(e) = &self.exporter {
            e.follow(self.status.as_ref());
        }
    }

    /// A VSMR replica runs: its status, and its group for the control API.
    pub fn report_replica(&mut self, (status, group): (StatusCell, ftvm_vsmr::membership::Control)) {
        self.report(status);
        self.replica = Some(group);
    }

    /// A primary protects the VM from now on.
    pub fn protected_by(&mut self, primary: Primary) {
        self.report(primary.status_cell());
        self.primary = Some(primary);
    }

    /// Serve until the VM stops; returns the exit status for this process.
    pub fn serve(mut self, role: &mut dyn Role) -> Result<i32, RunError> {
        let mut events = vec![EpollEvent::default(); 8];
        while self.vm.as_ref().is_none_or(|v| v.exit_reason().is_none()) {
            let n = ready(&self.epoll, &mut events)?.len();
            for ev in &events[..n] {
                let ended = match ev.data() {
                    SIGNAL => {
                        let _ = self.stop_signal.read();
                        tracing::info!("stop signal received");
                        self.stop(role)
                    }
                    API => {
                        if let Some(api) = &self.api {
                            api.accept_all();
                        }
                        None
                    }
                    API_REQUESTS => self.serve_requests(role)?,
                    EXIT => None,
                    token => role.event(&mut self, token)?,
                };
                if let Some(status) = ended {
                    return Ok(status);
                }
            }
        }
        self.finish(&mut events)
    }

    fn serve_requests(&mut self, role: &mut dyn Role) -> Result<Option<i32>, RunError> {
        let ctx = ApiContext {
            vm: self.vm.as_deref(),
            status: self.status.as_ref(),
            primary: self.primary.as_ref(),
            replica: self.replica.as_ref(),
        };
        let action = self.api.as_ref().map_or(Action::None, |a| a.serve_requests(&ctx));
        role.request(self, &action)?;
        match (&action, &self.vm) {
            (Action::Switchover, Some(v)) => {
                self.switching_over = true;
                v.request_stop();
                Ok(None)
            }
            (Action::Stop, _) => Ok(self.stop(role)),
            _ => Ok(None),
        }
    }

    /// Stop the VM; without one, the VMM ends here (status 0).
    fn stop(&self, role: &dyn Role) -> Option<i32> {
        match &self.vm {
            Some(v) => {
                v.request_stop();
                None
            }
            None => {
                errln!("{}", role.stopped_without_vm());
                Some(0)
            }
        }
    }

    /// The VM stopped: hand it over, say what was held, or say how it ended.
    fn finish(mut self, events: &mut [EpollEvent]) -> Result<i32, RunError> {
        let vm = self.vm.take().expect("the loop ends only with a VM");
        let exit = vm.wait();
        if let Some(mut p) = self.primary.take() {
            if self.switching_over && matches!(exit, VmExit::Stopped) {
                return Ok(self.hand_over(&mut p));
            }
            if let Finished::Held { reason, frames, console_bytes } = p.finish(exit.status()) {
                let held = format!("{frames} network frames and {console_bytes} bytes of console output");
                let guest = match &exit {
                    VmExit::Exited(status) => {
                        // The guest's exit is output like any other: held with
                        // the rest, until an operator stops this VMM.
                        tracing::error!(
                            "the guest exited with status {status} but its backup was lost before acknowledging its last output ({held}); that output and the exit stay held; stop ftvm to drop them"
                        );
                        p.status_cell().lock().detail =
                            format!("PAUSED: backup lost: {reason}; the guest exited with status {status}, its last output held");
                        self.wait_for_stop(events, &vm, &p)?;
                        format!("the guest had exited with status {status}; ")
                    }
                    _ => String::new(),
                };
                errln!(
                    "ftvm: error: VM stopped with output its backup never acknowledged ({guest}backup lost: {reason}); {held} dropped, not released"
                );
                return Ok(1);
            }
        }
        match &exit {
            VmExit::Exited(_) => tracing::info!("{exit}"),
            VmExit::Stopped => errln!("ftvm: VM stopped"),
            _ => errln!("ftvm: {exit}"),
        }
        Ok(exit.status())
    }

    /// `ftvm switchover`'s end: a last checkpoint, its acknowledgement, the
    /// reply; the exit status.
    fn hand_over(&self, p: &mut Primary) -> i32 {
        let backup = p.status().peer;
        let handed = p.hand_over();
        let response = if handed {
            Response { state: Some("handed over".into()), replication: Some(p.status()), ..Response::ok() }
        } else {
            Response::error(format!(
                "switch-over failed: the backup {backup} did not acknowledge the last checkpoint; it takes the VM over as after a failure"
            ))
        };
        if let Some(api) = &self.api {
            api.reply_switchover(response);
        }
        if handed {
            errln!("ftvm: VM handed over to its backup {backup}");
            return 0;
        }
        errln!("ftvm: switch-over failed: the backup {backup} did not acknowledge the last checkpoint");
        1
    }

    /// Serve the control socket until a stop signal or `ftvm stop` (a VM whose
    /// guest exited while its last output is held for an acknowledgement that
    /// will not come).
    fn wait_for_stop(&self, events: &mut [EpollEvent], vm: &Vm, primary: &Primary) -> Result<(), RunError> {
        let status = primary.status_cell();
        // The VM's exit stays readable: no longer watched.
        let _ = self.epoll.ctl(ControlOperation::Delete, vm.exit_event().as_raw_fd(), EpollEvent::default());
        loop {
            for ev in ready(&self.epoll, events)? {
                match ev.data() {
                    SIGNAL => {
                        let _ = self.stop_signal.read();
                        tracing::info!("stop signal received");
                        return Ok(());
                    }
                    API => {
                        if let Some(api) = &self.api {
                            api.accept_all();
                        }
                    }
                    API_REQUESTS => {
                        let ctx = ApiContext { vm: Some(vm), status: Some(&status), primary: Some(primary), replica: None };
                        if self.api.as_ref().map_or(Action::None, |a| a.serve_requests(&ctx)) == Action::Stop {
                            return Ok(());
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Build the VM for an image or a snapshot, not yet running.
fn build(guest: &Guest, host: &HostOptions) -> Result<Vm, RunError> {
    let (mem_size, vcpus) = match guest {
        Guest::Image { mem_size, vcpus, .. } => (*mem_size, *vcpus),
        Guest::Snapshot(path) => {
            let state = snapshot::read_state(path)?;
            let mem_size = ftvm_vmm::memory::saved_size(&state)
                .map_err(|e| SnapshotError::Corrupted { path: path.display().to_string(), what: e.to_string() })?;
            (mem_size, ftvm_vmm::vcpu::count(&state) as u32)
        }
    };
    let config = VmConfig {
        mem_size,
        vcpus,
        prefault: host.prefault,
        dirty_backend: host.dirty_backend,
        idle_pause: host.idle_pause,
        vcpu_state_reads: host.vcpu_state_reads,
        devices: host.devices.clone(),
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let mut vm = Vm::new(config)?;
    let took = t0.elapsed();
    if took > SLOW_BUILD {
        // Opening the TAP takes the kernel's network configuration lock
        // (rtnl), which a busy host's namespace and device teardown can
        // hold for seconds: say where the time went.
        tracing::warn!(ms = took.as_millis() as u64, "building the VM (KVM, guest memory, devices) was slow");
    }
    match guest {
        Guest::Image { image, rootfs, cmdline, .. } => {
            vm.boot(image, rootfs.as_deref(), cmdline)?;
        }
        Guest::Snapshot(path) => {
            let state = snapshot::read(path, vm.ram())?;
            vm.restore(&state)?;
            tracing::info!(path = %path.display(), "restored snapshot");
        }
    }
    Ok(vm)
}

/// Serve the control socket at `path` to the VMM's user (the one it
/// becomes with `--user`), root and `--api-group`.
fn bind_api(path: &Path, host: &HostOptions) -> Result<ApiServer, RunError> {
    // SAFETY: geteuid has no preconditions.
    let owner = host.user.as_ref().map_or_else(|| unsafe { libc::geteuid() }, |u| u.uid);
    let group = host.api_group.as_deref().map(Group::lookup).transpose()?;
    ApiServer::bind(path, Access { owner, group }).map_err(|err| RunError::Api { path: path.display().to_string(), err })
}

/// The events ready on `epoll`, waiting as long as it takes (a signal
/// that interrupts the wait is not an error).
fn ready<'a>(epoll: &Epoll, events: &'a mut [EpollEvent]) -> Result<&'a [EpollEvent], RunError> {
    loop {
        match epoll.wait(-1, events) {
            Ok(n) => return Ok(&events[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(RunError::Os { op: "epoll_wait", err: e }),
        }
    }
}
