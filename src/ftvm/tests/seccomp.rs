//! Seccomp filters are on by default (so every other end-to-end test runs
//! the VMM under them): a thread of each kind that makes a system call its
//! filter forbids ends the VMM with one line naming the thread and the call
//! (exit status 159, 128 + SIGSYS); `--no-seccomp` turns the filters off.
//! The forbidden call is made on request of `FTVM_TEST_FAULT=forbidden-syscall:KIND`
//! right after the thread installed its filter.

mod common;

use std::os::unix::net::UnixStream;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

const HANG: Duration = Duration::from_secs(60);

fn finish(name: &str, cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    Process::spawn(name, cmd).unwrap().wait_with_output_within(HANG).unwrap()
}

fn assert_killed(out: &Output, thread: &str, kind: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(159), "{kind}: {err}");
    let line = format!("ftvm: error: thread {thread} ({kind} filter) made system call 135 (personality), which its seccomp filter forbids");
    assert!(err.contains(&line), "{kind}: expected {line:?} in: {err}");
}

#[test]
fn a_forbidden_system_call_ends_the_vmm_with_one_line() {
    let dir = Scratch::new("seccomp").unwrap();
    let disk = dir.sparse_file("disk.img", 1 << 20).unwrap();
    let run = |kind: &str, extra: &[&str]| {
        let mut cmd = ftvm();
        cmd.args(["run", "--cmdline", "ticker=20", "--image", image("probe").to_str().unwrap()])
            .args(extra)
            .env("FTVM_TEST_FAULT", format!("forbidden-syscall:{kind}"));
        cmd
    };
    let out = finish("vmm", &mut run("vmm", &[]));
    assert_killed(&out, "ftvm", "vmm");
    let out = finish("vcpu", &mut run("vcpu", &[]));
    assert_killed(&out, "vcpu0", "vcpu");
    let out = finish("device", &mut run("device", &["--disk", disk.to_str().unwrap()]));
    assert_killed(&out, "device0", "device");

    // A control-socket client thread: started when a client connects.
    let socket = dir.join("api.sock");
    let mut vmm = Process::spawn_collected("api", run("api", &["--api-socket", socket.to_str().unwrap()]).stdin(Stdio::null())).unwrap();
    let connected = vmm.wait_until(HANG, |_| UnixStream::connect(&socket).is_ok());
    assert!(connected.is_ok() || vmm.try_wait().is_some(), "{}", vmm.output());
    let status = exit_status(&mut vmm, HANG);
    assert_eq!(status.code(), Some(159), "{}", vmm.output());
    assert!(vmm.output().contains("thread api-client (api filter) made system call 135 (personality)"), "{}", vmm.output());

    // Without filters the same request changes nothing.
    let mut cmd = ftvm();
    cmd.args(["run", "--no-seccomp", "--cmdline", "exit=7", "--image", image("probe").to_str().unwrap()])
        .env("FTVM_TEST_FAULT", "forbidden-syscall:vcpu");
    assert_eq!(finish("unfiltered", &mut cmd).status.code(), Some(7));
}

/// A primary replicating to a backup, with `FTVM_TEST_FAULT=fault`: how it
/// ended.
fn primary_with_fault(fault: &str) -> Output {
    let addr = free_addr();
    let _backup =
        Process::spawn_collected("backup", ftvm().args(["backup", "--insecure", "--listen", &addr]).stdin(Stdio::null())).unwrap();
    let mut primary = ftvm();
    primary
        .args(["run", "--cmdline", "ticker=20", "--insecure", "--replicate-to", &addr, "--image", image("probe").to_str().unwrap()])
        .env("FTVM_TEST_FAULT", fault);
    finish("primary", &mut primary)
}

#[test]
fn a_replication_thread_is_filtered_too() {
    let out = primary_with_fault("forbidden-syscall:replication");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(159), "{err}");
    assert!(err.contains("(replication filter) made system call 135 (personality)"), "{err}");
}

/// A host name in an address is looked up under the filters: one that does
/// not resolve is an error naming it, not a forbidden call.
#[test]
fn a_host_name_is_looked_up_under_the_filters() {
    let out = finish("backup", ftvm().args(["backup", "--insecure", "--listen", "nosuch.invalid:47999"]));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("nosuch.invalid") && !err.contains("seccomp"), "{err}");
    assert_eq!(err.trim().lines().filter(|l| l.starts_with("ftvm: error")).count(), 1, "{err}");
}

/// A thread that panics under its filter says so in one line (the
/// default panic output made calls the filter forbids, and the process
/// ended by SIGSYS with a line about getcwd instead).
#[test]
fn a_panic_under_a_filter_is_reported_as_a_panic() {
    let out = primary_with_fault("panic:replication");
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(159), "{err}");
    assert!(err.contains("panicked at") && err.contains("test fault: a replication thread panics under its filter"), "{err}");
    assert!(!err.contains("seccomp filter forbids"), "{err}");
}
