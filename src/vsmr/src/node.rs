//! The consensus thread: one raft-rs `RawNode` driven by ticks, peer
//! messages and proposals, handing committed entries on in log order.
//!
//! raft-rs (tikv `raft` 0.7) is used rather than openraft because it has no
//! async runtime: it is a state machine the caller drives from its own
//! thread, as the VMM drives everything else (docs/replicas.md, "Why
//! raft-rs").
//!
//! The log lives in memory (`MemStorage`); it is compacted behind the
//! applied index, and a peer that needs what was compacted gets raft's
//! snapshot, which carries no VM data (a replica that far behind is
//! brought up to date by a full `syncvm` anyway), only the configuration
//! and the members' addresses (`membership`). Only the term and vote must
//! outlive a replica (`--raft-state`, `vote`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use protobuf::Message as _;
use raft::eraftpb::{ConfState, EntryType, Message, MessageType};
use raft::storage::MemStorage;
use raft::{Config, RawNode, StateRole, INVALID_ID};

use ftvm_vmm::sync::Lock;

use crate::direct_input::InputGate;
use crate::failover::{self, Cause, Detection, Election, FastElection, Lost};
pub use crate::inbound::Event;
use crate::log::{Entry, InputCounts, MAX_INPUT_FRAMES};
use crate::membership::{Book, Changes, Membership, Store};
use crate::mesh::Mesh;
use crate::outbox::Outbox;
use crate::tuning::{BatchAppend, EarlyApply, LeaderApply, LinkBatch, Tuning};
use crate::vote::{Vote, VoteFile};
use ftvm_replication::metrics::StatusCell;
use ftvm_replication::protocol::{self, Kind};
use ftvm_replication::ReplicationError;

/// One raft tick: elections after 20-40 ticks of silence, heartbeats every 2.
pub const TICK: Duration = Duration::from_millis(10);
const ELECTION_TICKS: usize = 20;
const HEARTBEAT_TICKS: usize = 2;
/// Entries kept behind the applied index before compaction.
const KEEP_ENTRIES: u64 = 4096;
/// A peer counts as alive when a message from it arrived this recently.
pub const ALIVE: Duration = Duration::from_millis(500);
/// A leadership that lasts this long was not handed straight back: the
/// count of hand-overs in a row starts again (`hand_over`).
const SETTLED: Duration = Duration::from_secs(2);
/// Hand-overs won in a row after which a leader that may not lead keeps
/// the leadership (`hand_over`): a hand-over to a replica that may lead
/// ends in one, and a drain's hand-back in two.
const BOUNCES: u32 = 3;

/// An entry the log committed, in log order.
#[derive(Debug)]
pub enum Committed {
    /// Entries this replica's guest ran were replaced by another leader's
    /// (`--leader-apply append`): its VM no longer follows the log.
    OutOfStep,
    Entry {
        index: u64,
        term: u64,
        entry: Entry,
    },
    /// The empty entry a new leader appends first: everything before it is
    /// committed, and `leader` leads from here.
    LeaderStart {
        index: u64,
        term: u64,
        leader: u64,
    },
    /// `Input` entries in log order that the consensus thread could not
    /// deliver itself (`--direct-input on`, `gate`).
    Inputs(Vec<Vec<u8>>),
}

/// What this replica believes about leadership right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct View {
    pub term: u64,
    pub leader: u64,
    pub is_leader: bool,
}

pub struct NodeConfig {
    pub id: u64,
    /// The voters of a new group (`--peers`); none for a replica that
    /// joins one (`--join`): it learns the group from raft's snapshot.
    pub voters: Vec<u64>,
    /// Every member's address, kept up to date as the group changes.
    pub book: Arc<Mutex<Book>>,
    /// The group as `ftvm status` shows it.
    pub shown: Arc<Mutex<Membership>>,
    pub witness: bool,
    /// This replica runs a VM: committed entries go to its applier. A
    /// witness without one is told only who leads (`LeaderStart`): its
    /// thread would be woken for every entry only to drop it.
    pub vm: bool,
    /// This replica may lead (a VM replica with the current state): the
    /// witness, or a replica that was never brought up to date, hands
    /// leadership on to one that may.
    pub eligible: Arc<AtomicBool>,
    pub failover: failover::Options,
    /// Where the election that made this replica leader is shown.
    pub status: StatusCell,
    /// `--early-apply`, `--batch-append`.
    pub tuning: Tuning,
    /// `--direct-input on` on a VM replica: committed input goes into the
    /// guest from this thread when the applier has nothing earlier.
    pub gate: Option<Arc<InputGate>>,
    /// Input entries and frames handed on (the `syncvm` metrics).
    pub inputs: Arc<InputCounts>,
    /// `--raft-state`: where the term and vote are kept, and what it held
    /// at start.
    pub votes: Option<(VoteFile, Option<Vote>)>,
}

impl NodeConfig {
    /// Whether a follower may hand entries on once appended: with three
    /// voters, this replica one of them, the leader and this replica are a
    /// majority (`tuning::EarlyApply`). Not in a joint configuration (a
    /// majority of each half is needed), nor on a learner.
    fn early_apply(&self, conf: &ConfState) -> bool {
        self.tuning.early_apply == EarlyApply::On
            && conf.voters.len() == 3
            && conf.voters.contains(&self.id)
            && conf.voters_outgoing.is_empty()
    }

    /// Whether the leader may skip commit notices: every follower applies
    /// on append (the three voters' setting; no learner, which does not).
    fn followers_apply_early(&self, conf: &ConfState) -> bool {
        self.early_apply(conf) && conf.learners.is_empty()
    }

    /// Whether a leader with a VM hands its own input and `syncvm`s on once
    /// appended (`tuning::LeaderApply`).
    fn leader_apply(&self) -> bool {
        self.tuning.leader_apply == LeaderApply::Append && self.vm
    }
}

/// Start the consensus thread. `view` is kept up to date; committed
/// entries go to `committed`.
pub fn start(
    mut config: NodeConfig,
    mesh: Arc<Mesh>,
    events: Receiver<Event>,
    committed: Sender<Committed>,
    view: Arc<Mutex<View>>,
) -> Result<(), ReplicationError> {
    let raft_config = Config {
        id: config.id,
        election_tick: ELECTION_TICKS,
        heartbeat_tick: HEARTBEAT_TICKS,
        // A leader cut off in a minority steps down after an election
        // timeout; a returning replica does not disrupt a working leader.
        check_quorum: true,
        pre_vote: true,
        max_size_per_msg: 1 << 20,
        max_inflight_msgs: 256,
        // The witness stands later than the VM replicas, so a live
        // secondary usually wins; should it win, it hands over at once.
        min_election_tick: if config.witness { 3 * ELECTION_TICKS } else { 0 },
        max_election_tick: if config.witness { 5 * ELECTION_TICKS } else { 0 },
        // Followers that apply on append need no separate commit notice:
        // one message per peer per commit fewer.
        skip_bcast_commit: config.followers_apply_early(&ConfState::from((config.voters.clone(), vec![]))),
        batch_append: config.tuning.batch_append == BatchAppend::On,
        ..Default::default()
    };
    raft_config.validate().map_err(|e| ReplicationError::Consensus(e.to_string()))?;
    let (votes, held) = config.votes.take().unzip();
    if let (Some(file), Some(Some(v))) = (&votes, held) {
        tracing::info!(term = v.term, vote = v.vote, "term and vote from {}", file.path().display());
    }
    let storage = Store::new(storage(&config.voters, held.flatten()), config.book.clone());
    let changes = Changes::new(config.id, config.book.clone(), config.shown.clone());
    let logger = slog::Logger::root(TracingDrain, slog::o!());
    let node = RawNode::new(&raft_config, storage, &logger).map_err(|e| ReplicationError::Consensus(e.to_string()))?;
    changes.publish(&node);
    let early_apply = config.early_apply(&ConfState::from((config.voters.clone(), vec![])));
    std::thread::Builder::new()
        .name("consensus".into())
        .spawn(move || {
            ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Replication);
            Loop {
                node,
                mesh,
                committed,
                view,
                config,
                compacted: 0,
                heard: HashMap::new(),
                leader_since: (INVALID_ID, 0, Instant::now()),
                handed_in_a_row: 0,
                lost: None,
                round: None,
                delivered: 0,
                inputs: Vec::new(),
                outbox: Outbox::default(),
                votes,
                changes,
                early_apply,
            }
            .run(events)
        })
        .map_err(ReplicationError::Thread)?;
    Ok(())
}

/// An empty log for `voters`, at the term and vote kept (`--raft-state`).
fn storage(voters: &[u64], held: Option<Vote>) -> MemStorage {
    let storage = MemStorage::new_with_conf_state(ConfState::from((voters.to_vec(), vec![])));
    if let Some(v) = held {
        let mut store = storage.wl();
        let hs = store.mut_hard_state();
        hs.set_term(v.term);
        hs.set_vote(v.vote);
    }
    storage
}

struct Loop {
    node: RawNode<Store>,
    mesh: Arc<Mesh>,
    committed: Sender<Committed>,
    view: Arc<Mutex<View>>,
    config: NodeConfig,
    /// The log is compacted up to here.
    compacted: u64,
    /// When a raft message from each peer last arrived.
    heard: HashMap<u64, Instant>,
    /// The leader this replica follows, its term, and since when.
    leader_since: (u64, u64, Instant),
    /// Elections this replica won in a row by a hand-over, the leadership
    /// changing hands within `SETTLED` each time: two VM replicas that may
    /// not lead (neither holds the released state: both were lost) would
    /// otherwise hand it to each other for ever (`hand_over`).
    handed_in_a_row: u32,
    /// The leader found dead, while the election this calls for runs.
    lost: Option<Lost>,
    /// What started the election this replica runs: shown if it wins.
    round: Option<(Cause, Instant)>,
    /// Entries up to here were handed on (`committed`): committed ones,
    /// and with `--early-apply on` appended ones of the current term.
    delivered: u64,
    /// `--input-batch on`: frames of this round, not yet proposed.
    inputs: Vec<Vec<u8>>,
    /// `--link-batch on`: this round's raft messages, per peer, until
    /// `flush` hands each peer's to its sender thread at once.
    outbox: Outbox,
    votes: Option<VoteFile>,
    /// The members, and the leader's replacement of one (`membership`).
    changes: Changes,
    /// This replica may hand entries on once appended (`NodeConfig::early_apply`
    /// of the configuration now).
    early_apply: bool,
}

impl Loop {
    fn run(mut self, events: Receiver<Event>) {
        let mut next_tick = Instant::now() + TICK;
        loop {
            let now = Instant::now();
            match events.recv_timeout(next_tick.saturating_duration_since(now)) {
                Ok(ev) => {
                    self.handle(ev);
                    // Take what else is queued before the next Ready: batches.
                    for ev in events.try_iter().take(256) {
                        self.handle(ev);
                    }
                    self.propose_inputs();
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            if Instant::now() >= next_tick {
                self.tick();
                next_tick = (next_tick + TICK).max(Instant::now());
                self.hand_over();
                self.changes.tick(&mut self.node);
            }
            if self.on_ready().is_err() {
                return;
            }
        }
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Peer(msg) => match Message::parse_from_bytes(&msg.payload) {
                // The sender is who its authenticated link says it is.
                Ok(m) if m.get_msg_type() == MessageType::MsgAppend && !append_is_sound(&m) => {
                    tracing::warn!(from = msg.from, index = m.index, "dropped an append whose entries do not follow its index")
                }
                Ok(mut m) if m.from == msg.from && m.to == self.config.id => {
                    self.heard.insert(m.from, Instant::now());
                    let log = &self.node.raft.raft_log;
                    if m.get_msg_type() == MessageType::MsgHeartbeat && m.commit > log.last_index() {
                        // This replica restarted under the same leader and
                        // lost its log (it is in memory): the leader still
                        // counts on what it acknowledged before and names a
                        // commit index beyond its log, which raft-rs takes
                        // for a broken invariant (it panics). Such a
                        // heartbeat commits nothing here; the append that
                        // answers it finds the gap, and a snapshot follows.
                        tracing::debug!(commit = m.commit, last = log.last_index(), "a heartbeat beyond this log: committing nothing");
                        m.commit = log.committed;
                    }
                    self.step(m);
                }
                Ok(m) => tracing::warn!(link = msg.from, from = m.from, to = m.to, "dropped a raft message not from its link's peer"),
                Err(e) => tracing::warn!(from = msg.from, "dropped a malformed raft message: {e}"),
            },
            Event::PeerLost(id) => {
                let raft = &self.node.raft;
                if raft.state == StateRole::Follower && raft.leader_id == id && id != self.config.id {
                    self.detected(id, Detection::LinkClosed);
                }
            }
            Event::Inputs(frames) => {
                if self.node.raft.state == StateRole::Leader {
                    // An event holds at most MAX_INPUT_FRAMES (the network
                    // card's side), so neither does an entry.
                    if self.inputs.len() + frames.len() > MAX_INPUT_FRAMES {
                        self.propose_inputs();
                    }
                    self.inputs.extend(frames);
                }
            }
            Event::Propose(data) => {
                // The input queued before this proposal goes first.
                self.propose_inputs();
                if self.node.raft.state == StateRole::Leader {
                    let _ = self.node.propose(vec![], data);
                }
            }
            Event::Replace(r) => {
                let answer = match self.step_aside(r.remove) {
                    Some(answer) => Err(answer),
                    None => self.changes.request(&mut self.node, &r),
                };
                let _ = r.reply.send(answer);
            }
            Event::Compact(index) => {
                let store = self.node.raft.raft_log.store.clone();
                let index = index.min(self.node.raft.raft_log.applied);
                if index > self.compacted {
                    self.compacted = index;
                    let _ = store.wl().compact(index);
                }
            }
        }
    }

    /// `--input-batch on`: the frames queued so far as one entry.
    fn propose_inputs(&mut self) {
        if self.inputs.is_empty() {
            return;
        }
        let frames = std::mem::take(&mut self.inputs);
        if self.node.raft.state == StateRole::Leader {
            let _ = self.node.propose(vec![], Entry::Inputs(frames).encode());
        }
    }

    /// Step a peer's message, noting what it starts: a leader's hand-over
    /// makes this replica campaign; a candidate behind this replica's log,
    /// while the leader is found dead, cannot win its vote, so this
    /// replica stands itself (and hands over if it may not lead).
    fn step(&mut self, m: Message) {
        let raft = &self.node.raft;
        let (from, kind) = (m.from, m.get_msg_type());
        let was = raft.state;
        let behind = kind == MessageType::MsgRequestPreVote
            && self.lost.is_some_and(|l| l.term == raft.term)
            && raft.state != StateRole::Leader
            && (m.log_term, m.index) < (raft.raft_log.last_term(), raft.raft_log.last_index());
        let _ = self.node.step(m);
        let now = self.node.raft.state;
        if kind == MessageType::MsgTimeoutNow && was != now && now == StateRole::Candidate {
            self.round = Some((Cause::Handover { from }, Instant::now()));
        }
        if let (true, Some(lost)) = (behind, self.lost) {
            tracing::info!(candidate = from, "a candidate is behind this log while the leader is lost: standing");
            self.campaign(lost.cause(), lost.at);
        }
    }

    /// A raft tick, then this replica's own failure detection: the
    /// leader's silence past `--failure-timeout-ms`, and the retries of an
    /// election it called for that no peer answered yet (a peer that did
    /// not yet find the leader dead ignores a pre-vote).
    fn tick(&mut self) {
        self.node.tick();
        let raft = &self.node.raft;
        let me = self.config.id;
        // The randomized timeout fired (tick_election resets the count).
        if matches!(raft.state, StateRole::PreCandidate | StateRole::Candidate) && raft.election_elapsed == 0 {
            self.round = Some((Cause::Timeout, Instant::now()));
        }
        let key = (raft.leader_id, raft.term);
        if (self.leader_since.0, self.leader_since.1) != key {
            self.leader_since = (key.0, key.1, Instant::now());
        } else if self.leader_since.2.elapsed() >= SETTLED && raft.state != StateRole::Leader {
            self.handed_in_a_row = 0;
        }
        if let Some(lost) = self.lost {
            let expired = lost.at.elapsed() >= TICK * ELECTION_TICKS as u32;
            if expired || (raft.term > lost.term && raft.leader_id != INVALID_ID) {
                self.lost = None;
            } else if raft.state == StateRole::PreCandidate && self.round.is_some_and(|(c, _)| c == lost.cause()) {
                self.campaign(lost.cause(), lost.at);
            }
            return;
        }
        let (FastElection::On, Some(timeout)) = (self.config.failover.fast, self.config.failover.failure_timeout) else { return };
        let leader = raft.leader_id;
        if raft.state != StateRole::Follower || leader == INVALID_ID || leader == me {
            return;
        }
        let last = self.heard.get(&leader).copied().map_or(self.leader_since.2, |t| t.max(self.leader_since.2));
        if last.elapsed() >= timeout {
            self.detected(leader, Detection::Silent);
        }
    }

    /// The leader `leader` is found dead: give up the lease (grant votes at
    /// once) and, if this replica may lead, campaign (pre-vote first).
    fn detected(&mut self, leader: u64, how: Detection) {
        if self.config.failover.fast == FastElection::Off {
            return;
        }
        let raft = &mut self.node.raft;
        let lost = Lost { leader, how, term: raft.term, at: Instant::now() };
        self.lost = Some(lost);
        // check-quorum's lease: a follower ignores votes while it heard
        // from a leader within the election timeout.
        raft.election_elapsed = raft.election_elapsed.max(raft.election_timeout());
        if self.config.eligible.load(Ordering::SeqCst) {
            tracing::warn!(leader, ?how, term = raft.term, "the leader is lost: starting an election");
            self.campaign(lost.cause(), lost.at);
        } else {
            tracing::info!(leader, ?how, term = raft.term, "the leader is lost: voting at once (this replica does not stand)");
        }
    }

    fn campaign(&mut self, cause: Cause, since: Instant) {
        // Only a voter stands (not a learner, nor one that joins or was
        // removed): raft-rs does not check, and one with no configuration
        // would count an election with no voters as won.
        if !self.node.raft.promotable() {
            return;
        }
        if !self.round.is_some_and(|(c, _)| c == cause) {
            self.round = Some((cause, since));
        }
        // raft-rs starts with a pre-vote (pre_vote is set).
        let _ = self.node.campaign();
        // The randomized timeout is the fallback: it fires only once this
        // election went unanswered that long (the retries above run for
        // one election timeout), not because `detected` aged the lease.
        let raft = &mut self.node.raft;
        if raft.state == StateRole::PreCandidate {
            raft.election_elapsed = 0;
        }
    }

    /// A leader that may not lead (the witness; a replica never brought up
    /// to date) hands leadership to the live VM replica furthest along.
    /// Not after `BOUNCES` hand-overs to it in a row: then no VM replica
    /// holds the state behind the released output (both were lost), none
    /// may serve, and the group waits under this leader, saying why.
    fn hand_over(&mut self) {
        let raft = &self.node.raft;
        if raft.state != StateRole::Leader || self.config.eligible.load(Ordering::SeqCst) || raft.lead_transferee.is_some() {
            return;
        }
        if self.handed_in_a_row >= BOUNCES {
            if self.handed_in_a_row == BOUNCES {
                self.handed_in_a_row += 1;
                let why = "no VM replica may lead: none holds the state behind the output the group released (it was lost with its host); \
                           the group waits, its output held, until one does";
                tracing::warn!(term = raft.term, "{why}");
                self.config.status.lock().detail = why.to_string();
            }
            return;
        }
        if let Some(id) = self.successor() {
            tracing::info!(to = id, "this replica may not lead: handing leadership over");
            self.node.transfer_leader(id);
        }
    }

    /// The live VM replica furthest along, this one and learners left out.
    fn successor(&self) -> Option<u64> {
        let raft = &self.node.raft;
        let peers = self.mesh.peers();
        peers
            .iter()
            .filter(|(id, p)| **id != self.config.id && !p.witness && p.heard.is_some_and(|t| t.elapsed() < ALIVE))
            .filter_map(|(id, _)| raft.prs().get(*id).filter(|_| !raft.prs().conf().learners().contains(id)).map(|pr| (pr.matched, *id)))
            .max()
            .map(|(_, id)| id)
    }

    /// Asked, as the leader, to replace itself (its host is to be emptied):
    /// it cannot remove itself, so it hands leadership to the live VM
    /// replica furthest along, and the request is to be made again to
    /// that one. What to answer, if it does.
    fn step_aside(&mut self, remove: u64) -> Option<String> {
        let raft = &self.node.raft;
        if remove != self.config.id || raft.state != StateRole::Leader {
            return None;
        }
        let to = raft.lead_transferee.or_else(|| self.successor())?;
        if self.node.raft.lead_transferee.is_none() {
            tracing::info!(to, "asked to replace this replica, which leads: handing leadership over");
            self.node.transfer_leader(to);
        }
        Some(format!("replica {remove} leads: it hands leadership over to replica {to}; ask replica {to} to replace {remove}"))
    }

    /// With `--link-batch on` the messages wait in the outbox for the
    /// round's `flush`; with `off` each goes to its peer's sender thread at once.
    fn send(&mut self, msgs: Vec<Message>) {
        for m in msgs {
            match m.write_to_bytes() {
                Ok(bytes) => {
                    let frame = protocol::frame(Kind::Raft, &bytes);
                    match self.config.tuning.link_batch {
                        LinkBatch::On => self.outbox.push(m.to, frame),
                        LinkBatch::Off => {
                            self.mesh.send(m.to, frame);
                        }
                    }
                }
                Err(e) => tracing::error!("cannot encode a raft message: {e}"),
            }
        }
    }

    /// Hand each peer the round's messages for it as one batch: one
    /// wake-up of its sender thread.
    fn flush(&mut self) {
        for (to, frames) in self.outbox.drain() {
            self.mesh.send_batch(to, frames);
        }
    }

    fn apply(&mut self, entries: Vec<raft::eraftpb::Entry>) -> Result<(), ()> {
        let gate = self.config.gate.clone();
        let mut direct = Vec::new();
        for e in entries {
            // Handed on already, on append (`early_apply`).
            if e.index <= self.delivered {
                continue;
            }
            self.delivered = e.index;
            if e.get_entry_type() != EntryType::EntryNormal {
                continue;
            }
            let c = if e.data.is_empty() {
                Committed::LeaderStart { index: e.index, term: e.term, leader: self.node.raft.leader_id }
            } else if !self.config.vm {
                continue;
            } else {
                match Entry::decode(&e.data) {
                    Ok(entry) => {
                        match &entry {
                            Entry::Input(_) => self.config.inputs.add(1),
                            Entry::Inputs(frames) => self.config.inputs.add(frames.len()),
                            Entry::Sync { .. } => {}
                        }
                        Committed::Entry { index: e.index, term: e.term, entry }
                    }
                    Err(err) => {
                        tracing::error!(index = e.index, "a committed entry does not decode: {err}");
                        continue;
                    }
                }
            };
            if let Some(gate) = &gate {
                match c {
                    Committed::Entry { entry: Entry::Input(frame), .. } => {
                        direct.push(frame);
                        continue;
                    }
                    Committed::Entry { entry: Entry::Inputs(frames), .. } => {
                        direct.extend(frames);
                        continue;
                    }
                    _ => {}
                }
                self.deliver(gate, &mut direct)?;
                gate.handing();
            }
            self.committed.send(c).map_err(|_| ())?;
        }
        match &gate {
            Some(gate) => self.deliver(gate, &mut direct),
            None => Ok(()),
        }
    }

    /// `--direct-input on`: committed input into the guest, or to the
    /// applier if it has something earlier.
    fn deliver(&self, gate: &InputGate, frames: &mut Vec<Vec<u8>>) -> Result<(), ()> {
        if frames.is_empty() {
            return Ok(());
        }
        match gate.deliver(std::mem::take(frames)) {
            None => Ok(()),
            Some(frames) => {
                gate.handing();
                self.committed.send(Committed::Inputs(frames)).map_err(|_| ())
            }
        }
    }

    fn on_ready(&mut self) -> Result<(), ()> {
        if !self.node.has_ready() {
            return Ok(());
        }
        let store = self.node.raft.raft_log.store.clone();
        let mut ready = self.node.ready();
        if let Some(ss) = ready.ss() {
            tracing::info!(term = self.node.raft.term, leader = ss.leader_id, role = ?ss.raft_state, "consensus role");
            if ss.raft_state == StateRole::Leader {
                self.elected();
            }
        }
        self.send(ready.take_messages());
        // Applied once this round's messages are on their way (`flush`):
        // delivering input to the guest does not delay the appends.
        let committed = ready.take_committed_entries();
        if !ready.snapshot().is_empty() {
            // No data: the input behind it is gone, so this VM no longer
            // matches the others until a full syncvm; it may not lead.
            self.config.eligible.store(false, Ordering::SeqCst);
            tracing::info!(index = ready.snapshot().get_metadata().index, "caught up from a snapshot: needs a full syncvm");
            let _ = store.wl().apply_snapshot(ready.snapshot().clone());
            self.delivered = self.delivered.max(ready.snapshot().get_metadata().index);
            self.changes.restored(&self.node, &*self.mesh, ready.snapshot());
            self.reconfigured();
        }
        if let Some(first) = ready.entries().first().map(|e| e.index) {
            if first <= self.delivered {
                // Only entries a leader handed on before they committed can
                // be overwritten (`--leader-apply append`): the next
                // leader's log replaced them. Its guest ran them; it must
                // not lead, and its next syncvm compares every page. The
                // new entries there are handed on, so that it takes part
                // in the new leader's syncvms.
                tracing::warn!(
                    from = first,
                    delivered = self.delivered,
                    "entries this replica's guest ran were replaced by the new leader's: out of step until a full syncvm"
                );
                self.config.eligible.store(false, Ordering::SeqCst);
                self.delivered = first - 1;
                self.committed.send(Committed::OutOfStep).map_err(|_| ())?;
            }
            let _ = store.wl().append(ready.entries());
        }
        if let Some(hs) = ready.hs() {
            store.wl().set_hardstate(hs.clone());
            // Before the votes and acknowledgements that rest on it leave.
            if let Some(file) = &mut self.votes {
                if let Err(e) = file.store(Vote { term: hs.term, vote: hs.vote }) {
                    // Voting on without it could elect two leaders in a term.
                    let why = format!("cannot keep the raft term and vote in {}: {e}; this replica stops", file.path().display());
                    tracing::error!("{why}");
                    eprintln!("ftvm: error: {why}");
                    std::process::exit(1);
                }
            }
        }
        self.send(ready.take_persisted_messages());
        // Before `advance`, which tells raft-rs they are applied: a joint
        // configuration's automatic leave is proposed then, and only once
        // raft-rs sees the configuration that entry made.
        self.configure(&committed);
        let mut light = self.node.advance(ready);
        if let Some(commit) = light.commit_index() {
            store.wl().mut_hard_state().set_commit(commit);
        }
        self.send(light.take_messages());
        self.flush();
        // Before the entries go: the applier judges their terms by it.
        let raft = &self.node.raft;
        *self.view.locked() = View { term: raft.term, leader: raft.leader_id, is_leader: raft.state == StateRole::Leader };
        let later = light.take_committed_entries();
        self.apply(committed)?;
        self.configure(&later);
        self.apply(later)?;
        self.apply_appended()?;
        self.node.advance_apply();
        let applied = self.node.raft.raft_log.applied;
        if applied >= self.compacted + 2 * KEEP_ENTRIES {
            self.compacted = applied - KEEP_ENTRIES;
            let _ = store.wl().compact(self.compacted);
        }
        Ok(())
    }
}

impl Loop {
    /// Committed configuration entries (`membership`), as they commit: not
    /// on append, as `--early-apply` hands input on.
    fn configure(&mut self, committed: &[raft::eraftpb::Entry]) {
        let mut changed = false;
        for e in committed.iter().filter(|e| e.get_entry_type() != EntryType::EntryNormal) {
            self.changes.apply(&mut self.node, &*self.mesh, e);
            changed = true;
        }
        if changed {
            self.reconfigured();
        }
    }

    /// The configuration changed: whether entries go on early follows it.
    fn reconfigured(&mut self) {
        let conf = self.node.raft.prs().conf().to_conf_state();
        self.early_apply = self.config.early_apply(&conf);
        let skip = self.config.followers_apply_early(&conf);
        self.node.skip_bcast_commit(skip);
    }

    /// `--early-apply on`, a follower: hand on the entries appended (and
    /// acknowledged: the persisted messages went first) up to the last of
    /// the current term. Only the current term's leader makes entries of
    /// its term, and it sent this replica a prefix of its own log, so the
    /// leader and this replica both hold them: with three voters, a
    /// majority, which any later leader's log includes (raft's election
    /// rule), exactly as when the leader counts this replica's
    /// acknowledgement and commits them. Entries of earlier terms before
    /// such an entry are committed with it.
    ///
    /// `--leader-apply append`, the leader: hand on its own entries once
    /// appended, in log order, up to the first one that is neither input
    /// nor a `syncvm` with a secondary and is not committed yet.
    fn apply_appended(&mut self) -> Result<(), ()> {
        let raft = &self.node.raft;
        let log = &raft.raft_log;
        let leads = raft.state == StateRole::Leader;
        let may = if leads {
            self.config.leader_apply()
        } else {
            self.early_apply && raft.state == StateRole::Follower && raft.leader_id != INVALID_ID
        };
        if !may || log.last_term() != raft.term || log.last_index() <= self.delivered {
            return Ok(());
        }
        let from = (self.delivered + 1).max(log.first_index());
        let mut entries = match log.entries(from, None, raft::GetEntriesContext::empty(false)) {
            Ok(entries) => entries,
            Err(e) => {
                // Raft's commit hands them on later.
                tracing::debug!(from, "cannot read appended entries: {e}");
                return Ok(());
            }
        };
        if leads {
            let committed = log.committed;
            if let Some(stop) = entries.iter().position(|e| e.index > committed && !handed_before_commit(e)) {
                entries.truncate(stop);
            }
        }
        self.apply(entries)
    }

    /// This replica leads: show what started the election it won.
    fn elected(&mut self) {
        let (cause, since) = self.round.take().unwrap_or((Cause::Timeout, Instant::now()));
        self.lost = None;
        self.handed_in_a_row = match cause {
            Cause::Handover { .. } => self.handed_in_a_row + 1,
            _ => 0,
        };
        let e = Election { term: self.node.raft.term, cause, after_us: since.elapsed().as_micros() as u64 };
        tracing::info!("elected: {e}");
        self.config.status.lock().election = Some(e);
    }
}

/// `--leader-apply append`: what the leader may hand on before it commits.
/// Its input, and a `syncvm` with a secondary (the output waits for that
/// secondary's acknowledgement, given only for an entry it holds): not a
/// term's first entry nor a barrier, whose commit is what they prove.
fn handed_before_commit(e: &raft::eraftpb::Entry) -> bool {
    e.get_entry_type() == EntryType::EntryNormal
        && (Entry::is_input(&e.data) || matches!(Entry::decode(&e.data), Ok(Entry::Sync { secondary, .. }) if secondary != 0))
}

/// raft-rs logs through slog: its records go to tracing (target `raft`).
struct TracingDrain;

impl slog::Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &slog::Record<'_>, _values: &slog::OwnedKVList) -> Result<(), slog::Never> {
        match record.level() {
            slog::Level::Critical | slog::Level::Error => tracing::error!(target: "raft", "{}", record.msg()),
            slog::Level::Warning => tracing::warn!(target: "raft", "{}", record.msg()),
            slog::Level::Info => tracing::info!(target: "raft", "{}", record.msg()),
            _ => tracing::debug!(target: "raft", "{}", record.msg()),
        }
        Ok(())
    }
}

/// Whether an append's entries follow its index one after another, their
/// terms never below its log term, never falling, never above its own
/// term: raft-rs slices its log by these numbers and panics on a message
/// that breaks them, which only a broken or hostile peer sends.
fn append_is_sound(m: &Message) -> bool {
    let mut term = m.log_term;
    m.entries.iter().zip(1u64..).all(|(e, n)| {
        let sound = m.index.checked_add(n) == Some(e.index) && e.term >= term && e.term <= m.term;
        term = e.term;
        sound
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_whose_entries_do_not_follow_their_index_are_not_sound() {
        let append = |index, log_term, entries: &[(u64, u64)]| {
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgAppend);
            (m.term, m.index, m.log_term) = (3, index, log_term);
            m.entries = entries.iter().map(|&(index, term)| raft::eraftpb::Entry { index, term, ..Default::default() }).collect();
            m
        };
        assert!(append_is_sound(&append(4, 1, &[(5, 1), (6, 2), (7, 3)])));
        assert!(append_is_sound(&append(4, 1, &[])));
        assert!(!append_is_sound(&append(0, 0, &[(5, 1)])), "a gap after its index");
        assert!(!append_is_sound(&append(2, 2, &[(3, 2), (1, 2)])), "indices out of order");
        assert!(!append_is_sound(&append(u64::MAX, 1, &[(0, 1)])), "an index past the last");
        assert!(!append_is_sound(&append(4, 2, &[(5, 1)])), "a term below the log term");
        assert!(!append_is_sound(&append(4, 1, &[(5, 2), (6, 1)])), "a falling term");
        assert!(!append_is_sound(&append(4, 1, &[(5, 4)])), "a term above the message's");
    }

    /// Replica 1 asked by candidate 3 for its vote in term 5, as it answers
    /// after a restart with `held` read back: does it grant it?
    fn grants_vote_to_3_in_term_5(held: Option<Vote>) -> bool {
        let config = Config { id: 1, election_tick: ELECTION_TICKS, heartbeat_tick: HEARTBEAT_TICKS, ..Default::default() };
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let mut node = RawNode::new(&config, storage(&[1, 2, 3], held), &logger).unwrap();
        let mut ask = Message::default();
        ask.set_msg_type(MessageType::MsgRequestVote);
        (ask.from, ask.to, ask.term) = (3, 1, 5);
        node.step(ask).unwrap();
        let mut ready = node.ready();
        let answer = ready.take_persisted_messages().into_iter().find(|m| m.get_msg_type() == MessageType::MsgRequestVoteResponse);
        !answer.expect("an answer to the vote request").reject
    }

    #[test]
    fn a_vote_kept_across_a_restart_is_not_given_twice_in_its_term() {
        assert!(grants_vote_to_3_in_term_5(None), "a replica with no state kept grants it");
        assert!(!grants_vote_to_3_in_term_5(Some(Vote { term: 5, vote: 2 })), "it voted for 2 in term 5 before its restart");
        assert!(grants_vote_to_3_in_term_5(Some(Vote { term: 5, vote: 3 })), "the same candidate again");
        assert!(grants_vote_to_3_in_term_5(Some(Vote { term: 4, vote: 2 })), "a vote of an earlier term");
    }
}
