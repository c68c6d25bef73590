//! One checkpoint as a chain of stages with typed hand-offs:
//!
//! ```text
//!  primary                                                       backup
//!  Freeze ──Frozen──▶ Capture ──Captured──▶ Encode ──frame──▶ Transport ──▶ Apply
//!  (pause, dirty set,  (copy the pages      (PageEncoder per   (TCP)         (stage,
//!   state, output       as they were at      page, tagged)                    then commit)
//!   epoch)              the freeze)
//! ```
//!
//! Each stage is a trait with today's behaviour as its implementation; a
//! later mechanism (copy-on-write capture, XOR-diff encoding, a shared-memory
//! transport, a double-buffered apply) is one more implementation chosen by
//! a switch (`Switches`), so it can be measured on and off in one run.

pub mod apply;
pub mod capture;
mod cores;
pub mod costs;
pub mod encode;
pub mod epochs;
pub mod freeze;
pub mod last_sent;
pub mod policy;
pub mod predict;
pub mod prefetch;
pub mod transport;
pub mod trigger;

use std::sync::Arc;

use ftvm_vmm::pages::PageEncoder;
use ftvm_vmm::{DirtyBackend, Vm};

use crate::checkpoint::Carrying;
use crate::error::ReplicationError;
use crate::fakeack::delta::Carried;
use crate::fakeack::FakeAck;
use crate::output::{DiskJournal, OutputBuffer};
use crate::protocol;
use capture::Capture;
use freeze::Freeze;
use predict::FreezeMask;

/// Which implementation each stage uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Switches {
    pub capture: capture::Mode,
    pub encoding: encode::Encoding,
    pub diff: encode::Diff,
    pub device_state: encode::States,
    pub transport: transport::Kind,
    pub trigger: trigger::Mode,
    pub group_commit: trigger::GroupCommit,
    pub predict_writes: predict::Mode,
    pub prefetch: prefetch::Mode,
    pub prefetch_by: prefetch::pull::By,
    pub fake_ack_state: crate::fakeack::delta::Sending,
    /// The per-page costs the adaptive mechanisms weigh (`--tuning auto`
    /// measures them at start).
    pub costs: costs::Costs,
}

/// What taking one checkpoint cost, stage by stage.
#[derive(Clone, Copy, Debug, Default)]
pub struct Taken {
    pub epoch: u64,
    /// Why it was taken and how long its epoch ran: set by whoever
    /// triggered it (the epoch loop).
    pub trigger: trigger::Started,
    /// Stopping the VM and the pause.
    pub freeze: freeze::Figures,
    /// Every page written in the epoch, sent ahead or in the checkpoint.
    pub dirty_pages: u64,
    /// Write-fault prediction (all zero without it).
    pub predict: predict::Figures,
    /// What its state carries besides the VM's own.
    pub state: crate::checkpoint::Carrying,
    /// Its pages and state as encoded.
    pub encoded: encode::Encoded,
    /// What `--prefetch` sent of its epoch while the guest ran.
    pub prefetched: prefetch::Sent,
    /// The per-page costs weighed after this checkpoint.
    pub costs: costs::Costs,
    /// Its diffs went LZ4-compressed.
    pub compressed: bool,
}

/// The primary's half of the pipeline: from the running VM to a frame.
pub struct Pipeline {
    freeze: Box<dyn Freeze>,
    /// Which pages the freeze leaves writable (write-fault prediction, or none).
    mask: Box<dyn FreezeMask>,
    capture: Box<dyn Capture>,
    /// In-epoch transfer: rounds of pages sent while the guest runs, or none.
    in_epoch: Box<dyn prefetch::InEpoch>,
    encoder: Box<dyn PageEncoder>,
    sent_state: encode::SentState,
    /// What the backup holds of the fake-ACK proxy's state.
    sent_fake_ack: crate::fakeack::delta::Sender,
    frame: Vec<u8>,
    /// The largest checkpoint payload the backup accepts from this VM.
    limit: u64,
    /// What the adaptive stages weigh; the copy cost follows the
    /// stop-and-copy when the capture copies in the pause.
    costs: costs::Costs,
    copies_in_pause: bool,
    /// `--diff`: with `auto`, whether the link is busy enough to compress diffs.
    diff: encode::Diff,
    link_load: Option<encode::link_load::LinkLoad>,
}

impl Pipeline {
    pub fn new(switches: &Switches, vm: &Vm, output: Arc<OutputBuffer>, journal: Arc<DiskJournal>) -> Result<Pipeline, ReplicationError> {
        Pipeline::with_fake_ack(switches, vm, output, journal, None)
    }

    /// A pipeline whose checkpoints carry `fake_ack`'s state too (`--fake-ack on`).
    pub fn with_fake_ack(
        switches: &Switches,
        vm: &Vm,
        output: Arc<OutputBuffer>,
        journal: Arc<DiskJournal>,
        fake_ack: Option<Arc<FakeAck>>,
    ) -> Result<Pipeline, ReplicationError> {
        let pages = vm.ram().pages();
        if switches.predict_writes != predict::Mode::Off && vm.config().dirty_backend != DirtyBackend::Bitmap {
            // The ring re-protects every page it harvested.
            return Err(ReplicationError::Unsupported("--predict-writes needs --dirty-backend bitmap"));
        }
        if switches.prefetch_by == prefetch::pull::By::Pull && switches.prefetch == prefetch::Mode::Off {
            return Err(ReplicationError::Unsupported("--prefetch-by pull needs --prefetch on or adaptive"));
        }
        let limit = crate::bounds::checkpoint_limit(vm.config().mem_size, vm.config().vcpus);
        Ok(Pipeline {
            freeze: Box::new(freeze::PauseAndSave::new(pages, output, journal).with_fake_ack(fake_ack)),
            mask: predict::mask(switches.predict_writes, pages, &switches.costs),
            capture: capture::new(switches.capture, vm)?,
            in_epoch: prefetch::in_epoch(switches.prefetch, switches.prefetch_by, pages, limit, &switches.costs),
            encoder: encode::new(switches.encoding, switches.diff, pages),
            sent_state: encode::SentState::new(switches.device_state),
            sent_fake_ack: crate::fakeack::delta::Sender::new(switches.fake_ack_state),
            frame: Vec::new(),
            limit,
            costs: switches.costs,
            copies_in_pause: switches.capture == capture::Mode::Pause,
            diff: switches.diff,
            link_load: (switches.diff == encode::Diff::Auto).then(encode::link_load::LinkLoad::new),
        })
    }

    /// Dirty tracking restarts for a new backup: forget what was left
    /// writable and what the old backup holds.
    pub fn restart(&mut self) {
        self.mask.reset();
        self.in_epoch.reset();
    }

    /// `--prefetch-by pull`: where the backup's confirmations of the lists
    /// it read go (None: the rounds push their pages, or there are none).
    pub fn pull_confirmations(&self) -> Option<Arc<std::sync::atomic::AtomicU64>> {
        self.in_epoch.pull_confirmations()
    }

    /// When the open epoch's next in-epoch round is due (None: none left).
    pub fn next_round(&self, plan: &trigger::Plan) -> Option<std::time::Instant> {
        self.in_epoch.next_round(window(plan))
    }

    /// The in-epoch round that is due, for the open epoch `epoch`, while
    /// the guest runs: the frame to send, if there is anything to send.
    /// Then `round_sent`.
    pub fn round(&mut self, vm: &Vm, epoch: u64, plan: &trigger::Plan) -> Result<Option<&[u8]>, ReplicationError> {
        self.in_epoch.round(vm, epoch, window(plan), self.mask.reserved(), self.encoder.as_mut())
    }

    /// The round's frame went out (or there was none).
    pub fn round_sent(&mut self) {
        self.in_epoch.round_sent();
    }

    /// The next checkpoint goes to a new backup, which has nothing but what
    /// pre-copy sent it: forget what was assumed about the previous one.
    pub fn new_backup(&mut self) {
        self.encoder.reset();
        self.sent_state.reset();
        self.sent_fake_ack.reset();
        if let Some(load) = &mut self.link_load {
            load.restart();
        }
    }

    /// `--diff auto`: the link's busy time (`Transport::busy`), read after
    /// a checkpoint went out (and only then: a socket query under the
    /// link's lock), may turn compression on or off.
    pub fn link_busy(&mut self, now: std::time::Instant, busy: impl FnOnce() -> Option<std::time::Duration>) {
        if let Some(on) = self.link_load.as_mut().and_then(|load| load.observe(now, busy())) {
            self.encoder.compress(on);
        }
    }

    /// Take checkpoint `epoch`: the VM is paused only for the freeze (and
    /// whatever the capture does before the guest runs again). Returns the
    /// figures and the frame to send.
    pub fn take(&mut self, vm: &Vm, epoch: u64) -> Result<(Taken, &[u8]), ReplicationError> {
        let mut frozen = self.freeze.freeze(vm, epoch, self.mask.as_mut())?;
        // Pages the prefetch rounds harvested and left to the stop-and-copy.
        let prefetched = self.in_epoch.close_epoch(&mut frozen.dirty);
        if let Some(ahead) = self.in_epoch.written_ahead() {
            self.mask.written_ahead(ahead);
        }
        let t0 = std::time::Instant::now();
        let captured = self.capture.in_pause(vm, &frozen.dirty, self.mask.left_writable());
        let (copy, copied) = (t0.elapsed(), frozen.dirty.count());
        tracing::debug!(copy_us = copy.as_micros() as u64, pages = copied, "capture");
        if self.copies_in_pause && captured.is_ok() && self.costs.follow_copy(copied, copy) {
            self.mask.weigh(&self.costs);
            self.in_epoch.weigh(&self.costs);
            self.costs.passed();
        }
        let mut thawed = frozen.thaw();
        captured?;
        let pages = self.capture.finish(vm)?;
        self.mask.filter(pages, self.encoder.as_ref());
        // Before `filter` may leave an unchanged disk's state out.
        let disk_pending = ftvm_vmm::devices::requests_in_flight(thawed.state.vm.changed.iter());
        self.sent_state.filter(&mut thawed.state.vm);
        // The proxy's whole table as saved at the freeze, and what of it goes.
        let (mut fake_ack_bytes, mut fake_ack_flows, mut fake_ack_bulk_flows) = (0, 0, 0);
        if let Some(Carried::Whole(table)) = thawed.state.fake_ack.take() {
            (fake_ack_bytes, fake_ack_flows, fake_ack_bulk_flows) = (table.stored_bytes(), table.flows() as u64, table.bulk_flows() as u64);
            thawed.state.fake_ack = Some(self.sent_fake_ack.carry(epoch, table.carried()));
        }
        // `--diff auto`: a big checkpoint's diffs go compressed whatever the
        // link's load (`link_load::compress_checkpoint`), then the encoder
        // follows the link again (prefetch rounds).
        let compressed = match &self.link_load {
            Some(load) => {
                let on = load.compress_checkpoint(pages.len());
                self.encoder.compress(on);
                on
            }
            None => self.diff == encode::Diff::Lz4,
        };
        let encoded = encode::checkpoint(&mut self.frame, epoch, &thawed.state, pages, self.encoder.as_mut());
        if let Some(load) = &self.link_load {
            self.encoder.compress(load.compressing());
        }
        let predicted = self.mask.settle(self.encoder.as_ref());
        let bytes = protocol::payload_len(&self.frame);
        if bytes > self.limit {
            // The bounds make this impossible; sending it would make the backup give up on us.
            return Err(ReplicationError::CheckpointTooLarge { epoch, bytes, limit: self.limit });
        }
        let taken = Taken {
            epoch,
            freeze: thawed.figures,
            // Pages left to the encoder and found unchanged were not written
            // (nor sent: the bundle leaves them out).
            dirty_pages: pages.len() as u64 + prefetched.only_ahead - predicted.sent_unchanged,
            predict: predicted,
            state: Carrying {
                disk_writes: thawed.state.disk.len() as u64,
                disk_bytes: thawed.state.disk.iter().map(|w| w.data.len() as u64).sum(),
                disk_pending,
                fake_ack_bytes,
                fake_ack_flows,
                fake_ack_bulk_flows,
                fake_ack_sent_bytes: thawed.state.fake_ack.as_ref().map_or(0, Carried::frame_bytes),
            },
            encoded,
            prefetched,
            costs: self.costs,
            compressed,
            ..Taken::default()
        };
        Ok((taken, &self.frame))
    }
}

/// The open epoch as the in-epoch rounds are scheduled in it.
fn window(plan: &trigger::Plan) -> prefetch::Window {
    prefetch::Window { since: plan.since, max_epoch: plan.max_epoch }
}
