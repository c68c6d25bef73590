//! `--vcpu-state-reads changing` reads from KVM, at each save, only what a
//! guest at CPL3 can change, and the rest once. Checked here against whole
//! reads under a guest that reaches everything such a guest can: two vCPUs,
//! the Linux personality's threads (their fs base written at CPL3),
//! copy-on-write forks (page faults through the VMM's ring-0 stub), FPU and
//! vector state.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use ftvm_vmm::vcpu::Vcpu;
use ftvm_vmm::{Console, Persist, StateReads, Vm, VmConfig, VmExit};

fn image(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/images").join(name);
    assert!(path.exists(), "guest image {} missing: run scripts/build-images.sh", path.display());
    path
}

/// Run `image` with `cmdline` on `vcpus`, pausing it every 2 ms until it
/// exits: save (the once-read part from the cache), then audit (read whole
/// and compare). Returns how many saves, at how many distinct places.
fn save_and_audit_until_exit(image_name: &str, cmdline: &str, vcpus: u32) -> (usize, usize) {
    let (console, captured) = Console::capture();
    let output = || String::from_utf8_lossy(&captured.lock().unwrap()).into_owned();
    let config = VmConfig { mem_size: 512 << 20, vcpus, console, vcpu_state_reads: StateReads::Changing, ..Default::default() };
    let vm = Vm::new(config).unwrap();
    vm.boot(&image(image_name), None, cmdline).unwrap();
    vm.start().unwrap();
    let mut saves = 0;
    let mut places = HashSet::new();
    while vm.exit_reason().is_none() {
        std::thread::sleep(Duration::from_millis(2));
        vm.pause();
        let saved = vm.save().unwrap();
        assert_eq!(vm.audit_vcpu_state().unwrap(), None, "{image_name} after {saves} saves; guest said:\n{}", output());
        for i in 0..vcpus as usize {
            places.insert((i, Vcpu::state_in(&saved, i).unwrap().regs.rip));
        }
        saves += 1;
        vm.resume();
    }
    assert_eq!(vm.wait(), VmExit::Exited(0), "{image_name}: {}", output());
    (saves, places.len())
}

#[test]
fn the_state_read_once_stays_what_whole_reads_find() {
    // SAFETY: set before this test starts any thread; the only test in this binary.
    unsafe { std::env::set_var(ftvm_vmm::boot::RUNTIME_ENV, image("linux.elf")) };
    // A Linux program (one vCPU): threads, copy-on-write forks.
    let (saves, places) = save_and_audit_until_exit("linux-fork", "-- fork cowloop 1500", 1);
    eprintln!("linux-fork: {saves} saves at {places} places");
    assert!(saves >= 50 && places >= 10, "linux-fork: {saves} saves at {places} places");
    // Two vCPUs writing memory.
    let (saves, places) = save_and_audit_until_exit("memtouch.elf", "ws=4M pattern=seq duration=1s report=0", 2);
    assert!(saves >= 50 && places >= 10, "memtouch: {saves} saves at {places} places");
}
