//! virtio-blk backed by a raw file.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk as blk;
use virtio_queue::{Queue, QueueT};

use super::{drain, read_config_bytes, Pass, VirtioDevice, VirtioError};
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
        let file = Block::open_file(path)?;
        let len = file.metadata().map_err(|err| BlockError::Open { path: name.clone(), err })?.len();
        if len % SECTOR != 0 {
            return Err(BlockError::Size { path: name, len });
        }
        let mut id = [0u8; ID_LEN];
        let label = format!("ftvm-{:x}", crc32c::crc32c(name.as_bytes()));
        id[..label.len().min(ID_LEN)].copy_from_slice(&label.as_bytes()[..label.len().min(ID_LEN)]);
        Ok(Block { file, path: path.to_owned(), sectors: len / SECTOR, id, buf: Vec::new(), hooks })
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

    /// Serve requests until the queue is empty or the write observer asks
    /// to wait (it bounds what it records between two of its wake-ups).
    fn serve(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<Pass, VirtioError> {
        let observer = self.hooks.disk_writes();
        let mut pass = Pass::default();
        loop {
            if observer.as_ref().is_some_and(|o| !o.accepting()) {
                pass.deferred = true;
                return Ok(pass);
            }
            let Some(chain) = queue.pop_descriptor_chain(mem) else { return Ok(pass) };
            let head = chain.head_index();
            let len = self.request(chain, mem)?;
            queue.add_used(mem, head, len).map_err(|err| VirtioError::Queue { queue: 0, err })?;
            pass.used = true;
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    use super::*;
    use crate::devices::virtio::mmio::MmioTransport;
    use crate::devices::virtio::test_util::{
        block_header, guest_ram, offer_block_request, pattern, Buf, Driver, Offered, TempDisk, NO_STATUS,
    };
    use crate::hooks::DiskWriteObserver;
    use crate::memory::GuestRam;
    use crate::sync::Lock;

    const DISK_SECTORS: u64 = 8;
    const DISK_BYTES: usize = DISK_SECTORS as usize * SECTOR as usize;

    fn original_contents() -> Vec<u8> {
        pattern(DISK_BYTES, 1)
    }

    /// The disk image with `data` written at `sector`.
    fn contents_after_write(sector: u64, data: &[u8]) -> Vec<u8> {
        let mut contents = original_contents();
        let at = (sector * SECTOR) as usize;
        contents[at..at + data.len()].copy_from_slice(data);
        contents
    }

    /// What the disk-write hook is told, in order; `wait` makes it refuse
    /// more requests.
    #[derive(Default)]
    struct WriteLog(Mutex<Vec<(u64, Vec<u8>)>>, AtomicBool);

    impl DiskWriteObserver for WriteLog {
        fn written(&self, offset: u64, data: &[u8]) {
            self.0.locked().push((offset, data.to_vec()));
        }

        fn accepting(&self) -> bool {
            !self.1.load(Ordering::SeqCst)
        }
    }

    /// A running virtio-blk device on a patterned disk image, with the
    /// driver side of its queue and a log of the disk-write hook.
    struct Rig<'m> {
        disk: TempDisk,
        transport: MmioTransport,
        driver: Driver<'m>,
        mem: &'m GuestMemory,
        writes: Arc<WriteLog>,
    }

    impl<'m> Rig<'m> {
        fn new(ram: &'m GuestRam) -> Rig<'m> {
            let disk = TempDisk::with_contents(&original_contents());
            let hooks = Arc::new(Hooks::default());
            let writes = Arc::new(WriteLog::default());
            hooks.set_disk_writes(Some(writes.clone()));
            let mut transport = disk.transport(hooks);
            let driver = Driver::new(ram.memory());
            driver.start(&mut transport);
            Rig { disk, transport, driver, mem: ram.memory(), writes }
        }

        fn offer(&mut self, kind: u32, sector: u64, data: &[Buf]) -> Offered {
            offer_block_request(&mut self.driver, kind, sector, data)
        }

        /// The driver's kick: the device serves everything offered.
        fn kick(&mut self) -> Result<bool, VirtioError> {
            self.transport.process_queue(0, self.mem)
        }

        /// Offer one request, kick, and return its status byte.
        fn serve(&mut self, kind: u32, sector: u64, data: &[Buf]) -> u8 {
            let request = self.offer(kind, sector, data);
            assert!(self.kick().expect("request served"), "the request was used");
            self.status(request)
        }

        fn status(&self, request: Offered) -> u8 {
            let [status] = self.driver.bytes(request.status)[..] else { unreachable!("one status byte") };
            status
        }

        fn written_to_hook(&self) -> Vec<(u64, Vec<u8>)> {
            self.writes.0.locked().clone()
        }
    }

    #[test]
    fn a_write_lands_in_the_disk_image() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let data = pattern(2 * SECTOR as usize, 50);
        let buf = rig.driver.readable(&data);
        assert_eq!(rig.serve(REQ_OUT, 2, &[buf]), STATUS_OK);
        assert_eq!(rig.disk.contents(), contents_after_write(2, &data));
        // Only the status byte was written into guest buffers.
        assert_eq!(rig.driver.used(), [(0, 1)]);
    }

    #[test]
    fn requests_wait_in_the_queue_while_the_write_hook_asks_to() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        rig.writes.1.store(true, Ordering::SeqCst);
        let data = pattern(SECTOR as usize, 60);
        let buf = rig.driver.readable(&data);
        let request = rig.offer(REQ_OUT, 1, &[buf]);
        assert!(!rig.kick().unwrap(), "nothing is served while the hook says wait");
        assert_eq!(rig.status(request), NO_STATUS);
        assert_eq!(rig.disk.contents(), original_contents());
        assert!(rig.written_to_hook().is_empty());
        // The hook has room again and wakes the device: the request was kept.
        rig.writes.1.store(false, Ordering::SeqCst);
        assert!(rig.kick().unwrap());
        assert_eq!(rig.status(request), STATUS_OK);
        assert_eq!(rig.disk.contents(), contents_after_write(1, &data));
        assert_eq!(rig.written_to_hook(), [(SECTOR, data)]);
    }

    #[test]
    fn a_read_returns_the_disk_bytes() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let buf = rig.driver.writable(2 * SECTOR as u32, 0xaa);
        assert_eq!(rig.serve(REQ_IN, 3, &[buf]), STATUS_OK);
        assert_eq!(rig.driver.bytes(buf), original_contents()[3 * 512..5 * 512]);
        assert_eq!(rig.driver.used(), [(0, 2 * SECTOR as u32 + 1)]);
    }

    #[test]
    fn a_read_over_several_buffers_fills_them_in_order() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let first = rig.driver.writable(SECTOR as u32, 0xaa);
        let second = rig.driver.writable(SECTOR as u32, 0xaa);
        assert_eq!(rig.serve(REQ_IN, 6, &[first, second]), STATUS_OK);
        assert_eq!(rig.driver.bytes(first), original_contents()[6 * 512..7 * 512]);
        assert_eq!(rig.driver.bytes(second), original_contents()[7 * 512..8 * 512]);
    }

    #[test]
    fn requests_outside_the_disk_fail_and_change_nothing() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let two_sectors = rig.driver.readable(&pattern(2 * SECTOR as usize, 50));
        let half_sector = rig.driver.readable(&pattern(SECTOR as usize / 2, 50));
        let read_into = rig.driver.writable(SECTOR as u32, 0xaa);
        // The last sector plus one past the end.
        assert_eq!(rig.serve(REQ_OUT, DISK_SECTORS - 1, &[two_sectors]), STATUS_IOERR);
        // A sector number that wraps around when the length is added.
        assert_eq!(rig.serve(REQ_OUT, u64::MAX, &[two_sectors]), STATUS_IOERR);
        // Not a whole number of sectors.
        assert_eq!(rig.serve(REQ_OUT, 0, &[half_sector]), STATUS_IOERR);
        assert_eq!(rig.serve(REQ_IN, DISK_SECTORS, &[read_into]), STATUS_IOERR);

        assert_eq!(rig.disk.contents(), original_contents());
        assert!(rig.written_to_hook().is_empty());
        assert_eq!(rig.driver.bytes(read_into), vec![0xaa; SECTOR as usize]);
        // Each failure wrote its status byte and nothing else.
        assert!(rig.driver.used().iter().all(|&(_, len)| len == 1), "{:?}", rig.driver.used());
    }

    #[test]
    fn get_id_returns_the_disk_id() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let buf = rig.driver.writable(ID_LEN as u32, 0xaa);
        assert_eq!(rig.serve(REQ_GET_ID, 0, &[buf]), STATUS_OK);
        // The id is derived from the image's path, zero-padded.
        let mut expected = format!("ftvm-{:x}", crc32c::crc32c(rig.disk.path().display().to_string().as_bytes())).into_bytes();
        expected.resize(ID_LEN, 0);
        assert_eq!(rig.driver.bytes(buf), expected);
        assert_eq!(rig.driver.used(), [(0, ID_LEN as u32 + 1)]);
    }

    #[test]
    fn flush_succeeds() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        assert_eq!(rig.serve(REQ_FLUSH, 0, &[]), STATUS_OK);
        assert_eq!(rig.driver.used(), [(0, 1)]);
    }

    #[test]
    fn an_unknown_request_type_is_unsupported() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        // Discard is a real request type, but not one this device offers.
        let data = rig.driver.readable(&pattern(SECTOR as usize, 50));
        assert_eq!(rig.serve(blk::VIRTIO_BLK_T_DISCARD, 0, &[data]), STATUS_UNSUPP);
        assert_eq!(rig.disk.contents(), original_contents());
        assert_eq!(rig.driver.used(), [(0, 1)]);
    }

    #[test]
    fn a_chain_without_room_for_the_status_is_an_error() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let header = rig.driver.readable(&block_header(REQ_OUT, 0));
        let data = rig.driver.readable(&pattern(SECTOR as usize, 50));
        rig.driver.offer(&[header, data]);
        assert!(matches!(rig.kick(), Err(VirtioError::Chain(_))));
        assert_eq!(rig.disk.contents(), original_contents());
        assert!(rig.written_to_hook().is_empty());
        assert!(rig.driver.used().is_empty());
    }

    #[test]
    fn the_write_hook_sees_each_write_with_its_offset_and_data() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let (one, two) = (pattern(SECTOR as usize, 50), pattern(2 * SECTOR as usize, 60));
        let (one_buf, two_buf) = (rig.driver.readable(&one), rig.driver.readable(&two));
        let read_into = rig.driver.writable(SECTOR as u32, 0);
        assert_eq!(rig.serve(REQ_OUT, 1, &[one_buf]), STATUS_OK);
        assert_eq!(rig.serve(REQ_IN, 0, &[read_into]), STATUS_OK);
        assert_eq!(rig.serve(REQ_OUT, 5, &[two_buf]), STATUS_OK);
        // Reads are not reported.
        assert_eq!(rig.written_to_hook(), [(SECTOR, one), (5 * SECTOR, two)]);
    }

    #[test]
    fn the_used_ring_gets_one_entry_per_request() {
        let ram = guest_ram();
        let mut rig = Rig::new(&ram);
        let data = rig.driver.readable(&pattern(SECTOR as usize, 50));
        let read_into = rig.driver.writable(2 * SECTOR as u32, 0);
        let id_into = rig.driver.writable(ID_LEN as u32, 0);
        // All offered before one kick, as a driver batching requests does.
        let requests = [
            rig.offer(REQ_OUT, 0, &[data]),
            rig.offer(REQ_IN, 2, &[read_into]),
            rig.offer(REQ_GET_ID, 0, &[id_into]),
            rig.offer(REQ_FLUSH, 0, &[]),
        ];
        assert!(rig.kick().expect("requests served"));
        let heads: Vec<u32> = requests.iter().map(|r| u32::from(r.head)).collect();
        let expected = [(heads[0], 1), (heads[1], 2 * SECTOR as u32 + 1), (heads[2], ID_LEN as u32 + 1), (heads[3], 1)];
        assert_eq!(rig.driver.used(), expected);
        assert!(requests.iter().all(|&r| rig.status(r) == STATUS_OK));
        // Nothing new: the kick reports no used buffers.
        assert!(!rig.kick().expect("empty queue"));
    }

    #[test]
    fn status_bytes_start_out_unwritten() {
        // Guards the tests above: a status they read was written by the device.
        assert!(![STATUS_OK, STATUS_IOERR, STATUS_UNSUPP].contains(&NO_STATUS));
    }

    #[test]
    fn open_rejects_a_disk_that_is_not_whole_sectors() {
        let disk = TempDisk::with_contents(&[0; 1000]);
        let err = Block::open(disk.path(), Arc::default()).err().expect("1000 bytes is not whole sectors");
        assert!(matches!(&err, BlockError::Size { path, len: 1000 } if *path == disk.path().display().to_string()), "{err}");
    }

    #[test]
    fn open_of_a_missing_disk_fails() {
        let path = TempDisk::with_contents(&[]).path().to_owned(); // removed again on drop
        assert!(matches!(Block::open(&path, Arc::default()), Err(BlockError::Open { .. })));
    }

    #[test]
    fn save_gives_the_sector_count() {
        let disk = TempDisk::with_contents(&original_contents());
        let block = Block::open(disk.path(), Arc::default()).expect("open");
        assert_eq!(block.save().expect("save"), ModelState::Block(BlockState { sectors: DISK_SECTORS }));
    }

    #[test]
    fn restore_needs_a_disk_of_the_saved_size() {
        let disk = TempDisk::with_contents(&original_contents());
        let bigger = TempDisk::with_contents(&pattern(2 * DISK_BYTES, 1));
        let saved = Block::open(disk.path(), Arc::default()).expect("open").save().expect("save");

        Block::open(disk.path(), Arc::default()).expect("open").restore(&saved).expect("same size restores");
        let err = Block::open(bigger.path(), Arc::default()).expect("open").restore(&saved).expect_err("another size");
        let DeviceError::Restore { kind: DeviceKind::Block, reason } = &err else { panic!("not a disk restore error: {err}") };
        for named in [DISK_BYTES.to_string(), (2 * DISK_BYTES).to_string(), bigger.path().display().to_string()] {
            assert!(reason.contains(&named), "{reason:?} does not name {named}");
        }
    }

    #[test]
    fn restore_rejects_a_network_cards_state() {
        let disk = TempDisk::with_contents(&original_contents());
        let net = ModelState::Net(crate::devices::virtio::net::NetState { mac: [0x52, 0x54, 0, 0, 0, 1] });
        let err = Block::open(disk.path(), Arc::default()).expect("open").restore(&net).expect_err("not a disk's state");
        assert!(matches!(err, DeviceError::Restore { kind: DeviceKind::Block, .. }), "{err}");
    }
}
