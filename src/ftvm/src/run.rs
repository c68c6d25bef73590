//! Running a VM as this process: boot it, restore it, or follow a primary as
//! its backup; then serve signals and the control socket until it stops.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use ftvm_replication::vsmr::{self, ReplicaConfig};
use ftvm_replication::{Backup, BackupConfig, Finished, Outcome, Primary, PrimaryConfig, ReplicationError, StatusCell};
use ftvm_vmm::seccomp::{self, ThreadKind};
use ftvm_vmm::snapshot::{self, SnapshotError};
use ftvm_vmm::{DirtyBackend, IdlePause, Persist, Vm, VmConfig, VmError, VmExit};

use crate::api::access::{Access, AccessError, Group};
use crate::api::client::ClientError;
use crate::api::server::{Action, ApiContext, ApiServer};
use crate::api::Response;
use crate::exporter::{Exporter, ExporterError};
use crate::output::errln;
use crate::signals;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Replication(#[from] ReplicationError),
    #[error("cannot serve control socket {path}: {err}")]
    Api { path: String, err: std::io::Error },
    #[error("{op}: {err}")]
    Os { op: &'static str, err: std::io::Error },
    #[error(transparent)]
    Metrics(#[from] ExporterError),
    #[error(transparent)]
    Seccomp(#[from] ftvm_vmm::seccomp::SeccompError),
    #[error(transparent)]
    Secret(#[from] ftvm_replication::pipeline::transport::SecretError),
    #[error(transparent)]
    Privilege(#[from] crate::privilege::PrivilegeError),
    #[error(transparent)]
    Access(#[from] AccessError),
    #[error("{0}")]
    Usage(String),
}

pub enum Source {
    Image {
        image: PathBuf,
        mem_size: u64,
        vcpus: u32,
        cmdline: String,
    },
    Snapshot(PathBuf),
    /// Wait for a primary and take its VM over when it fails.
    Backup(Box<BackupConfig>),
    /// A consensus-ordered replica with a VM (`ftvm replica`).
    Replica {
        image: PathBuf,
        mem_size: u64,
        vcpus: u32,
        cmdline: String,
        config: Box<ReplicaConfig>,
    },
    /// A consensus-ordered replica without a VM (`ftvm replica --witness`).
    Witness(Box<ReplicaConfig>),
}

pub struct HostOptions {
    pub prefault: bool,
    pub dirty_backend: DirtyBackend,
    pub idle_pause: IdlePause,
    pub api_socket: Option<PathBuf>,
    /// Let this group's members use the control socket too.
    pub api_group: Option<String>,
    /// Filter the VMM's system calls (docs/seccomp.md).
    pub seccomp: bool,
    /// Serve Prometheus metrics here.
    pub metrics_listen: Option<String>,
    pub devices: ftvm_vmm::devices::DeviceConfig,
    /// Replicate to a backup (primary role); a backup's settings once it
    /// took over and is protected in turn.
    pub replicate: Option<PrimaryConfig>,
    /// A backup: once it took over, protect the VM with the first of these
    /// that answers (`ftvm backup --standby`).
    pub standbys: Vec<String>,
    /// Run as this user once the VM's devices and the control socket are open.
    pub user: Option<crate::privilege::User>,
}

/// How long a promoted backup waits before trying its standbys again when
/// none answered.
const STANDBY_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

const EXIT: u64 = 0;
const SIGNAL: u64 = 1;
const API: u64 = 2;
const TAKEOVER: u64 = 3;
const API_REQUESTS: u64 = 4;
const PROMOTED: u64 = 5;

fn os(op: &'static str) -> impl Fn(std::io::Error) -> RunError {
    move |err| RunError::Os { op, err }
}

/// Build the VM for an image or a snapshot, not yet running.
fn build(source: &Source, host: &HostOptions) -> Result<Vm, RunError> {
    let (mem_size, vcpus) = match source {
        Source::Image { mem_size, vcpus, .. } | Source::Replica { mem_size, vcpus, .. } => (*mem_size, *vcpus),
        Source::Snapshot(path) => {
            let state = snapshot::read_state(path)?;
            let mem_size = ftvm_vmm::memory::saved_size(&state)
                .map_err(|e| SnapshotError::Corrupted { path: path.display().to_string(), what: e.to_string() })?;
            (mem_size, ftvm_vmm::vcpu::count(&state) as u32)
        }
        Source::Backup(_) | Source::Witness(_) => unreachable!("a backup's VM is built from its primary's shape; a witness has none"),
    };
    let config = VmConfig {
        mem_size,
        vcpus,
        prefault: host.prefault,
        dirty_backend: host.dirty_backend,
        idle_pause: host.idle_pause,
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
    match source {
        Source::Image { image, cmdline, .. } | Source::Replica { image, cmdline, .. } => {
            vm.boot(image, cmdline)?;
        }
        Source::Snapshot(path) => {
            let state = snapshot::read(path, vm.ram())?;
            vm.restore(&state)?;
            tracing::info!(path = %path.display(), "restored snapshot");
        }
        Source::Backup(_) | Source::Witness(_) => {}
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

/// Building a VM longer than this is logged.
const SLOW_BUILD: std::time::Duration = std::time::Duration::from_secs(1);

/// Run until the VM stops; returns the exit status for this process.
pub fn run(source: Source, host: HostOptions) -> Result<i32, RunError> {
    if let Source::Backup(config) = &source {
        // What a primary's arrival would find wrong, found now.
        ftvm_vmm::vm::check_shape(config.mem_size, config.vcpus)?;
        config.devices.check().map_err(VmError::from)?;
    }
    // Before the filters: the socket is made its owner's (umask, chown, chmod).
    let api = host.api_socket.as_ref().map(|p| bind_api(p, &host)).transpose()?;
    if host.seccomp {
        // This thread creates every other: its filter is the widest, and
        // each thread narrows it to its kind's as it starts.
        seccomp::enable()?;
        seccomp::install(ThreadKind::Vmm)?;
    }
    // A VM of its own (not a backup's; a witness has none) is built now, while this is the only
    // thread: `--user` then drops root before any other thread starts.
    let built = match &source {
        Source::Backup(_) | Source::Witness(_) => None,
        source => Some(build(source, &host)?),
    };
    if let Some(user) = &host.user {
        user.become_it()?;
    }
    let exporter = host.metrics_listen.as_deref().map(Exporter::start).transpose()?;
    let follow = |status: Option<&StatusCell>| {
        if let Some(e) = &exporter {
            e.follow(status);
        }
    };
    let stop_signal = signals::install().map_err(os("install signal handlers"))?;
    let epoll = Epoll::new().map_err(os("epoll"))?;
    let watch = |fd, token| epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token)).map_err(os("epoll_ctl"));
    watch(stop_signal.as_raw_fd(), SIGNAL)?;
    if let Some(api) = &api {
        watch(api.listener().as_raw_fd(), API)?;
        watch(api.requests_event().as_raw_fd(), API_REQUESTS)?;
    }

    let mut vm: Option<Arc<Vm>> = None;
    let mut primary: Option<Primary> = None;
    let mut status: Option<StatusCell> = None;
    let takeover_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
    let (takeover_tx, takeover_rx) = mpsc::channel();
    // A backup that took over may be protected again: it starts a primary of
    // its own, off the event loop (pre-copy takes a while).
    let promoted_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
    watch(promoted_evt.as_raw_fd(), PROMOTED)?;
    let (promoted_tx, promoted_rx) = mpsc::channel::<Result<Primary, ReplicationError>>();
    let mut promoting = false;
    // `ftvm switchover`: the VM stops to be handed over to the backup.
    let mut switching_over = false;
    let no_vm_stop = if matches!(source, Source::Witness(_)) { "ftvm: witness stopped" } else { "ftvm: backup stopped before taking over" };
    let promotion = if matches!(source, Source::Backup(_)) { host.replicate.clone() } else { None };
    match source {
        Source::Backup(config) => {
            let backup = Backup::bind(*config)?;
            backup.status().lock().standbys = host.standbys.clone();
            status = Some(backup.status());
            follow(status.as_ref());
            watch(takeover_evt.as_raw_fd(), TAKEOVER)?;
            let evt = takeover_evt.try_clone().map_err(os("eventfd"))?;
            std::thread::Builder::new()
                .name("backup".into())
                .spawn(move || {
                    let _ = takeover_tx.send(backup.run());
                    let _ = evt.write(1);
                })
                .map_err(os("start backup thread"))?;
        }
        Source::Witness(config) => {
            status = Some(vsmr::start(*config, None)?);
            follow(status.as_ref());
        }
        source => {
            let v = Arc::new(built.expect("built above"));
            if matches!(source, Source::Replica { .. }) {
                // A VSMR replica's guest takes input from the log; its TAP
                // is read only while it leads (from its first pass on).
                v.devices().set_host_input(false);
            }
            // Protected from its start: no output leaves before the backup
            // has the state behind it, not even while it is being reached.
            let plumbing = host.replicate.as_ref().map(|config| Primary::plumb(&v, config)).transpose()?;
            if let Some(p) = &plumbing {
                p.hold_from_start();
            }
            v.start().map_err(os("start vCPU threads"))?;
            watch(v.exit_event().as_raw_fd(), EXIT)?;
            if let Source::Replica { config, .. } = source {
                status = Some(vsmr::start(*config, Some(v.clone()))?);
                follow(status.as_ref());
            }
            if let (Some(config), Some(plumbing)) = (host.replicate.clone(), plumbing) {
                // A stop signal while the backup is brought up to date ends that.
                match Primary::start_plumbed(v.clone(), config, plumbing, signals::stop_requested()) {
                    Ok(p) => {
                        status = Some(p.status_cell());
                        follow(status.as_ref());
                        primary = Some(p);
                    }
                    Err(ReplicationError::Stopped) => {
                        v.request_stop();
                        v.wait();
                        errln!("ftvm: VM stopped while its backup was being brought up to date");
                        return Ok(0);
                    }
                    Err(e) => {
                        v.request_stop();
                        v.wait();
                        return Err(e.into());
                    }
                }
            }
            vm = Some(v);
        }
    }

    let mut events = vec![EpollEvent::default(); 8];
    loop {
        if vm.as_ref().is_some_and(|v| v.exit_reason().is_some()) {
            break;
        }
        for ev in ready(&epoll, &mut events)? {
            match ev.data() {
                SIGNAL => {
                    let _ = stop_signal.read();
                    tracing::info!("stop signal received");
                    match &vm {
                        Some(v) => v.request_stop(),
                        None => {
                            errln!("{no_vm_stop}");
                            return Ok(0);
                        }
                    }
                }
                API => {
                    if let Some(api) = &api {
                        api.accept_all();
                    }
                }
                API_REQUESTS => {
                    let ctx = ApiContext { vm: vm.as_deref(), status: status.as_ref(), primary: primary.as_ref() };
                    let action = api.as_ref().map_or(Action::None, |a| a.serve_requests(&ctx));
                    if let (Action::Protect(addr), Some(v), Some(template), false) = (&action, &vm, &promotion, promoting) {
                        promoting = true;
                        let evt = promoted_evt.try_clone().map_err(os("eventfd"))?;
                        protect(v.clone(), template.clone(), vec![addr.clone()], false, promoted_tx.clone(), evt)?;
                    }
                    if action == Action::Switchover {
                        if let Some(v) = &vm {
                            switching_over = true;
                            v.request_stop();
                        }
                    }
                    if action == Action::Stop {
                        match &vm {
                            Some(v) => v.request_stop(),
                            None => {
                                errln!("{no_vm_stop}");
                                return Ok(0);
                            }
                        }
                    }
                }
                PROMOTED => {
                    let _ = promoted_evt.read();
                    if let Ok(result) = promoted_rx.try_recv() {
                        promoting = false;
                        match result {
                            Ok(p) => {
                                p.status_cell().lock().standbys = host.standbys.clone();
                                status = Some(p.status_cell());
                                follow(status.as_ref());
                                primary = Some(p);
                            }
                            Err(e) => tracing::error!("protecting the promoted VM failed: {e}"),
                        }
                    }
                }
                TAKEOVER => {
                    let _ = takeover_evt.read();
                    match takeover_rx.try_recv() {
                        Ok(Ok(Outcome::TookOver(v))) => {
                            watch(v.exit_event().as_raw_fd(), EXIT)?;
                            if let (Some(template), false) = (&promotion, host.standbys.is_empty()) {
                                // Protected again without an operator.
                                promoting = true;
                                let evt = promoted_evt.try_clone().map_err(os("eventfd"))?;
                                protect(v.clone(), template.clone(), host.standbys.clone(), true, promoted_tx.clone(), evt)?;
                            }
                            vm = Some(v);
                        }
                        Ok(Ok(Outcome::PrimaryFinished(status))) => {
                            errln!("ftvm: the primary's guest exited with status {status}; backup done");
                            return Ok(status);
                        }
                        Ok(Err(e)) => return Err(e.into()),
                        Err(_) => {}
                    }
                }
                _ => {}
            }
        }
    }
    let vm = vm.expect("the loop ends only with a VM");
    let exit = vm.wait();
    if let (Some(p), true) = (&mut primary, switching_over && matches!(exit, VmExit::Stopped)) {
        let backup = p.status().peer;
        let handed = p.hand_over();
        let response = if handed {
            Response { state: Some("handed over".into()), replication: Some(p.status()), ..Response::ok() }
        } else {
            Response::error(format!(
                "switch-over failed: the backup {backup} did not acknowledge the last checkpoint; it takes the VM over as after a failure"
            ))
        };
        if let Some(api) = &api {
            api.reply_switchover(response);
        }
        if handed {
            errln!("ftvm: VM handed over to its backup {backup}");
            return Ok(0);
        }
        errln!("ftvm: switch-over failed: the backup {backup} did not acknowledge the last checkpoint");
        return Ok(1);
    }
    if let Some(mut p) = primary.take() {
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
                    wait_for_stop(&epoll, &mut events, stop_signal, api.as_ref(), &vm, &p)?;
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

/// Serve the control socket until a stop signal or `ftvm stop` (a VM whose
/// guest exited while its last output is held for an acknowledgement that
/// will not come).
fn wait_for_stop(
    epoll: &Epoll,
    events: &mut [EpollEvent],
    stop_signal: &EventFd,
    api: Option<&ApiServer>,
    vm: &Vm,
    primary: &Primary,
) -> Result<(), RunError> {
    let status = primary.status_cell();
    // The VM's exit stays readable: no longer watched.
    let _ = epoll.ctl(ControlOperation::Delete, vm.exit_event().as_raw_fd(), EpollEvent::default());
    loop {
        for ev in ready(epoll, events)? {
            match ev.data() {
                SIGNAL => {
                    let _ = stop_signal.read();
                    tracing::info!("stop signal received");
                    return Ok(());
                }
                API => {
                    if let Some(api) = api {
                        api.accept_all();
                    }
                }
                API_REQUESTS => {
                    let ctx = ApiContext { vm: Some(vm), status: Some(&status), primary: Some(primary) };
                    if api.map_or(Action::None, |a| a.serve_requests(&ctx)) == Action::Stop {
                        return Ok(());
                    }
                }
                _ => {}
            }
        }
    }
}

/// Protect `vm` (a backup's that took over) with the first of `backups` that
/// answers, on a thread of its own (pre-copy takes a while); the result goes
/// to `tx` and `evt` is written. With `retry`, tries them again every
/// [`STANDBY_RETRY`] until one answers or the VMM stops.
fn protect(
    vm: Arc<Vm>,
    template: PrimaryConfig,
    backups: Vec<String>,
    retry: bool,
    tx: mpsc::Sender<Result<Primary, ReplicationError>>,
    evt: EventFd,
) -> Result<(), RunError> {
    std::thread::Builder::new()
        .name("protect".into())
        .spawn(move || {
            let result = 'attempts: loop {
                let mut failure = None;
                for addr in &backups {
                    let config = PrimaryConfig { backup: addr.clone(), ..template.clone() };
                    match Primary::start(vm.clone(), config, signals::stop_requested()) {
                        Ok(p) => {
                            tracing::info!(backup = %addr, "the promoted VM is protected again");
                            break 'attempts Ok(p);
                        }
                        Err(e) => {
                            tracing::warn!(backup = %addr, "cannot protect the VM with this backup: {e}");
                            failure = Some(e);
                        }
                    }
                }
                let stopping = signals::stop_requested().load(Ordering::SeqCst) || vm.exit_reason().is_some();
                if !retry || stopping {
                    break Err(failure.unwrap_or(ReplicationError::Stopped));
                }
                std::thread::sleep(STANDBY_RETRY);
            };
            let _ = tx.send(result);
            let _ = evt.write(1);
        })
        .map_err(os("start protection thread"))?;
    Ok(())
}
