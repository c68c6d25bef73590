//! Who is in the group, and how a lost replica is replaced by a new one
//! (`ftvm replica-replace`): through raft's configuration changes, never by
//! reusing the lost replica's id (with an empty log it could lose
//! committed entries or vote twice in a term).
//!
//! The leader adds the new replica as a learner (it gets the log, raft's
//! snapshot first, but neither votes nor counts towards a commit), and once
//! it holds the log up to the entry that added it, replaces the lost
//! replica by it in one joint change (raft-rs's `ConfChangeV2`: the old and
//! the new voters must both agree on every entry until the group leaves
//! the joint configuration, which raft-rs proposes on its own). Every
//! configuration is an entry of the log, applied by each replica once
//! committed; the replicas' addresses go with it (the entry's context),
//! and raft's snapshot carries them all (`Store`), so that a replica that
//! catches up from a snapshot knows the group and its links.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use protobuf::Message as _;
use raft::eraftpb::{
    ConfChange, ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, ConfState, Entry, EntryType, Snapshot,
};
use raft::storage::{MemStorage, MemStorageCore};
use raft::{GetEntriesContext, RaftState, RawNode, StateRole, Storage};
use serde::{Deserialize, Serialize};

use ftvm_vmm::sync::Lock;

use crate::inbound::{Event, Replace};
use crate::mesh::Mesh;

/// Each member's address (`ID=HOST:PORT`), as `--peers` and `--join` give it.
pub type Book = BTreeMap<u64, String>;

/// How long an operator's request waits for the consensus thread.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// A leader that finds the group in a joint configuration this long (its
/// own automatic leave did not come: a leader changed in between) leaves it.
const JOINT_LEAVE: Duration = Duration::from_secs(1);

/// `1=HOST:PORT,2=HOST:PORT`: the form of `--peers`, of a configuration
/// entry's context and of a snapshot's data.
pub fn encode(book: &Book) -> Vec<u8> {
    book.iter().map(|(id, addr)| format!("{id}={addr}")).collect::<Vec<_>>().join(",").into_bytes()
}

/// The addresses `encode` wrote; what does not parse is left out (it came
/// from a peer of this group, through raft).
pub fn decode(bytes: &[u8]) -> Book {
    let Ok(text) = std::str::from_utf8(bytes) else { return Book::new() };
    text.split(',')
        .filter_map(|item| {
            let (id, addr) = item.split_once('=')?;
            Some((id.parse().ok()?, addr.to_string()))
        })
        .filter(|(id, addr)| *id != 0 && addr.contains(':'))
        .collect()
}

/// One member as `ftvm status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: u64,
    pub addr: String,
    /// `voter`, `learner` (gets the log, does not vote), or `leaving` (a
    /// voter of the outgoing half of a joint configuration).
    pub role: String,
}

/// The group as this replica last applied it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    pub members: Vec<Member>,
    /// The replacement this replica (the leader) carries out, if any.
    pub changing: Option<String>,
}

/// The operator's handle on the group (the control API's
/// `replica_replace` and the members in `status`).
#[derive(Clone)]
pub struct Control {
    events: Sender<Event>,
    shown: Arc<Mutex<Membership>>,
}

impl Control {
    pub fn new(events: Sender<Event>, shown: Arc<Mutex<Membership>>) -> Control {
        Control { events, shown }
    }

    /// Ask this replica, which must lead, to replace member `remove` by a
    /// new replica `add` listening at `addr`. Answers once the change is
    /// proposed (it completes in the background: `membership`).
    pub fn replace(&self, remove: u64, add: u64, addr: String) -> Result<String, String> {
        let (reply, answer) = mpsc::channel();
        self.events.send(Event::Replace(Replace { remove, add, addr, reply })).map_err(|_| "the consensus thread stopped".to_string())?;
        answer.recv_timeout(REQUEST_TIMEOUT).map_err(|_| "the consensus thread did not answer".to_string())?
    }

    pub fn membership(&self) -> Membership {
        self.shown.locked().clone()
    }
}

/// raft-rs's in-memory storage, whose snapshots carry the members'
/// addresses (the log behind a snapshot is gone, and with it the
/// configuration entries that named them).
#[derive(Clone)]
pub struct Store {
    mem: MemStorage,
    book: Arc<Mutex<Book>>,
}

impl Store {
    pub fn new(mem: MemStorage, book: Arc<Mutex<Book>>) -> Store {
        Store { mem, book }
    }

    pub fn wl(&self) -> std::sync::RwLockWriteGuard<'_, MemStorageCore> {
        self.mem.wl()
    }
}

impl Storage for Store {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.mem.initial_state()
    }

    fn entries(&self, low: u64, high: u64, max_size: impl Into<Option<u64>>, context: GetEntriesContext) -> raft::Result<Vec<Entry>> {
        self.mem.entries(low, high, max_size, context)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.mem.term(idx)
    }

    fn first_index(&self) -> raft::Result<u64> {
        self.mem.first_index()
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.mem.last_index()
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let mut snapshot = self.mem.snapshot(request_index, to)?;
        snapshot.data = encode(&self.book.locked()).into();
        Ok(snapshot)
    }
}

/// The links to the members, which follow the configuration.
pub trait Links {
    /// Link to member `id` at `addr` (nothing if linked already).
    fn add_peer(&self, id: u64, addr: &str);
    /// Close the links to a member that left, and refuse it from now on.
    fn remove_peer(&self, id: u64);
    /// The members linked to (this replica left out).
    fn members(&self) -> Vec<u64>;
}

impl Links for Mesh {
    fn add_peer(&self, id: u64, addr: &str) {
        Mesh::add_peer(self, id, addr)
    }

    fn remove_peer(&self, id: u64) {
        Mesh::remove_peer(self, id)
    }

    fn members(&self) -> Vec<u64> {
        Mesh::members(self)
    }
}

/// The leader's replacement in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Replacement {
    remove: u64,
    add: u64,
    /// The new replica is a learner: promote it once it holds the log up
    /// to here (the entry that added it).
    learner_from: Option<u64>,
}

/// The consensus thread's side of the membership: the addresses, what
/// `ftvm status` shows, and the leader's replacement in progress.
pub struct Changes {
    me: u64,
    book: Arc<Mutex<Book>>,
    shown: Arc<Mutex<Membership>>,
    pending: Option<Replacement>,
    /// Configuration entries up to here were applied.
    applied: u64,
    /// Since when this leader sees a joint configuration.
    joint_since: Option<Instant>,
}

/// The members a configuration names, in any role.
fn members(cs: &ConfState) -> Vec<u64> {
    let mut ids: Vec<u64> = cs.voters.iter().chain(&cs.learners).chain(&cs.voters_outgoing).chain(&cs.learners_next).copied().collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

impl Changes {
    pub fn new(me: u64, book: Arc<Mutex<Book>>, shown: Arc<Mutex<Membership>>) -> Changes {
        Changes { me, book, shown, pending: None, applied: 0, joint_since: None }
    }

    /// An operator's request, on this replica: checked, and if it may go
    /// ahead, the new replica proposed as a learner.
    pub fn request(&mut self, node: &mut RawNode<Store>, r: &Replace) -> Result<String, String> {
        let raft = &node.raft;
        if raft.state != StateRole::Leader {
            return Err(match raft.leader_id {
                raft::INVALID_ID => format!("replica {} does not lead and knows no leader: ask again once one is elected", self.me),
                leader => format!("replica {} does not lead: ask the leader, replica {leader}", self.me),
            });
        }
        let cs = raft.prs().conf().to_conf_state();
        let book = self.book.locked().clone();
        if r.add == 0 || r.remove == 0 {
            return Err("replica ids start at 1".into());
        }
        if r.add == r.remove {
            return Err(format!("replica {} cannot replace itself: the new replica needs an id of its own", r.add));
        }
        if !cs.voters.contains(&r.remove) {
            return Err(format!("replica {} is not a voting member of the group (voters: {:?})", r.remove, cs.voters));
        }
        if r.remove == self.me {
            return Err(format!("replica {} leads: it cannot remove itself (replace a replica that is lost)", self.me));
        }
        if cs.voters.contains(&r.add) || cs.voters_outgoing.contains(&r.add) {
            return Err(format!("replica {} is a member of the group already", r.add));
        }
        if let Some(p) = self.pending.filter(|p| p.remove == r.remove && p.add != r.add && p.learner_from.is_some()) {
            return self.drop_learner(node, p, r.add);
        }
        if let Some(p) = self.pending {
            return Err(format!("a membership change is already in progress: replica {} replaces {}", p.add, p.remove));
        }
        if !cs.voters_outgoing.is_empty() || raft.has_pending_conf() {
            return Err("a membership change is already in progress: try again once it completed".into());
        }
        if let Some((other, _)) = book.iter().find(|(id, a)| **id != r.add && **a == r.addr) {
            return Err(format!("replica {other} is at {} already: the new replica needs an address of its own", r.addr));
        }
        if cs.learners.contains(&r.add) {
            // Added by an earlier request whose leader did not finish it.
            if book.get(&r.add) != Some(&r.addr) {
                return Err(format!(
                    "replica {} joined at {} already, not {}",
                    r.add,
                    book.get(&r.add).map_or("?", String::as_str),
                    r.addr
                ));
            }
            self.pending = Some(Replacement { remove: r.remove, add: r.add, learner_from: Some(0) });
            self.publish(node);
            return Ok(format!(
                "replacing replica {} by {}: {} is a learner already; it is promoted once it holds the log",
                r.remove, r.add, r.add
            ));
        }
        // A new replica must learn the configuration from raft's snapshot:
        // one that got the log from its first entry would miss the
        // configuration the group started with (it is not in the log).
        let first = node.raft.raft_log.first_index();
        let applied = node.raft.raft_log.applied;
        if first < 2 {
            if applied < 2 {
                return Err("the group has only just started: try again in a moment".into());
            }
            let _ = node.raft.raft_log.store.wl().compact(applied);
        }
        let mut cc = ConfChangeV2::default();
        cc.set_changes(vec![single(r.add, ConfChangeType::AddLearnerNode)].into());
        let context = encode(&Book::from([(r.add, r.addr.clone())]));
        node.propose_conf_change(context, cc).map_err(|e| format!("the change was not proposed: {e}"))?;
        let index = node.raft.raft_log.last_index();
        self.pending = Some(Replacement { remove: r.remove, add: r.add, learner_from: Some(index) });
        tracing::info!(remove = r.remove, add = r.add, addr = %r.addr, index, "replacing a replica: the new one joins as a learner");
        self.publish(node);
        Ok(format!(
            "replacing replica {} by {}: {} joins as a learner, then replaces {} once it holds the log",
            r.remove, r.add, r.add, r.remove
        ))
    }

    /// Another new replica is asked to replace the one that `pending`'s
    /// learner was to replace: that learner is lost too (it never held the
    /// log, or it would be a voter now), and would hold the change up for
    /// good. It leaves the group (one change of a learner, no joint
    /// configuration); the new one is asked for again once that is done.
    fn drop_learner(&mut self, node: &mut RawNode<Store>, p: Replacement, add: u64) -> Result<String, String> {
        if node.raft.has_pending_conf() {
            return Err("a membership change is already in progress: try again once it completed".into());
        }
        let mut cc = ConfChangeV2::default();
        cc.set_changes(vec![single(p.add, ConfChangeType::RemoveNode)].into());
        node.propose_conf_change(vec![], cc).map_err(|e| format!("the change was not proposed: {e}"))?;
        tracing::info!(learner = p.add, remove = p.remove, add, "the learner that was to replace a replica is dropped for another");
        self.pending = None;
        self.publish(node);
        Ok(format!(
            "replica {} was to replace {} and does not hold the log: it leaves the group; ask again for {add} once it left",
            p.add, p.remove
        ))
    }

    /// Each tick: a leader promotes the learner it waits for once it holds
    /// the log, and leaves a joint configuration left behind by another
    /// leader. A replica that does not lead gives up its replacement.
    pub fn tick(&mut self, node: &mut RawNode<Store>) {
        if node.raft.state != StateRole::Leader {
            if let Some(p) = self.pending.take() {
                tracing::warn!(remove = p.remove, add = p.add, "leadership lost: the replacement stops here; ask the new leader again");
                self.publish(node);
            }
            return;
        }
        let cs = node.raft.prs().conf().to_conf_state();
        let settled = !node.raft.has_pending_conf();
        if cs.voters_outgoing.is_empty() {
            self.joint_since = None;
        } else {
            // raft-rs leaves a joint configuration on its own once its
            // entry is applied, unless leadership changed before: then
            // this leader does, once it had time to.
            let since = *self.joint_since.get_or_insert_with(Instant::now);
            if settled && since.elapsed() >= JOINT_LEAVE {
                tracing::info!("leaving the joint configuration");
                let _ = node.propose_conf_change(vec![], ConfChangeV2::default());
                self.joint_since = None;
            }
            return;
        }
        let Some(Replacement { remove, add, learner_from: Some(from) }) = self.pending else { return };
        let caught_up =
            node.raft.prs().get(add).is_some_and(|pr| node.raft.prs().conf().learners().contains(&add) && pr.matched >= from.max(1));
        if !settled || !caught_up || !cs.learners.contains(&add) {
            return;
        }
        let mut cc = ConfChangeV2::default();
        cc.set_transition(ConfChangeTransition::Auto);
        cc.set_changes(vec![single(add, ConfChangeType::AddNode), single(remove, ConfChangeType::RemoveNode)].into());
        match node.propose_conf_change(vec![], cc) {
            Ok(()) => {
                tracing::info!(remove, add, "the new replica holds the log: it becomes a voter in place of the lost one (joint consensus)");
                self.pending = Some(Replacement { remove, add, learner_from: None });
                self.publish(node);
            }
            Err(e) => tracing::warn!(remove, add, "cannot propose the promotion yet: {e}"),
        }
    }

    /// Apply a committed configuration entry: raft's configuration, the
    /// addresses, and the links (new members dialled, removed ones closed).
    /// Each entry once, in log order.
    pub fn apply(&mut self, node: &mut RawNode<Store>, mesh: &dyn Links, e: &Entry) {
        if e.index <= self.applied {
            return;
        }
        self.applied = e.index;
        // (This group proposes only V2 changes; raft-rs takes either.)
        let applied = match e.get_entry_type() {
            EntryType::EntryConfChangeV2 => ConfChangeV2::parse_from_bytes(&e.data)
                .map_err(|err| err.to_string())
                .and_then(|cc| node.apply_conf_change(&cc).map_err(|err| err.to_string())),
            EntryType::EntryConfChange => ConfChange::parse_from_bytes(&e.data)
                .map_err(|err| err.to_string())
                .and_then(|cc| node.apply_conf_change(&cc).map_err(|err| err.to_string())),
            EntryType::EntryNormal => return,
        };
        self.book.locked().extend(decode(&e.context));
        let cs = match applied {
            Ok(cs) => cs,
            Err(err) => return tracing::error!(index = e.index, "cannot apply a committed configuration entry: {err}"),
        };
        node.raft.raft_log.store.wl().set_conf_state(cs.clone());
        tracing::info!(index = e.index, voters = ?cs.voters, learners = ?cs.learners, outgoing = ?cs.voters_outgoing, "configuration applied");
        self.follow(&cs, mesh);
        if let Some(p) = self.pending {
            if cs.voters.contains(&p.add) && !cs.voters.contains(&p.remove) && cs.voters_outgoing.is_empty() {
                tracing::info!(remove = p.remove, add = p.add, "replica replaced");
                self.pending = None;
            }
        }
        self.publish(node);
    }

    /// A snapshot was applied: its configuration is raft's now (raft-rs
    /// restored it), its data the members' addresses.
    pub fn restored(&mut self, node: &RawNode<Store>, mesh: &dyn Links, snapshot: &Snapshot) {
        let book = decode(&snapshot.data);
        if !book.is_empty() {
            self.book.locked().extend(book);
        }
        self.applied = self.applied.max(snapshot.get_metadata().index);
        let cs = snapshot.get_metadata().get_conf_state().clone();
        self.follow(&cs, mesh);
        self.publish(node);
    }

    /// The links follow the configuration.
    fn follow(&self, cs: &ConfState, mesh: &dyn Links) {
        let ids = members(cs);
        if ids.is_empty() {
            return;
        }
        let mut book = self.book.locked();
        for id in ids.iter().filter(|id| **id != self.me) {
            match book.get(id) {
                Some(addr) => mesh.add_peer(*id, addr),
                None => tracing::warn!(id, "a member's address is not known here: it cannot be reached"),
            }
        }
        for id in mesh.members() {
            if !ids.contains(&id) {
                mesh.remove_peer(id);
            }
        }
        book.retain(|id, _| ids.contains(id));
    }

    /// What `ftvm status` shows.
    pub fn publish(&self, node: &RawNode<Store>) {
        let cs = node.raft.prs().conf().to_conf_state();
        let book = self.book.locked();
        let role = |id: u64| {
            if cs.voters.contains(&id) {
                "voter"
            } else if cs.voters_outgoing.contains(&id) {
                "leaving"
            } else {
                "learner"
            }
        };
        let members = members(&cs)
            .into_iter()
            .map(|id| Member { id, addr: book.get(&id).cloned().unwrap_or_default(), role: role(id).into() })
            .collect();
        let changing = self.pending.map(|p| match p.learner_from {
            Some(_) => format!("replica {} replaces {}: {} is a learner, getting the log", p.add, p.remove, p.add),
            None => format!("replica {} replaces {}: joint configuration", p.add, p.remove),
        });
        *self.shown.locked() = Membership { members, changing };
    }
}

fn single(id: u64, kind: ConfChangeType) -> ConfChangeSingle {
    let mut s = ConfChangeSingle::default();
    s.set_node_id(id);
    s.set_change_type(kind);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_travel_as_peers_lists() {
        let book = Book::from([(1, "10.0.0.1:7101".to_string()), (4, "h:7104".to_string())]);
        assert_eq!(encode(&book), b"1=10.0.0.1:7101,4=h:7104");
        assert_eq!(decode(&encode(&book)), book);
        assert!(decode(b"").is_empty());
        assert_eq!(decode(b"0=a:1,x=b:2,3=c,5=d:5"), Book::from([(5, "d:5".to_string())]), "what does not parse is left out");
        assert!(decode(&[0xff, 0xfe]).is_empty());
    }

    /// Links as a set of ids (no sockets).
    #[derive(Default)]
    struct FakeLinks(Mutex<Book>);

    impl Links for FakeLinks {
        fn add_peer(&self, id: u64, addr: &str) {
            self.0.locked().insert(id, addr.into());
        }

        fn remove_peer(&self, id: u64) {
            self.0.locked().remove(&id);
        }

        fn members(&self) -> Vec<u64> {
            self.0.locked().keys().copied().collect()
        }
    }

    struct Replica {
        node: RawNode<Store>,
        changes: Changes,
        links: FakeLinks,
    }

    /// Replicas driven in memory as the consensus thread drives its node
    /// (configuration entries applied before `advance`); messages to or
    /// from a replica that is down are lost.
    struct Group {
        replicas: BTreeMap<u64, Replica>,
        down: Vec<u64>,
    }

    fn addr(id: u64) -> String {
        format!("10.0.0.{id}:7100")
    }

    impl Group {
        fn new() -> Group {
            let mut g = Group { replicas: BTreeMap::new(), down: Vec::new() };
            for id in 1..=3 {
                g.start(id, &[1, 2, 3]);
            }
            g
        }

        /// A replica whose configuration is `voters` (none: one that joins).
        fn start(&mut self, id: u64, voters: &[u64]) {
            let config = raft::Config { id, election_tick: 20, heartbeat_tick: 2, pre_vote: true, ..Default::default() };
            let book: Book = if voters.is_empty() { Book::new() } else { voters.iter().map(|&v| (v, addr(v))).collect() };
            let book = Arc::new(Mutex::new(book));
            let mem = MemStorage::new_with_conf_state(ConfState::from((voters.to_vec(), vec![])));
            let logger = slog::Logger::root(slog::Discard, slog::o!());
            let node = RawNode::new(&config, Store::new(mem, book.clone()), &logger).unwrap();
            let changes = Changes::new(id, book, Arc::default());
            self.replicas.insert(id, Replica { node, changes, links: FakeLinks::default() });
        }

        fn r(&mut self, id: u64) -> &mut Replica {
            self.replicas.get_mut(&id).unwrap()
        }

        /// Rounds of Ready handling and message delivery, a tick each.
        fn run(&mut self, rounds: usize) {
            for _ in 0..rounds {
                let mut msgs = Vec::new();
                for (id, r) in self.replicas.iter_mut().filter(|(id, _)| !self.down.contains(id)) {
                    r.node.tick();
                    r.changes.tick(&mut r.node);
                    if !r.node.has_ready() {
                        continue;
                    }
                    let store = r.node.raft.raft_log.store.clone();
                    let mut rd = r.node.ready();
                    msgs.extend(rd.take_messages());
                    if !rd.snapshot().is_empty() {
                        store.wl().apply_snapshot(rd.snapshot().clone()).unwrap();
                        r.changes.restored(&r.node, &r.links, rd.snapshot());
                    }
                    store.wl().append(rd.entries()).unwrap();
                    if let Some(hs) = rd.hs() {
                        store.wl().set_hardstate(hs.clone());
                    }
                    msgs.extend(rd.take_persisted_messages());
                    for e in rd.take_committed_entries() {
                        r.changes.apply(&mut r.node, &r.links, &e);
                    }
                    let mut light = r.node.advance(rd);
                    if let Some(commit) = light.commit_index() {
                        store.wl().mut_hard_state().set_commit(commit);
                    }
                    msgs.extend(light.take_messages());
                    for e in light.take_committed_entries() {
                        r.changes.apply(&mut r.node, &r.links, &e);
                    }
                    r.node.advance_apply();
                    let _ = id;
                }
                for m in msgs {
                    if !self.down.contains(&m.to) && !self.down.contains(&m.from) {
                        if let Some(r) = self.replicas.get_mut(&m.to) {
                            let _ = r.node.step(m);
                        }
                    }
                }
            }
        }

        fn leader(&self) -> Option<u64> {
            self.replicas.iter().find(|(id, r)| !self.down.contains(id) && r.node.raft.state == StateRole::Leader).map(|(id, _)| *id)
        }

        fn voters(&mut self, id: u64) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
            let mut cs = self.r(id).node.raft.prs().conf().to_conf_state();
            cs.voters.sort_unstable();
            (cs.voters.clone(), cs.learners.clone(), cs.voters_outgoing.clone())
        }

        fn ask(&mut self, on: u64, remove: u64, add: u64) -> Result<String, String> {
            let (reply, _answer) = mpsc::channel();
            let r = Replace { remove, add, addr: addr(add), reply };
            let replica = self.r(on);
            replica.changes.request(&mut replica.node, &r)
        }
    }

    #[test]
    fn a_lost_voter_is_replaced_by_a_learner_made_voter_through_one_joint_change() {
        let mut g = Group::new();
        g.r(1).node.campaign().unwrap();
        g.run(10);
        assert_eq!(g.leader(), Some(1));
        for i in 0..20u8 {
            g.r(1).node.propose(vec![], vec![i]).unwrap();
        }
        g.run(5);
        g.down.push(2);
        assert!(g.ask(3, 2, 4).unwrap_err().contains("replica 3 does not lead: ask the leader, replica 1"));
        assert!(g.ask(1, 9, 4).unwrap_err().contains("replica 9 is not a voting member"));
        assert!(g.ask(1, 1, 4).unwrap_err().contains("it cannot remove itself"));
        assert!(g.ask(1, 2, 3).unwrap_err().contains("replica 3 is a member of the group already"));
        g.ask(1, 2, 4).unwrap();
        assert!(g.ask(1, 2, 4).unwrap_err().contains("already in progress"));
        g.run(5);
        // Replica 4 is not running: a learner that gets nothing, never promoted.
        assert_eq!(g.voters(1), (vec![1, 2, 3], vec![4], vec![]));
        assert_eq!(g.r(1).links.members(), vec![2, 3, 4], "the leader links to the learner");
        g.start(4, &[]);
        // With no configuration it does not stand, whatever the silence.
        for _ in 0..100 {
            g.r(4).node.tick();
        }
        assert_eq!((g.r(4).node.raft.state, g.r(4).node.raft.term), (StateRole::Follower, 0), "a replica that joins stood");
        g.run(40);
        for id in [1, 3, 4] {
            assert_eq!(g.voters(id), (vec![1, 3, 4], vec![], vec![]), "replica {id}");
            assert_eq!(g.r(id).changes.book.locked().keys().copied().collect::<Vec<_>>(), vec![1, 3, 4], "replica {id}'s addresses");
        }
        assert_eq!(g.r(1).links.members(), vec![3, 4], "the removed replica's links are closed");
        assert_eq!(g.r(4).links.members(), vec![1, 3], "the new replica learned the group from the snapshot");
        assert!(g.r(1).changes.pending.is_none() && g.r(1).changes.shown.locked().changing.is_none());
        // Three configuration entries: the learner, the joint change and
        // its one leave (a second leave would fail to apply).
        let log = &g.r(1).node.raft.raft_log;
        let entries = log.entries(log.first_index(), None, GetEntriesContext::empty(false)).unwrap();
        let changes: Vec<u64> = entries.iter().filter(|e| e.get_entry_type() == EntryType::EntryConfChangeV2).map(|e| e.index).collect();
        assert_eq!(changes.len(), 3, "the learner, the joint change and one leave: {changes:?}");
        // The old leader is lost too: the new voters elect the new replica.
        g.down.push(1);
        g.r(4).node.campaign().unwrap();
        g.run(10);
        assert_eq!(g.leader(), Some(4));
    }
    #[test]
    fn a_learner_lost_before_it_held_the_log_is_dropped_for_another() {
        let mut g = Group::new();
        g.r(1).node.campaign().unwrap();
        g.run(10);
        for i in 0..20u8 {
            g.r(1).node.propose(vec![], vec![i]).unwrap();
        }
        g.run(5);
        g.down.push(2);
        g.ask(1, 2, 4).unwrap();
        g.run(5);
        assert_eq!(g.voters(1), (vec![1, 2, 3], vec![4], vec![]), "replica 4 never runs: a learner for good");
        // Replica 4 is lost too: replica 5 is asked for instead.
        let said = g.ask(1, 2, 5).unwrap();
        assert!(said.contains("replica 4 was to replace 2") && said.contains("leaves the group"), "{said}");
        g.run(5);
        assert_eq!(g.voters(1), (vec![1, 2, 3], vec![], vec![]), "the lost learner left");
        assert_eq!(g.r(1).links.members(), vec![2, 3]);
        g.ask(1, 2, 5).unwrap();
        g.start(5, &[]);
        g.run(40);
        for id in [1, 3, 5] {
            assert_eq!(g.voters(id), (vec![1, 3, 5], vec![], vec![]), "replica {id}");
        }
        // Asking for the same one again is no drop.
        assert!(g.ask(1, 3, 6).is_ok());
        assert!(g.ask(1, 3, 6).unwrap_err().contains("already in progress"));
    }
}
