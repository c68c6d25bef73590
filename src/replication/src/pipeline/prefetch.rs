//! In-epoch transfer (`--prefetch`, after Phantasy): while the guest runs,
//! send the backup the pages it dirtied earlier in the open epoch, so the
//! stop-and-copy at the end of the epoch carries only the pages written
//! again since.
//!
//! A round harvests the dirty set without pausing, re-arms tracking, and
//! only then reads the pages it sends: a page written during or after its
//! read is reported again and goes again (in a later round or in the
//! checkpoint), so a torn read is never what the backup commits. Write-cold
//! pages go first, in fact only they go: a page the last two checkpoints
//! both carried (written late in each epoch, or all through it), or one
//! already sent in this epoch and written again, is hot; it is left for the
//! stop-and-copy
//! (`carry`) and, where the dirty backend can, left writable, so the guest
//! takes no extra tracked first write for it. The backup stages what
//! arrives and commits it only with the checkpoint of the same epoch
//! (`backup::Replica::stage_prefetch`): a primary that dies mid-epoch
//! leaves it exactly at the last checkpoint.

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{BundleWriter, PageEncoder};
use ftvm_vmm::{PageBitmap, Vm};

use crate::protocol::{self, Kind};
use crate::switch::switch;
use crate::ReplicationError;

switch! {
    /// `--prefetch`: send pages of the open epoch while the guest runs.
    pub enum Mode {
        /// Every dirty page goes in the stop-and-copy.
        Off = "off",
        /// Write-cold pages dirtied earlier in the epoch go ahead of the checkpoint.
        On = "on",
    }
}

/// Prefetch rounds per epoch, evenly spaced over its planned length (the
/// last quarter is left to the stop-and-copy: what is written there is
/// likely written again before the freeze).
pub const ROUNDS: u32 = 7;

/// What the prefetch rounds of one epoch sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub pages: u64,
    /// Bytes of their frames.
    pub bytes: u64,
    /// Of those pages, the ones the checkpoint does not carry again (not
    /// written since they were sent).
    pub only_ahead: u64,
}

/// One epoch's prefetch rounds, and what the freeze must add to its dirty set.
pub struct Prefetcher {
    /// Harvested by a round and not sent: the checkpoint carries them.
    carry: PageBitmap,
    /// Sent by a round of the open epoch.
    sent_pages: PageBitmap,
    /// Pages the last two checkpoints both carried: written late in every
    /// epoch, or all through it. (One checkpoint is weak evidence: a guest
    /// that writes a large cold set at random rewrites many of its pages
    /// in the next epoch by chance.)
    recent: PageBitmap,
    /// The last checkpoint's dirty set.
    last: PageBitmap,
    harvested: PageBitmap,
    hot: PageBitmap,
    page: Vec<u8>,
    frame: Vec<u8>,
    sent: Sent,
    /// The most the rounds of one epoch send (the backup stages at most this).
    limit: u64,
}

impl Prefetcher {
    /// For a guest of `ram_pages` pages; one epoch's rounds send at most `limit` bytes.
    pub fn new(ram_pages: u64, limit: u64) -> Prefetcher {
        let empty = PageBitmap::new(ram_pages);
        Prefetcher {
            carry: empty.clone(),
            sent_pages: empty.clone(),
            recent: empty.clone(),
            last: empty.clone(),
            harvested: empty.clone(),
            hot: empty,
            page: vec![0; PAGE],
            frame: Vec::new(),
            sent: Sent::default(),
            limit,
        }
    }

    /// One round for epoch `epoch`: the frame to send (None: nothing cold
    /// was dirtied). Pages go through `encoder`, the checkpoint's, so a
    /// diff in the checkpoint is made against what the backup will have
    /// staged.
    pub fn round(&mut self, vm: &Vm, epoch: u64, encoder: &mut dyn PageEncoder) -> Result<Option<&[u8]>, ReplicationError> {
        self.harvested.clear();
        vm.harvest_dirty(&mut self.harvested)?;
        self.hot.copy_from(&self.recent);
        for other in [&self.sent_pages, &self.carry] {
            self.hot.or_words(other.words());
        }
        self.hot.intersect(&self.harvested);
        // Before any page is read: a write after this is reported again.
        vm.rearm_dirty(&self.hot)?;
        self.carry.or_words(self.hot.words());
        self.harvested.subtract(&self.hot);
        let cold = self.harvested.count();
        let most = 8 + ftvm_vmm::pages::max_bundle_len(0, cold);
        if cold == 0 || self.sent.bytes + most > self.limit {
            // Over the epoch's budget: the checkpoint takes them.
            self.carry.or_words(self.harvested.words());
            return Ok(None);
        }
        protocol::begin_frame(&mut self.frame, Kind::Prefetch);
        self.frame.extend_from_slice(&epoch.to_le_bytes());
        let mut bundle = BundleWriter::begin(&mut self.frame, &[], encoder, false);
        for p in self.harvested.pages() {
            vm.ram().read_page(p, &mut self.page).map_err(ftvm_vmm::VmError::from)?;
            bundle.page(p, &self.page);
        }
        let written = bundle.finish();
        protocol::finish_frame(&mut self.frame);
        self.sent_pages.or_words(self.harvested.words());
        self.sent.pages += written.pages;
        self.sent.bytes += self.frame.len() as u64;
        Ok(Some(&self.frame))
    }

    /// At the freeze of the epoch: add the pages harvested and not sent to
    /// its dirty set, remember which pages are hot, and return what
    /// the epoch's rounds sent (the next epoch starts from nothing).
    pub fn close_epoch(&mut self, dirty: &mut PageBitmap) -> Sent {
        dirty.or_words(self.carry.words());
        self.recent.copy_from(dirty);
        self.recent.intersect(&self.last);
        self.last.copy_from(dirty);
        self.carry.clear();
        self.sent_pages.subtract(dirty);
        self.sent.only_ahead = self.sent_pages.count();
        self.sent_pages.clear();
        std::mem::take(&mut self.sent)
    }

    /// Dirty tracking restarts (a new backup): nothing carried or sent.
    pub fn reset(&mut self) {
        for b in [&mut self.carry, &mut self.sent_pages, &mut self.recent, &mut self.last] {
            b.clear();
        }
        self.sent = Sent::default();
    }
}
