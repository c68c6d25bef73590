//! Live pre-copy: bring a new backup's memory and disk up to date while the
//! guest keeps running, so the first checkpoint (the stop-and-copy) is small.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::{PageBitmap, Vm};

use ftvm_replication::output::DiskJournal;
use ftvm_replication::pipeline::encode::page_frame::page_frame;
use ftvm_replication::pipeline::transport::Transport;
use ftvm_replication::pipeline::trigger::Trigger;
use ftvm_replication::protocol::{self, Kind};
use ftvm_replication::ReplicationError;

/// Pages per pre-copy message.
const BATCH_PAGES: usize = 256;
/// Pre-copy stops iterating when a round finds this few dirty pages...
const DONE_PAGES: u64 = 512;
/// ... or after this many rounds.
const ROUNDS: usize = 8;
const DISK_CHUNK: usize = 1 << 20;

/// Copy memory and disk while the guest runs, then re-copy what it dirtied
/// until little is left, or until the disk journal asks for the first
/// checkpoint (`trigger`: the guest writes its disk fast). Returns the bytes
/// sent. Gives up with `ReplicationError::Stopped` soon after `stop` is set
/// (it is checked between messages and disk chunks).
pub fn run(
    link: &mut dyn Transport,
    vm: &Vm,
    journal: &DiskJournal,
    trigger: &Trigger,
    disk: Option<&Path>,
    stop: &AtomicBool,
) -> Result<u64, ReplicationError> {
    journal.start();
    vm.start_dirty_tracking()?;
    let mut sent = 0u64;
    let mut frame = Vec::new();
    // Round 0: every page that is not zero (the backup's RAM starts zeroed).
    let populated: Vec<u64> = vm.ram().populated_ranges().into_iter().flat_map(|(s, e)| s / PAGE as u64..e.div_ceil(PAGE as u64)).collect();
    sent += send_pages(link, vm, &populated, true, &mut frame, stop)?;
    if let Some(path) = disk {
        sent += send_disk(link, path, &mut frame, stop)?;
    }
    let mut dirty = PageBitmap::new(vm.ram().pages());
    let keep_none = PageBitmap::new(vm.ram().pages());
    for _ in 0..ROUNDS {
        dirty.clear();
        vm.collect_dirty(&mut dirty, &keep_none)?;
        let pages: Vec<u64> = dirty.pages().collect();
        sent += send_pages(link, vm, &pages, false, &mut frame, stop)?;
        if (pages.len() as u64) < DONE_PAGES || trigger.is_pending() {
            break;
        }
    }
    Ok(sent)
}

/// `fresh`: the backup has never had these pages, so zero pages are left out.
fn send_pages(
    link: &mut dyn Transport,
    vm: &Vm,
    pages: &[u64],
    fresh: bool,
    frame: &mut Vec<u8>,
    stop: &AtomicBool,
) -> Result<u64, ReplicationError> {
    let mut sent = 0;
    let mut page = vec![0u8; PAGE];
    for batch in pages.chunks(BATCH_PAGES) {
        stopped(stop)?;
        let written = page_frame(frame, Kind::Pages, &[], &[], vm.ram(), batch, fresh, &mut page, |_, _| {})?;
        if written == 0 {
            continue;
        }
        link.send(frame).map_err(ReplicationError::Send)?;
        sent += frame.len() as u64;
    }
    Ok(sent)
}

/// The disk's data regions in chunks, skipping all-zero chunks.
fn send_disk(link: &mut dyn Transport, path: &Path, frame: &mut Vec<u8>, stop: &AtomicBool) -> Result<u64, ReplicationError> {
    let file = File::open(path).map_err(ReplicationError::PrimaryDisk)?;
    let len = file.metadata().map_err(ReplicationError::PrimaryDisk)?.len();
    let mut chunk = vec![0u8; DISK_CHUNK];
    let mut sent = 0;
    let mut offset = 0u64;
    while offset < len {
        stopped(stop)?;
        let n = (len - offset).min(DISK_CHUNK as u64) as usize;
        file.read_exact_at(&mut chunk[..n], offset).map_err(ReplicationError::PrimaryDisk)?;
        if !ftvm_vmm::pages::is_zero(&chunk[..n]) {
            protocol::begin_frame(frame, Kind::Disk);
            frame.extend_from_slice(&offset.to_le_bytes());
            frame.extend_from_slice(&chunk[..n]);
            protocol::finish_frame(frame);
            link.send(frame).map_err(ReplicationError::Send)?;
            sent += frame.len() as u64;
        }
        offset += n as u64;
    }
    Ok(sent)
}

fn stopped(stop: &AtomicBool) -> Result<(), ReplicationError> {
    if stop.load(Ordering::SeqCst) {
        return Err(ReplicationError::Stopped);
    }
    Ok(())
}
