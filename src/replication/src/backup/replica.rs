//! The backup's copy of the VM between checkpoints.

use std::fs::OpenOptions;
use std::path::Path;

use ftvm_vmm::arch::compat::CpuProfile;
use ftvm_vmm::devices::KindList;
use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::{Bundle, BundleWriter, Cursor, RawEncoder};
use ftvm_vmm::{Components, Vm, VmConfig};

use super::BackupConfig;
use crate::arbiter::Ownership;
use crate::pipeline::apply::{ApplyError, DiskImage};
use crate::pipeline::prefetch::pull::PrimaryRam;
use crate::protocol::{Hello, ProtocolError, PullList};

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
    /// A replica in the primary's shape, or why this backup refuses it.
    /// `host` is what this host offers a vCPU.
    pub fn for_primary(c: &BackupConfig, host: &CpuProfile, hello: &Hello) -> Result<Replica, String> {
        if c.mem_size.is_some_and(|m| m != hello.mem_size) || c.vcpus.is_some_and(|v| v != hello.vcpus) {
            return Err(format!(
                "the primary's VM has {} MiB and {} vCPUs, this backup was started for {} MiB and {} vCPUs",
                hello.mem_size >> 20,
                hello.vcpus,
                c.mem_size.map_or(hello.mem_size, |m| m) >> 20,
                c.vcpus.unwrap_or(hello.vcpus)
            ));
        }
        if let (Some(theirs), Some(ours)) = (hello.mac, c.devices.net.as_ref().map(|n| n.mac)) {
            if theirs != ours {
                return Err("the primary's network card has another MAC address than this backup's --net".into());
            }
        }
        // So is the host, so that an incompatible one is found now, not at failover.
        host.can_restore(&hello.cpu).map_err(|e| format!("this host cannot run the primary's vCPUs: {e}"))?;
        // Devices are compared before the disk replica is touched.
        let ours = c.devices.kinds();
        if ours != hello.devices {
            return Err(format!("the primary's VM has devices {} but this backup was given {}", KindList(&hello.devices), KindList(&ours)));
        }
        let disk_size = match (&c.devices.disk, hello.disk_size) {
            (Some(path), Some(size)) => {
                prepare_disk(path, size)?;
                size
            }
            _ => 0,
        };
        // Built after the disk is sized: the VM's disk takes the file's size.
        let config = VmConfig {
            mem_size: hello.mem_size,
            vcpus: hello.vcpus,
            prefault: c.prefault,
            dirty_backend: c.dirty_backend,
            idle_pause: c.idle_pause,
            console: c.console.clone(),
            devices: c.devices.clone(),
        };
        let vm = Vm::new(config).map_err(|e| format!("cannot build the replica VM: {e}"))?;
        if vm.devices().kinds() != ours {
            return Err(format!("this backup's VM has devices {} instead of {}", KindList(&vm.devices().kinds()), KindList(&ours)));
        }
        let disk = match &c.devices.disk {
            Some(path) if hello.disk_size.is_some() => {
                let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| format!("cannot open the disk replica: {e}"))?;
                Some(Box::new(f) as Box<dyn DiskImage>)
            }
            _ => None,
        };
        Ok(Replica {
            vm,
            disk,
            disk_name: c.devices.disk.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            disk_size,
            committed: None,
            fake_ack: None,
            next_epoch: hello.first_epoch,
            usable: true,
            owner_seen: None,
            staged: Staged::default(),
        })
    }

    /// The replica matches no checkpoint any more: forget the last one, so
    /// there is nothing to take over.
    pub fn discard(&mut self) {
        self.committed = None;
        self.fake_ack = None;
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

/// Make the file at `path` an empty replica of a `size`-byte disk, or say
/// why it cannot be one. A file smaller than the primary's disk is refused
/// untouched; otherwise it is emptied (pre-copy sends everything that is
/// not zero) and given exactly the primary's size.
fn prepare_disk(path: &Path, size: u64) -> Result<(), String> {
    let name = path.display();
    let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| format!("cannot open the disk replica {name}: {e}"))?;
    let ours = f.metadata().map_err(|e| format!("cannot read the size of the disk replica {name}: {e}"))?.len();
    if ours < size {
        return Err(format!("the primary's disk has {size} bytes, this backup's --disk {name} only {ours}"));
    }
    f.set_len(0).and_then(|_| f.set_len(size)).map_err(|e| format!("cannot size the disk replica {name}: {e}"))
}
