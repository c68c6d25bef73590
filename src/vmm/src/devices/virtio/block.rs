//! virtio-blk backed by a raw file.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk as blk;
use virtio_queue::{Queue, QueueT};

use super::{drain, read_config_bytes, VirtioDevice, VirtioError};
use crate::devices::{DeviceError, DeviceKind, ModelState};
use crate::hooks::Hooks;
use crate::memory::GuestMemory;
use crate::persist::Persist;

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
/// Largest single request we bounce through memory.
const MAX_REQUEST: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("cannot open disk {path}: {err}")]
    Open { path: String, err: std::io::Error },
    #[error("disk {path} is {len} bytes, not a whole number of 512-byte sectors")]
    Size { path: String, len: u64 },
}

/// The disk's own saved state: its size, which the guest already knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub sectors: u64,
}

pub struct Block {
    file: File,
    path: PathBuf,
    sectors: u64,
    id: [u8; ID_LEN],
    buf: Vec<u8>,
    hooks: Arc<Hooks>,
}

impl Block {
    pub fn open(path: &Path, hooks: Arc<Hooks>) -> Result<Block, BlockError> {
        let name = path.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|err| BlockError::Open { path: name.clone(), err })?;
        let len = file.metadata().map_err(|err| BlockError::Open { path: name.clone(), err })?.len();
        if len % SECTOR != 0 {
            return Err(BlockError::Size { path: name, len });
        }
        let mut id = [0u8; ID_LEN];
        let label = format!("ftvm-{:x}", crc32c::crc32c(name.as_bytes()));
        id[..label.len().min(ID_LEN)].copy_from_slice(&label.as_bytes()[..label.len().min(ID_LEN)]);
        Ok(Block { file, path: path.to_owned(), sectors: len / SECTOR, id, buf: Vec::new(), hooks })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serve one request; returns the bytes written into guest buffers.
    fn request(&mut self, chain: virtio_queue::DescriptorChain<&GuestMemory>, mem: &GuestMemory) -> Result<u32, VirtioError> {
        let chain_err = |e: virtio_queue::Error| VirtioError::Chain(e.to_string());
        let mut reader = chain.clone().reader(mem).map_err(chain_err)?;
        let mut writer = chain.writer(mem).map_err(chain_err)?;
        let mut header = [0u8; 16];
        reader.read_exact(&mut header)?;
        let kind = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        let room = writer.available_bytes();
        if room == 0 {
            return Err(VirtioError::Chain("block request without a status byte".into()));
        }
        let mut status_writer = writer.split_at(room - 1).map_err(chain_err)?;
        let status = match kind {
            REQ_IN => self.read(sector, writer.available_bytes(), &mut writer),
            REQ_OUT => self.write(sector, reader.available_bytes(), &mut reader),
            REQ_FLUSH => match self.file.sync_data() {
                Ok(()) => STATUS_OK,
                Err(_) => STATUS_IOERR,
            },
            REQ_GET_ID => {
                let n = writer.available_bytes().min(ID_LEN);
                writer.write_all(&self.id[..n])?;
                STATUS_OK
            }
            _ => STATUS_UNSUPP,
        };
        status_writer.write_all(&[status])?;
        Ok((writer.bytes_written() + status_writer.bytes_written()) as u32)
    }

    fn in_range(&self, sector: u64, len: usize) -> bool {
        (len as u64).is_multiple_of(SECTOR)
            && len <= MAX_REQUEST
            && sector.checked_add(len as u64 / SECTOR).is_some_and(|end| end <= self.sectors)
    }

    fn read(&mut self, sector: u64, len: usize, writer: &mut impl Write) -> u8 {
        if !self.in_range(sector, len) {
            return STATUS_IOERR;
        }
        self.buf.resize(len, 0);
        if self.file.read_exact_at(&mut self.buf, sector * SECTOR).is_err() || writer.write_all(&self.buf).is_err() {
            return STATUS_IOERR;
        }
        STATUS_OK
    }

    fn write(&mut self, sector: u64, len: usize, reader: &mut impl Read) -> u8 {
        if !self.in_range(sector, len) {
            return STATUS_IOERR;
        }
        self.buf.resize(len, 0);
        if reader.read_exact(&mut self.buf).is_err() {
            return STATUS_IOERR;
        }
        match self.file.write_all_at(&self.buf, sector * SECTOR) {
            Ok(()) => {
                if let Some(observer) = self.hooks.disk_writes() {
                    observer.written(sector * SECTOR, &self.buf);
                }
                STATUS_OK
            }
            // ENOSPC on a full host disk lands here: the guest sees IOERR
            // for this write and everything written before stays intact.
            Err(e) => {
                tracing::warn!(disk = %self.path.display(), sector, error = %e, "disk write failed");
                STATUS_IOERR
            }
        }
    }

    fn serve(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<bool, VirtioError> {
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let len = self.request(chain, mem)?;
            queue.add_used(mem, head, len).map_err(|err| VirtioError::Queue { queue: 0, err })?;
            used = true;
        }
        Ok(used)
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
}

impl Persist for Block {
    type State = ModelState;
    type Error = DeviceError;

    fn save(&self) -> Result<ModelState, DeviceError> {
        Ok(ModelState::Block(BlockState { sectors: self.sectors }))
    }

    /// A disk of another size would contradict what the guest read from it.
    fn restore(&mut self, state: &ModelState) -> Result<(), DeviceError> {
        let bad = |reason| DeviceError::Restore { kind: DeviceKind::Block, reason };
        match state {
            ModelState::Block(s) if s.sectors == self.sectors => Ok(()),
            ModelState::Block(s) => Err(bad(format!(
                "the saved VM's disk has {} bytes, {} has {}",
                s.sectors * SECTOR,
                self.path.display(),
                self.sectors * SECTOR
            ))),
            other => Err(bad(format!("saved state is not a disk's: {other:?}"))),
        }
    }
}
