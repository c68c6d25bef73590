//! Operator workflows on the network test topology (`scripts/netns.sh`),
//! with the kv guest, real clients writing unique keys, and real host
//! deaths. Needs root, KVM and redis-cli (scripts/setup.sh).
//!
//! - `a_restored_vm_is_protected_from_the_start`: a snapshot of a kv guest
//!   restored with `--replicate-to`; its primary killed, the backup takes
//!   over with every write from before the snapshot and after the restore.
//! - `a_promoted_backup_protects_itself_with_its_standby`: primary ->
//!   backup1 (`--standby` backup2, backup3): the primary killed, backup1
//!   takes over and is protected by backup2 without an operator (`ftvm
//!   status` shows it); backup2 killed, backup1 is protected by backup3;
//!   backup1's host cut, backup3 takes over; no acknowledged write lost.
//! - `switchover_hands_the_vm_over_without_losing_output`: `ftvm
//!   switchover` while clients write: the primary exits 0, the backup runs
//!   the VM, every acknowledged write is there; again with an etcd arbiter
//!   (`switchover_with_an_arbiter_hands_over_ownership_too`).
//! - `upgrade_sequence_moves_the_vm_without_losing_a_write`: the upgrade
//!   of docs/operations.md step by step under writing clients: the backup
//!   restarted and attached again, `ftvm switchover`, a backup started on
//!   the old primary's host protects the VM through `--standby`.
//! - `the_operations_guide_files_check`: the systemd units, the Prometheus
//!   configuration and its alert rules of docs/ops/ pass systemd-analyze and
//!   promtool, and the alerts fire on series shaped like ftvm's.
//! - `the_vmm_drops_to_an_unprivileged_user`: `--user nobody`: the kv guest
//!   serves on its TAP and disk, the VMM has nobody's IDs and no capability,
//!   and writes only where nobody may.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{ftvm, guest_kv, image, net_on, scratch_for, spawn_logged, status, wait_log, wait_status};
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR, H1_REPL_ADDR, H2_REPL_ADDR};
use ftvm_testkit::writers::{self, Writers};

const VALUE_LEN: usize = 200;

/// `ftvm backup` in `role`'s namespace on TAP `tap`, listening on `listen`.
fn start_backup(topo: &Topology, dir: &Scratch, role: &str, tap: &str, listen: &str, extra: &[&str]) -> Process {
    let mut cmd = topo.command(role, env!("CARGO_BIN_EXE_ftvm"));
    cmd.args(["backup", "--insecure", "--listen", listen, "--net", &net_on(tap), "--api-socket"])
        .arg(dir.join(format!("{}.sock", listen.replace([':', '.'], "_"))))
        .args(extra)
        .env("FTVM_LOG", "info");
    // One log per process, though several listen on the same address in turn.
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    let n = STARTED.fetch_add(1, Ordering::Relaxed);
    spawn_logged(cmd, "backup", dir, &format!("{}-{n}", listen.replace([':', '.'], "_")))
}

fn backup_socket(dir: &Scratch, listen: &str) -> std::path::PathBuf {
    dir.join(format!("{}.sock", listen.replace([':', '.'], "_")))
}

/// A kv primary in h1 on tap0 (`ftvm run` or `ftvm restore`, by `args`).
fn start_primary(topo: &Topology, dir: &Scratch, tag: &str, args: &[String]) -> Process {
    let mut cmd = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    cmd.args(args).args(["--net", &net_on("tap0"), "--api-socket"]).arg(dir.join(format!("{tag}.sock"))).env("FTVM_LOG", "info");
    spawn_logged(cmd, "primary", dir, tag)
}

fn kv_run(backup: Option<&str>) -> Vec<String> {
    let mut args: Vec<String> =
        vec!["run".into(), "--image".into(), image("kv").display().to_string(), "--cmdline".into(), format!("ip={GUEST_ADDR}/24")];
    if let Some(b) = backup {
        args.extend(["--insecure".into(), "--replicate-to".into(), b.into()]);
    }
    args
}

fn writers(topo: &Topology, prefix: &str) -> Writers {
    Writers::start(writers::Config {
        addr: guest_kv(),
        netns: Some(topo.ns("client")),
        connections: 4,
        pipeline: 2,
        value_len: VALUE_LEN,
        prefix: prefix.into(),
        timeout: Duration::from_secs(2),
    })
    .unwrap()
}

/// Writes go on until one was acknowledged after `mark` (the VM serves
/// again), then stop; their acknowledged keys.
fn until_served_again(w: Writers, mark: Instant) -> Vec<String> {
    w.mark(mark);
    let t0 = Instant::now();
    while w.first_ack_after_mark().is_none() && t0.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(w.first_ack_after_mark().is_some(), "no write acknowledged after the hand-over");
    std::thread::sleep(Duration::from_millis(300));
    w.stop().acked
}

/// Every key of `acked` reads back from the VM serving now.
fn assert_none_lost(topo: &Topology, acked: &[String]) {
    let client = topo.ns("client");
    let verified = writers::verify(guest_kv(), Some(&client), acked, VALUE_LEN, Instant::now() + Duration::from_secs(15)).unwrap();
    eprintln!("acknowledged {}, verified {}, lost {}", acked.len(), verified.checked, verified.lost());
    assert!(!acked.is_empty());
    assert_eq!(
        verified.lost(),
        0,
        "missing {:?}, wrong {:?}",
        &verified.missing[..verified.missing.len().min(5)],
        &verified.wrong[..verified.wrong.len().min(5)]
    );
}

#[test]
fn a_restored_vm_is_protected_from_the_start() {
    let topo = Topology::new("oprest").unwrap();
    topo.restore().unwrap();
    let dir = scratch_for("operations", "restore");
    let backup_addr = format!("{H2_REPL_ADDR}:7000");

    // An unreplicated kv guest takes writes, then is snapshotted and stopped.
    let mut vm = start_primary(&topo, &dir, "original", &kv_run(None));
    let w = writers(&topo, "before");
    let t0 = Instant::now();
    while w.acked() < 200 && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut acked = w.stop().acked;
    assert!(acked.len() >= 200, "the original VM acknowledged only {} writes: {}", acked.len(), vm.stderr());
    let snap = dir.join("kv.snap");
    let out =
        ftvm().args(["snapshot", "--stop", "--api-socket"]).arg(dir.join("original.sock")).arg("--output").arg(&snap).output().unwrap();
    assert!(out.status.success(), "ftvm snapshot: {}", String::from_utf8_lossy(&out.stderr));
    assert!(vm.wait().unwrap().success(), "{}", vm.stderr());

    // Restored with replication: protected before it serves a write.
    let mut backup = start_backup(&topo, &dir, "h2", "tap0", &backup_addr, &[]);
    // (As an unprivileged user: replication needs no privilege once the VM is open.)
    let restore: Vec<String> =
        ["restore", "--snapshot", &snap.display().to_string(), "--insecure", "--replicate-to", &backup_addr, "--user", "nobody"]
            .map(String::from)
            .into();
    let mut primary = start_primary(&topo, &dir, "restored", &restore);
    let socket = dir.join("restored.sock");
    wait_status(&socket, "protected: yes", &mut primary, Duration::from_secs(30));
    let st = status(&socket);
    assert!(st.contains("role: primary") && st.contains(&format!("backup: {backup_addr}")), "{st}");

    let w = writers(&topo, "after");
    std::thread::sleep(Duration::from_millis(800));
    primary.kill();
    wait_log(&mut backup, "PRIMARY LOST", Duration::from_secs(10));
    topo.forget_guest().unwrap();
    acked.extend(until_served_again(w, Instant::now()));
    assert_none_lost(&topo, &acked);
    assert!(acked.iter().any(|k| k.starts_with("before")) && acked.iter().any(|k| k.starts_with("after")));
}

/// A second TAP on h1's bridge, for a second VMM on that host.
fn add_tap(topo: &Topology, role: &str, tap: &str) {
    let ns = topo.ns(role);
    for args in [
        vec!["-n", &ns, "tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr"],
        vec!["-n", &ns, "link", "set", tap, "master", "br0", "up"],
    ] {
        let out = Command::new("ip").args(&args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn a_promoted_backup_protects_itself_with_its_standby() {
    let topo = Topology::new("opstby").unwrap();
    topo.restore().unwrap();
    let dir = scratch_for("operations", "standby");
    // backup1 on h2; its standbys backup2 and backup3 on h1 beside the
    // primary (TAPs of their own); the first standby listed never answers.
    add_tap(&topo, "h1", "tap1");
    add_tap(&topo, "h1", "tap2");
    let (b1, b2, b3) = (format!("{H2_REPL_ADDR}:7000"), format!("{H1_REPL_ADDR}:7001"), format!("{H1_REPL_ADDR}:7002"));
    let standbys = format!("{H2_REPL_ADDR}:7999,{b2},{b3}");
    let mut backup2 = start_backup(&topo, &dir, "h1", "tap1", &b2, &[]);
    let mut backup3 = start_backup(&topo, &dir, "h1", "tap2", &b3, &[]);
    let mut backup1 = start_backup(&topo, &dir, "h2", "tap0", &b1, &["--standby", &standbys]);
    let mut primary = start_primary(&topo, &dir, "primary", &kv_run(Some(&b1)));
    let socket = dir.join("primary.sock");
    wait_status(&socket, "protected: yes", &mut primary, Duration::from_secs(30));
    let (s1, s2, s3) = (backup_socket(&dir, &b1), backup_socket(&dir, &b2), backup_socket(&dir, &b3));
    let st = status(&s1);
    assert!(st.contains("role: backup") && st.contains(&format!("standbys: {}", standbys.replace(',', ", "))), "{st}");

    // The primary dies: backup1 takes over, then backup2 protects it.
    let w = writers(&topo, "first");
    std::thread::sleep(Duration::from_millis(600));
    primary.kill();
    wait_log(&mut backup1, "PRIMARY LOST", Duration::from_secs(10));
    topo.forget_guest().unwrap();
    let st = wait_status(&s1, "protected: yes", &mut backup1, Duration::from_secs(60));
    assert!(st.contains("role: primary") && st.contains(&format!("backup: {b2}")), "backup1 after takeover: {st}");
    let st = status(&s2);
    assert!(st.contains("role: backup") && st.contains("protected: yes"), "backup2: {st}");
    let mut acked = until_served_again(w, Instant::now());

    // Its backup dies: the next standby that answers, backup3, protects it.
    let w = writers(&topo, "second");
    std::thread::sleep(Duration::from_millis(400));
    backup2.kill();
    let t0 = Instant::now();
    loop {
        let st = status(&s1);
        if st.contains("protected: yes") && st.contains(&format!("backup: {b3}")) {
            break;
        }
        assert!(backup1.running(), "{}", backup1.stderr());
        assert!(t0.elapsed() < Duration::from_secs(60), "backup1 not protected by backup3: {st}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = status(&s3);
    assert!(st.contains("role: backup") && st.contains("protected: yes"), "backup3: {st}");
    acked.extend(until_served_again(w, Instant::now()));

    // backup1's host dies: backup3 takes over.
    let w = writers(&topo, "third");
    std::thread::sleep(Duration::from_millis(600));
    topo.cut_host("h2").unwrap();
    backup1.kill();
    wait_log(&mut backup3, "PRIMARY LOST", Duration::from_secs(10));
    topo.forget_guest().unwrap();
    acked.extend(until_served_again(w, Instant::now()));
    let st = status(&s3);
    assert!(st.contains("role: primary"), "backup3 after takeover: {st}");
    assert_none_lost(&topo, &acked);
}

#[test]
fn switchover_hands_the_vm_over_without_losing_output() {
    switchover(false);
}

#[test]
fn switchover_with_an_arbiter_hands_over_ownership_too() {
    switchover(true);
}

/// `ftvm switchover` under writes; with `arbiter`, an etcd in h2 that both
/// sides use (the backup must win ownership to run the VM).
fn switchover(arbiter: bool) {
    let topo = Topology::new(if arbiter { "opswia" } else { "opswit" }).unwrap();
    topo.restore().unwrap();
    let dir = scratch_for("operations", if arbiter { "switchover-arbiter" } else { "switchover" });
    let backup_addr = format!("{H2_REPL_ADDR}:7000");
    let etcd = arbiter.then(|| Etcd::start_in(dir.path(), &topo.ns("h2"), &[H2_REPL_ADDR, "127.0.0.1"]).unwrap());
    let (on_h1, on_h2) = match &etcd {
        Some(e) => (vec!["--arbiter".to_string(), e.endpoint().to_string()], vec!["--arbiter".to_string(), e.endpoint_on("127.0.0.1")]),
        None => (vec![], vec![]),
    };
    let mut backup = start_backup(&topo, &dir, "h2", "tap0", &backup_addr, &on_h2.iter().map(String::as_str).collect::<Vec<_>>());
    let mut run = kv_run(Some(&backup_addr));
    run.extend(on_h1);
    let mut primary = start_primary(&topo, &dir, "primary", &run);
    let socket = dir.join("primary.sock");

    // Not a primary: refused with one line.
    wait_status(&backup_socket(&dir, &backup_addr), "role: backup", &mut backup, Duration::from_secs(10));
    let out = ftvm().args(["switchover", "--api-socket"]).arg(backup_socket(&dir, &backup_addr)).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("this VMM is a backup: ask its primary to switch over") && err.lines().count() == 1, "{err}");
    wait_status(&socket, "protected: yes", &mut primary, Duration::from_secs(30));

    let w = writers(&topo, "switch");
    std::thread::sleep(Duration::from_millis(800));
    let before = w.acked();
    let out = ftvm().args(["switchover", "--api-socket"]).arg(&socket).output().unwrap();
    let at = Instant::now();
    assert!(out.status.success(), "ftvm switchover: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("handed over to the backup {backup_addr}")));
    let exit = primary.wait().unwrap();
    assert!(exit.success(), "the primary after a switch-over: {exit:?} {}", primary.stderr());
    assert!(primary.stderr().contains("VM handed over to its backup"), "{}", primary.stderr());
    let log = wait_log(&mut backup, "HANDED OVER", Duration::from_secs(5));
    assert!(!log.contains("PRIMARY LOST"), "{log}");
    assert_eq!(log.contains("this backup owns the VM now"), arbiter, "{log}");
    let acked = until_served_again(w, at);
    assert!(before > 0);
    assert_none_lost(&topo, &acked);
    let st = status(&backup_socket(&dir, &backup_addr));
    assert!(st.contains("role: primary") && st.contains("switch-over"), "{st}");
}

/// `key:` line of /proc/PID/status, its fields.
fn proc_status(pid: u32, key: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_default().split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn the_vmm_drops_to_an_unprivileged_user() {
    let topo = Topology::new("opuser").unwrap();
    topo.restore().unwrap();
    let dir = scratch_for("operations", "user");
    let id = |flag: &str| String::from_utf8(Command::new("id").args([flag, "nobody"]).output().unwrap().stdout).unwrap().trim().to_string();
    let (uid, gid) = (id("-u"), id("-g"));
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let mut args = kv_run(None);
    args.extend(["--user".into(), "nobody".into(), "--disk".into(), disk.display().to_string()]);
    let mut vm = start_primary(&topo, &dir, "vm", &args);
    let socket = dir.join("vm.sock");
    wait_status(&socket, "state: running", &mut vm, Duration::from_secs(20));

    // The guest serves on its TAP; the VMM holds no privilege.
    let t0 = Instant::now();
    loop {
        let (ok, out) = topo.redis_cli(GUEST_ADDR, &["SET", "user", "nobody"]);
        if ok && out.trim() == "OK" {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the guest does not serve: {out}\n{}", vm.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, out) = topo.redis_cli(GUEST_ADDR, &["GET", "user"]);
    assert!(ok && out.trim() == "nobody", "{out}");
    assert_eq!(proc_status(vm.id(), "Uid:"), [uid.as_str(); 4].join(" "));
    assert_eq!(proc_status(vm.id(), "Gid:"), [gid.as_str(); 4].join(" "));
    assert_eq!(proc_status(vm.id(), "Groups:"), "");
    assert_eq!(proc_status(vm.id(), "CapEff:"), "0000000000000000");

    // It writes only where that user may: not in a directory of root's (0700).
    let private = dir.join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let out = ftvm().args(["snapshot", "--api-socket"]).arg(&socket).arg("--output").arg(private.join("vm.snap")).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"), "{}", String::from_utf8_lossy(&out.stderr));
    let open = dir.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = ftvm().args(["snapshot", "--api-socket"]).arg(&socket).arg("--output").arg(open.join("vm.snap")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(open.join("vm.snap")).unwrap());
    assert_eq!(owner.to_string(), uid);

    let out = ftvm().args(["stop", "--api-socket"]).arg(&socket).output().unwrap();
    assert!(out.status.success());
    assert!(vm.wait().unwrap().success(), "{}", vm.stderr());

    // A user that does not exist: one line, before anything starts.
    let out = ftvm().args(["run", "--image"]).arg(image("probe")).args(["--user", "ftvm-no-such-user"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim(), "ftvm: error: --user ftvm-no-such-user: no such user");
}

#[test]
fn upgrade_sequence_moves_the_vm_without_losing_a_write() {
    let topo = Topology::new("opupgr").unwrap();
    topo.restore().unwrap();
    let dir = scratch_for("operations", "upgrade");
    let (h1, h2) = (format!("{H1_REPL_ADDR}:7000"), format!("{H2_REPL_ADDR}:7000"));
    let standby = ["--standby", h1.as_str()];
    let mut backup = start_backup(&topo, &dir, "h2", "tap0", &h2, &standby);
    let mut primary = start_primary(&topo, &dir, "primary", &kv_run(Some(&h2)));
    let socket = dir.join("primary.sock");
    wait_status(&socket, "protected: yes", &mut primary, Duration::from_secs(30));
    let w = writers(&topo, "upgrade");
    std::thread::sleep(Duration::from_millis(500));

    // 1. The backup restarts (with the new ftvm): the primary loses it.
    let out = ftvm().args(["stop", "--api-socket"]).arg(backup_socket(&dir, &h2)).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(backup.wait().unwrap().success(), "{}", backup.stderr());
    wait_status(&socket, "protected: no", &mut primary, Duration::from_secs(10));
    let mut backup = start_backup(&topo, &dir, "h2", "tap0", &h2, &standby);
    wait_status(&backup_socket(&dir, &h2), "role: backup", &mut backup, Duration::from_secs(10));

    // 2. Attached again.
    let out = ftvm().args(["protect", "--api-socket"]).arg(&socket).args(["--backup", &h2]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    wait_status(&socket, "protected: yes", &mut primary, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(300));

    // 3. Handed over.
    let out = ftvm().args(["switchover", "--api-socket"]).arg(&socket).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let at = Instant::now();
    assert!(primary.wait().unwrap().success(), "{}", primary.stderr());
    wait_log(&mut backup, "HANDED OVER", Duration::from_secs(5));

    // 4. A backup on the old primary's host: the standby of the VM's new host.
    let mut old_host = start_backup(&topo, &dir, "h1", "tap0", &h1, &[]);
    let st = wait_status(&backup_socket(&dir, &h2), "protected: yes", &mut backup, Duration::from_secs(60));
    assert!(st.contains("role: primary") && st.contains(&format!("backup: {h1}")), "{st}");
    let st = status(&backup_socket(&dir, &h1));
    assert!(st.contains("role: backup") && st.contains("protected: yes"), "{st}");
    let acked = until_served_again(w, at);
    assert_none_lost(&topo, &acked);
    assert!(old_host.running() && backup.running());
}

#[test]
fn the_operations_guide_files_check() {
    let ops = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/ops");
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(out.status.success(), "{cmd:?}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    };
    run(Command::new("promtool").arg("check").arg("config").arg(ops.join("prometheus.yml")));
    run(Command::new("promtool").arg("test").arg("rules").arg(ops.join("ftvm-rules.test.yml")));
    // The units as installed, with ftvm where this build has it.
    let dir = scratch_for("operations", "units");
    for unit in ["ftvm-primary.service", "ftvm-backup.service"] {
        let text = std::fs::read_to_string(ops.join(unit)).unwrap();
        assert!(text.contains("ExecStart=/usr/local/bin/ftvm "), "{unit}");
        let text = text.replace("/usr/local/bin/ftvm", env!("CARGO_BIN_EXE_ftvm"));
        std::fs::write(dir.join(unit), text).unwrap();
        run(Command::new("systemd-analyze").arg("verify").arg(dir.join(unit)));
    }
}
