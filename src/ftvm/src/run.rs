//! Running a VM as this process: boot or restore, then serve signals and
//! the control socket until the guest stops.

use std::os::fd::AsRawFd;
use std::path::PathBuf;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use vmm::snapshot::{self, SnapshotError};
use vmm::{DirtyBackend, Vm, VmConfig, VmError, VmExit};

use crate::api::client::ClientError;
use crate::api::server::ApiServer;
use crate::signals;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("cannot serve control socket {path}: {err}")]
    Api { path: String, err: std::io::Error },
    #[error("{op}: {err}")]
    Os { op: &'static str, err: std::io::Error },
}

pub enum Source {
    Image { image: PathBuf, mem_size: u64, vcpus: u32, cmdline: String },
    Snapshot(PathBuf),
}

pub struct HostOptions {
    pub prefault: bool,
    pub dirty_backend: DirtyBackend,
    pub api_socket: Option<PathBuf>,
    pub devices: vmm::devices::DeviceConfig,
}

/// Run the VM to completion; returns the exit status for this process.
pub fn run(source: Source, host: HostOptions) -> Result<i32, RunError> {
    let (mem_size, vcpus) = match &source {
        Source::Image { mem_size, vcpus, .. } => (*mem_size, *vcpus),
        Source::Snapshot(path) => {
            let header = snapshot::read_header(path)?;
            (header.mem_size, header.vcpus)
        }
    };
    let config = VmConfig {
        mem_size,
        vcpus,
        prefault: host.prefault,
        dirty_backend: host.dirty_backend,
        devices: host.devices,
        ..Default::default()
    };
    let mut vm = Vm::new(config)?;
    match &source {
        Source::Image { image, cmdline, .. } => {
            vm.boot(image, cmdline)?;
        }
        Source::Snapshot(path) => {
            let header = snapshot::read(path, vm.ram())?;
            vm.restore_state(&header.state)?;
            tracing::info!(path = %path.display(), "restored snapshot");
        }
    }
    let api = host
        .api_socket
        .as_ref()
        .map(|p| ApiServer::bind(p).map_err(|err| RunError::Api { path: p.display().to_string(), err }))
        .transpose()?;
    let stop_signal = signals::install().map_err(|err| RunError::Os { op: "install signal handlers", err })?;
    vm.start().map_err(|err| RunError::Os { op: "start vCPU threads", err })?;

    let os = |op| move |err| RunError::Os { op, err };
    let epoll = Epoll::new().map_err(os("epoll"))?;
    const EXIT: u64 = 0;
    const SIGNAL: u64 = 1;
    const API: u64 = 2;
    let mut fds = vec![(vm.exit_event().as_raw_fd(), EXIT), (stop_signal.as_raw_fd(), SIGNAL)];
    if let Some(api) = &api {
        fds.push((api.listener().as_raw_fd(), API));
    }
    for (fd, token) in fds {
        epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token)).map_err(os("epoll_ctl"))?;
    }
    let mut events = vec![EpollEvent::default(); 4];
    while vm.exit_reason().is_none() {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(RunError::Os { op: "epoll_wait", err: e }),
        };
        for ev in &events[..n] {
            match ev.data() {
                SIGNAL => {
                    let _ = stop_signal.read();
                    tracing::info!("stop signal received");
                    vm.request_stop();
                }
                API if api.as_ref().is_some_and(|a| a.accept_all(&vm)) => vm.request_stop(),
                _ => {}
            }
        }
    }
    let exit = vm.wait();
    match &exit {
        VmExit::Exited(_) => tracing::info!("{exit}"),
        VmExit::Stopped => eprintln!("ftvm: VM stopped"),
        _ => eprintln!("ftvm: {exit}"),
    }
    Ok(exit.status())
}
