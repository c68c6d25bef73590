//! The epoch loop: one object drives the chain of stages from epoch to
//! epoch. It waits for the trigger (output held, the guest idle, the
//! epoch's bound), runs the in-epoch stage's rounds while it waits, takes
//! the checkpoint through the pipeline, hands the frame to the link, and
//! feeds what the checkpoint cost back into the pacing. What a role does
//! around it (a lost backup, fencing, a goodbye) is the role's: the loop
//! returns why it ended.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ftvm_vmm::Vm;

use super::trigger::{self, Pacing, Sample, Started, Trigger};
use super::{Pipeline, Taken};
use crate::error::ReplicationError;
use crate::output::OutputBuffer;

/// How often the loop looks at the link's loss and the stop flag while it
/// waits (the trigger wakes it sooner for a checkpoint).
const LOOK_EVERY: Duration = Duration::from_millis(20);

/// Where the loop's frames go, and how the far side is doing: a primary's
/// session with its backup.
pub trait EpochLink {
    /// Why the far side was lost.
    type Loss;
    /// The far side was found lost (once: the loss is taken).
    fn take_loss(&self) -> Option<Self::Loss>;
    /// Checkpoints sent and not yet acknowledged.
    fn in_flight(&self) -> usize;
    /// Send checkpoint `taken`'s `frame`; the guest resumed at `resumed`.
    fn send_checkpoint(&self, taken: &Taken, frame: &[u8], resumed: Instant) -> Result<(), Self::Loss>;
    /// Send an in-epoch round's `frame` of the open epoch `epoch`.
    fn send_round(&self, epoch: u64, frame: &[u8]) -> Result<(), Self::Loss>;
    /// Taking checkpoint `epoch` failed with `err`.
    fn checkpoint_failed(&self, epoch: u64, err: ReplicationError) -> Self::Loss;
    /// How long the link has had data in flight (`Transport::busy`).
    fn busy(&self) -> Option<Duration> {
        None
    }
}

/// Why the loop ended.
pub enum Ended<L> {
    /// The link was lost.
    Lost(L),
    /// The stop flag was set: the caller takes the last checkpoint.
    Stopped,
}

/// The chain of stages and what drives it, for one link.
pub struct EpochLoop<'a> {
    pub pipeline: &'a mut Pipeline,
    pub vm: &'a Vm,
    pub output: &'a OutputBuffer,
    pub trigger: &'a Trigger,
    /// Checkpoints in flight at most (`--pipeline-depth`).
    pub depth: usize,
    pub stop: &'a AtomicBool,
}

impl EpochLoop<'_> {
    /// Checkpoint whenever the trigger says so, paced by `pacing`, until
    /// the link is lost or the stop flag is set. `next_epoch` is the next
    /// checkpoint's number (never reused); `taken` is told of each
    /// checkpoint sent.
    pub fn run<L: EpochLink>(
        &mut self,
        link: &L,
        pacing: &mut Pacing,
        next_epoch: &mut u64,
        mut taken: impl FnMut(&Taken),
    ) -> Ended<L::Loss> {
        let guest = trigger::GuestView { vm: self.vm, output: self.output };
        let depth = self.depth.max(1);
        let mut since = Instant::now();
        loop {
            if let Some(loss) = link.take_loss() {
                return Ended::Lost(loss);
            }
            if self.stop.load(Ordering::SeqCst) {
                return Ended::Stopped;
            }
            let plan = pacing.plan(since);
            let next_round = self.pipeline.next_round(&plan);
            // Back now and then to look at the loss and stop flags.
            let look = next_round.map_or(Instant::now() + LOOK_EVERY, |at| at.min(Instant::now() + LOOK_EVERY));
            let Some(reason) = self.trigger.wait(&plan, &guest, || link.in_flight() < depth, look) else {
                if next_round.is_some_and(|at| Instant::now() >= at) {
                    if let Err(loss) = self.round(link, *next_epoch, &plan) {
                        return Ended::Lost(loss);
                    }
                }
                continue;
            };
            let epoch = *next_epoch;
            *next_epoch += 1;
            let held = self.output.held_since();
            let start = Instant::now();
            let (mut t, frame) = match self.pipeline.take(self.vm, epoch) {
                Ok(t) => t,
                Err(err) => return Ended::Lost(link.checkpoint_failed(epoch, err)),
            };
            t.trigger = Started {
                reason,
                epoch_len: start.saturating_duration_since(since),
                max_epoch: plan.max_epoch,
                spacing: plan.spacing,
                output_wait: held.map_or(Duration::ZERO, |h| start.saturating_duration_since(h)),
                clients: self.output.clients_last_closed() as u32,
            };
            since = start + t.freeze.pause;
            if let Err(loss) = link.send_checkpoint(&t, frame, Instant::now()) {
                return Ended::Lost(loss);
            }
            self.pipeline.link_busy(Instant::now(), || link.busy());
            // The cost grows with the pages the checkpoint carries (not those sent ahead).
            pacing.record(&Sample {
                pause: t.freeze.pause,
                cost: start.elapsed(),
                dirty_pages: t.encoded.pages.pages,
                epoch: t.trigger.epoch_len,
                clients: t.trigger.clients,
            });
            taken(&t);
        }
    }

    /// The in-epoch round that is due, sent while the guest runs.
    fn round<L: EpochLink>(&mut self, link: &L, epoch: u64, plan: &trigger::Plan) -> Result<(), L::Loss> {
        let sent = match self.pipeline.round(self.vm, epoch, plan) {
            Ok(Some(frame)) => link.send_round(epoch, frame),
            Ok(None) => Ok(()),
            Err(err) => Err(link.checkpoint_failed(epoch, err)),
        };
        self.pipeline.round_sent();
        sent
    }
}
