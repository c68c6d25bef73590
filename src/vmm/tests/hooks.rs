//! The VMM's hooks through real KVM and real devices: disk writes reach the
//! observer after the disk has them; the idle hook fires when every vCPU
//! waits; a snapshot of a VM restores only onto the same devices.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ftvm_vmm::devices::DeviceConfig;
use ftvm_vmm::hooks::{DiskWriteObserver, IdleObserver};
use ftvm_vmm::{ComponentId, Console, Persist, Vm, VmConfig, VmError, VmExit};

fn image(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/images").join(format!("{name}.elf"));
    assert!(path.exists(), "guest image {} missing: run scripts/build-images.sh", path.display());
    path
}

fn disk(tag: &str, bytes: u64) -> PathBuf {
    let path = std::env::temp_dir().join(format!("ftvm-hooks-{tag}-{}.img", std::process::id()));
    std::fs::File::create(&path).unwrap().set_len(bytes).unwrap();
    path
}

#[derive(Default)]
struct Writes(Mutex<Vec<(u64, usize)>>);

impl DiskWriteObserver for Writes {
    fn written(&self, offset: u64, data: &[u8]) {
        self.0.lock().unwrap().push((offset, data.len()));
    }
}

#[test]
fn disk_writes_reach_the_observer() {
    let path = disk("writes", 1 << 20);
    let (console, out) = Console::capture();
    let devices = DeviceConfig { disk: Some(path.clone()), ..Default::default() };
    let vm = Vm::new(VmConfig { mem_size: 64 << 20, console, devices, ..Default::default() }).unwrap();
    let writes = Arc::new(Writes::default());
    vm.hooks().set_disk_writes(Some(writes.clone()));
    vm.boot(&image("netprobe"), None, "blk=selftest").unwrap();
    vm.start().unwrap();
    assert_eq!(vm.wait(), VmExit::Exited(0), "{}", String::from_utf8_lossy(&out.lock().unwrap()));
    let seen = writes.0.lock().unwrap().clone();
    // The self-test writes a run of sectors from 0, then sector 7 alone.
    assert!(seen.len() >= 2, "{seen:?}");
    assert_eq!(seen[0].0, 0);
    assert!(seen.contains(&(7 * 512, 512)), "{seen:?}");
    std::fs::remove_file(path).unwrap();
}

struct Idle(AtomicUsize);

impl IdleObserver for Idle {
    fn all_idle(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// How often the idle hook fired while one vCPU ran `cmdline` on `image`
/// to a clean exit.
fn times_idle(image_name: &str, cmdline: &str) -> usize {
    let (console, _out) = Console::capture();
    let vm = Vm::new(VmConfig { mem_size: 64 << 20, vcpus: 1, console, ..Default::default() }).unwrap();
    let idle = Arc::new(Idle(AtomicUsize::new(0)));
    vm.hooks().set_idle(Some(idle.clone()));
    vm.boot(&image(image_name), None, cmdline).unwrap();
    vm.start().unwrap();
    assert_eq!(vm.wait(), VmExit::Exited(0));
    idle.0.load(Ordering::SeqCst)
}

#[test]
fn the_idle_hook_fires_when_every_vcpu_waits() {
    // A ticker sleeps in the wait hypercall between its ticks.
    let idle = times_idle("probe", "ticker=5,count=10");
    assert!(idle >= 5, "idle {idle} times");
    // A memory-bound guest that never waits is never idle.
    assert_eq!(times_idle("memtouch", "ws=1M writes=2000000 report=0"), 0);
}

#[test]
fn state_restores_only_onto_a_vm_of_the_same_shape_and_devices() {
    let (console, _out) = Console::capture();
    let path = disk("shape", 1 << 20);
    let devices = DeviceConfig { disk: Some(path.clone()), ..Default::default() };
    let vm = Vm::new(VmConfig { mem_size: 64 << 20, vcpus: 1, console: console.clone(), devices: devices.clone(), ..Default::default() })
        .unwrap();
    vm.boot(&image("probe"), None, "hello").unwrap();
    let state = vm.save().unwrap();

    let ids: Vec<&str> = state.ids().map(ComponentId::as_str).collect();
    assert_eq!(ids, ["clock", "devices/disk0", "memory", "vcpu/0", "vcpu/0/tsc"]);

    let mut same =
        Vm::new(VmConfig { mem_size: 64 << 20, vcpus: 1, console: console.clone(), devices: devices.clone(), ..Default::default() })
            .unwrap();
    same.restore(&state).unwrap();
    // Round trip: the restored VM saves the same components, but for its
    // clock and counter, which moved on.
    let mut again = same.save().unwrap();
    for id in [ftvm_vmm::clock::component_id(), ftvm_vmm::vcpu::component_ids(0)[1].clone()] {
        again.insert(id.clone(), state.get(&id).unwrap().to_vec());
    }
    assert!(again == state, "the restored VM's state");

    // A component this VM has no place for is refused before anything is loaded.
    let mut extra = state.clone();
    extra.put(ComponentId::new("rtc"), &0u64);
    let mut fresh = Vm::new(VmConfig { mem_size: 64 << 20, vcpus: 1, console: console.clone(), devices, ..Default::default() }).unwrap();
    assert_eq!(fresh.restore(&extra).unwrap_err().to_string(), "the saved state has a rtc, which this VM does not");

    let mut no_disk = Vm::new(VmConfig { mem_size: 64 << 20, vcpus: 1, console: console.clone(), ..Default::default() }).unwrap();
    let e = no_disk.restore(&state).unwrap_err();
    assert_eq!(e.to_string(), "the saved VM has devices [disk], this VM has []");

    let other = disk("shape-other", 2 << 20);
    let devices = DeviceConfig { disk: Some(other.clone()), ..Default::default() };
    let mut bigger = Vm::new(VmConfig { mem_size: 64 << 20, vcpus: 1, console: console.clone(), devices, ..Default::default() }).unwrap();
    assert!(bigger.restore(&state).unwrap_err().to_string().contains("disk has 1048576 bytes"));

    let mut two = Vm::new(VmConfig { mem_size: 64 << 20, vcpus: 2, console: console.clone(), ..Default::default() }).unwrap();
    assert!(matches!(two.restore(&state), Err(VmError::ShapeMismatch { got: 1, want: 2 })));

    let mut smaller = Vm::new(VmConfig { mem_size: 32 << 20, vcpus: 1, console, ..Default::default() }).unwrap();
    assert!(smaller.restore(&state).is_err());
    std::fs::remove_file(path).unwrap();
    std::fs::remove_file(other).unwrap();
}
