//! The backup's copy of the VM between checkpoints: what the apply stage
//! stages checkpoints against and commits them to, and where pages sent
//! ahead of their checkpoint (`--prefetch`) wait for it.

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{Bundle, BundleWriter, Cursor, RawEncoder};
use ftvm_vmm::{Components, Vm};

use super::{ApplyError, DiskImage};
use crate::arbiter::Ownership;
use crate::pipeline::prefetch::pull::PrimaryRam;
use crate::protocol::{ProtocolError, PullList};

pub struct Replica {
    /// Never runs until it takes over.
    pub vm: Vm,
    pub disk: Option<Box<dyn DiskImage>>,
    /// The disk replica's file, as given (`--disk`), for error messages.
    pub disk_name: String,
    pub disk_size: u64,
    /// The last checkpoint applied: its epoch and its VM state.
    pub committed: Option<(u64, Components)>,
    /// The fake-ACK proxy's state of that checkpoint (`--fake-ack on`).
    pub fake_ack: Option<crate::fakeack::State>,
    /// The first frames of that checkpoint's epoch, which it carried
    /// (`CheckpointState::output`): a takeover sends them first.
    pub output: Vec<Vec<u8>>,
    pub next_epoch: u64,
    /// Who owned the VM (per the arbiter) while the primary replicated to us.
    pub owner_seen: Option<Ownership>,
    /// False once an apply failed and could not be undone: RAM or disk
    /// match no checkpoint, and the replica must never run.
    pub usable: bool,
    /// Pages of epoch `next_epoch` prefetched while the primary's guest ran
    /// (`--prefetch`): checked, not applied; committed with that checkpoint,
    /// forgotten if it never comes.
    pub staged: Staged,
}

/// Prefetch frames of the next epoch, in arrival order, each checked.
#[derive(Debug, Default)]
pub struct Staged {
    /// Each an epoch number and a bundle without state.
    payloads: Vec<Vec<u8>>,
    bytes: u64,
}

impl Staged {
    pub fn is_empty(&self) -> bool {
        self.payloads.is_empty()
    }

    fn bundles(&self) -> impl Iterator<Item = Bundle<'_>> {
        // Every payload was checked when it was staged, for this RAM.
        self.payloads.iter().filter_map(|p| Bundle::parse(&mut Cursor::new(&p[8..]), u64::MAX).ok())
    }

    pub fn clear(&mut self) {
        self.payloads.clear();
        self.bytes = 0;
    }
}

impl Replica {
    /// The replica matches no checkpoint any more: forget the last one, so
    /// there is nothing to take over.
    pub fn discard(&mut self) {
        self.committed = None;
        self.fake_ack = None;
        self.output.clear();
        self.usable = false;
        self.staged.clear();
    }

    /// Stage a prefetch frame (`epoch u64 | bundle`) of the next epoch; the
    /// epoch's frames together stay within `limit` bytes (what the primary
    /// sends of one epoch at most).
    pub fn stage_prefetch(&mut self, payload: Vec<u8>, limit: u64) -> Result<(), ApplyError> {
        let mut c = Cursor::new(&payload);
        let epoch = c.u64().map_err(ProtocolError::from)?;
        if epoch != self.next_epoch {
            return Err(
                ProtocolError::Corrupt(format!("pages prefetched for epoch {epoch} arrived, {} was expected", self.next_epoch)).into()
            );
        }
        let pages = Bundle::parse(&mut c, self.vm.ram().pages()).map_err(ProtocolError::from)?;
        if !c.is_empty() || !pages.state.is_empty() {
            return Err(ProtocolError::Corrupt("malformed prefetched pages".into()).into());
        }
        let bytes = self.staged.bytes + payload.len() as u64;
        if bytes > limit {
            return Err(ProtocolError::Corrupt(format!("epoch {epoch} prefetched more than {limit} bytes")).into());
        }
        self.staged.payloads.push(payload);
        self.staged.bytes = bytes;
        Ok(())
    }

    /// Stage the pages `list` names (`--prefetch-by pull`), read now from
    /// the primary's memory `ram`, as a prefetch frame of their epoch.
    pub fn stage_pulled(&mut self, ram: &PrimaryRam, list: &PullList, limit: u64) -> Result<(), ApplyError> {
        let pages = self.vm.ram().pages();
        if let Some(p) = list.pages.iter().find(|&&p| p >= pages.min(ram.pages())) {
            return Err(ProtocolError::Corrupt(format!("pulled page {p} is beyond guest RAM")).into());
        }
        let mut payload = Vec::with_capacity(8 + ftvm_vmm::pages::max_bundle_len(0, list.pages.len() as u64) as usize);
        payload.extend_from_slice(&list.epoch.to_le_bytes());
        let (mut raw, mut page) = (RawEncoder, vec![0u8; PAGE]);
        let mut bundle = BundleWriter::begin(&mut payload, &[], &mut raw, false);
        for &p in &list.pages {
            ram.read_page(p, &mut page);
            bundle.page(p, &page);
        }
        bundle.finish();
        self.stage_prefetch(payload, limit)
    }

    /// Write the staged pages into RAM, in the order they arrived (a diff
    /// applies to what the frames before it left), and forget them.
    /// Part of committing the next checkpoint, before its own pages: only a
    /// page outside RAM can fail, and every one was checked.
    pub fn commit_staged(&mut self) -> Result<(), ftvm_vmm::memory::MemoryError> {
        let staged = std::mem::take(&mut self.staged);
        let result = staged.bundles().try_for_each(|b| b.apply(self.vm.ram()));
        result
    }

    /// A pre-copy round's pages (a bundle without state).
    pub fn precopy_pages(&self, payload: &[u8]) -> Result<(), ApplyError> {
        let mut c = Cursor::new(payload);
        let pages = Bundle::parse(&mut c, self.vm.ram().pages()).map_err(ProtocolError::from)?;
        if !c.is_empty() || !pages.state.is_empty() {
            return Err(ProtocolError::Corrupt("malformed pre-copy pages".into()).into());
        }
        // Cannot fail: every page was checked against RAM.
        pages.apply(self.vm.ram()).map_err(|e| ProtocolError::Corrupt(e.to_string()))?;
        Ok(())
    }

    /// A pre-copy chunk of the disk: `offset u64 | data`.
    pub fn precopy_disk(&self, payload: &[u8]) -> Result<(), ApplyError> {
        let mut c = Cursor::new(payload);
        let offset = c.u64().map_err(ProtocolError::from)?;
        let data = c.rest();
        let (Some(disk), true) = (&self.disk, offset.checked_add(data.len() as u64).is_some_and(|e| e <= self.disk_size)) else {
            return Err(ProtocolError::Corrupt("pre-copy disk data beyond the disk".into()).into());
        };
        disk.write_at(data, offset).map_err(|err| ApplyError::Precopy { disk: self.disk_name.clone(), err })
    }
}
