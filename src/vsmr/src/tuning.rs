//! Throughput switches of consensus-ordered replicas, each measured on
//! and off (docs/replicas.md, "Measured"): where a request's time goes
//! between the leader's TAP and the release of its reply.

use ftvm_vmm::switch;

switch! {
    /// `--early-apply`: when the secondary's guest gets a log entry.
    pub enum EarlyApply {
        /// As soon as the secondary has appended it, if it is of the
        /// current term: with three voters the leader and this replica are
        /// a majority, so it is committed (raft's own commit rule, counted
        /// here instead of at the leader). The leader then sends no
        /// separate commit notice (`skip_bcast_commit`).
        On = "on",
        /// When the secondary learns that it is committed (the leader's
        /// next message after the commit).
        Off = "off",
    }
}

switch! {
    /// `--leader-apply`: when the leader's own guest gets a log entry.
    pub enum LeaderApply {
        /// As soon as the leader appended it (proposed it), if it is input
        /// or a `syncvm` with a secondary and everything before it was
        /// handed on: the consensus round no longer delays the leader's
        /// guest nor its freeze. Output still waits for the secondary's
        /// acknowledgement of a later `syncvm`, which the secondary gives
        /// only for an entry it holds, so one the leader and it hold: a
        /// majority of three, committed (or, with `--early-apply off`,
        /// known committed). Anything else (a new term's first entry, a
        /// barrier, which proves leadership by committing) waits for its
        /// commit. A leader that loses entries its guest ran (cut off, its
        /// log overwritten by the next leader's) is out of step.
        Append = "append",
        /// Once it is committed, as every replica's (PLOVER).
        Commit = "commit",
    }
}

switch! {
    /// `--batch-append`: raft messages to one peer per round of the
    /// consensus thread.
    pub enum BatchAppend {
        /// Appends queued for a peer in one round merge into one message
        /// (raft-rs's `batch_append`).
        On = "on",
        /// One append per proposal (raft-rs's default).
        Off = "off",
    }
}

switch! {
    /// `--sync-spacing`: what the proposer's spacing between two
    /// `syncvm`s learns from.
    pub enum SyncSpacing {
        /// The whole `syncvm` from its proposal to the secondary's
        /// acknowledgement (as a primary-backup checkpoint's cost).
        Cost = "cost",
        /// Only the leader's pause: the consensus round and the wait for
        /// the acknowledgement do not stop the guest, so they do not delay
        /// the next `syncvm`.
        Pause = "pause",
    }
}

switch! {
    /// `--direct-input`: which thread puts committed input into the guest.
    pub enum DirectInput {
        /// The applier, woken by the consensus thread.
        Off = "off",
        /// The consensus thread itself when the applier has nothing earlier
        /// (`gate`): one thread wake-up fewer per batch.
        On = "on",
    }
}

switch! {
    /// `--ack-wait`: which thread of the leader waits for the secondary's
    /// acknowledgement of a `syncvm` (then releases the output).
    pub enum AckWait {
        /// The applier: no committed input reaches the guest meanwhile.
        Applier = "applier",
        /// The proposer (which waits for the `syncvm` anyway): the
        /// applier goes on delivering input as soon as the guest resumed.
        Proposer = "proposer",
    }
}

switch! {
    /// `--early-resume`: when the leader's guest resumes in a `syncvm`.
    pub enum EarlyResume {
        /// Once the bitmaps are swapped and the union's pages and disk
        /// blocks are copied aside (`aside`): hashing, the wait for the
        /// secondary's hashes and the sending of the divergent pages read
        /// the copy while the guest runs. Not when every page is compared
        /// (a full `syncvm`, or a secondary not in step): it would copy
        /// all of memory and disk.
        On = "on",
        /// Once the divergent pages are sent.
        Off = "off",
    }
}

switch! {
    /// `--sync-settle`: whether a VM replica lets its guest finish the
    /// input delivered before a `syncvm` (`settle`) before it freezes or
    /// pauses it for that `syncvm`.
    pub enum SyncSettle {
        /// Until the device has placed every frame handed to it and every
        /// vCPU waits in the wait hypercall, at most `settle::MAX`: both
        /// replicas then freeze at the same point of the input, with the
        /// same requests answered (fewer divergent pages).
        On = "on",
        /// At once, wherever the guest is in the input it was given.
        Off = "off",
    }
}

switch! {
    /// `--sync-clock`: how a VM replica's guest clock moves.
    pub enum SyncClock {
        /// Stepped (`ftvm_vmm::clock::GuestClock`): it stands still
        /// between two `syncvm`s, at the reading the leader froze its
        /// guest with (the secondary takes it with the leader's state),
        /// and moves to the host's reading when the leader freezes its
        /// guest for a `syncvm` or a barrier, or when a guest waits for a
        /// deadline that passed. Both replicas' guests then read the same
        /// time while they run the same input, and store the same
        /// timestamps (TCP timers, round-trip samples): fewer divergent
        /// pages.
        Step = "step",
        /// Running: each replica's guest reads its host's clock.
        Run = "run",
    }
}

switch! {
    /// `--sync-output`: whether the leader's `syncvm` carries its output
    /// still held: of the epoch the `syncvm` closes and of any earlier one
    /// not acknowledged yet (`--sync-pipeline on`).
    pub enum SyncOutput {
        /// In `SyncPages` (its first 256 KiB): the secondary keeps it in
        /// place of its own output of the replaced execution, and sends it
        /// if it takes over (`--takeover-replay on`). A leader that dies
        /// after the acknowledgement and before its release no longer
        /// leaves those replies to the clients' retransmission.
        On = "on",
        /// Not carried: those replies come back by retransmission.
        Off = "off",
    }
}

switch! {
    /// `--ack-release`: which thread of the leader releases a `syncvm`'s
    /// output once the secondary acknowledged it (`release`).
    pub enum AckRelease {
        /// The thread that waits for the acknowledgement (`--ack-wait`),
        /// once the link thread handed it over.
        Waiter = "waiter",
        /// The link thread that reads it, at once (as primary-backup's
        /// acknowledgement reader).
        Link = "link",
    }
}

switch! {
    /// `--input-batch`: how the leader's network input becomes log entries.
    pub enum InputBatch {
        /// The frames of one read pass of the TAP go to the consensus
        /// thread together, and the frames it finds queued in one round
        /// become one `Inputs` entry: raft's per-entry work, the encoding
        /// and the delivery to the guest once per batch, and one wake-up of
        /// the consensus thread per pass.
        On = "on",
        /// One `Input` entry per frame, each sent to the consensus thread
        /// as it is read from the TAP.
        Off = "off",
    }
}

switch! {
    /// `--sync-pipeline`: whether the leader proposes the next `syncvm`
    /// while the previous one awaits its acknowledgement.
    pub enum SyncPipeline {
        /// One `syncvm` at a time: the next is proposed once the previous
        /// one was acknowledged (and its output released).
        Off = "off",
        /// Two in flight: the next is proposed (its consensus round, then
        /// its freeze and exchange) as soon as the previous one's pages
        /// are sent; an acknowledgement thread awaits the acknowledgements
        /// and releases the output, in order (`release`). Only between
        /// `syncvm`s with the same secondary that compare the dirty pages
        /// (not a full one, nor a barrier).
        On = "on",
    }
}

switch! {
    /// `--link-batch`: system calls per message on the peer links.
    pub enum LinkBatch {
        /// The consensus thread hands each peer's sender thread the raft
        /// messages of one round together (`outbox`: one wake-up per peer
        /// per round, not per message). A link's sender thread sends every
        /// message queued by the time it wakes (at most `transport::BATCH_FRAMES`), each its own frame
        /// (with its own MAC and sequence number under `--secret-file`), in
        /// one `writev`: one system call for the raft and `syncvm` messages
        /// of a consensus round instead of one per message. A link's
        /// reader reads what has arrived (up to 64 KiB) in one call and
        /// parses the frames in it.
        On = "on",
        /// One `send` per message; three reads per frame (header, payload,
        /// checksum), twice that with `--secret-file` (the seal).
        Off = "off",
    }
}

switch! {
    /// `--link-direct`: who writes a message to a peer's link.
    pub enum LinkDirect {
        /// The peer's sender thread, always (one wake-up of it per
        /// message or round).
        Off = "off",
        /// The thread that sends it (the consensus thread, the applier),
        /// when nothing is queued for the peer before it, the link is up
        /// and not being written, and its socket has room for it (so the
        /// write does not block); otherwise the sender thread. A
        /// message's path loses a thread wake-up.
        On = "on",
    }
}

switch! {
    /// `--link-compress`: whether messages go compressed on the peer links
    /// (`squeeze`).
    pub enum LinkCompress {
        /// LZ4, each frame of at least `squeeze::COMPRESS_FROM` bytes that
        /// comes out shorter: the log entries, which carry every input
        /// frame to both peers, and a `syncvm`'s bitmaps and pages.
        Lz4 = "lz4",
        /// As they are.
        Off = "off",
    }
}

/// The switches together.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tuning {
    pub early_apply: EarlyApply,
    pub batch_append: BatchAppend,
    pub sync_spacing: SyncSpacing,
    pub direct_input: DirectInput,
    pub ack_wait: AckWait,
    pub early_resume: EarlyResume,
    pub sync_settle: SyncSettle,
    pub sync_clock: SyncClock,
    pub ack_release: AckRelease,
    pub input_batch: InputBatch,
    pub sync_pipeline: SyncPipeline,
    pub link_batch: LinkBatch,
    pub link_direct: LinkDirect,
    pub link_compress: LinkCompress,
    /// `--predict-writes` (`writes`).
    pub predict_writes: ftvm_replication::pipeline::predict::Mode,
    /// The per-page costs adaptive prediction weighs (measured at start
    /// under `--tuning auto`).
    pub costs: ftvm_replication::pipeline::costs::Costs,
    /// `--leader-apply`.
    pub leader_apply: LeaderApply,
    /// `--sync-output`.
    pub sync_output: SyncOutput,
    /// `--witness-linger-us` (`Mesh::set_witness_linger`; zero: off).
    pub witness_linger: std::time::Duration,
}

impl Tuning {
    /// `--witness-linger-us` unless given.
    pub const DEFAULT_WITNESS_LINGER: std::time::Duration = std::time::Duration::from_millis(1);
}
