//! Checkpoints: taken on the primary in one short pause, applied on the
//! backup all at once or not at all.
//!
//! Payload: `epoch u64 | dirty pages (page set) | state length u64 | VM
//! state (bincode) | disk writes`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use ftvm_vmm::{DirtyBitmap, Vm, VmState};

use crate::protocol::{self, Cursor, Kind, PageSet, ProtocolError, PAGE};
use crate::ReplicationError;

/// What taking one checkpoint cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct Taken {
    pub epoch: u64,
    pub pause: Duration,
    pub dirty_pages: u64,
    pub disk_writes: u64,
}

/// Pause the VM, capture epoch `epoch` into `frame` (a complete frame ready
/// to send), and resume it. Only the page copy happens inside the pause;
/// encoding the state and the checksum happen after the guest runs again.
/// `protect_from`: on the first checkpoint, start holding network output,
/// with the guest running in that epoch next.
pub fn take(
    vm: &Vm,
    epoch: u64,
    dirty: &mut DirtyBitmap,
    frame: &mut Vec<u8>,
    protect_from: Option<u64>,
) -> Result<Taken, ReplicationError> {
    let t0 = Instant::now();
    vm.pause();
    let captured = capture(vm, epoch, dirty, frame);
    // Close the output epoch inside the pause: frames the guest sends after
    // resuming belong to the next epoch.
    let output = vm.devices().output();
    match protect_from {
        Some(next) => output.protect(next),
        None => {
            output.close_epoch();
        }
    }
    vm.resume();
    let pause = t0.elapsed();
    let (state, disk) = captured?;
    let state = bincode::serialize(&state).expect("VM state serializes");
    frame.extend_from_slice(&(state.len() as u64).to_le_bytes());
    frame.extend_from_slice(&state);
    protocol::put_disk_writes(frame, &disk);
    protocol::finish_frame(frame);
    Ok(Taken { epoch, pause, dirty_pages: dirty.count(), disk_writes: disk.len() as u64 })
}

type Captured = (VmState, Vec<ftvm_vmm::devices::virtio::block_journal::DiskWrite>);

fn capture(vm: &Vm, epoch: u64, dirty: &mut DirtyBitmap, frame: &mut Vec<u8>) -> Result<Captured, ReplicationError> {
    dirty.clear();
    vm.collect_dirty(dirty)?;
    let state = vm.save_state()?;
    let disk = vm.devices().disk_journal().take();
    protocol::begin_frame(frame, Kind::Checkpoint);
    frame.extend_from_slice(&epoch.to_le_bytes());
    let pages: Vec<u64> = dirty.pages().collect();
    // SAFETY: the VM is paused: neither vCPUs nor devices write its memory.
    let mem = unsafe { vm.ram().as_slice() };
    protocol::put_pages(frame, &pages, |p| &mem[p as usize * PAGE..(p as usize + 1) * PAGE]);
    Ok((state, disk))
}

/// A received checkpoint, fully parsed and checked against the VM it is
/// for, before anything is applied.
pub struct Checkpoint<'a> {
    pub epoch: u64,
    pub pages: PageSet<'a>,
    pub state: &'a [u8],
    pub disk: Vec<(u64, &'a [u8])>,
}

impl<'a> Checkpoint<'a> {
    pub fn parse(payload: &'a [u8], ram_pages: u64, disk_size: u64) -> Result<Checkpoint<'a>, ProtocolError> {
        let mut c = Cursor::new(payload);
        let epoch = c.u64()?;
        let pages = PageSet::read(&mut c)?;
        if let Some((p, _)) = pages.iter().find(|(p, _)| *p >= ram_pages) {
            return Err(ProtocolError::Corrupt(format!("checkpoint {epoch} has page {p} beyond guest RAM")));
        }
        let state_len = c.u64()? as usize;
        let state = c.take(state_len)?;
        let disk = protocol::read_disk_writes(&mut c)?;
        if let Some((off, data)) = disk.iter().find(|(off, d)| off.checked_add(d.len() as u64).is_none_or(|e| e > disk_size)) {
            return Err(ProtocolError::Corrupt(format!(
                "checkpoint {epoch} writes {} bytes at disk offset {off}, beyond the {disk_size}-byte disk",
                data.len()
            )));
        }
        if !c.is_empty() {
            return Err(ProtocolError::Corrupt(format!("checkpoint {epoch} has trailing bytes")));
        }
        Ok(Checkpoint { epoch, pages, state, disk })
    }

    /// Decode the VM state (checked before anything is applied).
    pub fn vm_state(&self) -> Result<VmState, ProtocolError> {
        protocol::decode(self.state)
    }

    /// Write the pages into the (stopped) backup VM and the writes into its disk.
    pub fn apply(&self, vm: &Vm, disk: Option<&File>) -> Result<(), ReplicationError> {
        apply_pages(vm, &self.pages);
        if let Some(disk) = disk {
            for (offset, data) in &self.disk {
                disk.write_all_at(data, *offset).map_err(ReplicationError::BackupDisk)?;
            }
        }
        Ok(())
    }
}

/// Copy a page set into guest RAM; page numbers were checked by the caller.
pub fn apply_pages(vm: &Vm, pages: &PageSet) {
    // SAFETY: only the backup calls this, on a VM whose vCPUs and devices
    // have never run; nothing else reads or writes its memory meanwhile.
    let mem = unsafe { vm.ram().as_mut_slice() };
    for (p, data) in pages.iter() {
        let at = p as usize * PAGE;
        mem[at..at + PAGE].copy_from_slice(data);
    }
}
