//! The checkpoint pipeline end to end in one process, on real KVM: a
//! primary VM's checkpoint, taken by the stages, applied by the backup's
//! apply stage into a replica; every damaged checkpoint refused before
//! anything changes; and a commit that fails midway (a full replica disk)
//! undone, byte for byte.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ftvm_primary_backup::backup::{BackupConfig, Replica};
use ftvm_replication::bounds;
use ftvm_replication::checkpoint::{Checkpoint, CheckpointState};
use ftvm_replication::output::{DiskJournal, OutputBuffer};
use ftvm_replication::pipeline::apply::{Apply, ApplyError, DiskImage, InPlace};
use ftvm_replication::pipeline::encode::{Diff, States};
use ftvm_replication::pipeline::prefetch::pull::{By, Offer, PrimaryRam};
use ftvm_replication::pipeline::prefetch::Mode;
use ftvm_replication::pipeline::trigger::{Mode as TriggerMode, Plan};
use ftvm_replication::pipeline::{Pipeline, Switches};
use ftvm_replication::protocol::{self, Heartbeat, Hello, Kind};
use ftvm_replication::ReplicationError;
use ftvm_vmm::devices::{DeviceConfig, DeviceKind};
use ftvm_vmm::hooks::{DiskWriteObserver, FrameSink};
use ftvm_vmm::memory::PAGE;
use ftvm_vmm::{Console, DirtyBackend, Persist, Vm, VmConfig};

const MEM: u64 = 16 << 20;
const DISK: u64 = 16 << 20;

struct Nowhere;

impl FrameSink for Nowhere {
    fn send(&self, _frame: &[u8]) {}
}

fn vm() -> Vm {
    let (console, _) = Console::capture();
    Vm::new(VmConfig { mem_size: MEM, vcpus: 1, console, ..Default::default() }).unwrap()
}

fn replica(first_epoch: u64) -> Replica {
    replica_with_disk(first_epoch, None)
}

/// A replica, with a disk replica at `disk` of `DISK` bytes if given.
fn replica_with_disk(first_epoch: u64, disk: Option<&Path>) -> Replica {
    let (console, _) = Console::capture();
    let config = BackupConfig {
        listen: String::new(),
        devices: DeviceConfig { net: None, disk: disk.map(Path::to_owned), ..Default::default() },
        mem_size: None,
        vcpus: None,
        failure_timeout: Some(Duration::from_secs(1)),
        heartbeat: Duration::from_millis(5),
        prefault: false,
        dirty_backend: DirtyBackend::Bitmap,
        idle_pause: Default::default(),
        vcpu_state_reads: Default::default(),
        priority: Default::default(),
        console,
        metrics: None,
        arbiter: None,
        auth: None,
        handshake_timeout: Duration::from_secs(5),
    };
    let (devices, disk_size) = match disk {
        Some(_) => (vec![DeviceKind::Block], Some(DISK)),
        None => (vec![], None),
    };
    let heartbeat = Heartbeat { session: [0; 8], port: 0, interval_ms: 5 };
    let cpu = ftvm_vmm::vm::host_cpu_profile().unwrap();
    let hello = Hello { mem_size: MEM, vcpus: 1, devices, mac: None, disk_size, epoch_ms: 20, first_epoch, heartbeat, cpu: cpu.clone() };
    ftvm_primary_backup::backup::for_primary(&config, &cpu, &hello).unwrap()
}

/// Checkpoint 5 of a VM whose pages 1000 (data), 1001 (zeroed again) and 2000 changed (above the system area).
fn checkpoint_frame(vm: &Vm) -> Vec<u8> {
    checkpoint_with_writes(vm, &[])
}

/// Checkpoint 5 as `checkpoint_frame`, carrying the disk writes `writes` (offset, data).
fn checkpoint_with_writes(vm: &Vm, writes: &[(u64, Vec<u8>)]) -> Vec<u8> {
    vm.start_dirty_tracking().unwrap();
    vm.ram().write_page(1000, &[0xab; PAGE]).unwrap();
    vm.ram().write_page(1001, &[0; PAGE]).unwrap();
    vm.ram().write_page(2000, &[0x01; PAGE]).unwrap();
    let output = Arc::new(OutputBuffer::new(Arc::new(Nowhere)));
    let journal = Arc::new(DiskJournal::default());
    journal.start();
    for (offset, data) in writes {
        journal.written(*offset, data);
    }
    let mut pipeline = Pipeline::new(&Switches::default(), vm, output, journal).unwrap();
    let (taken, frame) = pipeline.take(vm, 5).unwrap();
    assert_eq!((taken.epoch, taken.dirty_pages, taken.state.disk_writes), (5, 3, writes.len() as u64));
    assert!(protocol::payload_len(frame) <= bounds::checkpoint_limit(MEM, 1));
    frame.to_vec()
}

/// A primary tracking its dirty pages, a pipeline with `switches` over it
/// (output going nowhere) and its started disk journal.
fn tracked(switches: &Switches) -> (Vm, Pipeline, Arc<DiskJournal>) {
    let primary = vm();
    primary.start_dirty_tracking().unwrap();
    let output = Arc::new(OutputBuffer::new(Arc::new(Nowhere)));
    let journal = Arc::new(DiskJournal::default());
    journal.start();
    let pipeline = Pipeline::new(switches, &primary, output, journal.clone()).unwrap();
    (primary, pipeline, journal)
}

/// Stage and commit checkpoint `frame` into `replica`; both must succeed.
fn stage_and_commit(apply: &mut InPlace, replica: &mut Replica, frame: &[u8]) {
    let payload = payload(frame);
    let staged = apply.stage(replica, &payload).unwrap();
    apply.commit(replica, staged).unwrap();
}

/// Stages and commits checkpoint frames into a replica, as a backup does:
/// one applier for all of them.
fn committer() -> impl FnMut(&mut Replica, &[u8]) {
    let mut apply = InPlace::default();
    move |replica, frame| stage_and_commit(&mut apply, replica, frame)
}

fn payload(frame: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    assert_eq!(protocol::read_frame(&mut &frame[..], 1 << 30, &mut buf).unwrap(), Kind::Checkpoint);
    buf
}

#[test]
fn a_checkpoint_applies_whole_into_the_replica() {
    let primary = vm();
    let frame = checkpoint_frame(&primary);
    let payload = payload(&frame);
    let mut replica = replica(5);
    replica.vm.ram().write_page(1001, &[0x77; PAGE]).unwrap();
    let mut apply = InPlace::default();
    let staged = apply.stage(&replica, &payload).unwrap();
    assert_eq!(staged.pages.len(), 3);
    let state = staged.pages.state.len() as u64;
    assert!(state * 8 < bounds::vm_state_limit(1), "a vCPU's state of {state} bytes leaves little room in the bound");
    apply.commit(&mut replica, staged).unwrap();
    let mut page = vec![0u8; PAGE];
    for (p, fill) in [(1000, 0xab), (1001, 0), (2000, 1), (1002, 0)] {
        replica.vm.ram().read_page(p, &mut page).unwrap();
        assert!(page.iter().all(|&b| b == fill), "page {p}");
    }
    let (epoch, state) = replica.committed.as_ref().unwrap();
    assert_eq!((*epoch, ftvm_vmm::vcpu::count(state), replica.next_epoch), (5, 1, 6));
}

#[test]
fn out_of_order_checkpoints_are_refused_before_anything_changes() {
    let primary = vm();
    let payload = payload(&checkpoint_frame(&primary));
    let mut replica = replica(4);
    assert!(InPlace::default().stage(&replica, &payload).is_err(), "checkpoint 5 when 4 is next");
    let mut page = vec![0u8; PAGE];
    replica.vm.ram().read_page(1000, &mut page).unwrap();
    assert!(page.iter().all(|&b| b == 0));
    assert!(replica.committed.is_none());
    replica.next_epoch = 5;
    assert!(InPlace::default().stage(&replica, &payload).is_ok());
}

#[test]
fn every_truncation_and_bit_flip_of_a_checkpoint_is_refused() {
    let primary = vm();
    let frame = checkpoint_frame(&primary);
    let mut buf = Vec::new();
    for cut in 0..frame.len() {
        assert!(protocol::read_frame(&mut &frame[..cut], 1 << 30, &mut buf).is_err(), "frame cut at {cut}");
    }
    for i in 0..frame.len() {
        let mut bad = frame.clone();
        bad[i] ^= 1 << (i % 8);
        assert!(protocol::read_frame(&mut &bad[..], 1 << 30, &mut buf).is_err(), "flip in byte {i}");
    }
    // A payload cut short inside a valid frame (a primary bug) is refused too.
    let payload = payload(&frame);
    let pages = MEM / PAGE as u64;
    for cut in 0..payload.len() {
        assert!(Checkpoint::parse(&payload[..cut], pages, 0).is_err(), "payload cut at {cut}");
    }
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted on Drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = std::env::temp_dir().join(format!("ftvm-pipeline-{}-{size}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(&dir).output().unwrap();
        assert!(out.status.success(), "mount tmpfs (the tests run as root): {}", String::from_utf8_lossy(&out.stderr));
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn file_bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

fn ram_bytes(vm: &Vm) -> Vec<u8> {
    let mut all = vec![0u8; MEM as usize];
    for (p, page) in all.chunks_exact_mut(PAGE).enumerate() {
        vm.ram().read_page(p as u64, page).unwrap();
    }
    all
}

#[test]
fn a_commit_that_fills_the_replica_disk_is_undone_byte_for_byte() {
    // 1 MiB of space under a 16 MiB sparse replica.
    let fs = Tmpfs::mount("1M");
    let path = fs.0.join("replica.img");
    File::create(&path).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(DISK).unwrap();
    let mut replica = replica_with_disk(5, Some(&path));
    // What the previous checkpoints left: data in the disk and in RAM.
    let disk = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    disk.write_all_at(&[0x11; 64 << 10], 0).unwrap();
    disk.write_all_at(&[0x22; 64 << 10], 4 << 20).unwrap();
    replica.vm.ram().write_page(1000, &[0x77; PAGE]).unwrap();
    replica.vm.ram().write_page(1001, &[0x78; PAGE]).unwrap();
    let (disk_before, ram_before) = (file_bytes(&path), ram_bytes(&replica.vm));

    // Overwrite both data ranges (partly), fill zeros, then more than fits.
    let writes = vec![
        (4096, vec![0xa1; 8192]),
        ((4 << 20) - 512, vec![0xa2; 4096]),
        (1 << 20, vec![0xa3; 512 << 10]),
        (2 << 20, vec![0xa4; 2 << 20]),
        (8 << 20, vec![0xa5; 4096]),
    ];
    let primary = vm();
    let too_big = payload(&checkpoint_with_writes(&primary, &writes));
    let mut apply = InPlace::default();
    let staged = apply.stage(&replica, &too_big).unwrap();
    match apply.commit(&mut replica, staged) {
        Err(ApplyError::Undone { epoch: 5, err, .. }) => assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}"),
        Err(e) => panic!("{e}"),
        Ok(()) => panic!("2.5 MiB of writes fit on a 1 MiB tmpfs?"),
    }
    assert!(file_bytes(&path) == disk_before, "the disk replica changed");
    assert!(ram_bytes(&replica.vm) == ram_before, "the replica's RAM changed");
    assert!(replica.usable && replica.committed.is_none() && replica.next_epoch == 5);

    // The undo gave the space back: a checkpoint that fits still applies.
    let smaller = payload(&checkpoint_with_writes(&primary, &writes[..2]));
    let staged = apply.stage(&replica, &smaller).unwrap();
    apply.commit(&mut replica, staged).unwrap();
    let mut expected = disk_before.clone();
    for (offset, data) in &writes[..2] {
        expected[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
    }
    assert!(file_bytes(&path) == expected);
    assert_eq!(replica.committed.as_ref().map(|c| c.0), Some(5));
}

/// A disk image whose writes all fail: neither the checkpoint nor its undo can be written.
struct Broken;

impl DiskImage for Broken {
    fn read_at(&self, buf: &mut [u8], _offset: u64) -> io::Result<()> {
        buf.fill(0x33);
        Ok(())
    }

    fn write_at(&self, _data: &[u8], _offset: u64) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EIO))
    }

    fn zero(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EIO))
    }
}

#[test]
fn a_commit_whose_undo_fails_discards_the_replica() {
    let fs = Tmpfs::mount("4M");
    let path = fs.0.join("replica.img");
    File::create(&path).unwrap().set_len(DISK).unwrap();
    let mut replica = replica_with_disk(5, Some(&path));
    // An earlier checkpoint was committed...
    let primary = vm();
    let earlier = payload(&checkpoint_with_writes(&primary, &[]));
    let mut apply = InPlace::default();
    let staged = apply.stage(&replica, &earlier).unwrap();
    apply.commit(&mut replica, staged).unwrap();
    assert!(replica.committed.is_some());
    // ... then the disk breaks under the next one.
    replica.disk = Some(Box::new(Broken));
    replica.next_epoch = 5;
    let with_writes = payload(&checkpoint_with_writes(&primary, &[(0, vec![1; 512]), (4096, vec![2; 512])]));
    let staged = apply.stage(&replica, &with_writes).unwrap();
    let e = apply.commit(&mut replica, staged).unwrap_err();
    assert!(matches!(e, ApplyError::Unusable { epoch: 5, .. }), "{e}");
    assert!(!replica.usable, "never to be taken over");
    assert!(replica.committed.is_none(), "nothing left to take over");
}

/// Checkpoints of the diff encoders, epoch after epoch, rebuild the
/// primary's memory exactly in the replica; a checkpoint whose commit is
/// undone (a full replica disk) leaves the replica at the previous one.
#[test]
fn diff_checkpoints_rebuild_the_primarys_memory_and_an_undone_one_changes_nothing() {
    for diff in [Diff::Xor, Diff::Lz4] {
        // (A size of its own: mounts are named by process and size.)
        let fs = Tmpfs::mount("1024k");
        let path = fs.0.join("replica.img");
        File::create(&path).unwrap().set_len(DISK).unwrap();
        let mut replica = replica_with_disk(1, Some(&path));
        let pages = |vm: &Vm| ram_bytes(vm)[1000 * PAGE..1040 * PAGE].to_vec();
        let (primary, mut pipeline, journal) = tracked(&Switches { diff, ..Switches::default() });
        let mut apply = InPlace::default();
        let mut saved = 0;
        for epoch in 1..=6u64 {
            // Whole pages first, then a few bytes of each, a page zeroed.
            for p in 1000..1040u64 {
                let mut page = vec![0u8; PAGE];
                primary.ram().read_page(p, &mut page).unwrap();
                match epoch {
                    1 => page.iter_mut().enumerate().for_each(|(i, b)| *b = (i as u64 * p) as u8),
                    _ if p == 1039 => page.fill(0),
                    _ => (0..epoch as usize).for_each(|k| page[(p as usize * 97 + k * 613) % PAGE] ^= epoch as u8),
                }
                primary.ram().write_page(p, &page).unwrap();
            }
            if epoch == 4 {
                // More than the replica's tmpfs holds: this commit is undone.
                journal.written(0, &vec![0xa5; 2 << 20]);
            }
            let (taken, frame) = pipeline.take(&primary, epoch).unwrap();
            saved += taken.encoded.pages.diff_saved;
            let payload = payload(frame);
            let before = pages(&replica.vm);
            let staged = apply.stage(&replica, &payload).unwrap();
            if epoch == 4 {
                assert!(matches!(apply.commit(&mut replica, staged), Err(ApplyError::Undone { epoch: 4, .. })));
                assert!(pages(&replica.vm) == before, "{diff}: an undone commit changed the replica's RAM");
                assert_eq!(replica.next_epoch, 4);
                // A backup stops here (and the primary starts over with a
                // new one); this test carries on from the undone checkpoint
                // by applying it again without its disk write.
                let staged = apply.stage(&replica, &payload).unwrap();
                let staged = Checkpoint { state: CheckpointState { disk: Vec::new(), ..staged.state }, ..staged };
                apply.commit(&mut replica, staged).unwrap();
            } else {
                apply.commit(&mut replica, staged).unwrap();
            }
            assert!(pages(&replica.vm) == pages(&primary), "{diff}: the replica's RAM after checkpoint {epoch}");
        }
        assert!(saved > 30 * (PAGE as u64 - 200), "{diff}: the later checkpoints went as diffs ({saved} bytes saved)");
    }
}

/// With `--device-state changed` a checkpoint carries only the state that
/// changed; the backup's state after each is still the primary's, whole. A
/// backup without the earlier state refuses such a checkpoint at stage.
#[test]
fn only_changed_state_is_sent_and_the_backup_still_has_all_of_it() {
    let primary = vm();
    primary.start_dirty_tracking().unwrap();
    let output = Arc::new(OutputBuffer::new(Arc::new(Nowhere)));
    let journal = Arc::new(DiskJournal::default());
    let switches = Switches { device_state: States::Changed, ..Switches::default() };
    let mut pipeline = Pipeline::new(&switches, &primary, output, journal).unwrap();
    let mut backup = replica(1);
    let mut apply = InPlace::default();
    let mut state_bytes = Vec::new();
    let mut omitted = Vec::new();
    let mut last_tsc = 0;
    for epoch in 1..=3 {
        if epoch == 3 {
            // The clock moves on: its state goes again, nothing else.
            std::thread::sleep(Duration::from_millis(2));
            pipeline.new_backup();
        }
        let (taken, frame) = pipeline.take(&primary, epoch).unwrap();
        state_bytes.push(taken.encoded.state_bytes);
        let payload = payload(frame);
        let staged = apply.stage(&backup, &payload).unwrap();
        omitted.push(staged.state.vm.omitted());
        if epoch == 2 {
            let fresh = replica(2);
            let refused = apply.stage(&fresh, &payload).err().expect("a fresh backup cannot take a partial state");
            assert!(refused.to_string().contains("leaves out state"), "{refused}");
        }
        apply.commit(&mut backup, staged).unwrap();
        // The same as the primary's now, but for the clock, which moved on.
        let (_, theirs) = backup.committed.as_ref().unwrap();
        let mut now = primary.save().unwrap();
        let clock = ftvm_vmm::clock::component_id();
        assert!(ftvm_vmm::clock::saved_ns(theirs).unwrap() <= ftvm_vmm::clock::saved_ns(&now).unwrap());
        now.insert(clock.clone(), theirs.get(&clock).unwrap().to_vec());
        // And for the vCPU's time-stamp counter, which moves on too: it went
        // with every checkpoint.
        let [_, counter] = ftvm_vmm::vcpu::component_ids(0);
        let tsc = |s: &ftvm_vmm::Components| s.state::<u64>(&counter).unwrap();
        assert!(tsc(theirs) > 0 && tsc(theirs) <= tsc(&now) && tsc(theirs) > last_tsc, "epoch {epoch}");
        last_tsc = tsc(theirs);
        now.put(counter.clone(), &last_tsc);
        assert!(theirs == &now, "the backup's state after {epoch}");
    }
    // The VM does not run: after the first, nothing changes but the guest
    // clock (which it reads from the host clock) until a new backup.
    assert_eq!(omitted[0], 0, "the first checkpoint carries everything");
    assert!(omitted[1] >= 2, "memory and the vCPU left out: {omitted:?}");
    assert_eq!(omitted[2], 0, "a new backup gets everything again");
    assert!(state_bytes[1] * 4 < state_bytes[0], "{state_bytes:?}");
}

/// Write `fill` over pages `pages` of `vm`, as the guest would.
fn fill_pages(vm: &Vm, pages: std::ops::Range<u64>, fill: u8) {
    for p in pages {
        vm.ram().write_page(p, &[fill; PAGE]).unwrap();
    }
}

/// The payload of a prefetch frame.
fn prefetch_payload(frame: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    assert_eq!(protocol::read_frame(&mut &frame[..], 1 << 30, &mut buf).unwrap(), Kind::Prefetch);
    buf
}

/// Write `byte` over the 64-byte block `block` of each of `pages` (the
/// rest of each page stays: a diff of it is small).
fn touch_pages(vm: &Vm, pages: std::ops::Range<u64>, block: usize, byte: u8) {
    let mut page = vec![0u8; PAGE];
    for p in pages {
        vm.ram().read_page(p, &mut page).unwrap();
        page[block * 64..(block + 1) * 64].fill(byte);
        vm.ram().write_page(p, &page).unwrap();
    }
}

/// An in-epoch round of epoch `epoch`, with (`late`) or without the
/// resends of an epoch's last quarter: in an epoch too short for more than
/// its last round, or in one so long that its first round is far from its
/// last quarter. (The round's frame is not reported sent, so the next one
/// is planned the same.)
fn round<'p>(pipeline: &'p mut Pipeline, vm: &Vm, epoch: u64, late: bool) -> Result<Option<&'p [u8]>, ReplicationError> {
    let max_epoch = if late { Duration::from_micros(1) } else { Duration::from_secs(3600) };
    let plan = Plan { mode: TriggerMode::Periodic, since: Instant::now(), spacing: Duration::ZERO, hold_bound: max_epoch, max_epoch };
    pipeline.round(vm, epoch, &plan)
}

/// The pages a `PullList` frame names.
fn pull_list(frame: &[u8]) -> protocol::PullList {
    let mut buf = Vec::new();
    assert_eq!(protocol::read_frame(&mut &frame[..], 1 << 30, &mut buf).unwrap(), Kind::PullList);
    protocol::decode(&buf).unwrap()
}

/// `--prefetch-by pull`, with and without diffs, through a real read-only
/// mapping of the primary's memfd passed over a Unix socket. A list the
/// backup confirmed before the freeze stays out of the checkpoint. One it
/// had not confirmed goes in the checkpoint whole, and the checkpoint is
/// applied after the staged pages: a backup that read a listed page after
/// the guest resumed and wrote it again (content of the next epoch) still
/// ends exactly at the checkpoint. (Without the encoder forgetting pulled
/// pages, `--diff lz4` would send a diff against a version the backup no
/// longer holds; without the freeze adding unconfirmed lists, the newer
/// content would stay.)
#[test]
fn pulled_pages_read_after_the_freeze_are_carried_by_the_checkpoint() {
    for diff in [Diff::Off, Diff::Lz4] {
        let (primary, mut pipeline, _) = tracked(&Switches { diff, prefetch: Mode::On, prefetch_by: By::Pull, ..Switches::default() });
        let confirmed = pipeline.pull_confirmations().expect("pull rounds");
        let offer = Offer::new().unwrap();
        let (name, size) = (offer.name().to_string(), primary.ram().size());
        let mapper = std::thread::spawn(move || PrimaryRam::map(&name, size, Duration::from_secs(5)));
        offer.serve(primary.ram().memfd(), Duration::from_secs(5)).unwrap();
        let ram = mapper.join().unwrap().unwrap();
        let mut replica = replica(1);
        let limit = bounds::checkpoint_limit(MEM, 1);
        let mut commit = committer();

        // Epoch 1: a list read and confirmed before the freeze; pages
        // written after the round go in the checkpoint (and the diff
        // encoder keeps them).
        fill_pages(&primary, 1000..1040, 0x11);
        let frame = round(&mut pipeline, &primary, 1, true).unwrap().expect("cold pages to list").to_vec();
        assert!(frame.len() < 40 * 10 + 64, "{diff}: a list, not pages ({} bytes)", frame.len());
        let list = pull_list(&frame);
        assert_eq!(list.pages, (1000..1040).collect::<Vec<_>>());
        let before = ram_bytes(&replica.vm);
        replica.stage_pulled(&ram, &list, limit).unwrap();
        assert!(ram_bytes(&replica.vm) == before, "{diff}: pulled pages are staged, not in RAM yet");
        confirmed.fetch_max(list.list, std::sync::atomic::Ordering::AcqRel);
        fill_pages(&primary, 1100..1120, 0x12);
        let (taken, frame) = pipeline.take(&primary, 1).unwrap();
        assert_eq!((taken.prefetched.pages, taken.encoded.pages.pages, taken.prefetched.only_ahead), (40, 20, 40), "{diff}");
        commit(&mut replica, frame);
        assert!(ram_bytes(&replica.vm) == ram_bytes(&primary), "{diff}: after checkpoint 1");

        // Epoch 2: pages 1100..1120 listed; the freeze comes before the
        // backup confirmed the list, so the checkpoint carries them.
        touch_pages(&primary, 1100..1120, 0, 0x21);
        let frame = round(&mut pipeline, &primary, 2, true).unwrap().expect("cold pages to list").to_vec();
        let late = pull_list(&frame);
        let (taken, frame) = pipeline.take(&primary, 2).unwrap();
        let frame = frame.to_vec();
        assert_eq!((taken.prefetched.pages, taken.encoded.pages.pages, taken.prefetched.only_ahead), (20, 20, 0), "{diff}");
        let at_checkpoint_2 = ram_bytes(&primary);
        // The guest runs epoch 3 and writes another block of a listed
        // page; only then does the backup read the list (and stages epoch
        // 3's content for 2). A diff against checkpoint 1's copy would
        // carry block 0 only and leave that block as epoch 3 wrote it.
        touch_pages(&primary, 1100..1101, 63, 0x31);
        replica.stage_pulled(&ram, &late, limit).unwrap();
        commit(&mut replica, &frame);
        assert!(ram_bytes(&replica.vm) == at_checkpoint_2, "{diff}: the backup is exactly at checkpoint 2");

        // Epoch 3: a list read, then the primary dies before the freeze:
        // the backup stays at checkpoint 2. (Page 1100, written in epoch 3
        // above, is listed too: pages a checkpoint carried only because
        // their list was not confirmed do not count as hot.)
        fill_pages(&primary, 1300..1302, 0x32);
        let frame = round(&mut pipeline, &primary, 3, true).unwrap().expect("cold pages to list").to_vec();
        assert_eq!(pull_list(&frame).pages, [1100, 1300, 1301], "{diff}");
        replica.stage_pulled(&ram, &pull_list(&frame), limit).unwrap();
        assert!(!replica.staged.is_empty());
        assert!(ram_bytes(&replica.vm) == at_checkpoint_2, "{diff}: a failure mid-fetch leaves the last checkpoint");
        // A list of another epoch, or of pages beyond RAM, is refused.
        let mut wrong = pull_list(&frame);
        wrong.epoch = 4;
        assert!(replica.stage_pulled(&ram, &wrong, limit).is_err(), "{diff}: a list of epoch 4 while 3 is next");
        wrong.epoch = 3;
        wrong.pages = vec![MEM / PAGE as u64];
        assert!(replica.stage_pulled(&ram, &wrong, limit).is_err(), "{diff}: a page beyond RAM");
    }
}

/// With `--prefetch on`, pages dirtied early in an epoch and not written
/// again go to the backup while the guest runs, write-cold ones only; the
/// checkpoint carries the rest, and the backup's RAM after it is the
/// primary's. Prefetched pages stay staged until their checkpoint: a
/// primary that dies mid-epoch leaves the backup exactly at the last one.
#[test]
fn prefetched_pages_commit_only_with_their_checkpoint() {
    for diff in [Diff::Off, Diff::Lz4] {
        let (primary, mut pipeline, _) = tracked(&Switches { diff, prefetch: Mode::On, ..Switches::default() });
        let mut replica = replica(1);
        let limit = bounds::checkpoint_limit(MEM, 1);
        let mut commit = committer();

        // Epoch 1: nothing recent yet, so every page harvested is cold.
        fill_pages(&primary, 1000..1040, 0x11);
        let frame = round(&mut pipeline, &primary, 1, true).unwrap().expect("cold pages to send").to_vec();
        let before = ram_bytes(&replica.vm);
        replica.stage_prefetch(prefetch_payload(&frame), limit).unwrap();
        assert!(ram_bytes(&replica.vm) == before, "{diff}: staged pages are not in RAM yet");
        let (taken, frame) = pipeline.take(&primary, 1).unwrap();
        assert_eq!((taken.prefetched.pages, taken.encoded.pages.pages), (40, 0), "{diff}");
        commit(&mut replica, frame);
        assert!(ram_bytes(&replica.vm) == ram_bytes(&primary), "{diff}: after checkpoint 1");

        // Epoch 2: checkpoint 1 carried no page (all went ahead), so every
        // page harvested is cold again.
        fill_pages(&primary, 1000..1010, 0x22);
        fill_pages(&primary, 1100..1120, 0x23);
        let frame = round(&mut pipeline, &primary, 2, false).unwrap().expect("cold pages to send").to_vec();
        replica.stage_prefetch(prefetch_payload(&frame), limit).unwrap();
        // Written again after they were sent: deferred to the epoch's last
        // quarter (no checkpoint says they are hot).
        fill_pages(&primary, 1100..1104, 0x24);
        fill_pages(&primary, 1200..1201, 0x25);
        let one = round(&mut pipeline, &primary, 2, false).unwrap().expect("page 1200 is cold").to_vec();
        replica.stage_prefetch(prefetch_payload(&one), limit).unwrap();
        // A round of the last quarter sends them again (the later copy wins
        // on the backup).
        let four = round(&mut pipeline, &primary, 2, true).unwrap().expect("pages 1100..1104 deferred").to_vec();
        assert!(one.len() < four.len(), "{diff}: page 1200 first, pages 1100..1104 in a late round");
        replica.stage_prefetch(prefetch_payload(&four), limit).unwrap();
        // Written after the last round: the stop-and-copy takes it.
        fill_pages(&primary, 1300..1302, 0x26);
        let before = ram_bytes(&replica.vm);
        let (taken, frame) = pipeline.take(&primary, 2).unwrap();
        assert_eq!((taken.prefetched.pages, taken.encoded.pages.pages, taken.dirty_pages), (35, 2, 33), "{diff}");
        assert!(ram_bytes(&replica.vm) == before, "{diff}: staging changed nothing");
        commit(&mut replica, frame);
        assert!(ram_bytes(&replica.vm) == ram_bytes(&primary), "{diff}: after checkpoint 2");
        let at_checkpoint_2 = ram_bytes(&replica.vm);

        // Epoch 3: only checkpoint 2 carried pages 1300..1302, which is no
        // evidence of heat: they go ahead.
        fill_pages(&primary, 1300..1302, 0x31);
        fill_pages(&primary, 1400..1410, 0x32);
        let frame = round(&mut pipeline, &primary, 3, true).unwrap().expect("cold pages to send").to_vec();
        let payload = prefetch_payload(&frame);
        // A round of another epoch is refused, and nothing is staged for it.
        assert!(replica.stage_prefetch(payload.clone(), limit).is_ok());
        let mut wrong = payload.clone();
        wrong[..8].copy_from_slice(&4u64.to_le_bytes());
        assert!(replica.stage_prefetch(wrong, limit).is_err(), "{diff}: prefetch for epoch 4 while 3 is next");
        assert!(replica.stage_prefetch(payload, frame.len() as u64).is_err(), "{diff}: more than an epoch's bound");
        // The primary dies here: the backup is exactly at checkpoint 2.
        assert!(!replica.staged.is_empty());
        assert!(ram_bytes(&replica.vm) == at_checkpoint_2, "{diff}: a failure mid-epoch leaves the last checkpoint");
        assert_eq!(replica.committed.as_ref().map(|(e, _)| *e), Some(2));
        // Written after the round: checkpoint 3 carries them too.
        fill_pages(&primary, 1300..1302, 0x33);
        let (taken, _) = pipeline.take(&primary, 3).unwrap();
        assert_eq!((taken.prefetched.pages, taken.encoded.pages.pages), (12, 2), "{diff}");

        // Epoch 4 (the primary alone): carried by the last two checkpoints,
        // pages 1300..1302 are hot and stay for the stop-and-copy.
        fill_pages(&primary, 1300..1302, 0x41);
        fill_pages(&primary, 1500..1501, 0x42);
        assert!(round(&mut pipeline, &primary, 4, true).unwrap().is_some());
        let (taken, _) = pipeline.take(&primary, 4).unwrap();
        assert_eq!((taken.prefetched.pages, taken.encoded.pages.pages), (1, 2), "{diff}");
    }
}
