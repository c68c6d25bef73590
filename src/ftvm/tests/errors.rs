//! Bad input gets one clear line on stderr and a non-zero exit, never a panic.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;

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

/// A copy of the probe image in `dir` with `patch` applied to its bytes.
fn patched(dir: &Scratch, name: &str, patch: impl FnOnce(&mut Vec<u8>)) -> std::path::PathBuf {
    let mut bytes = std::fs::read(image("probe")).unwrap();
    patch(&mut bytes);
    let path = dir.join(name);
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
    let dir = Scratch::new("errors").unwrap();
    let text = dir.join("text");
    std::fs::write(&text, "#!/bin/sh\necho not a guest\n").unwrap();
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let arm = patched(&dir, "arm", |b| b[18] = 183); // EM_AARCH64
    let elf32 = patched(&dir, "elf32", |b| b[4] = 1);
    let huge = patched(&dir, "huge", |b| {
        // Grow the last loadable segment's memory size to 1 GiB.
        let (phoff, phnum) = (u64_at(b, 32) as usize, u16::from_le_bytes([b[56], b[57]]) as usize);
        let last = (0..phnum).map(|i| phoff + i * 56).rfind(|&o| b[o] == 1).unwrap();
        b[last + 40..last + 48].copy_from_slice(&(1u64 << 30).to_le_bytes());
    });
    let truncated = patched(&dir, "trunc", |b| b.truncate(2000));
    let cases = [
        (dir.join("missing"), "cannot open image"),
        (text, "is not an ELF file"),
        (arm, "machine is not x86-64"),
        (elf32, "not ELF64"),
        (huge, "needs 1027 MiB of guest memory, the VM has 256 MiB"),
        (truncated, "segment extends past the end of the file"),
    ];
    for (path, want) in cases {
        assert_one_line_error(&run_with(&path, &[]), want, &path.display().to_string());
    }
}

#[test]
fn bad_vm_shapes() {
    let probe = image("probe");
    let cases: [(&[&str], &str); 6] = [
        (&["--memory", "18446744073709551615"], "--memory 18446744073709551615 MiB is more than any host can map"),
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
    let dir = Scratch::new("not-a-socket").unwrap();
    let file = dir.join("vm.sock");
    std::fs::write(&file, "").unwrap();
    for path in [&file, &dir.join("")] {
        let out = ftvm().args(["status", "--api-socket"]).arg(path).output().unwrap();
        assert_one_line_error(&out, "is not a control socket (a VMM's --api-socket)", "a file or a directory");
    }
}

#[test]
fn sigterm_and_sigint_stop_the_vm_cleanly() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut cmd = ftvm();
        cmd.args(["run", "--vcpus", "2", "--cmdline", "ticker=10", "--image"])
            .arg(image("probe"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut vmm = Process::spawn("ftvm", &mut cmd).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        vmm.signal(sig).unwrap();
        let t0 = Instant::now();
        let out = vmm.wait_with_output().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "stopping took {:?}", t0.elapsed());
        assert_eq!(out.status.code(), Some(0), "signal {sig}: {}", stderr(&out));
        assert!(stderr(&out).contains("VM stopped"), "{}", stderr(&out));
        assert!(stdout(&out).contains("probe: tick n="), "the guest ran before the signal");
    }
}

/// A witness (replica 3 of a group without a secret, the others absent)
/// logging at info, and its peer address.
fn witness() -> (Process, String) {
    let addrs: Vec<String> = (0..3).map(|_| free_addr()).collect();
    let peers = format!("1={},2={},3={}", addrs[0], addrs[1], addrs[2]);
    let mut cmd = ftvm();
    cmd.args(["replica", "--insecure", "--id", "3", "--peers", &peers, "--witness"]).env("FTVM_LOG", "info");
    (Process::spawn_collected("witness", &mut cmd).unwrap(), addrs[2].clone())
}

fn dial(witness: &mut Process, addr: &str) -> std::net::TcpStream {
    let t0 = Instant::now();
    loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => return s,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(20), "the witness never listened: {e}\n{}", witness.output()),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Peers that never finish their handshake are at most 16 at once: a new
/// one closes the oldest, so idle strangers neither grow a replica's
/// threads and memory without bound nor keep a real peer out.
#[test]
fn idle_peer_links_are_bounded() {
    use ftvm_replication::protocol::{frame, Kind};
    use std::io::{Read, Write};

    let (mut witness, addr) = witness();
    let mut idle: Vec<std::net::TcpStream> = (0..24).map(|_| dial(&mut witness, &addr)).collect();
    let mut peer = dial(&mut witness, &addr);
    peer.write_all(&frame(Kind::PeerHello, &[1, 0, 0, 0])).unwrap();
    let log = wait_log(&mut witness, "peer connected", Duration::from_secs(20));
    assert!(log.lines().any(|l| l.contains("peer connected") && l.contains("id=1")), "{log}");
    let first = &mut idle[0];
    first.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(matches!(first.read(&mut [0; 1]), Ok(0) | Err(_)), "the oldest idle link is still open");
    assert!(witness.output().contains("16 peer links were in their handshake: ended the oldest for this one"), "{}", witness.output());
}

/// A peer link that sends its handshake a byte at a time, each well within
/// the read timeout, is closed at its 5 s deadline, though no other
/// connection arrives to make the replica look.
#[test]
fn a_slow_peer_handshake_is_closed_at_its_deadline() {
    use std::io::Write;

    let (mut witness, addr) = witness();
    let mut slow = dial(&mut witness, &addr);
    let t0 = Instant::now();
    let header = ftvm_replication::protocol::frame(ftvm_replication::protocol::Kind::PeerHello, &[1, 0, 0, 0]);
    let mut closed = false;
    for byte in header.iter().cycle().take(20) {
        std::thread::sleep(Duration::from_millis(750));
        if slow.write_all(&[*byte]).is_err() {
            closed = true;
            break;
        }
    }
    let after = t0.elapsed();
    assert!(closed, "the slow link is still open after {after:?}\n{}", witness.output());
    let log = wait_log(&mut witness, "no complete handshake within 5000 ms", Duration::from_secs(10));
    assert!(log.contains("refused a peer link: no complete handshake within 5000 ms"), "{log}");
}

/// A raft append whose entries do not follow its index (raft-rs panics on
/// one) from a peer of a group without a secret is dropped with a warning:
/// the witness lives on.
#[test]
fn a_malformed_raft_append_is_dropped() {
    use ftvm_replication::protocol::{frame, Kind};
    use std::io::Write;

    let (mut witness, addr) = witness();
    let mut link = dial(&mut witness, &addr);
    // Protobuf by hand: (field << 3 | wire type) then a varint or a length.
    let varint = |mut n: u64, out: &mut Vec<u8>| loop {
        let low = (n & 0x7f) as u8;
        n >>= 7;
        out.push(if n == 0 { low } else { low | 0x80 });
        if n == 0 {
            break;
        }
    };
    let fields = |numbers: &[(u64, u64)], out: &mut Vec<u8>| numbers.iter().for_each(|&(f, v)| (varint(f << 3, out), varint(v, out)).1);
    let mut entry = Vec::new();
    fields(&[(2, 1), (3, 5)], &mut entry); // term 1, index 5
    let mut append = Vec::new();
    fields(&[(1, 3), (2, 3), (3, 1), (4, 1), (5, 0), (6, 0)], &mut append); // MsgAppend 1 -> 3, term 1, after index 0
    varint(7 << 3 | 2, &mut append);
    varint(entry.len() as u64, &mut append);
    append.extend_from_slice(&entry);
    fields(&[(8, 5)], &mut append); // commit 5
                                    // PeerHello { id: 1, witness: false, standby: false, disk: 0 } (postcard).
    let mut bytes = frame(Kind::PeerHello, &[1, 0, 0, 0]);
    bytes.extend(frame(Kind::Raft, &append));
    link.write_all(&bytes).unwrap();
    wait_log(&mut witness, "dropped an append whose entries do not follow its index", Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(300));
    assert!(witness.try_wait().is_none(), "the witness ended: {}", witness.output());
}

/// A replica that fails to start (its peer port is taken) leaves no
/// `--raft-state` file behind, and one that was there before untouched.
#[test]
fn a_replica_that_fails_to_start_leaves_no_raft_state_file() {
    let dir = Scratch::new("raft-state").unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peers = format!("1={},2={},3={}", free_addr(), free_addr(), taken.local_addr().unwrap());
    let fresh = dir.join("fresh.state");
    let kept = dir.join("kept.state");
    std::fs::write(&kept, b"").unwrap();
    for state in [&fresh, &kept] {
        let out = ftvm()
            .args(["replica", "--id", "3", "--peers", &peers, "--witness", "--insecure", "--raft-state"])
            .arg(state)
            .output()
            .unwrap();
        assert_one_line_error(&out, "cannot listen on", "taken peer port");
    }
    assert!(!fresh.exists(), "a failed replica left {}", fresh.display());
    assert!(kept.exists(), "a failed replica removed the file it found");
}
