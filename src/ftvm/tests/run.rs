//! `ftvm run` end to end: real KVM, real guest images.

mod common;

use common::*;

#[test]
fn memtouch_checksum_matches_host_with_one_and_two_vcpus() {
    for (vcpus, pattern) in [(1, "random"), (2, "random"), (2, "hotcold"), (1, "strided stride=5"), (2, "seq")] {
        let cmdline = format!("ws=8M pattern={pattern} writes=300000 report=0");
        let out = run_image("memtouch", &["--vcpus", &vcpus.to_string(), "--cmdline", &cmdline]);
        let text = stdout(&out);
        assert!(out.status.success(), "memtouch {cmdline} on {vcpus} vCPUs failed: {}{}", text, stderr(&out));
        let got = field(&text, "memtouch: done", "checksum").expect("checksum line");
        assert_eq!(got, expected_memtouch_checksum(&cmdline, vcpus), "{cmdline} on {vcpus} vCPUs");
        assert!(text.contains(&format!("writes={}", 300000 * vcpus)), "{text}");
    }
}

#[test]
fn memtouch_without_arguments_runs_and_exits() {
    let out = run_image("memtouch", &["--vcpus", "2"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("writes/s=") && text.contains("pages/s="), "progress lines: {text}");
    let sum = field(&text, "memtouch: done", "checksum").expect("checksum line");
    assert_eq!(sum.len(), 16);
}

#[test]
fn guest_exit_status_becomes_ftvm_status() {
    let out = run_image("probe", &["--cmdline", "exit=7"]);
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    let out = run_image("probe", &["--cmdline", "hello with words", "--vcpus", "3"]);
    assert!(out.status.success());
    assert_eq!(stdout(&out).trim(), "probe: hello vcpus=3 cmdline=hello with words");
}

#[test]
fn guest_faults_are_reported_with_vector_and_rip() {
    for (action, vector, extra) in [
        ("fault=pf", "vector 14 (#PF page fault)", Some("address 0x10")),
        ("fault=ud", "vector 6 (#UD invalid opcode)", None),
        ("fault=gp", "vector 13 (#GP general protection)", Some("error code")),
        ("fault=int3", "vector 3 (#BP breakpoint)", None),
    ] {
        let out = run_image("probe", &["--cmdline", action]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{action}: {err}");
        let line = err.lines().find(|l| l.contains("guest fault")).unwrap_or_else(|| panic!("{action}: no fault line in {err}"));
        assert!(line.contains(vector), "{action}: {line}");
        let rip = line.split("at rip 0x").nth(1).and_then(|r| r.split(|c: char| !c.is_ascii_hexdigit()).next()).unwrap();
        let rip = u64::from_str_radix(rip, 16).unwrap();
        assert!(rip >= 0x20_0000, "{action}: rip {rip:#x} should be inside the image");
        if let Some(extra) = extra {
            assert!(line.contains(extra), "{action}: {line}");
        }
        assert!(!err.contains("panicked at") || action == "panic", "no VMM panic: {err}");
    }
}

/// The address-space hypercall loads a guest-built root (here a copy of
/// the VMM's root table) and the VMM's own again (0); a root that is not a
/// page of RAM above the system area stops the VM with one line saying so.
#[test]
fn page_table_roots_are_loaded_or_refused_with_a_clear_error() {
    let out = run_image("probe", &["--cmdline", "root=copy"]);
    assert!(out.status.success() && stdout(&out).contains("probe: root copy ok value=42"), "{}{}", stdout(&out), stderr(&out));
    let out = run_image("probe", &["--cmdline", "root=0"]);
    assert!(out.status.success() && stdout(&out).contains("probe: root 0x0 loaded"), "{}{}", stdout(&out), stderr(&out));
    // The VMM's own tables (system area), not page-aligned, past the end of RAM.
    for bad in ["0x9000", "0x200800", "0x400000000"] {
        let out = run_image("probe", &["--cmdline", &format!("root={bad}")]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{bad}: {err}");
        let want = format!("vCPU 0: bad hypercall 0x505: page-table root {bad} is not a page of RAM above the system area");
        assert!(err.contains(&want), "{bad}: {err}");
        assert!(!stdout(&out).contains("loaded"), "{bad}: {}", stdout(&out));
    }
}

/// FAULT_HANDLER: a CPL3 page fault is reflected to the registered
/// handler on its stack with the fault's record (address, error code, rip,
/// rsp) and the program's registers; once it is removed the same fault
/// stops the VM as always; a stack top in the system area is refused.
#[test]
fn page_faults_are_reflected_to_a_registered_handler() {
    let out = run_image("probe", &["--cmdline", "reflect=ok"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains("probe: reflect ok addr=0x4000 error=0x7 rip=true rsp=true rbx=0x12345678 stack=true"),
        "{}",
        stdout(&out)
    );
    let out = run_image("probe", &["--cmdline", "reflect=unregister"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("vector 14 (#PF page fault)") && err.contains("error code 0x7, address 0x4000"), "{err}");
    let out = run_image("probe", &["--cmdline", "reflect=badstack"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let want = "vCPU 0: bad hypercall 0x506: fault handler stack top 0x1000 is not 16-byte aligned RAM above the system area";
    assert!(err.contains(want), "{err}");
    assert!(!stdout(&out).contains("registered"), "{}", stdout(&out));
}

#[test]
fn guest_panic_is_reported_with_its_message() {
    let out = run_image("probe", &["--cmdline", "panic"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("guest panicked on vCPU 0") && err.contains("probe panic 42"), "{err}");
}

#[test]
fn runtime_features_work() {
    for (action, vcpus, expect) in [
        ("smp", "2", "probe: smp ok vcpus=2 counter=200000 atomic=200000"),
        ("alloc", "1", "probe: alloc ok"),
        ("time", "1", "probe: time ok"),
        ("sse", "1", "probe: sse ok"),
    ] {
        let out = run_image("probe", &["--vcpus", vcpus, "--cmdline", action]);
        assert!(out.status.success(), "{action}: {}{}", stdout(&out), stderr(&out));
        assert!(stdout(&out).contains(expect), "{action}: {}", stdout(&out));
    }
}
