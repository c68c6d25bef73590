//! A VM replica: its guest gets the committed input in log order, its
//! output reaches the network only while it leads (and then only after the
//! `syncvm` that follows it), and it runs each committed `syncvm`.
//!
//! Threads: the device thread's input hook only queues frames for the
//! consensus thread (PLOVER's non-blocking consensus), and the device
//! thread reads the TAP only while this replica leads; the *applier* takes
//! committed entries in order, injects input and runs `syncvm`; while this
//! replica leads, a *proposer* decides when to propose the next `syncvm`
//! (the output trigger of the primary-backup pipeline: output held and
//! the guest idle, a hold bound, a maximum interval), with
//! `--sync-pipeline on` an *acknowledgement* thread awaits the
//! secondary's acknowledgements of `syncvm`s whose pages were sent and
//! releases their output, in order, and a *pre-copy*
//! worker brings a replica it has not synchronized up to date while the
//! guest runs (`rejoin`); a *joiner* thread takes such a pre-copy into
//! this replica's held VM.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ftvm_vmm::hooks::{FrameSink, HostInputFilter};
use ftvm_vmm::sync::{self as vsync, Lock};
use ftvm_vmm::Vm;

use crate::aside::Aside;
use crate::direct_input::InputGate;
use crate::disk::ReplicaDisk;
use crate::log::{Entry, InputCounts, MAX_INPUT_FRAMES};
use crate::loss::{self, OnSecondaryLoss};
use crate::mesh::{Inbound, Mesh};
use crate::node::{Committed, Event, View, ALIVE};
use crate::recent::{self, Recent};
use crate::rejoin::{self, RejoinMetrics, RejoinMode, RejoinRecord};
use crate::release::{Awaited, Waited};
use crate::settle;
use crate::sync::{self, Exchange, Figures, PageMode, StateBase, SyncError, SyncId};
use crate::tuning::{AckRelease, AckWait, EarlyResume, InputBatch, SyncClock, SyncOutput, SyncPipeline, SyncSettle, SyncSpacing};
use crate::writes::Writes;
use ftvm_replication::consensus_status::{SyncMetrics, SyncRole};
use ftvm_replication::metrics::{MetricsLog, Role, StatusCell};
use ftvm_replication::output::{DiskJournal, OutputBuffer};
use ftvm_replication::pipeline::encode::hash_compare::{self, HashCompare};
use ftvm_replication::pipeline::freeze::{Freeze, PauseAndSave};
use ftvm_replication::pipeline::predict;
use ftvm_replication::pipeline::trigger::{self, Pacing, Sample, Trigger};
use ftvm_replication::protocol::Kind;

/// A proposed `syncvm` not applied within this long was lost (a leader
/// change): propose again.
const PROPOSAL_TIMEOUT: Duration = Duration::from_secs(2);
/// A new leader picks a standby witness as its secondary only after this
/// long: when a group starts, the other VM replica may not be heard yet.
const STANDBY_GRACE: Duration = Duration::from_secs(1);

/// A VM replica's options.
pub struct Options {
    /// Longest interval between two `syncvm`s.
    pub max_interval: Duration,
    pub pages: PageMode,
    pub rejoin: RejoinMode,
    /// A witness with a VM: held from the start, until a leader brings it
    /// up to date.
    pub standby: bool,
    /// `--takeover-replay`.
    pub replay: recent::Mode,
    /// `--sync-spacing`.
    pub spacing: SyncSpacing,
    /// `--ack-wait`.
    pub ack_wait: AckWait,
    /// `--early-resume`.
    pub early_resume: EarlyResume,
    /// `--sync-settle`.
    pub sync_settle: SyncSettle,
    /// `--sync-clock`.
    pub sync_clock: SyncClock,
    /// `--ack-release`.
    pub ack_release: AckRelease,
    /// `--input-batch`.
    pub input_batch: InputBatch,
    /// `--sync-pipeline`.
    pub sync_pipeline: SyncPipeline,
    /// `--on-secondary-loss`.
    pub on_secondary_loss: OnSecondaryLoss,
    /// `--predict-writes`.
    pub predict_writes: predict::Mode,
    /// What adaptive prediction weighs.
    pub costs: ftvm_replication::pipeline::costs::Costs,
    /// `--sync-output`.
    pub sync_output: SyncOutput,
}

/// What arrives for a VM replica's threads from its links.
pub struct Inboxes {
    /// The `syncvm` exchange (the applier).
    pub sync: Receiver<Inbound>,
    /// A leader's pre-copy into this VM (the joiner).
    pub join: Receiver<Inbound>,
    /// Answers to this leader's pre-copy (the pre-copy worker).
    pub precopy: Receiver<Inbound>,
}

/// A pre-copy for the worker: this leadership, to this replica.
type Job = (Arc<Leadership>, u64);

/// Everything the replica's threads share.
pub struct Shared {
    pub id: u64,
    pub vm: Arc<Vm>,
    pub mesh: Arc<Mesh>,
    pub view: Arc<Mutex<View>>,
    pub events: Sender<Event>,
    pub eligible: Arc<AtomicBool>,
    pub status: StatusCell,
    pub metrics: MetricsLog,
    pub options: Options,
    /// The VM's disk (`--disk`): its own image, compared at each `syncvm`.
    pub disk: Option<ReplicaDisk>,
    /// The guest's output while this replica does not lead: kept since the
    /// last completed `syncvm` (`--takeover-replay on`), sent at takeover.
    recent: Arc<Recent>,
    /// The VM is held (paused) for a leader's pre-copy, or as a standby:
    /// released by this replica's first successful `syncvm`.
    held: Arc<AtomicBool>,
    /// `--direct-input on`: the consensus thread delivers input when this
    /// replica's applier has nothing earlier; the applier says when it is
    /// done with what it took.
    gate: Option<Arc<InputGate>>,
    /// Taken by whoever writes guest memory from outside while the VM is
    /// held (the joiner) and by the secondary's `syncvm`: a pre-copy batch
    /// never lands in the middle of a `syncvm`, nor after one succeeded.
    ram_writer: Mutex<()>,
    /// The pre-copy worker's queue.
    jobs: Mutex<Option<Sender<Job>>>,
    /// This VM holds the state that was released: it led, or completed a
    /// `syncvm` as secondary, and was not out of step since. Such a
    /// replica needs no pre-copy (a leader that stepped down keeps running
    /// and may lead again); a restarted one, before its raft catches up,
    /// may look eligible but does not hold it.
    current: AtomicBool,
    /// Set while this replica serves as leader.
    lead: Mutex<Option<Arc<Leadership>>>,
    /// When the previous `syncvm` ended here.
    last_sync: Mutex<Instant>,
    /// `--ack-release link`: the acknowledgement a link thread releases
    /// the output of (shared with the mesh's routes).
    acks: Arc<Awaited>,
    /// Input entries and frames the consensus thread handed on.
    inputs: Arc<InputCounts>,
    /// As a secondary: its memory equalled the leader's at the last
    /// `syncvm` and its writes since are tracked (otherwise the next
    /// `syncvm` compares every page).
    in_step: AtomicBool,
    /// This process acknowledged a leader's `syncvm` pages.
    acknowledged: AtomicBool,
    /// `--predict-writes`: the pages its `syncvm`s leave writable.
    writes: Mutex<Writes>,
    /// The VM state its last `syncvm` sent or applied (`sync::StateBase`).
    state_base: Mutex<Option<StateBase>>,
}

/// One term of serving as leader.
struct Leadership {
    term: u64,
    output: Arc<OutputBuffer>,
    trigger: Arc<Trigger>,
    freeze: Mutex<PauseAndSave>,
    /// `--early-resume on`: the copy of each `syncvm`'s union (`aside`),
    /// its buffer kept from one to the next.
    aside: Mutex<Aside>,
    /// How divergent pages go (`--sync-pages`): one for the leadership,
    /// so that `adaptive` learns from each `syncvm`.
    compare: Mutex<Box<dyn HashCompare>>,
    /// Output epochs closed so far (the next freeze closes this one).
    epoch: AtomicU64,
    serving: AtomicBool,
    /// The `syncvm`s under way (`ran` tells of changes).
    flight: Mutex<Flight>,
    /// The next one as the proposer proposed it.
    proposed: Mutex<Option<Proposed>>,
    /// `--ack-wait proposer`: a `syncvm` whose pages were sent and whose
    /// acknowledgement the proposer is to wait for (set under `flight`).
    unacked: Mutex<Option<(Done, Figures)>>,
    /// `--sync-pipeline on`: `syncvm`s whose pages were sent (or that
    /// failed before), in order, for the acknowledgement thread.
    acker: Mutex<Option<Sender<Unacked>>>,
    ran: Condvar,
    /// The last figures, for the proposer's pacing.
    last: Mutex<Option<Figures>>,
    /// The replica this leader last brought up to date.
    synced: Mutex<Option<u64>>,
    /// Where the pre-copy of a replica not synchronized yet stands.
    rejoin: Mutex<Rejoin>,
    /// When this leadership began.
    started: Instant,
    /// `--on-secondary-loss pause`: the guest is held (`Vm::hold`) until
    /// a full `syncvm` makes a replica the secondary, or until this
    /// leadership ends. (A lock, not a flag: the hold and a step-down's
    /// end of it must not interleave.)
    paused: Mutex<bool>,
}

/// The leader's `syncvm`s under way.
#[derive(Default)]
struct Flight {
    /// A `syncvm` proposed and not yet run: with `--sync-pipeline on`,
    /// until its pages are sent (or it failed before), otherwise until it
    /// is over.
    proposed: bool,
    /// `--sync-pipeline on`: `syncvm`s whose pages were sent and that are
    /// not over yet (the acknowledgement thread's), all with `secondary`.
    acking: usize,
    secondary: u64,
    /// Failed `syncvm`s of this leadership so far: one proposed before a
    /// failure is abandoned with it (`release`).
    failures: u64,
    /// `--sync-pipeline on`, for the proposer's pacing: when the guest of
    /// the `syncvm` whose pages were just sent resumed, and the applier's
    /// time for it (from reaching its entry until the pages were sent).
    sent: Option<(Instant, Duration)>,
}

/// A `syncvm` as its proposer proposed it.
#[derive(Clone, Copy, Debug)]
struct Proposed {
    /// When (`propose_us`).
    at: Instant,
    /// `Flight::failures` then: a failure after it abandons it.
    failures: u64,
    /// An earlier one awaited its acknowledgement then (`--sync-pipeline on`).
    overlapped: bool,
}

/// `--sync-pipeline on`: how many `syncvm`s may be in flight at once.
const PIPELINE_DEPTH: usize = 2;
/// `--sync-output on`: the leader's held output a `syncvm` carries at most
/// (its first frames; a client whose reply is beyond gets it by
/// retransmission, as without it).
const SYNC_OUTPUT_LIMIT: usize = 256 << 10;

/// A `syncvm` for the acknowledgement thread: its pages were sent at
/// `sent` (the figures), or it failed before.
type Unacked = (Done, Instant, Result<Figures, SyncError>);

/// Which `syncvm` of a leadership ended, for its release and record.
#[derive(Clone, Copy, Debug)]
struct Done {
    id: SyncId,
    /// The output epoch its freeze closed.
    epoch: u64,
    secondary: u64,
    full: bool,
    /// When the applier reached it.
    t0: Instant,
    /// From the proposal to `t0`.
    propose: Duration,
    /// Its acknowledgement is the acknowledgement thread's
    /// (`--sync-pipeline on`): the proposer did not wait for it.
    pipelined: bool,
    /// Proposed while an earlier one awaited its acknowledgement.
    overlapped: bool,
}

/// A leader's pre-copy of a replica it has not synchronized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rejoin {
    Idle,
    Running(u64),
    /// Done: the next `syncvm` with it is the (full) stop-and-copy.
    Ready(u64),
    /// It failed: the next `syncvm` with it is a full one without pre-copy.
    Failed(u64),
}

/// The guest's frames go nowhere: a replica that does not lead.
struct Discard;

impl FrameSink for Discard {
    fn send(&self, _frame: &[u8]) {}
}

/// The TAP's frames become proposals while this replica leads; the guest
/// gets them from the log, never straight from the TAP. (The network card
/// reads its TAP only while this replica leads; a frame read in the
/// moment before or after is dropped here.)
struct Input {
    shared: Arc<Shared>,
    /// `--input-batch on`: the frames of this read pass of the TAP, sent
    /// to the consensus thread together at its end (only the network
    /// card's thread calls the filter, so the lock is never contended).
    pass: Option<Mutex<Vec<Vec<u8>>>>,
}

impl HostInputFilter for Input {
    fn admit(&self, frame: &[u8]) -> bool {
        let serving = self.shared.lead.locked().as_ref().is_some_and(|l| l.serving.load(Ordering::Relaxed));
        if serving {
            match &self.pass {
                Some(pass) => {
                    let mut frames = pass.locked();
                    frames.push(frame.to_vec());
                    // A long pass (a flood) still goes on in bounded entries.
                    if frames.len() >= MAX_INPUT_FRAMES {
                        let _ = self.shared.events.send(Event::Inputs(std::mem::take(&mut *frames)));
                    }
                }
                None => {
                    let _ = self.shared.events.send(Event::Propose(Entry::Input(frame.to_vec()).encode()));
                }
            }
        }
        false
    }

    fn pass_end(&self) {
        if let Some(pass) = &self.pass {
            let frames = std::mem::take(&mut *pass.locked());
            if !frames.is_empty() {
                let _ = self.shared.events.send(Event::Inputs(frames));
            }
        }
    }
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u64,
        vm: Arc<Vm>,
        mesh: Arc<Mesh>,
        view: Arc<Mutex<View>>,
        events: Sender<Event>,
        eligible: Arc<AtomicBool>,
        status: StatusCell,
        metrics: MetricsLog,
        options: Options,
        disk: Option<ReplicaDisk>,
        held: Arc<AtomicBool>,
        gate: Option<Arc<InputGate>>,
        acks: Arc<Awaited>,
        inputs: Arc<InputCounts>,
    ) -> Shared {
        let writes = Mutex::new(Writes::new(options.predict_writes, vm.ram().pages(), &options.costs));
        Shared {
            writes,
            state_base: Mutex::new(None),
            id,
            vm,
            mesh,
            view,
            events,
            eligible,
            status,
            metrics,
            recent: Arc::new(Recent::new(options.replay)),
            options,
            disk,
            held,
            gate,
            ram_writer: Mutex::new(()),
            jobs: Mutex::new(None),
            current: AtomicBool::new(false),
            lead: Mutex::new(None),
            last_sync: Mutex::new(Instant::now()),
            acks,
            inputs,
            in_step: AtomicBool::new(false),
            acknowledged: AtomicBool::new(false),
        }
    }
}

/// Install the replica's hooks and start its threads: the applier, the
/// joiner and the pre-copy worker (these two hash pages on every core, so
/// they keep the filter of the thread that starts them, which may create
/// threads).
pub fn start(shared: Arc<Shared>, committed: Receiver<Committed>, inboxes: Inboxes) -> std::io::Result<()> {
    let hooks = shared.vm.hooks();
    // Its guest's input comes from the log: its TAP is read only while it
    // leads (`take_over`), not to drop every frame that reaches it meanwhile.
    shared.vm.devices().set_host_input(false);
    hooks.set_tx(Some(shared.recent.clone()));
    let pass = (shared.options.input_batch == InputBatch::On).then(Mutex::default);
    hooks.set_host_input(Some(Arc::new(Input { shared: shared.clone(), pass })));
    shared.track_disk_as_secondary();
    shared.vm.start_dirty_tracking().map_err(std::io::Error::other)?;
    if shared.options.sync_clock == SyncClock::Step {
        shared.vm.set_clock_stepped(true).map_err(std::io::Error::other)?;
    }
    if shared.options.standby {
        // Its guest has nothing to do until a leader copies it its state.
        shared.hold();
    }
    let (jobs_tx, jobs) = std::sync::mpsc::channel();
    *shared.jobs.locked() = Some(jobs_tx);
    let Inboxes { sync: sync_inbox, join, precopy } = inboxes;
    let s = shared.clone();
    std::thread::Builder::new().name("precopy".into()).spawn(move || precopy_loop(&s, jobs, precopy))?;
    let s = shared.clone();
    std::thread::Builder::new().name("joiner".into()).spawn(move || join_loop(&s, join))?;
    let sync_inbox = Arc::new(Mutex::new(sync_inbox));
    std::thread::Builder::new().name("applier".into()).spawn(move || Applier { shared, sync_inbox }.run(committed))?;
    Ok(())
}

impl Shared {
    /// Record the guest's disk writes in the journal a secondary's
    /// `syncvm` takes (until this replica leads: then its leadership's).
    fn track_disk_as_secondary(&self) {
        if let Some(d) = &self.disk {
            d.journal.start();
            self.vm.hooks().set_disk_writes(Some(d.journal.clone()));
        }
    }

    /// Hold the VM (once) until this replica's next successful `syncvm`.
    fn hold(&self) {
        if !self.held.swap(true, Ordering::SeqCst) {
            self.vm.hold();
        }
    }

    /// `--on-secondary-loss pause`: while `lead` has no synchronized
    /// secondary its guest is held, and its output with it (the proposer
    /// proposes no barrier), until a full `syncvm` makes a replica the
    /// secondary (`unpause`).
    fn pause_unprotected(&self, lead: &Leadership, why: &str) {
        let mut paused = lead.paused.locked();
        // (Once it stopped serving, `step_down` ended any hold: none now.)
        if !*paused && lead.serving.load(Ordering::SeqCst) {
            *paused = true;
            self.vm.hold();
            tracing::error!(
                term = lead.term,
                held = lead.output.held_frames(),
                "{why}: the guest is paused, its output held, until a secondary is synchronized (--on-secondary-loss pause)"
            );
            self.mesh.set_witness_linger(false);
            let mut st = self.status.lock();
            st.protected = false;
            st.detail = format!("{}: {why}", loss::PAUSED);
        }
    }

    /// End `pause_unprotected`'s hold, if any.
    fn unpause(&self, lead: &Leadership) {
        let mut paused = lead.paused.locked();
        if *paused {
            *paused = false;
            self.vm.release();
            tracing::warn!(term = lead.term, "the guest runs again");
        }
    }

    /// Whether a `syncvm` naming this replica as the secondary is one its
    /// leader has given up by now (a replica catching up from the log
    /// meets many): waiting for its messages would pause the guest for
    /// the step timeout each time. Its leader no longer leads when a
    /// later term began; and a leader compares dirty pages (not `full`)
    /// only with a secondary whose `syncvm` it saw succeed in its term,
    /// which, when this process has acknowledged none, was an earlier
    /// incarnation of this replica. Skipping one the leader does run
    /// fails it there, which its next (full) `syncvm` repairs.
    fn abandoned(&self, id: SyncId, full: bool) -> bool {
        id.term < self.view.locked().term || (!full && !self.acknowledged.load(Ordering::SeqCst))
    }

    /// This VM no longer matches what the leader released: it may not
    /// lead, and the next `syncvm` it takes part in compares every page.
    fn out_of_step(&self) {
        self.current.store(false, Ordering::SeqCst);
        self.in_step.store(false, Ordering::SeqCst);
        self.eligible.store(false, Ordering::SeqCst);
    }
}

/// The leader's pre-copy worker: one pre-copy at a time.
fn precopy_loop(s: &Shared, jobs: Receiver<Job>, inbox: Receiver<Inbound>) {
    for (session, (lead, peer)) in (1..).zip(jobs) {
        // Its messages carry (term, session), as syncvm's carry (term, index).
        let x = Exchange {
            mesh: &s.mesh,
            inbox: &inbox,
            peer,
            id: SyncId { term: lead.term, index: session },
            disk: s.disk.as_ref(),
            started: Instant::now(),
            writes: None,
            state_base: None,
        };
        let t0 = Instant::now();
        // (Not under the status lock: `pause_unprotected` takes it inside `paused`.)
        let paused = *lead.paused.locked();
        s.status.lock().detail = if paused {
            format!("{}; bringing replica {peer} up to date (pre-copy)", loss::PAUSED)
        } else {
            format!("leader: bringing replica {peer} up to date (pre-copy); UNPROTECTED")
        };
        let mut m = RejoinMetrics { term: lead.term, peer, ..RejoinMetrics::default() };
        let result = rejoin::precopy(&x, &s.vm, &lead.serving, &mut m);
        m.ok = result.is_ok();
        m.duration_us = t0.elapsed().as_micros() as u64;
        match &result {
            Ok(()) => tracing::info!(
                peer,
                rounds = m.rounds,
                pages = m.pages,
                blocks = m.blocks,
                left = m.left,
                bytes = m.precopy_bytes,
                ms = t0.elapsed().as_millis() as u64,
                skipped = m.skipped,
                "pre-copy done: a full syncvm follows"
            ),
            Err(e) => tracing::warn!(peer, "pre-copy failed: {e}; a full syncvm without it follows"),
        }
        s.metrics.record(&RejoinRecord { rejoin: m });
        *lead.rejoin.locked() = if result.is_ok() { Rejoin::Ready(peer) } else { Rejoin::Failed(peer) };
    }
}

/// The replica's side of a leader's pre-copy: while it is not in step,
/// hold the VM and take the pages in.
fn join_loop(s: &Shared, inbox: Receiver<Inbound>) {
    // The pre-copy being taken in: from whom, which.
    let mut session: Option<(u64, SyncId)> = None;
    while let Ok(msg) = inbox.recv() {
        let Some(id) = SyncId::parse(&msg.payload) else { continue };
        let x = Exchange {
            mesh: &s.mesh,
            inbox: &inbox,
            peer: msg.from,
            id,
            disk: s.disk.as_ref(),
            started: Instant::now(),
            writes: None,
            state_base: None,
        };
        let _writer = s.ram_writer.locked();
        match msg.kind {
            Kind::RejoinStart => {
                if s.lead.locked().is_some() {
                    // A stale leader's: this replica leads now.
                    continue;
                }
                let in_step = s.current.load(Ordering::SeqCst) && s.eligible.load(Ordering::SeqCst);
                if !in_step {
                    // From here on its memory is the leader's copy in the
                    // making: it may not lead, and its guest must not run.
                    s.out_of_step();
                    s.hold();
                    session = Some((msg.from, id));
                    s.status.lock().detail = format!("rejoining: pre-copy from {}", msg.from);
                }
                let answer = match rejoin::answer(&s.vm, s.disk.as_ref(), in_step) {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(leader = msg.from, "pre-copy: {e}");
                        session = None;
                        continue;
                    }
                };
                if x.send(Kind::RejoinHashes, &answer).is_err() {
                    session = None;
                }
            }
            Kind::RejoinPages => {
                // Only the current pre-copy's, and none once a syncvm made
                // this VM the leader's again.
                if session != Some((msg.from, id)) || s.current.load(Ordering::SeqCst) {
                    continue;
                }
                match rejoin::write_pages(&msg.payload, &s.vm, s.disk.as_ref()) {
                    Ok(seq) => {
                        let _ = x.send(Kind::RejoinAck, &seq.to_le_bytes());
                    }
                    Err(e) => {
                        tracing::warn!(leader = msg.from, "pre-copy: {e}; ignoring the rest of it");
                        session = None;
                    }
                }
            }
            _ => {}
        }
    }
}

struct Applier {
    shared: Arc<Shared>,
    /// The `syncvm` exchange's messages: the applier's, and with
    /// `--ack-wait proposer` the proposer's for the acknowledgement.
    sync_inbox: Arc<Mutex<Receiver<Inbound>>>,
}

impl Applier {
    fn run(self, committed: Receiver<Committed>) {
        let mut input = Vec::new();
        loop {
            let first = match committed.recv_timeout(Duration::from_millis(20)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            self.check_leadership();
            // Entries taken and not yet done with (`InputGate`).
            let mut taken = 0;
            for c in first.into_iter().chain(committed.try_iter()) {
                taken += 1;
                // Held for a pre-copy (or as a standby), the VM's input is
                // replaced whole at its syncvm: do not let it pile up.
                if self.shared.held.load(Ordering::SeqCst)
                    && matches!(c, Committed::Entry { entry: Entry::Input(_) | Entry::Inputs(_), .. } | Committed::Inputs(_))
                {
                    continue;
                }
                match c {
                    Committed::Entry { entry: Entry::Input(frame), .. } => input.push(frame),
                    Committed::Entry { entry: Entry::Inputs(frames), .. } => input.extend(frames),
                    Committed::Inputs(frames) => input.extend(frames),
                    other => {
                        // In log order: the input before it reaches the guest first.
                        self.deliver(&mut input);
                        self.apply(other);
                        self.done(&mut taken);
                    }
                }
            }
            self.deliver(&mut input);
            self.done(&mut taken);
        }
    }

    /// The entries taken so far are done with: their input is delivered.
    fn done(&self, taken: &mut u64) {
        if let Some(gate) = &self.shared.gate {
            gate.done(std::mem::take(taken));
        }
    }

    fn deliver(&self, input: &mut Vec<Vec<u8>>) {
        if !input.is_empty() {
            self.shared.vm.devices().inject_host_input(std::mem::take(input));
        }
    }

    fn apply(&self, c: Committed) {
        match c {
            Committed::OutOfStep => self.out_of_step(),
            Committed::LeaderStart { term, leader, .. } => {
                if leader == self.shared.id {
                    self.take_over(term);
                } else {
                    self.step_down("another replica leads");
                    let mut st = self.shared.status.lock();
                    st.role = Role::Secondary;
                    st.term = term;
                }
            }
            Committed::Entry { index, term, entry: Entry::Sync { leader, secondary, full } } => {
                let id = SyncId { term, index };
                if leader == self.shared.id {
                    self.lead_sync(id, secondary, full);
                } else if secondary == self.shared.id {
                    if self.shared.abandoned(id, full) {
                        // As after a failed one: the next comparison is
                        // of every page.
                        self.shared.in_step.store(false, Ordering::SeqCst);
                        tracing::debug!(index, term, leader, "skipped a syncvm its leader no longer runs");
                    } else {
                        self.follow_sync(id, leader, full);
                    }
                } else {
                    // The leader released output this VM has no state for.
                    self.out_of_step();
                }
            }
            Committed::Entry { entry: Entry::Input(_) | Entry::Inputs(_), .. } | Committed::Inputs(_) => {
                unreachable!("input is delivered in batches")
            }
        }
    }

    /// Consensus may have moved on without this replica (cut off in a
    /// minority, it stepped down): stop serving at once.
    fn check_leadership(&self) {
        let view = *self.shared.view.locked();
        let term = self.shared.lead.locked().as_ref().map(|l| l.term);
        if let Some(term) = term {
            if !view.is_leader || view.term != term {
                self.step_down("this replica no longer leads");
                self.shared.status.lock().role = Role::Secondary;
            }
        }
    }

    /// Every input committed before is in the guest's queue: serve.
    fn take_over(&self, term: u64) {
        let s = &self.shared;
        if s.lead.locked().as_ref().is_some_and(|l| l.term == term) {
            return;
        }
        // Against the joiner: either this replica leads before a pre-copy
        // into it starts (which it then ignores), or the pre-copy made it
        // ineligible first; it never serves a held VM.
        let _writer = s.ram_writer.locked();
        if !s.eligible.load(Ordering::SeqCst) {
            // The consensus thread hands leadership on.
            tracing::warn!(term, "elected, but this VM is not in step with what was released: not serving");
            return;
        }
        s.current.store(true, Ordering::SeqCst);
        let vm = &s.vm;
        let network = vm.devices().tap_sink().unwrap_or_else(|| Arc::new(Discard));
        let output_network = network.clone();
        let trigger = Arc::new(Trigger::default());
        let output = Arc::new(OutputBuffer::new(output_network).with_waker(vm.devices().waker()).with_trigger(trigger.clone()));
        // Held from now until the next syncvm (or consensus barrier).
        output.protect(0);
        let journal = Arc::new(DiskJournal::new(trigger.clone(), vm.devices().waker()));
        if s.disk.is_some() {
            // Its freeze takes the writes; a full journal asks for a syncvm.
            // (Those recorded before are not needed: a new leadership's
            // first syncvm compares every block.)
            journal.start();
            vm.hooks().set_disk_writes(Some(journal.clone()));
        }
        let freeze = PauseAndSave::new(vm.ram().pages(), output.clone(), journal);
        let lead = Arc::new(Leadership {
            term,
            output: output.clone(),
            trigger: trigger.clone(),
            freeze: Mutex::new(freeze),
            aside: Mutex::new(Aside::new(vm)),
            compare: Mutex::new(hash_compare::new(s.options.pages)),
            epoch: AtomicU64::new(0),
            serving: AtomicBool::new(true),
            flight: Mutex::new(Flight::default()),
            proposed: Mutex::new(None),
            unacked: Mutex::new(None),
            acker: Mutex::new(None),
            ran: Condvar::new(),
            last: Mutex::new(None),
            synced: Mutex::new(None),
            rejoin: Mutex::new(Rejoin::Idle),
            started: Instant::now(),
            paused: Mutex::new(false),
        });
        if s.options.on_secondary_loss == OnSecondaryLoss::Pause {
            // No secondary is synchronized with this leadership yet (its
            // first syncvm is a full one): nothing runs or goes out before.
            s.pause_unprotected(&lead, "no secondary synchronized yet");
        }
        vm.hooks().set_tx(Some(output));
        vm.hooks().set_idle(Some(trigger));
        *s.lead.locked() = Some(lead.clone());
        // From here its TAP's frames are proposed. Those that queued in it
        // while it followed were never ordered: the network card drops them.
        vm.devices().set_host_input(true);
        ftvm_replication::announce::announce(vm);
        // Its guest's output since its last syncvm: of the state it serves
        // from now (`recent`); whatever the guest sends next is held.
        let (frames, dropped, leaders) = s.recent.take();
        let replayed = frames.len();
        // With `--on-secondary-loss pause` they are held too: only this VM
        // has the state they tell of until its first syncvm.
        let paused = *lead.paused.locked();
        let replay: &dyn FrameSink = if paused { &*lead.output } else { &*network };
        for f in &frames {
            replay.send(f);
        }
        if s.options.replay == recent::Mode::On {
            tracing::info!(
                term,
                frames = replayed,
                dropped,
                "takeover: sent the guest's {replayed} frames since the last syncvm ({leaders} of them the last leader's, held when it froze for that syncvm)"
            );
        }
        {
            s.mesh.set_witness_linger(false);
            let mut st = s.status.lock();
            st.role = Role::Leader;
            st.term = term;
            st.protected = false;
            st.detail =
                if paused { format!("{}; waiting for a secondary", loss::PAUSED) } else { "leader: waiting for a secondary".into() };
        }
        tracing::warn!(term, "LEADER: serving the VM");
        if s.options.sync_pipeline == SyncPipeline::On {
            let (tx, rx) = mpsc::channel();
            *lead.acker.locked() = Some(tx);
            let (shared, lead) = (s.clone(), lead.clone());
            let _ = std::thread::Builder::new().name("sync-acks".into()).spawn(move || {
                ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Replication);
                ack_loop(&shared, &lead, &rx)
            });
        }
        let shared = s.clone();
        let inbox = self.sync_inbox.clone();
        let _ = std::thread::Builder::new().name("proposer".into()).spawn(move || {
            ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Replication);
            propose_loop(&shared, &lead, &inbox)
        });
    }

    fn out_of_step(&self) {
        self.shared.out_of_step();
    }

    fn step_down(&self, why: &str) {
        let s = &self.shared;
        let Some(lead) = s.lead.locked().take() else { return };
        // Its VM stays in step: anything another leader releases from now
        // on follows a Sync entry this replica applies too (as the
        // secondary, or as out of step: `apply`). Unless that leader's log
        // replaces entries its guest ran before they committed
        // (`--leader-apply append`): then the consensus thread says so
        // (`Committed::OutOfStep`).
        lead.serving.store(false, Ordering::SeqCst);
        lead.ran.notify_all();
        // Its input comes from the log again: its TAP is left unread.
        s.vm.devices().set_host_input(false);
        // Not leading, its guest runs as any replica's (its output goes
        // nowhere but `recent`).
        s.unpause(&lead);
        // No link thread takes an acknowledgement of it from now on, and
        // the acknowledgement thread's waits end.
        s.acks.clear();
        // The output held since the last syncvm is dropped with the buffer:
        // whoever leads now has its own.
        s.recent.clear();
        s.vm.hooks().set_tx(Some(s.recent.clone()));
        s.vm.hooks().set_idle(None);
        // Whoever leads next compares every block at its first syncvm.
        s.track_disk_as_secondary();
        s.mesh.set_witness_linger(false);
        s.status.lock().protected = false;
        tracing::warn!(term = lead.term, held = lead.output.held_frames(), "stepped down: {why}; held output dropped");
    }

    fn lead_sync(&self, id: SyncId, secondary: u64, full: bool) {
        let s = &self.shared;
        let Some(lead) = s.lead.locked().clone() else { return };
        if lead.term != id.term {
            return;
        }
        if secondary != 0 {
            s.settle();
        }
        if s.options.sync_clock == SyncClock::Step {
            // Before the freeze saves it: the reading both guests run the
            // next epoch with.
            if let Err(e) = s.vm.step_clock() {
                tracing::warn!("stepping the guest clock: {e}");
            }
        }
        let epoch = lead.epoch.fetch_add(1, Ordering::SeqCst);
        let t0 = Instant::now();
        let proposed = lead.proposed.locked().take();
        let propose = proposed.map_or(Duration::ZERO, |p| t0.saturating_duration_since(p.at));
        // (An entry proposed long ago, whose proposer gave up on it, counts
        // as proposed now.)
        let failures = proposed.map_or_else(|| lead.flight.locked().failures, |p| p.failures);
        let overlapped = proposed.is_some_and(|p| p.overlapped);
        // Its acknowledgement is awaited by the acknowledgement thread
        // (the proposer pipelines only these: `propose_loop`).
        let pipelined = s.options.sync_pipeline == SyncPipeline::On && secondary != 0 && !full;
        let done = Done { id, epoch, secondary, full, t0, propose, pipelined, overlapped };
        let inbox = self.sync_inbox.locked();
        let mut freezer = lead.freeze.locked();
        // (The exchange takes the prediction again to learn: not held across.)
        let frozen = freezer.freeze(&s.vm, epoch, s.writes.locked().leave());
        let freeze = t0.elapsed();
        let with_freeze = |f: Figures| Figures { steps: sync::Steps { freeze, ..f.steps }, ..f };
        let result = match frozen {
            Err(e) => Err(SyncError::Protocol(ftvm_replication::ProtocolError::Corrupt(e.to_string()))),
            Ok(frozen) if secondary == 0 => {
                // A barrier: consensus committed it, so this replica led then.
                let pause = frozen.thaw().figures.pause;
                Ok(Figures { pause, ..Figures::default() })
            }
            Ok(frozen) => {
                // `--sync-output on`: the secondary keeps it for a takeover.
                let output = match s.options.sync_output {
                    SyncOutput::On => lead.output.frames_through(frozen.epoch, SYNC_OUTPUT_LIMIT),
                    SyncOutput::Off => Vec::new(),
                };
                let x = Exchange {
                    mesh: &s.mesh,
                    inbox: &inbox,
                    peer: secondary,
                    id,
                    disk: s.disk.as_ref(),
                    started: t0,
                    writes: Some(&s.writes),
                    state_base: Some(&s.state_base),
                };
                let mut aside = lead.aside.locked();
                let aside = (s.options.early_resume == EarlyResume::On).then_some(&mut *aside);
                let mut compare = lead.compare.locked();
                let compare: &mut dyn HashCompare = &mut **compare;
                let link = s.options.ack_release == AckRelease::Link;
                if link || pipelined {
                    // Before any page is sent: the acknowledgement cannot
                    // come first. Under `flight`: a failure is counted, and
                    // the syncvms awaited then abandoned, wholly before or
                    // after this.
                    let flight = lead.flight.locked();
                    s.acks.expect(secondary, id, epoch, lead.output.clone(), link, flight.failures != failures);
                }
                if pipelined {
                    let result = sync::lead_unacked(&x, &s.vm, frozen, full, &mut *compare, aside, output).map(with_freeze);
                    // The acknowledgement thread takes it from here, in
                    // order; the proposer may propose the next one.
                    let sent = Instant::now();
                    let figures = result.as_ref().ok().copied();
                    let mut flight = lead.flight.locked();
                    let unhanded = match lead.acker.locked().as_ref() {
                        Some(acker) => acker.send((done, sent, result)).err().map(|e| e.0),
                        None => Some((done, sent, result)),
                    };
                    if unhanded.is_none() {
                        flight.acking += 1;
                    }
                    flight.proposed = false;
                    let pause = figures.map_or(Duration::ZERO, |f| f.pause);
                    flight.sent = Some((t0 + pause, sent.saturating_duration_since(t0)));
                    *lead.last.locked() = figures;
                    lead.ran.notify_all();
                    drop(flight);
                    if unhanded.is_some() {
                        // The acknowledgement thread is gone (it ends with
                        // the leadership): this syncvm is over.
                        s.synced(&lead, done, Err(SyncError::Closed));
                    }
                    return;
                }
                match s.options.ack_wait {
                    AckWait::Applier => sync::lead(&x, &s.vm, frozen, full, &mut *compare, aside, output).map(with_freeze),
                    AckWait::Proposer => match sync::lead_unacked(&x, &s.vm, frozen, full, &mut *compare, aside, output).map(with_freeze) {
                        Ok(figures) => {
                            // The proposer waits for the acknowledgement and
                            // releases; this thread delivers input meanwhile.
                            let _flight = lead.flight.locked();
                            *lead.unacked.locked() = Some((done, figures));
                            lead.ran.notify_all();
                            return;
                        }
                        Err(e) => Err(e),
                    },
                }
            }
        };
        drop(freezer);
        drop(inbox);
        s.synced(&lead, done, result);
    }

    fn follow_sync(&self, id: SyncId, leader: u64, full: bool) {
        let s = &self.shared;
        if s.lead.locked().is_some() {
            return;
        }
        if !s.held.load(Ordering::SeqCst) {
            s.settle();
        }
        let t0 = Instant::now();
        let inbox = self.sync_inbox.locked();
        let x = Exchange {
            mesh: &s.mesh,
            inbox: &inbox,
            peer: leader,
            id,
            disk: s.disk.as_ref(),
            started: t0,
            writes: Some(&s.writes),
            state_base: Some(&s.state_base),
        };
        // No pre-copy batch lands during the syncvm, nor after it succeeded.
        let writer = s.ram_writer.locked();
        // Inside the pause once applied: what the guest sent before is of
        // the execution the leader's state replaced.
        let result = sync::follow(&x, &s.vm, full || !s.in_step.load(Ordering::SeqCst), |output| s.recent.reset(output));
        s.in_step.store(result.is_ok(), Ordering::SeqCst);
        if matches!(result, Ok(_) | Err(SyncError::Unusable(_))) {
            s.acknowledged.store(true, Ordering::SeqCst);
        }
        if result.is_ok() {
            // (A syncvm that failed before the acknowledgement changed
            // nothing: whatever this VM held, it holds.)
            s.current.store(true, Ordering::SeqCst);
        }
        drop(writer);
        match &result {
            Ok(_) => {
                s.eligible.store(true, Ordering::SeqCst);
                if s.held.swap(false, Ordering::SeqCst) {
                    // The leader's copy: it runs from here.
                    s.vm.release();
                }
                let mut st = s.status.lock();
                st.role = Role::Secondary;
                st.term = id.term;
                st.protected = true;
                st.detail = format!("secondary of {leader}");
            }
            Err(e) => {
                if matches!(e, SyncError::Unusable(_)) {
                    // Acknowledged but not applied whole: the leader may
                    // release what this VM lacks.
                    self.out_of_step();
                }
                s.status.lock().detail = format!("secondary: syncvm with {leader} failed: {e}");
                tracing::warn!(index = id.index, leader, "syncvm failed: {e}; nothing applied");
            }
        }
        s.record(id, SyncRole::Secondary, leader, full, t0, &result, (Duration::ZERO, false));
    }
}

impl Shared {
    /// `--sync-settle on`: let the guest take and answer the input
    /// delivered to it before a `syncvm` stops it (`settle`).
    fn settle(&self) {
        if self.options.sync_settle == SyncSettle::On {
            let (waited, settled) = settle::settle(&self.vm, settle::MAX);
            tracing::trace!(waited_us = waited.as_micros() as u64, settled, "guest settled before a syncvm");
        }
    }

    /// A `syncvm` this leader ran is over (acknowledged, or failed):
    /// release the output it closed, record it, let the proposer go on.
    fn synced(&self, lead: &Leadership, done: Done, result: Result<Figures, SyncError>) {
        let s = self;
        let Done { id, epoch, secondary, full, t0, propose, pipelined, overlapped } = done;
        // `--ack-release link`: the link thread that read the
        // acknowledgement releases this epoch (after this, no link thread
        // takes one). A failure abandons the syncvms proposed before it
        // (under `flight`, with the count the applier looks at).
        let link_releases = {
            let mut flight = lead.flight.locked();
            if result.is_err() {
                flight.failures += 1;
            }
            s.acks.finish(id, result.is_ok())
        };
        // (Ended after this replica stepped down, by the acknowledgement
        // thread or the proposer: the status is the new role's.)
        let serving = lead.serving.load(Ordering::SeqCst);
        match &result {
            Ok(f) => {
                let released = if link_releases { Default::default() } else { lead.output.release_through(epoch) };
                let _ = s.events.send(Event::Compact(id.index));
                *lead.synced.locked() = (secondary != 0).then_some(secondary);
                if secondary != 0 {
                    // Its output went out above: the guest runs on, protected.
                    s.unpause(lead);
                }
                if serving {
                    s.mesh.set_witness_linger(secondary != 0);
                    let mut st = s.status.lock();
                    st.protected = secondary != 0;
                    st.detail =
                        if secondary != 0 { format!("leader: secondary {secondary}") } else { "leader: UNPROTECTED (no secondary)".into() };
                }
                tracing::debug!(
                    index = id.index,
                    secondary,
                    full,
                    released = released.frames,
                    divergent = f.divergent_pages,
                    "syncvm done"
                );
            }
            Err(e) => {
                *lead.synced.locked() = None;
                // Its dirty set was taken: were it a secondary later, the
                // next syncvm must compare every page.
                s.in_step.store(false, Ordering::SeqCst);
                tracing::warn!(index = id.index, secondary, "syncvm failed: {e}; output stays held");
                if serving {
                    let pause = s.options.on_secondary_loss == OnSecondaryLoss::Pause;
                    if pause {
                        // No other VM holds the state of the output held now.
                        s.pause_unprotected(lead, "the secondary's syncvm failed");
                    }
                    s.mesh.set_witness_linger(false);
                    let mut st = s.status.lock();
                    st.protected = false;
                    st.detail = if pause {
                        format!("{}: syncvm with {secondary} failed: {e}", loss::PAUSED)
                    } else {
                        format!("leader: syncvm with {secondary} failed: {e}")
                    };
                }
            }
        }
        s.record(id, SyncRole::Leader, secondary, full, t0, &result, (propose, overlapped));
        let mut flight = lead.flight.locked();
        if pipelined {
            // (The proposer learnt its figures when its pages were sent.)
            flight.acking = flight.acking.saturating_sub(1);
        } else {
            *lead.last.locked() = result.ok();
            flight.proposed = false;
        }
        lead.ran.notify_all();
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        id: SyncId,
        role: SyncRole,
        peer: u64,
        full: bool,
        t0: Instant,
        result: &Result<Figures, SyncError>,
        // The leader's: from its proposal to `t0`, and whether an earlier
        // one awaited its acknowledgement then.
        (propose, overlapped): (Duration, bool),
    ) {
        let s = self;
        let interval = {
            let mut last = s.last_sync.locked();
            let i = t0.saturating_duration_since(*last);
            *last = Instant::now();
            i
        };
        let f = result.as_ref().copied().unwrap_or_default();
        let (bytes, messages) = s.mesh.take_sent();
        let saved_bytes = s.mesh.take_saved();
        let (input_entries, input_frames) = s.inputs.take();
        let us = |d: Duration| d.as_micros() as u64;
        let m = SyncMetrics {
            term: id.term,
            index: id.index,
            role,
            peer,
            full,
            ok: result.is_ok(),
            bytes,
            dirty_pages: f.dirty_pages,
            divergent_pages: f.divergent_pages,
            patched_pages: f.patched_pages,
            repaired_pages: f.repaired_pages,
            page_bytes: f.page_bytes,
            dirty_blocks: f.dirty_blocks,
            divergent_blocks: f.divergent_blocks,
            pause_us: f.pause.as_micros() as u64,
            interval_us: interval.as_micros() as u64,
            sync_us: t0.elapsed().as_micros() as u64,
            messages,
            saved_bytes,
            propose_us: us(propose),
            overlapped,
            freeze_us: us(f.steps.freeze),
            bitmap_us: us(f.steps.bitmap),
            copy_us: us(f.steps.copy),
            hash_us: us(f.steps.hash),
            wait_us: us(f.steps.wait),
            ack_us: us(f.steps.ack),
            input_entries,
            input_frames,
            predicted: f.predicted.predicted,
            predicted_written: f.predicted.predicted_written,
            memory_digest: f.memory_digest,
        };
        s.metrics.record(&m);
        s.status.lock().last_sync = Some(m);
    }
}

/// While `lead` serves: propose a `syncvm` whenever the output trigger
/// says so, one at a time; with `--sync-pipeline on` the next one as soon
/// as the previous one's pages are sent, while its acknowledgement is
/// awaited (at most `PIPELINE_DEPTH` in flight).
fn propose_loop(s: &Shared, lead: &Arc<Leadership>, inbox: &Mutex<Receiver<Inbound>>) {
    let mut pacing = Pacing::new(trigger::Mode::Output, s.options.max_interval);
    let guest = trigger::GuestView { vm: &s.vm, output: &lead.output };
    let mut since = Instant::now();
    while lead.serving.load(Ordering::SeqCst) {
        // Room for one more: with one at a time (`acking` stays 0) there
        // always is here.
        wait_flight(lead, |f| f.acking < PIPELINE_DEPTH);
        let plan = pacing.plan(since);
        let look = Instant::now() + Duration::from_millis(20);
        if lead.trigger.wait(&plan, &guest, || true, look).is_none() {
            continue;
        }
        let start = Instant::now();
        let mut secondary = pick_secondary(s, lead);
        let full = secondary != 0 && *lead.synced.locked() != Some(secondary);
        let overlaps = |f: &Flight| f.acking > 0 && (full || secondary == 0 || secondary != f.secondary);
        if overlaps(&lead.flight.locked()) {
            // Only a syncvm that compares the dirty pages with the same
            // secondary may follow one not yet acknowledged: a full one
            // (and its pre-copy) or a barrier waits until the previous
            // ones are over, then the choice is made again.
            wait_flight(lead, |f| f.acking == 0);
            continue;
        }
        if full && !rejoined(s, lead, secondary) {
            // A barrier meanwhile: output is released unprotected, as with
            // no secondary at all.
            secondary = 0;
        }
        if secondary == 0 && s.options.on_secondary_loss == OnSecondaryLoss::Pause {
            // No barrier: the guest stays paused and its output held until
            // a full syncvm (after the pre-copy, if one runs) can be
            // proposed.
            s.pause_unprotected(lead, "no synchronized secondary");
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let full = secondary != 0 && full;
        {
            let mut flight = lead.flight.locked();
            flight.proposed = true;
            if secondary != 0 {
                flight.secondary = secondary;
            }
            *lead.proposed.locked() = Some(Proposed { at: Instant::now(), failures: flight.failures, overlapped: flight.acking > 0 });
        }
        let _ = s.events.send(Event::Propose(Entry::Sync { leader: s.id, secondary, full }.encode()));
        let mut flight = lead.flight.locked();
        let deadline = Instant::now() + PROPOSAL_TIMEOUT;
        loop {
            // `--ack-wait proposer`: the applier sent the pages (it sets
            // this under `flight`, so no notice is missed).
            let unacked = lead.unacked.locked().take();
            if let Some((done, figures)) = unacked {
                drop(flight);
                await_ack(s, lead, inbox, done, figures);
                flight = lead.flight.locked();
                continue;
            }
            if !(flight.proposed && lead.serving.load(Ordering::SeqCst) && Instant::now() < deadline) {
                break;
            }
            flight = vsync::wait_timeout(&lead.ran, flight, deadline.saturating_duration_since(Instant::now()));
        }
        flight.proposed = false;
        let sent = flight.sent.take();
        drop(flight);
        let f = lead.last.locked().take().unwrap_or_default();
        let cost = match (s.options.spacing, sent) {
            // `--sync-pipeline on`: as a pipelined checkpoint's, the work
            // that must end before the next one can start (the applier's:
            // freeze, exchange, pages sent), not the consensus round nor
            // the acknowledgement, which the next one overlaps.
            (SyncSpacing::Cost, Some((_, work))) => work,
            (SyncSpacing::Cost, None) => start.elapsed(),
            // Only what stops the guest: the next syncvm may follow at
            // twice its pause (`Pacing::spacing`).
            (SyncSpacing::Pause, _) => f.pause,
        };
        pacing.record(&Sample {
            pause: f.pause,
            cost,
            dirty_pages: f.dirty_pages,
            epoch: start.saturating_duration_since(since),
            clients: 0,
        });
        // The spacing runs from the guest's resume: with one syncvm at a
        // time, the next may start only once this one is over anyway.
        since = sent.map_or_else(Instant::now, |(resumed, _)| resumed);
    }
}

/// Wait until `ok` holds for `lead`'s `syncvm`s in flight, or it stops
/// serving.
fn wait_flight(lead: &Leadership, ok: impl Fn(&Flight) -> bool) {
    let mut flight = lead.flight.locked();
    while !ok(&flight) && lead.serving.load(Ordering::SeqCst) {
        // (Stepping down notifies `ran`; the timeout is a backstop.)
        flight = vsync::wait_timeout(&lead.ran, flight, Duration::from_millis(20));
    }
}

/// `--sync-pipeline on`, while `lead` serves (and until what it was
/// handed is done): await the secondary's acknowledgement of each
/// `syncvm` whose pages were sent, in order, and end it (release its
/// output, record it). One that failed, or whose acknowledgement does not
/// come, abandons those after it (`release`): they end failed too.
fn ack_loop(s: &Shared, lead: &Leadership, unacked: &Receiver<Unacked>) {
    loop {
        let (done, sent, result) = match unacked.recv_timeout(Duration::from_millis(20)) {
            Ok(u) => u,
            Err(RecvTimeoutError::Timeout) if lead.serving.load(Ordering::SeqCst) => continue,
            Err(_) => return,
        };
        let result = result.and_then(|figures| {
            let peer = done.secondary;
            let waited = s.acks.wait(done.id, sent + sync::STEP_TIMEOUT, || s.mesh.is_lost(peer));
            let ack = sent.elapsed();
            match waited {
                Waited::Acked => Ok(Figures { steps: sync::Steps { ack, ..figures.steps }, ..figures }),
                Waited::Lost => Err(SyncError::PeerLost),
                Waited::Abandoned => Err(SyncError::Abandoned),
                Waited::Timeout => Err(SyncError::Timeout(sync::STEP_TIMEOUT)),
            }
        });
        s.synced(lead, done, result);
    }
}

/// `--ack-wait proposer`: the secondary's acknowledgement of a `syncvm`
/// whose pages the applier sent, then its release.
fn await_ack(s: &Shared, lead: &Leadership, inbox: &Mutex<Receiver<Inbound>>, done: Done, figures: Figures) {
    let inbox = inbox.locked();
    let x = Exchange {
        mesh: &s.mesh,
        inbox: &inbox,
        peer: done.secondary,
        id: done.id,
        disk: s.disk.as_ref(),
        started: done.t0,
        writes: None,
        state_base: None,
    };
    let result = sync::await_ack(&x).map(|ack| Figures { steps: sync::Steps { ack, ..figures.steps }, ..figures });
    drop(inbox);
    s.synced(lead, done, result);
}

/// Whether the leader may run the full `syncvm` that makes `peer` its
/// secondary: with `--rejoin precopy`, once a pre-copy of it ended (done,
/// or failed: then without); starts that pre-copy when none runs.
fn rejoined(s: &Shared, lead: &Arc<Leadership>, peer: u64) -> bool {
    if s.options.rejoin == RejoinMode::Syncvm {
        return true;
    }
    let mut state = lead.rejoin.locked();
    match *state {
        Rejoin::Ready(p) | Rejoin::Failed(p) if p == peer => {
            // Consumed: should this syncvm fail, the next one pre-copies again.
            *state = Rejoin::Idle;
            true
        }
        Rejoin::Running(_) => false,
        _ => {
            let queued = s.jobs.locked().as_ref().is_some_and(|j| j.send((lead.clone(), peer)).is_ok());
            if !queued {
                return true;
            }
            *state = Rejoin::Running(peer);
            false
        }
    }
}

/// The VM replica to keep up to date: the one synchronized last if it is
/// alive, else the first live VM replica, a standby only when no other is
/// alive; 0 when there is none (the witness without a VM is never one).
fn pick_secondary(s: &Shared, lead: &Leadership) -> u64 {
    let peers = s.mesh.peers();
    let mut alive: Vec<(bool, u64)> = peers
        .iter()
        .filter(|(id, p)| **id != s.id && !p.witness && p.heard.is_some_and(|t| t.elapsed() < ALIVE))
        // Its disk could not be synchronized with this one (logged when it connected).
        .filter(|(_, p)| p.disk == s.disk.as_ref().map_or(0, ReplicaDisk::size))
        .map(|(id, p)| (p.standby, *id))
        .collect();
    alive.sort_unstable();
    match *lead.synced.locked() {
        Some(id) if alive.iter().any(|&(_, i)| i == id) => id,
        _ => match alive.first() {
            Some(&(true, _)) if lead.started.elapsed() < STANDBY_GRACE => 0,
            Some(&(_, id)) => id,
            None => 0,
        },
    }
}
