//! A backup (`ftvm backup`): follows its primary's checkpoints on a thread
//! of its own and takes the VM over when the primary fails; once it took
//! over, it is protected in turn (`ftvm protect`, `--standby`).

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use ftvm_primary_backup::{Backup, BackupConfig, Outcome, Primary, PrimaryConfig};
use ftvm_replication::ReplicationError;
use ftvm_vmm::{Vm, VmError};

use crate::api::server::Action;
use crate::error::{os, RunError};
use crate::output::errln;
use crate::run::{HostOptions, Role, Runtime, ROLE_EVENTS};
use crate::signals;

/// How long a promoted backup waits before trying its standbys again when
/// none answered.
const STANDBY_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// The backup's thread ended (took over, or the primary finished).
const TAKEOVER: u64 = ROLE_EVENTS;
/// A promoted VM's protection started, or failed.
const PROMOTED: u64 = ROLE_EVENTS + 1;

/// `ftvm backup`, ready to run.
pub struct Follower {
    pub config: BackupConfig,
    /// Once it took over, the primary it becomes when protected: the
    /// defaults of `ftvm run`, this backup's heartbeat, arbiter, secret,
    /// disk and standbys (`LossPolicy::standbys`).
    pub promotion: PrimaryConfig,
    pub host: HostOptions,
}

impl Follower {
    pub fn run(self) -> Result<i32, RunError> {
        // What a primary's arrival would find wrong, found now.
        ftvm_vmm::vm::check_shape(self.config.mem_size, self.config.vcpus)?;
        self.config.devices.check().map_err(VmError::from)?;
        let (mut rt, _) = Runtime::start(&self.host, None)?;
        let mut role = Following::start(&mut rt, self.config, self.promotion)?;
        rt.serve(&mut role)
    }
}

/// The backup's events: its thread's end, and the promoted VM's protection.
struct Following {
    promotion: PrimaryConfig,
    takeover_evt: EventFd,
    takeover_rx: mpsc::Receiver<Result<Outcome, ReplicationError>>,
    promoted_evt: EventFd,
    promoted_tx: mpsc::Sender<Result<Primary, ReplicationError>>,
    promoted_rx: mpsc::Receiver<Result<Primary, ReplicationError>>,
    /// A protection is under way (one at a time).
    promoting: bool,
}

impl Following {
    /// Bind the backup and follow the primary on a thread of its own.
    fn start(rt: &mut Runtime, config: BackupConfig, promotion: PrimaryConfig) -> Result<Following, RunError> {
        // A backup that took over may be protected again: it starts a primary of
        // its own, off the event loop (pre-copy takes a while).
        let promoted_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
        rt.watch(promoted_evt.as_raw_fd(), PROMOTED)?;
        let (promoted_tx, promoted_rx) = mpsc::channel();
        let takeover_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(os("eventfd"))?;
        let (takeover_tx, takeover_rx) = mpsc::channel();
        let backup = Backup::bind(config)?;
        backup.status().lock().standbys = promotion.loss.standbys.clone();
        rt.report(backup.status());
        rt.watch(takeover_evt.as_raw_fd(), TAKEOVER)?;
        let evt = takeover_evt.try_clone().map_err(os("eventfd"))?;
        std::thread::Builder::new()
            .name("backup".into())
            .spawn(move || {
                let _ = takeover_tx.send(backup.run());
                let _ = evt.write(1);
            })
            .map_err(os("start backup thread"))?;
        Ok(Following { promotion, takeover_evt, takeover_rx, promoted_evt, promoted_tx, promoted_rx, promoting: false })
    }

    /// Protect `vm` with the first of `backups` that answers, off the loop.
    fn protect(&mut self, vm: Arc<Vm>, backups: Vec<String>, retry: bool) -> Result<(), RunError> {
        self.promoting = true;
        let evt = self.promoted_evt.try_clone().map_err(os("eventfd"))?;
        protect(vm, self.promotion.clone(), backups, retry, self.promoted_tx.clone(), evt)
    }

    fn took_over(&mut self, rt: &mut Runtime) -> Result<Option<i32>, RunError> {
        let _ = self.takeover_evt.read();
        match self.takeover_rx.try_recv() {
            Ok(Ok(Outcome::TookOver(vm))) => {
                rt.adopt(vm.clone())?;
                if !self.promotion.loss.standbys.is_empty() {
                    // Protected again without an operator.
                    self.protect(vm, self.promotion.loss.standbys.clone(), true)?;
                }
                Ok(None)
            }
            Ok(Ok(Outcome::PrimaryFinished(status))) => {
                errln!("ftvm: the primary's guest exited with status {status}; backup done");
                Ok(Some(status))
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Ok(None),
        }
    }

    fn promoted(&mut self, rt: &mut Runtime) {
        let _ = self.promoted_evt.read();
        if let Ok(result) = self.promoted_rx.try_recv() {
            self.promoting = false;
            match result {
                Ok(p) => {
                    p.status_cell().lock().standbys = self.promotion.loss.standbys.clone();
                    rt.protected_by(p);
                }
                Err(e) => tracing::error!("protecting the promoted VM failed: {e}"),
            }
        }
    }
}

impl Role for Following {
    fn stopped_without_vm(&self) -> &'static str {
        "ftvm: backup stopped before taking over"
    }

    fn event(&mut self, rt: &mut Runtime, token: u64) -> Result<Option<i32>, RunError> {
        match token {
            TAKEOVER => self.took_over(rt),
            PROMOTED => {
                self.promoted(rt);
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    fn request(&mut self, rt: &mut Runtime, action: &Action) -> Result<(), RunError> {
        if let (Action::Protect(addr), Some(vm), false) = (action, &rt.vm, self.promoting) {
            self.protect(vm.clone(), vec![addr.clone()], false)?;
        }
        Ok(())
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
