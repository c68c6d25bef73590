//! The backup's copy of the VM between checkpoints.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;

use ftvm_vmm::devices::KindList;
use ftvm_vmm::pages::{Bundle, Cursor};
use ftvm_vmm::{Vm, VmConfig, VmState};

use super::BackupConfig;
use crate::arbiter::Ownership;
use crate::protocol::{Hello, ProtocolError};
use crate::ReplicationError;

pub struct Replica {
    /// Never runs until it takes over.
    pub vm: Vm,
    pub disk: Option<File>,
    pub disk_size: u64,
    /// The last checkpoint applied: its epoch and its VM state.
    pub committed: Option<(u64, VmState)>,
    pub next_epoch: u64,
    /// Who owned the VM (per the arbiter) while the primary replicated to us.
    pub owner_seen: Option<Ownership>,
}

impl Replica {
    /// A replica in the primary's shape, or why this backup refuses it.
    pub fn for_primary(c: &BackupConfig, hello: &Hello) -> Result<Replica, String> {
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
        let config = VmConfig {
            mem_size: hello.mem_size,
            vcpus: hello.vcpus,
            prefault: c.prefault,
            dirty_backend: c.dirty_backend,
            console: c.console.clone(),
            devices: c.devices.clone(),
        };
        let vm = Vm::new(config).map_err(|e| format!("cannot build the replica VM: {e}"))?;
        let ours = vm.devices().kinds();
        if ours != hello.devices {
            return Err(format!("the primary's VM has devices {} but this backup was given {}", KindList(&hello.devices), KindList(&ours)));
        }
        let (disk, disk_size) = match (&c.devices.disk, hello.disk_size) {
            (Some(path), Some(size)) => {
                // The replica starts empty: pre-copy sends everything that is not zero.
                let f = OpenOptions::new().write(true).open(path).map_err(|e| format!("cannot open the disk replica: {e}"))?;
                f.set_len(0).and_then(|_| f.set_len(size)).map_err(|e| format!("cannot size the disk replica: {e}"))?;
                (Some(f), size)
            }
            _ => (None, 0),
        };
        Ok(Replica { vm, disk, disk_size, committed: None, next_epoch: hello.first_epoch, owner_seen: None })
    }

    /// A pre-copy round's pages (a bundle without state).
    pub fn precopy_pages(&self, payload: &[u8]) -> Result<(), ReplicationError> {
        let mut c = Cursor::new(payload);
        let pages = Bundle::parse(&mut c, self.vm.ram().pages()).map_err(ProtocolError::from)?;
        if !c.is_empty() || !pages.state.is_empty() {
            return Err(ProtocolError::Corrupt("malformed pre-copy pages".into()).into());
        }
        pages.apply(self.vm.ram()).map_err(ftvm_vmm::VmError::from)?;
        Ok(())
    }

    /// A pre-copy chunk of the disk: `offset u64 | data`.
    pub fn precopy_disk(&self, payload: &[u8]) -> Result<(), ReplicationError> {
        let mut c = Cursor::new(payload);
        let offset = c.u64().map_err(ProtocolError::from)?;
        let data = c.rest();
        let (Some(disk), true) = (&self.disk, offset.checked_add(data.len() as u64).is_some_and(|e| e <= self.disk_size)) else {
            return Err(ProtocolError::Corrupt("pre-copy disk data beyond the disk".into()).into());
        };
        disk.write_all_at(data, offset).map_err(ReplicationError::BackupDisk)
    }
}
