//! A VM's whole life on real KVM: many vCPUs start, the guest exits, the
//! VMM joins and drops everything without touching a finished thread.

use std::path::PathBuf;

use ftvm_vmm::{Console, Vm, VmConfig, VmExit};

fn image(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/images").join(format!("{name}.elf"));
    assert!(path.exists(), "guest image {} missing: run scripts/build-images.sh", path.display());
    path
}

/// With 20 or more vCPUs, dropping a VM whose threads `wait` had joined
/// signalled thread ids that were gone (SIGSEGV, the exit status lost).
#[test]
fn many_vcpus_exit_and_drop_cleanly() {
    for vcpus in [20, 32] {
        let (console, _) = Console::capture();
        let vm = Vm::new(VmConfig { mem_size: 256 << 20, vcpus, console, ..Default::default() }).unwrap();
        vm.boot(&image("probe"), None, "exit=3").unwrap();
        vm.start().unwrap();
        assert_eq!(vm.wait(), VmExit::Exited(3), "{vcpus} vCPUs");
        vm.request_stop();
        drop(vm);
    }
}
