//! The checkpoint pipeline end to end in one process, on real KVM: a
//! primary VM's checkpoint, taken by the stages, applied by the backup's
//! apply stage into a replica; and every damaged checkpoint refused before
//! anything changes.

use std::sync::Arc;
use std::time::Duration;

use ftvm_replication::backup::{BackupConfig, Replica};
use ftvm_replication::checkpoint::Checkpoint;
use ftvm_replication::output::{DiskJournal, OutputBuffer};
use ftvm_replication::pipeline::apply::{Apply, InPlace};
use ftvm_replication::pipeline::{Pipeline, Switches};
use ftvm_replication::protocol::{self, Hello, Kind};
use ftvm_vmm::devices::DeviceConfig;
use ftvm_vmm::hooks::FrameSink;
use ftvm_vmm::memory::PAGE;
use ftvm_vmm::{Console, DirtyBackend, Vm, VmConfig};

const MEM: u64 = 16 << 20;

struct Nowhere;

impl FrameSink for Nowhere {
    fn send(&self, _frame: &[u8]) {}
}

fn vm() -> Vm {
    let (console, _) = Console::capture();
    Vm::new(VmConfig { mem_size: MEM, vcpus: 1, console, ..Default::default() }).unwrap()
}

fn pipeline(vm: &Vm) -> Pipeline {
    let output = Arc::new(OutputBuffer::new(Arc::new(Nowhere)));
    Pipeline::new(&Switches::default(), vm.ram().pages(), output, Arc::new(DiskJournal::default()))
}

fn replica(first_epoch: u64) -> Replica {
    let (console, _) = Console::capture();
    let config = BackupConfig {
        listen: String::new(),
        devices: DeviceConfig::default(),
        mem_size: None,
        vcpus: None,
        failure_timeout: Some(Duration::from_secs(1)),
        prefault: false,
        dirty_backend: DirtyBackend::Bitmap,
        console,
        metrics: None,
        arbiter: None,
        auth: None,
        handshake_timeout: Duration::from_secs(5),
    };
    let hello = Hello { mem_size: MEM, vcpus: 1, devices: vec![], mac: None, disk_size: None, epoch_ms: 20, first_epoch };
    Replica::for_primary(&config, &hello).unwrap()
}

/// Checkpoint 5 of a VM whose pages 1000 (data), 1001 (zeroed again) and 2000 changed (above the system area).
fn checkpoint_frame(vm: &Vm) -> Vec<u8> {
    vm.start_dirty_tracking().unwrap();
    vm.ram().write_page(1000, &[0xab; PAGE]).unwrap();
    vm.ram().write_page(1001, &[0; PAGE]).unwrap();
    vm.ram().write_page(2000, &[0x01; PAGE]).unwrap();
    let mut pipeline = pipeline(vm);
    let (taken, frame) = pipeline.take(vm, 5).unwrap();
    assert_eq!((taken.epoch, taken.dirty_pages), (5, 3));
    frame.to_vec()
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
    let mut apply = InPlace;
    let staged = apply.stage(&replica, &payload).unwrap();
    assert_eq!(staged.pages.len(), 3);
    apply.commit(&mut replica, staged).unwrap();
    let mut page = vec![0u8; PAGE];
    for (p, fill) in [(1000, 0xab), (1001, 0), (2000, 1), (1002, 0)] {
        replica.vm.ram().read_page(p, &mut page).unwrap();
        assert!(page.iter().all(|&b| b == fill), "page {p}");
    }
    let (epoch, state) = replica.committed.as_ref().unwrap();
    assert_eq!((*epoch, state.vcpus.len(), replica.next_epoch), (5, 1, 6));
}

#[test]
fn out_of_order_checkpoints_are_refused_before_anything_changes() {
    let primary = vm();
    let payload = payload(&checkpoint_frame(&primary));
    let mut replica = replica(4);
    assert!(InPlace.stage(&replica, &payload).is_err(), "checkpoint 5 when 4 is next");
    let mut page = vec![0u8; PAGE];
    replica.vm.ram().read_page(1000, &mut page).unwrap();
    assert!(page.iter().all(|&b| b == 0));
    assert!(replica.committed.is_none());
    replica.next_epoch = 5;
    assert!(InPlace.stage(&replica, &payload).is_ok());
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
