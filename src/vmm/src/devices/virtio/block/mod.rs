//! virtio-blk backed by a raw file.
//!
//! The device thread pops each request, keeps it on the *pending list*
//! (`request`) and issues its I/O to the disk's backend (`io`: run inside
//! the pass, or with `--disk-io async` after it, with the device unlocked,
//! so a pause does not wait for it); it places the used entry when the I/O
//! is done, in a pass.
//! Requests are issued and completed in the order they were popped, and at
//! most one write is in flight at a time (see `issue_ready`).
//!
//! The pending list is part of the device's saved state: a VM restored
//! from it (a snapshot, a backup's checkpoint) issues those requests again,
//! in order, before its guest runs. A write that reached the disk before
//! the state was saved is then written once more with the same data; the
//! pending requests are the newest ones in that order, so the disk ends up
//! as if each had been written once (docs/replication.md, "Disk requests in
//! flight").

mod io;
mod request;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk as blk;
use virtio_queue::{Queue, QueueT};

pub use io::DiskIo;
pub use request::{PendingRequest, Segment};

use super::{drain, read_config_bytes, DeferredIo, Pass, VirtioDevice, VirtioError};
use crate::devices::{DeviceError, DeviceKind, ModelState};
use crate::hooks::{DiskWriteObserver, Hooks};
use crate::memory::GuestMemory;
use crate::persist::Persist;
use io::{Backend, DiskFile, Done, Op};

const VIRTIO_BLK_F_FLUSH: u64 = 1 << blk::VIRTIO_BLK_F_FLUSH;
const SECTOR: u64 = 512;
const REQ_IN: u32 = blk::VIRTIO_BLK_T_IN;
const REQ_OUT: u32 = blk::VIRTIO_BLK_T_OUT;
const REQ_FLUSH: u32 = blk::VIRTIO_BLK_T_FLUSH;
const REQ_GET_ID: u32 = blk::VIRTIO_BLK_T_GET_ID;
const STATUS_OK: u8 = blk::VIRTIO_BLK_S_OK as u8;
const STATUS_IOERR: u8 = blk::VIRTIO_BLK_S_IOERR as u8;
const STATUS_UNSUPP: u8 = blk::VIRTIO_BLK_S_UNSUPP as u8;
const ID_LEN: usize = blk::VIRTIO_BLK_ID_BYTES as usize;
/// Largest single request we bounce through memory (and so the most one
/// request adds to what a disk-write observer records).
pub const MAX_REQUEST: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("cannot open disk {path}: {err}")]
    Open { path: String, err: std::io::Error },
    #[error("disk {path} is {len} bytes, not a whole number of 512-byte sectors")]
    Size { path: String, len: u64 },
}

/// The disk's own saved state: its size, which the guest already knows,
/// and the requests in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub sectors: u64,
    /// Popped and not completed, in the order they were popped.
    pub pending: Vec<PendingRequest>,
}

/// A request on the pending list.
struct InFlight {
    /// Matches its result (`Done::seq`); results of requests forgotten by a
    /// reset or a restore have older numbers and are dropped.
    seq: u64,
    req: PendingRequest,
    /// Handed to the backend.
    issued: bool,
}

pub struct Block {
    backend: Backend,
    path: PathBuf,
    sectors: u64,
    id: [u8; ID_LEN],
    hooks: Arc<Hooks>,
    pending: VecDeque<InFlight>,
    next_seq: u64,
}

impl Block {
    pub fn open(path: &Path, io: DiskIo, hooks: Arc<Hooks>) -> Result<Block, BlockError> {
        let name = path.display().to_string();
        let file = Block::open_file(path)?;
        let len = file.metadata().map_err(|err| BlockError::Open { path: name.clone(), err })?.len();
        if len % SECTOR != 0 {
            return Err(BlockError::Size { path: name, len });
        }
        let mut id = [0u8; ID_LEN];
        let label = format!("ftvm-{:x}", crc32c::crc32c(name.as_bytes()));
        id[..label.len().min(ID_LEN)].copy_from_slice(&label.as_bytes()[..label.len().min(ID_LEN)]);
        let disk = DiskFile { file, path: path.to_owned(), hooks: hooks.clone() };
        let backend = Backend::new(disk, io);
        Ok(Block { backend, path: path.to_owned(), sectors: len / SECTOR, id, hooks, pending: VecDeque::new(), next_seq: 0 })
    }

    fn open_file(path: &Path) -> Result<File, BlockError> {
        OpenOptions::new().read(true).write(true).open(path).map_err(|err| BlockError::Open { path: path.display().to_string(), err })
    }

    /// Whether `path` can serve as a disk (its size aside: a backup's
    /// replica takes the primary's).
    pub fn check_file(path: &Path) -> Result<(), BlockError> {
        Block::open_file(path).map(drop)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn io(&self) -> DiskIo {
        self.backend.io()
    }

    fn in_range(&self, sector: u64, len: usize) -> bool {
        (len as u64).is_multiple_of(SECTOR)
            && len <= MAX_REQUEST
            && sector.checked_add(len as u64 / SECTOR).is_some_and(|end| end <= self.sectors)
    }

    /// What the backend does for `req`; a write's data is copied out of
    /// guest memory now.
    fn op_for(&self, req: &PendingRequest, mem: &GuestMemory) -> Op {
        let fail = |status| Op::Reply { status, data: Vec::new() };
        let len = req.data_len();
        match req.kind {
            REQ_IN | REQ_OUT if !self.in_range(req.sector, len) => fail(STATUS_IOERR),
            REQ_IN => Op::Read { offset: req.sector * SECTOR, len },
            REQ_OUT => match req.gather(mem) {
                Ok(data) => Op::Write { offset: req.sector * SECTOR, data },
                Err(_) => fail(STATUS_IOERR),
            },
            REQ_FLUSH => Op::Flush,
            REQ_GET_ID => Op::Reply { status: STATUS_OK, data: self.id[..len.min(ID_LEN)].to_vec() },
            _ => fail(STATUS_UNSUPP),
        }
    }

    /// Issue the popped requests not issued yet, in order, as far as
    /// allowed: a write waits while another write is in flight, and while
    /// the write observer asks to wait. So each write is admitted while the
    /// observer's journal is below its bound with no other write on its
    /// way there, and the journal's bound holds as with synchronous I/O.
    /// Returns false if a request must wait (its turn comes with a result,
    /// after which the device thread takes another pass, or with the
    /// observer's wake-up).
    fn issue_ready(&mut self, mem: &GuestMemory, observer: Option<&dyn DiskWriteObserver>) -> bool {
        let mut write_in_flight = self.pending.iter().any(|r| r.issued && r.req.kind == REQ_OUT);
        for i in 0..self.pending.len() {
            if self.pending[i].issued {
                continue;
            }
            if self.pending[i].req.kind == REQ_OUT {
                if write_in_flight || observer.is_some_and(|o| !o.accepting()) {
                    return false;
                }
                write_in_flight = true;
            }
            let op = self.op_for(&self.pending[i].req, mem);
            self.pending[i].issued = true;
            self.backend.submit(self.pending[i].seq, op);
        }
        true
    }

    /// Place the used entry of every request whose I/O is done, in order.
    fn complete_done(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<bool, VirtioError> {
        let mut used = false;
        while let Some(Done { seq, status, data }) = self.backend.next_done() {
            if self.pending.front().is_none_or(|r| r.seq != seq) {
                continue; // a request forgotten by a reset or a restore
            }
            let req = self.pending.pop_front().expect("checked above").req;
            let written = if status == STATUS_OK { req.scatter(mem, &data)? } else { 0 };
            req.set_status(mem, status)?;
            queue.add_used(mem, req.head, written as u32 + 1).map_err(|err| VirtioError::Queue { queue: 0, err })?;
            used = true;
        }
        Ok(used)
    }

    /// Complete what is done, issue what may go, then pop more requests
    /// while the write observer accepts them and nothing popped waits.
    fn serve(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<Pass, VirtioError> {
        let observer = self.hooks.disk_writes();
        let mut pass = Pass::default();
        loop {
            pass.used |= self.complete_done(queue, mem)?;
            if !self.issue_ready(mem, observer.as_deref()) || observer.as_ref().is_some_and(|o| !o.accepting()) {
                pass.deferred = true;
                return Ok(pass);
            }
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                // With synchronous I/O everything issued is done already.
                pass.used |= self.complete_done(queue, mem)?;
                return Ok(pass);
            };
            let req = PendingRequest::parse(chain, mem)?;
            let seq = self.next_seq;
            self.next_seq += 1;
            self.pending.push_back(InFlight { seq, req, issued: false });
        }
    }
}

impl VirtioDevice for Block {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Block
    }

    fn queue_count(&self) -> usize {
        1
    }

    fn features(&self) -> u64 {
        VIRTIO_BLK_F_FLUSH
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // capacity (u64, sectors) is the only field we offer.
        read_config_bytes(&self.sectors.to_le_bytes(), offset, data);
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, VirtioError> {
        if index != 0 {
            return Ok(false);
        }
        drain(&mut queues[0], mem, 0, |q| self.serve(q, mem))
    }

    fn deferred_io(&self) -> Option<Arc<dyn DeferredIo>> {
        self.backend.deferred()
    }

    /// The requests in flight are forgotten (their I/O may still finish:
    /// the guest was told nothing of it).
    fn reset(&mut self) {
        self.pending.clear();
    }

    fn issue_restored(&mut self, mem: &GuestMemory) {
        if self.pending.iter().any(|r| !r.issued) {
            tracing::info!(disk = %self.path.display(), requests = self.pending.len(), "issuing again the disk requests in flight when the state was saved");
            let observer = self.hooks.disk_writes();
            self.issue_ready(mem, observer.as_deref());
        }
    }
}

impl Persist for Block {
    type State = ModelState;
    type Error = DeviceError;

    fn save(&self) -> Result<ModelState, DeviceError> {
        let pending = self.pending.iter().map(|r| r.req.clone()).collect();
        Ok(ModelState::Block(BlockState { sectors: self.sectors, pending }))
    }

    /// A disk of another size would contradict what the guest read from
    /// it. The saved pending list replaces this device's; its requests are
    /// issued by `issue_restored` (the guest memory they name is restored
    /// by then).
    fn restore(&mut self, state: &ModelState) -> Result<(), DeviceError> {
        let bad = |reason| DeviceError::Restore { kind: DeviceKind::Block, reason };
        let saved = match state {
            ModelState::Block(s) if s.sectors == self.sectors => s,
            ModelState::Block(s) => {
                return Err(bad(format!(
                    "the saved VM's disk has {} bytes, {} has {}",
                    s.sectors * SECTOR,
                    self.path.display(),
                    self.sectors * SECTOR
                )))
            }
            other => return Err(bad(format!("saved state is not a disk's: {other:?}"))),
        };
        // This device's own requests (if it ran) are forgotten.
        self.backend.forget();
        self.pending.clear();
        for req in &saved.pending {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.pending.push_back(InFlight { seq, req: req.clone(), issued: false });
        }
        Ok(())
    }
}
