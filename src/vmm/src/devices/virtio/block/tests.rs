use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::*;
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::test_util::{block_header, guest_ram, offer_block_request, pattern, Buf, Driver, Offered, TempDisk, NO_STATUS};
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

/// Both ways of running the disk's I/O.
const MODES: [DiskIo; 2] = [DiskIo::Sync, DiskIo::Async];

/// Runs `test` on a fresh rig in each of `MODES`.
fn in_every_mode(test: impl Fn(&mut Rig, DiskIo)) {
    for io in MODES {
        let ram = guest_ram();
        test(&mut Rig::with(&ram, io), io);
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

/// A device on `disk` with I/O run as `io`, and a fresh hook log.
fn device(disk: &TempDisk, io: DiskIo) -> (MmioTransport, Arc<WriteLog>) {
    let hooks = Arc::new(Hooks::default());
    let writes = Arc::new(WriteLog::default());
    hooks.set_disk_writes(Some(writes.clone()));
    (disk.transport_with(io, hooks), writes)
}

impl<'m> Rig<'m> {
    fn new(ram: &'m GuestRam) -> Rig<'m> {
        Rig::with(ram, DiskIo::Sync)
    }

    fn with(ram: &'m GuestRam, io: DiskIo) -> Rig<'m> {
        let disk = TempDisk::with_contents(&original_contents());
        let (mut transport, writes) = device(&disk, io);
        let driver = Driver::new(ram.memory());
        driver.start(&mut transport);
        Rig { disk, transport, driver, mem: ram.memory(), writes }
    }

    /// Kick, then, as the device thread does, run the I/O left for after
    /// the pass and serve again, until no request is in flight.
    fn settle(&mut self) {
        settle(&mut self.transport, self.mem);
    }

    /// What the device thread does after a pass (`--disk-io async`).
    fn run_io(&self) -> bool {
        run_io(&self.transport)
    }

    fn pending(&self) -> Vec<PendingRequest> {
        pending(&self.transport)
    }

    fn offer(&mut self, kind: u32, sector: u64, data: &[Buf]) -> Offered {
        offer_block_request(&mut self.driver, kind, sector, data)
    }

    /// One sector of `pattern(.., seed)` offered as a write to `sector`:
    /// the bytes and the request.
    fn offer_write(&mut self, sector: u64, seed: u8) -> (Vec<u8>, Offered) {
        let data = pattern(SECTOR as usize, seed);
        let buf = self.driver.readable(&data);
        let request = self.offer(REQ_OUT, sector, &[buf]);
        (data, request)
    }

    /// The driver's kick: the device serves everything offered.
    fn kick(&mut self) -> Result<bool, VirtioError> {
        self.transport.process_queue(0, self.mem)
    }

    /// Offer one request, kick, wait for it, and return its status byte.
    fn serve(&mut self, kind: u32, sector: u64, data: &[Buf]) -> u8 {
        let used = self.driver.used().len();
        let request = self.offer(kind, sector, data);
        self.settle();
        assert_eq!(self.driver.used().len(), used + 1, "the request was used");
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
    in_every_mode(|rig, _| {
        let data = pattern(2 * SECTOR as usize, 50);
        let buf = rig.driver.readable(&data);
        assert_eq!(rig.serve(REQ_OUT, 2, &[buf]), STATUS_OK);
        assert_eq!(rig.disk.contents(), contents_after_write(2, &data));
        // Only the status byte was written into guest buffers.
        assert_eq!(rig.driver.used(), [(0, 1)]);
    });
}

#[test]
fn requests_wait_in_the_queue_while_the_write_hook_asks_to() {
    let ram = guest_ram();
    let mut rig = Rig::new(&ram);
    rig.writes.1.store(true, Ordering::SeqCst);
    let (data, request) = rig.offer_write(1, 60);
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
    in_every_mode(|rig, _| {
        let buf = rig.driver.writable(2 * SECTOR as u32, 0xaa);
        assert_eq!(rig.serve(REQ_IN, 3, &[buf]), STATUS_OK);
        assert_eq!(rig.driver.bytes(buf), original_contents()[3 * 512..5 * 512]);
        assert_eq!(rig.driver.used(), [(0, 2 * SECTOR as u32 + 1)]);
    });
}

#[test]
fn a_read_over_several_buffers_fills_them_in_order() {
    in_every_mode(|rig, _| {
        let first = rig.driver.writable(SECTOR as u32, 0xaa);
        let second = rig.driver.writable(SECTOR as u32, 0xaa);
        assert_eq!(rig.serve(REQ_IN, 6, &[first, second]), STATUS_OK);
        assert_eq!(rig.driver.bytes(first), original_contents()[6 * 512..7 * 512]);
        assert_eq!(rig.driver.bytes(second), original_contents()[7 * 512..8 * 512]);
    });
}

#[test]
fn requests_outside_the_disk_fail_and_change_nothing() {
    in_every_mode(|rig, _| {
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
    });
}

#[test]
fn get_id_returns_the_disk_id() {
    in_every_mode(|rig, _| {
        let buf = rig.driver.writable(ID_LEN as u32, 0xaa);
        assert_eq!(rig.serve(REQ_GET_ID, 0, &[buf]), STATUS_OK);
        // The id is derived from the image's path, zero-padded.
        let mut expected = format!("ftvm-{:x}", crc32c::crc32c(rig.disk.path().display().to_string().as_bytes())).into_bytes();
        expected.resize(ID_LEN, 0);
        assert_eq!(rig.driver.bytes(buf), expected);
        assert_eq!(rig.driver.used(), [(0, ID_LEN as u32 + 1)]);
    });
}

#[test]
fn flush_succeeds() {
    in_every_mode(|rig, _| {
        assert_eq!(rig.serve(REQ_FLUSH, 0, &[]), STATUS_OK);
        assert_eq!(rig.driver.used(), [(0, 1)]);
    });
}

#[test]
fn an_unknown_request_type_is_unsupported() {
    in_every_mode(|rig, _| {
        // Discard is a real request type, but not one this device offers.
        let data = rig.driver.readable(&pattern(SECTOR as usize, 50));
        assert_eq!(rig.serve(blk::VIRTIO_BLK_T_DISCARD, 0, &[data]), STATUS_UNSUPP);
        assert_eq!(rig.disk.contents(), original_contents());
        assert_eq!(rig.driver.used(), [(0, 1)]);
    });
}

#[test]
fn a_chain_without_room_for_the_status_is_an_error() {
    in_every_mode(|rig, _| {
        let header = rig.driver.readable(&block_header(REQ_OUT, 0));
        let data = rig.driver.readable(&pattern(SECTOR as usize, 50));
        rig.driver.offer(&[header, data]);
        assert!(matches!(rig.kick(), Err(VirtioError::Chain(_))));
        assert_eq!(rig.disk.contents(), original_contents());
        assert!(rig.written_to_hook().is_empty());
        assert!(rig.driver.used().is_empty());
    });
}

#[test]
fn the_write_hook_sees_each_write_with_its_offset_and_data() {
    in_every_mode(|rig, _| {
        let (one, two) = (pattern(SECTOR as usize, 50), pattern(2 * SECTOR as usize, 60));
        let (one_buf, two_buf) = (rig.driver.readable(&one), rig.driver.readable(&two));
        let read_into = rig.driver.writable(SECTOR as u32, 0);
        assert_eq!(rig.serve(REQ_OUT, 1, &[one_buf]), STATUS_OK);
        assert_eq!(rig.serve(REQ_IN, 0, &[read_into]), STATUS_OK);
        assert_eq!(rig.serve(REQ_OUT, 5, &[two_buf]), STATUS_OK);
        // Reads are not reported.
        assert_eq!(rig.written_to_hook(), [(SECTOR, one), (5 * SECTOR, two)]);
    });
}

#[test]
fn the_used_ring_gets_one_entry_per_request() {
    in_every_mode(|rig, io| {
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
        let used = rig.kick().expect("requests served");
        // Synchronous I/O completes them all in the kick's pass.
        assert_eq!(used, io == DiskIo::Sync);
        rig.settle();
        let heads: Vec<u32> = requests.iter().map(|r| u32::from(r.head)).collect();
        let expected = [(heads[0], 1), (heads[1], 2 * SECTOR as u32 + 1), (heads[2], ID_LEN as u32 + 1), (heads[3], 1)];
        assert_eq!(rig.driver.used(), expected, "{io}");
        assert!(requests.iter().all(|&r| rig.status(r) == STATUS_OK));
        // Nothing new: the kick reports no used buffers.
        assert!(!rig.kick().expect("empty queue"));
    });
}

#[test]
fn status_bytes_start_out_unwritten() {
    // Guards the tests above: a status they read was written by the device.
    assert!(![STATUS_OK, STATUS_IOERR, STATUS_UNSUPP].contains(&NO_STATUS));
}

#[test]
fn open_rejects_a_disk_that_is_not_whole_sectors() {
    let disk = TempDisk::with_contents(&[0; 1000]);
    let err = Block::open(disk.path(), DiskIo::Sync, Arc::default()).err().expect("1000 bytes is not whole sectors");
    assert!(matches!(&err, BlockError::Size { path, len: 1000 } if *path == disk.path().display().to_string()), "{err}");
}

#[test]
fn open_of_a_missing_disk_fails() {
    let path = TempDisk::with_contents(&[]).path().to_owned(); // removed again on drop
    assert!(matches!(Block::open(&path, DiskIo::Sync, Arc::default()), Err(BlockError::Open { .. })));
}

#[test]
fn save_gives_the_sector_count() {
    let disk = TempDisk::with_contents(&original_contents());
    let block = Block::open(disk.path(), DiskIo::Sync, Arc::default()).expect("open");
    assert_eq!(block.save().expect("save"), ModelState::Block(BlockState { sectors: DISK_SECTORS, pending: vec![] }));
}

#[test]
fn restore_needs_a_disk_of_the_saved_size() {
    let disk = TempDisk::with_contents(&original_contents());
    let bigger = TempDisk::with_contents(&pattern(2 * DISK_BYTES, 1));
    let saved = Block::open(disk.path(), DiskIo::Sync, Arc::default()).expect("open").save().expect("save");

    Block::open(disk.path(), DiskIo::Sync, Arc::default()).expect("open").restore(&saved).expect("same size restores");
    let err = Block::open(bigger.path(), DiskIo::Sync, Arc::default()).expect("open").restore(&saved).expect_err("another size");
    let DeviceError::Restore { kind: DeviceKind::Block, reason } = &err else { panic!("not a disk restore error: {err}") };
    for named in [DISK_BYTES.to_string(), (2 * DISK_BYTES).to_string(), bigger.path().display().to_string()] {
        assert!(reason.contains(&named), "{reason:?} does not name {named}");
    }
}

#[test]
fn restore_rejects_a_network_cards_state() {
    let disk = TempDisk::with_contents(&original_contents());
    let net = ModelState::Net(crate::devices::virtio::net::NetState { mac: [0x52, 0x54, 0, 0, 0, 1] });
    let err = Block::open(disk.path(), DiskIo::Sync, Arc::default()).expect("open").restore(&net).expect_err("not a disk's state");
    assert!(matches!(err, DeviceError::Restore { kind: DeviceKind::Block, .. }), "{err}");
}

/// Kick `transport`, then run its deferred I/O and serve again, until no
/// request is in flight.
fn settle(transport: &mut MmioTransport, mem: &GuestMemory) {
    loop {
        transport.process_queue(0, mem).expect("requests served");
        if pending(transport).is_empty() {
            return;
        }
        assert!(run_io(transport), "requests in flight and no I/O to run");
    }
}

/// The device thread's work after a pass: the I/O of `--disk-io async`.
fn run_io(transport: &MmioTransport) -> bool {
    transport.deferred_io().is_some_and(|io| io.run())
}

/// The device's pending list, as it saves it.
fn pending(transport: &MmioTransport) -> Vec<PendingRequest> {
    match transport.save().expect("save").model {
        ModelState::Block(b) => b.pending,
        other => panic!("not a disk: {other:?}"),
    }
}

#[test]
fn with_async_io_the_io_runs_after_the_pass_and_its_result_reaches_the_guest_in_the_next() {
    let ram = guest_ram();
    let mut rig = Rig::with(&ram, DiskIo::Async);
    let (data, request) = rig.offer_write(3, 70);
    assert!(!rig.kick().expect("issued"), "nothing used yet");
    assert_eq!(rig.disk.contents(), original_contents(), "the pass did no I/O");
    // The device thread runs the I/O after the pass (a pause would not wait) ...
    assert!(rig.run_io());
    assert_eq!(rig.disk.contents(), contents_after_write(3, &data));
    assert_eq!(rig.written_to_hook(), [(3 * SECTOR, data)]);
    // ... but placed nothing in guest memory: the request is still in flight.
    assert_eq!(rig.status(request), NO_STATUS);
    assert!(rig.driver.used().is_empty());
    assert_eq!(rig.pending().len(), 1);
    // The device's next pass completes it.
    assert!(rig.kick().expect("completed"));
    assert_eq!(rig.status(request), STATUS_OK);
    assert_eq!(rig.driver.used(), [(u32::from(request.head), 1)]);
    assert!(rig.pending().is_empty());
}

#[test]
fn with_async_io_requests_wait_in_the_queue_while_the_write_hook_asks_to() {
    let ram = guest_ram();
    let mut rig = Rig::with(&ram, DiskIo::Async);
    rig.writes.1.store(true, Ordering::SeqCst);
    let (data, request) = rig.offer_write(1, 60);
    assert!(!rig.kick().unwrap());
    assert!(rig.pending().is_empty(), "not even popped");
    assert!(rig.written_to_hook().is_empty());
    rig.writes.1.store(false, Ordering::SeqCst);
    rig.settle();
    assert_eq!(rig.status(request), STATUS_OK);
    assert_eq!(rig.disk.contents(), contents_after_write(1, &data));
}

/// Overlapping writes and a read of what they wrote, in flight when the
/// device is saved (the first write already in the disk, its result not
/// placed yet); restored over a disk that has that write and over one that
/// has none (a backup's, a checkpoint older), with either kind of I/O: the
/// requests are issued again in order, and disk and read end up as if
/// each write had happened once.
#[test]
fn requests_in_flight_are_saved_and_issued_again_in_order_by_a_restored_device() {
    let ram = guest_ram();
    let mut rig = Rig::with(&ram, DiskIo::Async);
    let (a, b) = (pattern(2 * SECTOR as usize, 80), pattern(SECTOR as usize, 90));
    let (a_buf, b_buf) = (rig.driver.readable(&a), rig.driver.readable(&b));
    let read_into = rig.driver.writable(4 * SECTOR as u32, 0xaa);
    let w1 = rig.offer(REQ_OUT, 1, &[a_buf]);
    let w2 = rig.offer(REQ_OUT, 2, &[b_buf]);
    let r = rig.offer(REQ_IN, 0, &[read_into]);
    assert!(!rig.kick().expect("issued"));
    assert!(rig.run_io());
    assert_eq!(rig.disk.contents(), contents_after_write(1, &a));
    let saved = rig.transport.save().expect("save");
    // The first write is in flight, the second waits for it (one write at
    // a time), and the read waits in the queue behind them.
    let in_flight = pending(&rig.transport);
    let seg = |buf: Buf| Segment { addr: buf.addr, len: buf.len };
    assert_eq!(
        in_flight,
        [
            PendingRequest { head: w1.head, kind: REQ_OUT, sector: 1, data: vec![seg(a_buf)], status: w1.status.addr },
            PendingRequest { head: w2.head, kind: REQ_OUT, sector: 2, data: vec![seg(b_buf)], status: w2.status.addr },
        ]
    );
    // Through the snapshot encoding, as a restore in a new process sees it.
    let saved: crate::devices::DeviceState = crate::persist::decode(&crate::persist::encode(&saved)).expect("decode");
    assert_eq!(saved.requests_in_flight(), 2);
    assert_eq!(rig.status(w1), NO_STATUS);

    let mut expected = original_contents();
    expected[512..1536].copy_from_slice(&a);
    expected[1024..1536].copy_from_slice(&b);
    let first_landed = contents_after_write(1, &a);
    for io in MODES {
        for start in [original_contents(), first_landed.clone()] {
            let disk = TempDisk::with_contents(&start);
            let (mut restored, writes) = device(&disk, io);
            restored.restore(&saved).expect("restore");
            restored.issue_restored(rig.mem);
            settle(&mut restored, rig.mem);
            assert!(disk.contents() == expected, "{io}: the disk after the writes issued again");
            assert_eq!(writes.0.locked().clone(), [(SECTOR, a.clone()), (2 * SECTOR, b.clone())], "{io}");
            assert_eq!(rig.driver.used(), [(u32::from(w1.head), 1), (u32::from(w2.head), 1), (u32::from(r.head), 4 * SECTOR as u32 + 1)]);
            assert!([w1, w2, r].iter().all(|&q| rig.status(q) == STATUS_OK));
            assert_eq!(rig.driver.bytes(read_into), expected[..4 * SECTOR as usize], "{io}: the read sees both writes");
            // The next restore starts from the same guest memory.
            rig.driver.clear_used();
            for q in [w1, w2, r] {
                rig.driver.fill(q.status, NO_STATUS);
            }
            rig.driver.fill(read_into, 0xaa);
        }
    }
}

#[test]
fn a_reset_forgets_the_requests_in_flight() {
    let ram = guest_ram();
    let mut rig = Rig::with(&ram, DiskIo::Async);
    let (data, request) = rig.offer_write(0, 40);
    assert!(!rig.kick().expect("issued"));
    assert_eq!(rig.pending().len(), 1);
    crate::devices::virtio::test_util::write_reg(&mut rig.transport, virtio_bindings::virtio_mmio::VIRTIO_MMIO_STATUS, 0);
    assert!(rig.pending().is_empty());
    assert!(rig.run_io(), "the write still runs");
    assert!(!rig.kick().expect("a reset device does nothing"));
    assert_eq!(rig.status(request), NO_STATUS);
    // The driver sets the device up again on fresh rings: the old result
    // is never placed, the new request gets its own.
    rig.driver = Driver::new(ram.memory());
    rig.driver.start(&mut rig.transport);
    let read_into = rig.driver.writable(SECTOR as u32, 0xaa);
    let read = rig.offer(REQ_IN, 0, &[read_into]);
    rig.settle();
    assert_eq!(rig.driver.used(), [(u32::from(read.head), SECTOR as u32 + 1)]);
    assert_eq!(rig.driver.bytes(read_into), data, "the forgotten write still reached the disk before the read");
}
