//! The primary: brings a backup up to date with live pre-copy, then takes a
//! checkpoint every epoch and releases each epoch's output when the backup
//! acknowledges it.

mod config;
mod loss;
pub(crate) mod precopy;
mod session;

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ftvm_vmm::hooks::FrameSink;
use ftvm_vmm::sync::Lock;
use ftvm_vmm::Vm;

use ftvm_replication::arbiter::{Arbiter, Claim, Ownership};
use ftvm_replication::fakeack::FakeAck;
use ftvm_replication::metrics::{MetricsLog, Role, Status, StatusCell};
use ftvm_replication::output::{DiskJournal, OutputBuffer};
use ftvm_replication::pipeline::epochs::{Ended, EpochLoop};
use ftvm_replication::pipeline::trigger::{self, Pacing, Reason, Trigger};
use ftvm_replication::pipeline::Pipeline;
use ftvm_replication::ReplicationError;
use session::{Context, Session};

pub use config::{LossPolicy, OnBackupLoss, PrimaryConfig, SessionOptions, DEFAULT_PIPELINE_DEPTH, STANDBY_RETRY};
pub use loss::BackupLoss;

/// How often a side retries an arbiter it cannot reach.
const ARBITER_RETRY: Duration = Duration::from_millis(200);

/// Where output goes for a VM without a network card: nowhere.
struct NoNetwork;

impl FrameSink for NoNetwork {
    fn send(&self, _frame: &[u8]) {}
}

/// How a primary's replication ended (`Primary::finish`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    /// Every output the guest produced went out: the backup acknowledged
    /// it, or the VM ran unprotected (`--on-backup-loss continue`).
    Released,
    /// The backup was lost before it acknowledged output that is still
    /// held (`--on-backup-loss pause`, or an unreachable arbiter): that
    /// output was never released and never will be.
    Held {
        /// Why the backup was lost.
        reason: String,
        /// Network frames held.
        frames: usize,
        /// Bytes of console output held.
        console_bytes: usize,
    },
}

/// A running primary's replication.
pub struct Primary {
    status: StatusCell,
    output: Arc<OutputBuffer>,
    /// Why the backup was lost, while the VM is paused for it with its output held.
    unreleased: Arc<Mutex<Option<String>>>,
    requests: Sender<String>,
    stop: Arc<AtomicBool>,
    exit_status: Arc<AtomicI32>,
    handover: Arc<Handover>,
    thread: Option<JoinHandle<()>>,
}

/// A VM's output routed through output commit, and what goes with it
/// (`Primary::plumb`), before its primary reaches the backup.
pub struct Plumbing {
    me: String,
    ownership: Option<Ownership>,
    metrics: Arc<MetricsLog>,
    output: Arc<OutputBuffer>,
    journal: Arc<DiskJournal>,
    trigger: Arc<Trigger>,
    fake_ack: Option<Arc<FakeAck>>,
}

impl Plumbing {
    /// Hold the guest's output from its first instruction, as part of the
    /// first checkpoint's epoch: nothing leaves before a backup has the
    /// state behind it, not while the backup is reached and brought up to
    /// date, and not at all if it cannot be (a VM that already serves
    /// unprotected, such as a promoted backup, is not held back while a new
    /// backup is synchronized).
    pub fn hold_from_start(&self) {
        self.output.protect(FIRST_EPOCH);
    }
}

/// The number of a new primary's first checkpoint.
const FIRST_EPOCH: u64 = 0;

/// A planned switch-over (`Primary::hand_over`): asked, then done.
#[derive(Default)]
struct Handover {
    asked: AtomicBool,
    done: AtomicBool,
}

impl Primary {
    /// Reach the backup and synchronize it (pre-copy and the first
    /// checkpoint) before returning, so a bad backup is an error here; then
    /// keep checkpointing in the background. Once `cancel` is set (a stop
    /// signal, say), synchronizing gives up with `ReplicationError::Stopped`.
    pub fn start(vm: Arc<Vm>, config: PrimaryConfig, cancel: &AtomicBool) -> Result<Primary, ReplicationError> {
        let plumbing = Primary::plumb(&vm, &config)?;
        Primary::start_plumbed(vm, config, plumbing, cancel)
    }

    /// What comes before the guest runs, for a VM that is protected from
    /// its start (then `Plumbing::hold_from_start`): the VM claimed at the
    /// arbiter, the metrics file opened, and the guest's output (network
    /// frames, console, disk writes) routed through output commit; an
    /// arbiter or metrics path that does not work ends the VMM before its
    /// guest ran.
    pub fn plumb(vm: &Vm, config: &PrimaryConfig) -> Result<Plumbing, ReplicationError> {
        let me = ftvm_replication::identity(Role::Primary);
        let ownership = match &config.loss.arbiter {
            Some(arbiter) => Some(claim_at_start(arbiter, &me)?),
            None => None,
        };
        let metrics = Arc::new(MetricsLog::open(config.metrics.as_ref()).map_err(ReplicationError::Metrics)?);
        // Output commit plugs into the VM's hooks: frames through the
        // buffer, disk writes into the journal.
        // Both are bounded: at their bounds they make the device wait and
        // wake it when there is room again; the journal asks for early
        // checkpoints through the trigger.
        let network: Arc<dyn FrameSink> = vm.devices().tap_sink().unwrap_or_else(|| Arc::new(NoNetwork));
        // The trigger hears when output is first held in an epoch and when
        // the guest goes idle (the VMM's idle hook).
        let trigger = Arc::new(Trigger::default());
        let output = Arc::new(
            OutputBuffer::new(network.clone())
                .with_waker(vm.devices().waker())
                .with_console(vm.config().console.clone())
                .with_trigger(trigger.clone()),
        );
        vm.hooks().set_idle(Some(trigger.clone()));
        let journal = Arc::new(DiskJournal::new(trigger.clone(), vm.devices().waker()));
        // With --fake-ack the proxy stands in front of the output buffer
        // and rewrites what the guest receives.
        let fake_ack = config.fake_ack.early().map(|early| FakeAck::new(output.clone(), network, early));
        match &fake_ack {
            Some(proxy) => {
                vm.hooks().set_tx(Some(proxy.clone()));
                vm.hooks().set_guest_proxy(Some(proxy.clone()));
            }
            None => vm.hooks().set_tx(Some(output.clone())),
        }
        vm.hooks().set_console(Some(output.clone()));
        vm.hooks().set_disk_writes(Some(journal.clone()));
        Ok(Plumbing { me, ownership, metrics, output, journal, trigger, fake_ack })
    }

    /// `start` on a VM already plumbed (`plumb`).
    pub fn start_plumbed(vm: Arc<Vm>, config: PrimaryConfig, plumbing: Plumbing, cancel: &AtomicBool) -> Result<Primary, ReplicationError> {
        let Plumbing { me, ownership, metrics, output, journal, trigger, fake_ack } = plumbing;
        let status = StatusCell::new(Role::Primary);
        status.lock().costs = Some(config.switches.costs);
        let mut pipeline = Pipeline::with_fake_ack(&config.switches, &vm, output.clone(), journal.clone(), fake_ack.clone())?;
        let mut epoch = FIRST_EPOCH;
        let cx =
            Context { vm: &vm, status: &status, metrics: &metrics, output: &output, journal: &journal, trigger: &trigger, stop: cancel };
        let session = Session::open(&config.backup, &config.session, &cx, &mut pipeline, &mut epoch)?;
        let (requests, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let exit_status = Arc::new(AtomicI32::new(0));
        let handover = Arc::new(Handover::default());
        let unreleased = Arc::new(Mutex::new(None));
        let kept = output.clone();
        let worker = Worker {
            vm,
            options: config.session,
            loss: config.loss,
            pacing: config.switches.trigger,
            group_commit: config.switches.group_commit,
            depth: config.pipeline_depth,
            status: status.clone(),
            metrics,
            output,
            journal,
            trigger,
            pipeline,
            stop: stop.clone(),
            exit_status: exit_status.clone(),
            handover: handover.clone(),
            requests: rx,
            epoch,
            held_by_policy: false,
            me,
            ownership,
            fenced: false,
            fake_ack,
            unreleased: unreleased.clone(),
        };
        let thread =
            std::thread::Builder::new().name("replication".into()).spawn(move || worker.run(session)).map_err(ReplicationError::Thread)?;
        Ok(Primary { status, output: kept, unreleased, requests, stop, exit_status, handover, thread: Some(thread) })
    }

    pub fn status(&self) -> Status {
        self.status.get()
    }

    pub fn status_cell(&self) -> StatusCell {
        self.status.clone()
    }

    /// Protect the VM again with a new backup at `addr` (after losing one).
    pub fn protect(&self, addr: String) {
        let _ = self.requests.send(addr);
    }

    /// The VM stopped for good with `status`: send a last checkpoint, wait
    /// for its acknowledgement (so the guest's last output is released), and
    /// tell the backup to stop too instead of taking over. If the backup is
    /// lost first (or already was), the loss policy decides: `continue`
    /// releases the output, `pause` keeps it held, and `Finished::Held`
    /// says so (it is never released).
    pub fn finish(&mut self, status: i32) -> Finished {
        self.exit_status.store(status, Ordering::SeqCst);
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        match self.unreleased.locked().clone() {
            None => Finished::Released,
            Some(reason) => Finished::Held { reason, frames: self.output.held_frames(), console_bytes: self.output.held_console_bytes() },
        }
    }
}

impl Primary {
    /// The VM stopped to be handed over: send a last checkpoint and, once the
    /// backup acknowledged it (so all output is released), tell the backup
    /// to run the VM. Returns whether it was handed over; if not, the backup
    /// takes it over as from a failed primary (or has already).
    pub fn hand_over(&mut self) -> bool {
        self.handover.asked.store(true, Ordering::SeqCst);
        self.finish(0);
        self.handover.done.load(Ordering::SeqCst)
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        let _ = self.finish(0);
    }
}

struct Worker {
    vm: Arc<Vm>,
    /// How each session with a backup runs.
    options: SessionOptions,
    /// What a lost backup means: run on or pause, the arbiter, the standbys.
    loss: LossPolicy,
    /// `--trigger`: how the epochs are paced (afresh with each backup).
    pacing: trigger::Mode,
    group_commit: trigger::GroupCommit,
    /// `--pipeline-depth`.
    depth: usize,
    status: StatusCell,
    metrics: Arc<MetricsLog>,
    output: Arc<OutputBuffer>,
    journal: Arc<DiskJournal>,
    trigger: Arc<Trigger>,
    pipeline: Pipeline,
    stop: Arc<AtomicBool>,
    exit_status: Arc<AtomicI32>,
    handover: Arc<Handover>,
    requests: Receiver<String>,
    /// The next checkpoint's number; never reused, across backups.
    epoch: u64,
    /// The loss policy paused the VM (released once protected again).
    held_by_policy: bool,
    /// How this primary names itself to the arbiter.
    me: String,
    /// This primary's ownership as last won from the arbiter.
    ownership: Option<Ownership>,
    /// The backup won ownership: this primary must never emit again.
    fenced: bool,
    /// `--fake-ack`: stopped with the rest when fenced (it resends to the network).
    fake_ack: Option<Arc<FakeAck>>,
    /// Why the backup was lost, while the VM is paused with its output
    /// held for that (`Primary::finish` reports it).
    unreleased: Arc<Mutex<Option<String>>>,
}

impl Worker {
    fn run(mut self, first: Session) {
        let mut session = Some(first);
        let mut last_standby_try: Option<Instant> = None;
        loop {
            // `protect` also says goodbye when asked to stop, even if the
            // guest exited before this thread got going.
            if let Some(s) = session.take() {
                let loss = self.protect(&s);
                drop(s);
                // Also when the VM is stopping: the loss is logged and the
                // policy decides what happens to the output still held.
                match loss {
                    Some(loss) => self.backup_lost(&loss),
                    None => return,
                }
                if self.fenced {
                    return;
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            match self.requests.recv_timeout(Duration::from_millis(100)) {
                Ok(addr) => session = self.reprotect(&addr),
                Err(RecvTimeoutError::Timeout) => {
                    if !self.loss.standbys.is_empty() && last_standby_try.is_none_or(|t| t.elapsed() >= STANDBY_RETRY) {
                        last_standby_try = Some(Instant::now());
                        for addr in self.loss.standbys.clone() {
                            session = self.reprotect(&addr);
                            if session.is_some() || self.stop.load(Ordering::SeqCst) {
                                break;
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Protect the VM again with the backup at `addr`: the session, or None
    /// after undoing the attempt as the loss policy has it.
    fn reprotect(&mut self, addr: &str) -> Option<Session> {
        let cx = Context {
            vm: &self.vm,
            status: &self.status,
            metrics: &self.metrics,
            output: &self.output,
            journal: &self.journal,
            trigger: &self.trigger,
            stop: &self.stop,
        };
        match Session::open(addr, &self.options, &cx, &mut self.pipeline, &mut self.epoch) {
            Ok(s) => {
                tracing::info!(backup = %addr, "protected again");
                if std::mem::take(&mut self.held_by_policy) {
                    self.vm.release();
                }
                *self.unreleased.locked() = None;
                Some(s)
            }
            Err(e) => {
                self.reprotection_failed(&e);
                None
            }
        }
    }

    /// Checkpoint whenever the trigger says so until the backup is lost
    /// (returns why) or the primary stops (returns None after saying goodbye).
    fn protect(&mut self, session: &Session) -> Option<BackupLoss> {
        // Only while protecting: outside it this thread creates threads (a
        // new backup's session), which would inherit the priority.
        self.options.priority.during(|| self.protect_with(session))
    }

    fn protect_with(&mut self, session: &Session) -> Option<BackupLoss> {
        let mut pacing = Pacing::new(self.pacing, self.options.epoch).with_group_commit(self.group_commit);
        let mut epochs = EpochLoop {
            pipeline: &mut self.pipeline,
            vm: &self.vm,
            output: &self.output,
            trigger: &self.trigger,
            depth: self.depth,
            stop: &self.stop,
        };
        let status = &self.status;
        let record = |taken: &ftvm_replication::pipeline::Taken| {
            let mut st = status.lock();
            st.epoch = taken.epoch;
            st.costs = Some(taken.costs);
        };
        match epochs.run(session, &mut pacing, &mut self.epoch, record) {
            Ended::Lost(loss) => Some(loss),
            Ended::Stopped => self.farewell(session),
        }
    }

    /// Last checkpoint of the stopped VM, its acknowledgement, then Bye (or
    /// Handover, for a switch-over, only once everything is acknowledged).
    /// A backup lost before it acknowledged everything is returned: what
    /// is still held (the guest's last output) then goes as the loss
    /// policy has it, and the backup, told nothing, takes over from the
    /// last checkpoint it has (or has stopped).
    fn farewell(&mut self, session: &Session) -> Option<BackupLoss> {
        let epoch = self.epoch;
        let (mut taken, frame) = match self.pipeline.take(&self.vm, epoch) {
            Ok(t) => t,
            Err(err) => return Some(BackupLoss::Checkpoint { epoch, err }),
        };
        taken.trigger.reason = Reason::Stop;
        self.epoch += 1;
        let sent = Instant::now();
        if let Err(loss) = session.send_checkpoint(&taken, frame, sent) {
            return Some(session.loss_after(loss));
        }
        let deadline = sent + self.options.ack_timeout;
        while !session.is_lost() && !session.acked_all() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.handover.asked.load(Ordering::SeqCst) {
            if let Some(loss) = session.take_loss() {
                return Some(loss);
            }
            if !session.acked_all() {
                return Some(BackupLoss::Unacknowledged { epoch, waited_ms: sent.elapsed().as_millis() as u64 });
            }
            session.bye(self.exit_status.load(Ordering::SeqCst));
            return None;
        }
        if session.is_lost() || !session.acked_all() {
            tracing::error!(epoch, "switch-over: the backup did not acknowledge the last checkpoint; it takes over as after a failure");
            return None;
        }
        match session.hand_over() {
            Ok(()) => {
                tracing::info!(epoch, backup = %session.backup(), "handed the VM over to the backup");
                self.handover.done.store(true, Ordering::SeqCst);
            }
            Err(e) => tracing::error!("switch-over: cannot tell the backup: {e}; it takes over as after a failure"),
        }
        None
    }

    /// This primary must never emit again: nor may its fake-ACK proxy resend.
    fn fence(&mut self) {
        self.fenced = true;
        if let Some(proxy) = &self.fake_ack {
            proxy.stop();
        }
    }

    /// With an arbiter, keep the VM (and so its output) held until this side
    /// owns the VM again: the backup may be taking it over right now. Returns
    /// whether this primary still owns the VM.
    fn reclaim(&mut self, reason: &BackupLoss) -> bool {
        let (Some(arbiter), Some(seen)) = (self.loss.arbiter.clone(), self.ownership.clone()) else { return true };
        self.vm.hold();
        let mut logged = false;
        loop {
            match arbiter.claim(&seen, &self.me) {
                Ok(Claim::Won(ownership)) => {
                    tracing::warn!(generation = ownership.generation, "backup lost ({reason}); this primary still owns the VM");
                    self.ownership = Some(ownership);
                    self.vm.release();
                    return true;
                }
                Ok(Claim::Lost(owner)) => {
                    let e = ReplicationError::Fenced { owner: owner.owner, generation: owner.generation };
                    tracing::error!("FENCED: {e}");
                    self.status.lock().detail = format!("FENCED: {e}");
                    self.fence();
                    // Held output is never released: the VM stops where it is.
                    self.vm.fail(e.to_string());
                    return false;
                }
                Err(e) => {
                    if !logged {
                        tracing::error!(
                            "backup lost ({reason}) and {e}: the VM stays paused with its output held until the arbiter answers"
                        );
                        self.status.lock().detail = format!("PAUSED: backup lost, arbiter unreachable: {e}");
                        logged = true;
                    }
                    if self.stop.load(Ordering::SeqCst) {
                        *self.unreleased.locked() = Some(format!("{reason}; the arbiter was unreachable: {e}"));
                        self.fence();
                        return false;
                    }
                    std::thread::sleep(ARBITER_RETRY);
                }
            }
        }
    }

    /// A new backup could not be brought up to date. What the attempt
    /// started is undone as the loss policy has it: with `continue` the
    /// output it began to hold goes out (this VM is the only copy) instead
    /// of waiting for an acknowledgement that will never come; with `pause`
    /// it stays held with the paused guest.
    fn reprotection_failed(&mut self, e: &ReplicationError) {
        let detail = match self.loss.on_backup_loss {
            OnBackupLoss::Continue => {
                let released = self.output.unprotect();
                self.journal.stop();
                tracing::error!(frames_released = released.frames, "re-protection failed: {e}; the VM runs UNPROTECTED");
                format!("UNPROTECTED: re-protection failed: {e}")
            }
            OnBackupLoss::Pause => {
                self.journal.stop();
                *self.unreleased.locked() = Some(format!("re-protection failed: {e}"));
                tracing::error!("re-protection failed: {e}; the VM stays paused");
                format!("PAUSED: re-protection failed: {e}")
            }
        };
        let mut st = self.status.lock();
        st.protected = false;
        st.detail = detail;
    }

    fn backup_lost(&mut self, reason: &BackupLoss) {
        ftvm_replication::telemetry::telemetry().backup_lost();
        self.status.lock().peer.clear();
        if !self.reclaim(reason) {
            return;
        }
        let output = &self.output;
        match self.loss.on_backup_loss {
            OnBackupLoss::Continue => {
                let released = output.unprotect();
                self.journal.stop();
                tracing::error!(
                    frames_released = released.frames,
                    "BACKUP LOST ({reason}): the VM now runs UNPROTECTED; attach a new backup to protect it again"
                );
                let mut st = self.status.lock();
                st.protected = false;
                st.detail = format!("UNPROTECTED: backup lost: {reason}");
            }
            OnBackupLoss::Pause => {
                self.vm.hold();
                self.held_by_policy = true;
                *self.unreleased.locked() = Some(reason.to_string());
                if self.stop.load(Ordering::SeqCst) {
                    tracing::error!(
                        held = output.held_frames(),
                        "BACKUP LOST ({reason}) as the VM stopped: its last output stays held (never acknowledged)"
                    );
                } else {
                    tracing::error!(held = output.held_frames(), "BACKUP LOST ({reason}): the VM is paused until a new backup protects it");
                }
                let mut st = self.status.lock();
                st.protected = false;
                st.detail = format!("PAUSED: backup lost: {reason}");
            }
        }
    }
}

/// Become the VM's owner before protecting it.
fn claim_at_start(arbiter: &Arbiter, me: &str) -> Result<Ownership, ReplicationError> {
    let seen = arbiter.read()?;
    match arbiter.claim(&seen, me)? {
        Claim::Won(ownership) => {
            tracing::info!(generation = ownership.generation, arbiter = arbiter.endpoint(), "this primary owns the VM");
            Ok(ownership)
        }
        Claim::Lost(owner) => Err(ReplicationError::Fenced { owner: owner.owner, generation: owner.generation }),
    }
}
