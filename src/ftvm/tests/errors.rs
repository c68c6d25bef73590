//! Bad input gets one clear line on stderr and a non-zero exit, never a panic.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn scratch(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("ftvm-err-{}-{name}", std::process::id()))
}

fn assert_one_line_error(out: &std::process::Output, want: &str, case: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{case}: {err}");
    assert_eq!(err.lines().count(), 1, "{case}: exactly one line: {err}");
    assert!(err.starts_with("ftvm: error: "), "{case}: {err}");
    assert!(err.contains(want), "{case}: expected '{want}' in: {err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{case}: {err}");
}

fn run_with(image: &std::path::Path, args: &[&str]) -> std::process::Output {
    ftvm().arg("run").arg("--image").arg(image).args(args).output().unwrap()
}

/// A copy of the probe image with `patch` applied to its bytes.
fn patched(name: &str, patch: impl FnOnce(&mut Vec<u8>)) -> std::path::PathBuf {
    let mut bytes = std::fs::read(image("probe")).unwrap();
    patch(&mut bytes);
    let path = scratch(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn missing_kvm_device() {
    let out = ftvm().env("FTVM_KVM_DEVICE", "/nonexistent/kvm").args(["run", "--image"]).arg(image("probe")).output().unwrap();
    assert_one_line_error(&out, "/nonexistent/kvm does not exist", "missing /dev/kvm");
}

#[test]
fn bad_images() {
    let text = scratch("text");
    std::fs::write(&text, "#!/bin/sh\necho not a guest\n").unwrap();
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let arm = patched("arm", |b| b[18] = 183); // EM_AARCH64
    let elf32 = patched("elf32", |b| b[4] = 1);
    let huge = patched("huge", |b| {
        // Grow the last loadable segment's memory size to 1 GiB.
        let (phoff, phnum) = (u64_at(b, 32) as usize, u16::from_le_bytes([b[56], b[57]]) as usize);
        let last = (0..phnum).map(|i| phoff + i * 56).rfind(|&o| b[o] == 1).unwrap();
        b[last + 40..last + 48].copy_from_slice(&(1u64 << 30).to_le_bytes());
    });
    let truncated = patched("trunc", |b| b.truncate(2000));
    let cases = [
        (scratch("missing"), "cannot open image"),
        (text, "is not an ELF file"),
        (arm, "machine is not x86-64"),
        (elf32, "not ELF64"),
        (huge, "needs 1027 MiB of guest memory, the VM has 256 MiB"),
        (truncated, "segment extends past the end of the file"),
    ];
    for (path, want) in cases {
        assert_one_line_error(&run_with(&path, &[]), want, &path.display().to_string());
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn bad_vm_shapes() {
    let probe = image("probe");
    let cases: [(&[&str], &str); 5] = [
        (&["--vcpus", "99"], "99 vCPUs requested"),
        (&["--vcpus", "0"], "0 vCPUs requested"),
        (&["--memory", "4", "--vcpus", "4"], "too little guest memory"),
        (&["--memory", "5"], "multiple of 2 MiB"),
        (&["--memory", "1000000"], "multiple of 2 MiB between 4 MiB and 63 GiB"),
    ];
    for (args, want) in cases {
        assert_one_line_error(&run_with(&probe, args), want, &format!("{args:?}"));
    }
}

#[test]
fn unreachable_control_socket() {
    let out = ftvm().args(["status", "--api-socket", "/nonexistent/ftvm.sock"]).output().unwrap();
    assert_one_line_error(&out, "cannot reach the VMM at /nonexistent/ftvm.sock", "status");
}

#[test]
fn sigterm_and_sigint_stop_the_vm_cleanly() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let child = ftvm()
            .args(["run", "--vcpus", "2", "--cmdline", "ticker=10", "--image"])
            .arg(image("probe"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(child.id() as i32, sig) };
        let t0 = Instant::now();
        let out = child.wait_with_output().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "stopping took {:?}", t0.elapsed());
        assert_eq!(out.status.code(), Some(0), "signal {sig}: {}", stderr(&out));
        assert!(stderr(&out).contains("VM stopped"), "{}", stderr(&out));
        assert!(stdout(&out).contains("probe: tick n="), "the guest ran before the signal");
    }
}
