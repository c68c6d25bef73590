//! The control API (`docs/api.md`) through the real binary: versioned
//! requests, timeouts on both sides, clients served at once, and the CLI
//! commands for every operation.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ftvm_testkit::process::{Process, WaitError};
use ftvm_testkit::scratch::Scratch;

/// Long enough that only a hang reaches it.
const HANG: Duration = Duration::from_secs(30);

/// A probe VM ticking every `ms` with its control socket in a scratch directory.
struct Vm {
    vmm: Process,
    socket: PathBuf,
    _dir: Scratch,
}

fn start(tag: &str, ms: u32) -> Vm {
    let dir = Scratch::new(&format!("api-{tag}")).unwrap();
    let socket = dir.join("api.sock");
    let mut cmd = ftvm();
    cmd.args(["run", "--cmdline", &format!("ticker={ms}"), "--api-socket"]).arg(&socket).arg("--image").arg(image("probe"));
    let mut vmm = Process::spawn_collected("ftvm", &mut cmd).unwrap();
    vmm.wait_until(Duration::from_secs(10), |p| p.stdout().contains("probe: tick")).unwrap_or_else(|e| panic!("{e}: {}", vmm.output()));
    Vm { vmm, socket, _dir: dir }
}

/// `ftvm ARGS --api-socket SOCKET`, killed (and failed) if it hangs.
fn client(args: &[&str], socket: &Path) -> Output {
    let mut cmd = ftvm();
    cmd.args(args).arg("--api-socket").arg(socket).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    Process::spawn(args[0], &mut cmd).unwrap().wait_with_output_within(HANG).unwrap_or_else(|e| panic!("ftvm {args:?}: {e}"))
}

fn ticks(vm: &Vm) -> usize {
    vm.vmm.stdout().lines().filter(|l| l.starts_with("probe: tick")).count()
}

#[test]
fn silent_and_slow_clients_do_not_delay_others() {
    let vm = start("silent", 50);
    // One client connects and never sends anything; another sends a request
    // one byte at a time and never finishes it.
    let _silent = UnixStream::connect(&vm.socket).unwrap();
    let trickling = Arc::new(AtomicBool::new(true));
    let sent = Arc::new(AtomicU32::new(0));
    let mut slow = UnixStream::connect(&vm.socket).unwrap();
    let (t, s) = (trickling.clone(), sent.clone());
    let trickler = std::thread::spawn(move || {
        while t.load(Ordering::SeqCst) {
            if slow.write_all(if s.load(Ordering::SeqCst) == 0 { b"{" } else { b" " }).is_err() {
                break;
            }
            s.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    while sent.load(Ordering::SeqCst) < 3 {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Several clients at once, while both are still connected.
    let others: Vec<_> = (0..4)
        .map(|_| {
            let socket = vm.socket.clone();
            std::thread::spawn(move || client(&["status"], &socket))
        })
        .collect();
    for other in others {
        let out = other.join().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert!(stdout(&out).contains("state: running"), "{}", stdout(&out));
    }
    // The server has not hung up on the slow client to get to the others.
    assert!(!trickler.is_finished(), "the slow client was disconnected");
    trickling.store(false, Ordering::SeqCst);
    trickler.join().unwrap();
}

/// A control socket in a scratch directory whose every connection `serve`
/// takes, on a thread of its own.
fn fake_vmm(tag: &str, serve: fn(UnixStream)) -> (Scratch, PathBuf) {
    let dir = Scratch::new(tag).unwrap();
    let socket = dir.join("api.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || listener.incoming().flatten().for_each(serve));
    (dir, socket)
}

/// A reply that says ok but not what was done (a snapshot without its size)
/// is an invalid reply, not "written: 0 bytes".
#[test]
fn a_snapshot_reply_without_its_size_is_refused() {
    use std::io::{BufRead, BufReader, Write};
    let (dir, socket) = fake_vmm("api-hollow", |stream| {
        let mut line = String::new();
        let _ = BufReader::new(&stream).read_line(&mut line);
        let _ = (&stream).write_all(b"{\"version\":1,\"ok\":true}\n");
    });
    let out = client(&["snapshot", "--output", dir.join("vm.snap").to_str().unwrap()], &socket);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("sent an invalid reply: a snapshot reply without the snapshot's size"), "{err}");
}

#[test]
fn a_server_that_never_answers_is_one_clear_error() {
    // Every connection held, never answered.
    let (_dir, socket) = fake_vmm("api-mute", std::mem::forget);
    let cases: [&'static [&'static str]; 4] = [&["status"], &["pause"], &["stop"], &["status", "--timeout", "1"]];
    let clients: Vec<_> = cases
        .into_iter()
        .map(|args| {
            let socket = socket.clone();
            (args, std::thread::spawn(move || client(args, &socket)))
        })
        .collect();
    for (args, out) in clients {
        let out = out.join().unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.starts_with("ftvm: error: ") && err.contains("did not answer within"), "{args:?}: {err}");
        let want = if args.len() > 1 { "within 1 s" } else { "within 5 s" };
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn pause_resume_stop_and_json_status() {
    let mut vm = start("ops", 20);
    let json = |vm: &Vm| -> serde_json::Value {
        let out = client(&["status", "--json"], &vm.socket);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        serde_json::from_str(stdout(&out).trim()).unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", stdout(&out)))
    };
    let status = json(&vm);
    assert_eq!(status["state"], "running", "{status}");
    assert_eq!(status["version"], 1, "{status}");
    assert_eq!(status["vcpus"], 1, "{status}");

    let out = client(&["pause"], &vm.socket);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(json(&vm)["state"], "paused");
    std::thread::sleep(Duration::from_millis(200));
    let paused_at = ticks(&vm);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(ticks(&vm), paused_at, "the guest ran while paused");

    let out = client(&["resume"], &vm.socket);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(json(&vm)["state"], "running");
    vm.vmm.wait_until(Duration::from_secs(10), |p| p.stdout().matches("probe: tick").count() > paused_at + 5).unwrap();

    let out = client(&["stop"], &vm.socket);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("stopping"), "{}", stdout(&out));
    let status = vm.vmm.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{}", vm.vmm.output());
    assert!(vm.vmm.stderr().contains("VM stopped"), "{}", vm.vmm.output());
    assert!(!vm.socket.exists(), "the socket is removed when the VMM stops");
}

#[test]
fn requests_are_versioned() {
    let vm = start("version", 100);
    let stream = UnixStream::connect(&vm.socket).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut ask = |line: &str| -> serde_json::Value {
        (&stream).write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut reply = String::new();
        reader.read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{line}: reply is not JSON ({e}): {reply}"))
    };
    let r = ask(r#"{"version":2,"op":"status"}"#);
    assert_eq!(r["ok"], false, "{r}");
    assert_eq!(r["version"], 1, "{r}");
    let err = r["error"].as_str().unwrap();
    assert!(err.contains("version 2") && err.contains("version 1"), "{err}");
    let r = ask(r#"{"op":"status"}"#);
    assert_eq!(r["ok"], false, "{r}");
    assert!(r["error"].as_str().unwrap().contains("version"), "{r}");
    let r = ask(r#"{"version":1,"op":"fly"}"#);
    assert_eq!(r["ok"], false, "{r}");
    assert!(r["error"].as_str().unwrap().contains("fly"), "{r}");
    let r = ask("not json");
    assert_eq!(r["ok"], false, "{r}");
    // The connection still serves requests of the right version.
    let r = ask(r#"{"version":1,"op":"status"}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["state"], "running", "{r}");
}

#[test]
fn stop_ends_a_backup_waiting_for_its_primary() {
    let dir = Scratch::new("api-backup").unwrap();
    let socket = dir.join("b.sock");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let mut cmd = ftvm();
    cmd.args(["backup", "--insecure", "--listen", &addr, "--api-socket"]).arg(&socket);
    let mut backup = Process::spawn_collected("backup", &mut cmd).unwrap();
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "control socket never appeared: {}", backup.output());
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = client(&["status"], &socket);
    assert!(stdout(&out).contains("state: standby"), "{}{}", stdout(&out), stderr(&out));
    let out = client(&["stop"], &socket);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    match backup.wait_until(HANG, |_| false) {
        Err(WaitError::Exited(status)) => assert_eq!(status.code(), Some(0), "{}", backup.output()),
        other => panic!("the backup did not stop: {other:?}"),
    }
}

/// A probe VM started under `umask` with these extra options.
fn start_under_umask(tag: &str, umask: &str, extra: &[&str]) -> Vm {
    let dir = Scratch::new(&format!("api-{tag}")).unwrap();
    // Other users must reach the socket's directory for the test to mean anything.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let socket = dir.join("api.sock");
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", &format!("umask {umask}; exec \"$0\" \"$@\""), env!("CARGO_BIN_EXE_ftvm")]);
    cmd.args(["run", "--cmdline", "ticker=50", "--api-socket"]).arg(&socket).args(extra).arg("--image").arg(image("probe"));
    let mut vmm = Process::spawn_collected("ftvm", &mut cmd).unwrap();
    vmm.wait_until(Duration::from_secs(10), |p| p.stdout().contains("probe: tick")).unwrap_or_else(|e| panic!("{e}: {}", vmm.output()));
    Vm { vmm, socket, _dir: dir }
}

/// `ftvm ARGS --api-socket SOCKET` as user nobody (uid and gid 65534).
fn client_as_nobody(args: &[&str], socket: &Path) -> Output {
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_ftvm")]);
    cmd.args(args).arg("--api-socket").arg(socket).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    Process::spawn(args[0], &mut cmd).unwrap().wait_with_output_within(HANG).unwrap_or_else(|e| panic!("ftvm {args:?}: {e}"))
}

fn mode(path: &Path) -> u32 {
    std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).unwrap().permissions()) & 0o777
}

/// Whoever can use the control socket can read all of guest memory: under
/// umask 000 the socket and its snapshots are still the owner's alone, and a
/// client of another user is refused even when the socket's mode lets it in
/// (its peer credentials are checked).
#[test]
fn the_control_socket_and_snapshots_are_owner_only_whatever_the_umask() {
    let vm = start_under_umask("owner", "000", &[]);
    assert_eq!(mode(&vm.socket), 0o600);
    let out = client_as_nobody(&["status"], &vm.socket);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("Permission denied"), "{}", stderr(&out));

    // Loosened by hand: the credentials check still refuses, with a reason.
    std::fs::set_permissions(&vm.socket, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let snap = vm._dir.join("vm.snap");
    let out = client_as_nobody(&["snapshot", "--output", snap.to_str().unwrap()], &vm.socket);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the VMM refused: permission denied: uid 65534 may not use this control socket"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!snap.exists(), "a refused client got a snapshot");

    let out = client(&["snapshot", "--output", snap.to_str().unwrap()], &vm.socket);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(mode(&snap), 0o600, "a snapshot holds all of guest memory");
}

/// `--api-group` lets that group's members in (mode 0660), nobody else.
#[test]
fn an_api_group_lets_its_members_use_the_socket() {
    let vm = start_under_umask("group", "022", &["--api-group", "nogroup"]);
    assert_eq!(mode(&vm.socket), 0o660);
    let meta = std::fs::metadata(&vm.socket).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&meta), 65534);
    let out = client_as_nobody(&["status"], &vm.socket);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("state: running"), "{}", stdout(&out));

    let out = ftvm()
        .args(["run", "--api-socket", "/tmp/x.sock", "--api-group", "no-such-group-ftvm", "--image"])
        .arg(image("probe"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(stderr(&out).trim(), "ftvm: error: --api-group no-such-group-ftvm: no such group");
}

/// Idle connections that fill every place do not lock the operator out:
/// a newcomer ends the one that waited longest.
#[test]
fn idle_clients_in_every_place_do_not_lock_the_operator_out() {
    let vm = start("idle-full", 50);
    let idle: Vec<UnixStream> = (0..64).map(|_| UnixStream::connect(&vm.socket).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let out = client(&["status"], &vm.socket);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("state: running"), "{}", stdout(&out));
    // The oldest idle one was ended (the server shut it down).
    let mut first = &idle[0];
    first.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(std::io::Read::read(&mut first, &mut buf).unwrap(), 0, "the oldest idle client is closed");
}

/// A socket file nobody serves (its VMM ended without removing it) says so.
#[test]
fn a_stale_socket_says_no_vmm_serves_it() {
    let dir = Scratch::new("api-stale").unwrap();
    let socket = dir.join("api.sock");
    drop(UnixListener::bind(&socket).unwrap());
    let out = client(&["status"], &socket);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim(), format!("ftvm: error: no VMM serves {} (a socket left by a VMM that ended)", socket.display()));
}

/// A VM that is not replicated cannot switch over, and says why; a raw
/// request with a relative snapshot path is refused (the VMM's working
/// directory is not the client's).
#[test]
fn switchover_without_replication_and_relative_snapshot_paths_are_refused_clearly() {
    let vm = start("unreplicated", 50);
    let out = client(&["switchover"], &vm.socket);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the VM is not replicated (started without --replicate-to)"), "{err}");

    let stream = UnixStream::connect(&vm.socket).unwrap();
    (&stream).write_all(b"{\"version\":1,\"op\":\"snapshot\",\"path\":\"vm.snap\",\"stop\":false}\n").unwrap();
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply).unwrap();
    assert!(reply.contains("snapshot path vm.snap is not absolute"), "{reply}");

    let out = client(&["replica-replace", "--remove", "2", "--add", "4=127.0.0.1:7104"], &vm.socket);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("this VMM is not a VSMR replica"), "{err}");
}
