//! A backup's replica made in its primary's shape, or the reason this
//! backup refuses that primary.

use std::fs::OpenOptions;
use std::path::Path;

use ftvm_replication::pipeline::apply::{DiskImage, Replica, Staged};
use ftvm_replication::protocol::Hello;
use ftvm_vmm::arch::compat::CpuProfile;
use ftvm_vmm::devices::KindList;
use ftvm_vmm::{Vm, VmConfig};

use super::BackupConfig;

/// A replica in the primary's shape, or why this backup refuses it.
/// `host` is what this host offers a vCPU.
pub fn for_primary(c: &BackupConfig, host: &CpuProfile, hello: &Hello) -> Result<Replica, String> {
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
    // So is the host, so that an incompatible one is found now, not at failover.
    host.can_restore(&hello.cpu).map_err(|e| format!("this host cannot run the primary's vCPUs: {e}"))?;
    // Devices are compared before the disk replica is touched.
    let ours = c.devices.kinds();
    if ours != hello.devices {
        return Err(format!("the primary's VM has devices {} but this backup was given {}", KindList(&hello.devices), KindList(&ours)));
    }
    let disk_size = match (&c.devices.disk, hello.disk_size) {
        (Some(path), Some(size)) => {
            prepare_disk(path, size)?;
            size
        }
        _ => 0,
    };
    // Built after the disk is sized: the VM's disk takes the file's size.
    let config = VmConfig {
        mem_size: hello.mem_size,
        vcpus: hello.vcpus,
        prefault: c.prefault,
        dirty_backend: c.dirty_backend,
        idle_pause: c.idle_pause,
        vcpu_state_reads: c.vcpu_state_reads,
        console: c.console.clone(),
        devices: c.devices.clone(),
    };
    let vm = Vm::new(config).map_err(|e| format!("cannot build the replica VM: {e}"))?;
    if vm.devices().kinds() != ours {
        return Err(format!("this backup's VM has devices {} instead of {}", KindList(&vm.devices().kinds()), KindList(&ours)));
    }
    let disk = match &c.devices.disk {
        Some(path) if hello.disk_size.is_some() => {
            let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| format!("cannot open the disk replica: {e}"))?;
            Some(Box::new(f) as Box<dyn DiskImage>)
        }
        _ => None,
    };
    Ok(Replica {
        vm,
        disk,
        disk_name: c.devices.disk.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        disk_size,
        committed: None,
        fake_ack: None,
        output: Vec::new(),
        next_epoch: hello.first_epoch,
        usable: true,
        owner_seen: None,
        staged: Staged::default(),
    })
}

/// Make the file at `path` an empty replica of a `size`-byte disk, or say
/// why it cannot be one. A file smaller than the primary's disk is refused
/// untouched; otherwise it is emptied (pre-copy sends everything that is
/// not zero) and given exactly the primary's size.
fn prepare_disk(path: &Path, size: u64) -> Result<(), String> {
    let name = path.display();
    let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| format!("cannot open the disk replica {name}: {e}"))?;
    let ours = f.metadata().map_err(|e| format!("cannot read the size of the disk replica {name}: {e}"))?.len();
    if ours < size {
        return Err(format!("the primary's disk has {size} bytes, this backup's --disk {name} only {ours}"));
    }
    f.set_len(0).and_then(|_| f.set_len(size)).map_err(|e| format!("cannot size the disk replica {name}: {e}"))
}
