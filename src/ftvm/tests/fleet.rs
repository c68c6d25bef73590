//! The fleet end to end on real KVM: three simulated hosts (network
//! namespaces), one etcd, an agent per host, two kv VMs created from spec
//! files. Each VM is placed on two hosts and protected; acknowledged
//! writes go in; the host of a primary dies (links cut, every process in
//! it SIGKILLed); the VM goes on serving from its backup's host, is
//! protected again on the third host, and has every acknowledged write;
//! the host comes back and the fleet evens out onto it. No VM ever has
//! two primaries. A VSMR VM (`protection = "vsmr"`) on four hosts beside a
//! primary-backup one: the host of its leader dies, a new replica with a
//! new id joins on the fourth host, and the clients of both VMs lose no
//! acknowledged write; a new replica whose host dies before it joined is
//! replaced by another; a VSMR VM that lost all three replicas starts
//! afresh; a drained host's VSMR leader hands over and is replaced.
//! Needs root, iproute2, redis-cli, etcd.

mod common;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{image, poll_until, scratch_for};
use ftvm_fleet::placement::Fleet;
use ftvm_fleet::{Role, Store};
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::netns;
use ftvm_testkit::process::Process;
use ftvm_testkit::topology::{Topology, FLEET_ETCD_ADDR};
use ftvm_testkit::writers::{self, Writers};

const VMS: [(&str, &str, &str); 2] = [("kva", "10.0.0.11", "52:54:00:00:00:11"), ("kvb", "10.0.0.12", "52:54:00:00:00:12")];

fn agent(topo: &Topology, dir: &std::path::Path, etcd: &str, host: u32, secret: &std::path::Path) -> Process {
    let mut cmd = topo.command(&format!("h{host}"), env!("CARGO_BIN_EXE_ftvm"));
    cmd.args(["agent", "--etcd", etcd, "--host", &format!("h{host}"), "--repl-addr", &format!("192.168.100.{host}")])
        .args(["--memory-mib", "512", "--vcpus", "4", "--secret-file"])
        .arg(secret)
        .arg("--state-dir")
        .arg(dir.join(format!("h{host}")))
        .args(["--metrics-listen", "127.0.0.1:9400"])
        .env("FTVM_LOG", "info");
    Process::spawn_logged(&format!("agent h{host}"), &mut cmd, dir, &format!("agent-h{host}")).unwrap()
}

fn all_protected(f: &Fleet) -> bool {
    VMS.iter().all(|(vm, _, _)| f.protected(vm))
}

/// Hosts whose process for `vm` says it runs the VM (a primary, a VSMR
/// leader of the newest term reported: raft has one leader per term, and
/// a deposed one may not have been reported anew yet), but for `dead`
/// (its reports stay until its lease expires, though nothing runs there).
fn primaries(f: &Fleet, vm: &str, dead: Option<&str>) -> Vec<String> {
    let reports: Vec<_> = f.reports.get(vm).into_iter().flatten().filter(|(h, _)| Some(h.as_str()) != dead).collect();
    let newest = reports.iter().filter(|(_, r)| r.role == Role::Leader).map(|(_, r)| r.term).max();
    let serves = |r: &ftvm_fleet::Report| r.role == Role::Primary || (r.role == Role::Leader && Some(r.term) == newest);
    reports.into_iter().filter(|(_, r)| serves(r)).map(|(h, _)| h.clone()).collect()
}

/// The fleet as etcd holds it (read from the lan namespace, where etcd serves).
fn read(topo: &Topology, store: &Store) -> Fleet {
    let store = store.clone();
    netns::run_in(&topo.ns("lan"), move || store.read()).unwrap().unwrap()
}

/// Poll the fleet until `done`, checking on every read that no VM has two primaries.
fn wait_fleet(topo: &Topology, store: &Store, dead: Option<&str>, timeout: Duration, what: &str, done: impl Fn(&Fleet) -> bool) -> Fleet {
    let deadline = Instant::now() + timeout;
    loop {
        let f = read(topo, store);
        for vm in f.vms.keys() {
            let p = primaries(&f, vm, dead);
            assert!(p.len() <= 1, "{what}: {vm} has two primaries: {p:?}");
        }
        if done(&f) {
            return f;
        }
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}: {f:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `ftvm ARGS` in the lan namespace, where etcd serves.
fn ftvm_in(topo: &Topology, args: &[&str]) -> std::process::Output {
    topo.command("lan", env!("CARGO_BIN_EXE_ftvm")).args(args).output().unwrap()
}

fn cli(topo: &Topology, args: &[&str]) -> String {
    let out = ftvm_in(topo, args);
    assert!(out.status.success(), "ftvm {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Write a spec for `vm` and create it with `ftvm vm create`.
/// `disk`: the VM gets a disk of 8 MiB and the kv guest logs its writes there.
#[allow(clippy::too_many_arguments)]
fn create(
    topo: &Topology,
    dir: &std::path::Path,
    etcd: &str,
    vm: &str,
    addr: &str,
    mac: &str,
    memory_mib: u64,
    disk: bool,
) -> std::process::Output {
    let (aof, disk) = if disk { (" aof=on", "disk_mib = 8\n") } else { ("", "") };
    create_with(topo, dir, etcd, vm, addr, mac, memory_mib, aof, disk)
}

/// Write a spec for `vm` (`cmdline` after the address, `more` lines) and
/// create it with `ftvm vm create`.
#[allow(clippy::too_many_arguments)]
fn create_with(
    topo: &Topology,
    dir: &std::path::Path,
    etcd: &str,
    vm: &str,
    addr: &str,
    mac: &str,
    memory_mib: u64,
    cmdline: &str,
    more: &str,
) -> std::process::Output {
    let spec = dir.join(format!("{vm}.toml"));
    let image = image("kv");
    let text = format!(
        "name = \"{vm}\"\nimage = \"{}\"\nmemory_mib = {memory_mib}\ncmdline = \"ip={addr}/24{cmdline}\"\nmac = \"{mac}\"\n{more}",
        image.display()
    );
    std::fs::write(&spec, text).unwrap();
    ftvm_in(topo, &["vm", "create", "--etcd", etcd, "--spec", spec.to_str().unwrap()])
}

fn secret_in(dir: &std::path::Path) -> std::path::PathBuf {
    let secret = dir.join("secret");
    std::fs::write(&secret, b"the fleet's replication secret\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    secret
}

/// Hosts with an agent each, and the fleet's etcd.
/// Ask every agent still running to stop (SIGTERM).
fn stop_agents(agents: &mut [Process]) {
    for a in agents.iter_mut() {
        if a.running() {
            a.signal(libc::SIGTERM).unwrap();
        }
    }
}

struct Rig {
    topo: Topology,
    etcd: Etcd,
    store: Store,
    secret: std::path::PathBuf,
    agents: Vec<Process>,
}

impl Rig {
    fn new(dir: &ftvm_testkit::scratch::Scratch) -> Rig {
        Rig::with_hosts(dir, 3)
    }

    fn with_hosts(dir: &ftvm_testkit::scratch::Scratch, hosts: u32) -> Rig {
        let topo = Topology::fleet("flee", hosts).unwrap();
        std::fs::create_dir_all(dir.join("etcd")).unwrap();
        let etcd = Etcd::start_in(&dir.join("etcd"), &topo.ns("lan"), &[FLEET_ETCD_ADDR]).unwrap();
        let store = Store::new(etcd.endpoint());
        let secret = secret_in(dir.path());
        let agents = (1..=hosts).map(|h| agent(&topo, dir.path(), etcd.endpoint(), h, &secret)).collect();
        Rig { topo, etcd, store, secret, agents }
    }
}

#[test]
fn a_drained_host_empties_and_a_restarted_agent_keeps_its_vms() {
    let dir = scratch_for("fleet", "drain");
    let Rig { topo, etcd, store, secret, mut agents } = Rig::new(&dir);
    let (vm, addr, mac) = VMS[0];
    assert!(create(&topo, dir.path(), etcd.endpoint(), vm, addr, mac, 64, false).status.success());
    // A VM no host can take says why, and is not placed.
    assert!(create(&topo, dir.path(), etcd.endpoint(), "huge", "10.0.0.19", "52:54:00:00:00:19", 4096, false).status.success());
    let only_kva = |f: &Fleet| f.placements.get(vm).is_some_and(|(p, _)| p.primary.is_some() && p.backup.is_some());
    let fleet = wait_fleet(&topo, &store, None, Duration::from_secs(60), "kva protected", |f| only_kva(f) && f.protected(vm));
    let list = cli(&topo, &["vm", "list", "--etcd", etcd.endpoint()]);
    assert!(list.lines().any(|l| l.starts_with("huge ") && l.contains("no host with 4096 MiB and 1 vCPUs free")), "{list}");
    for i in 0..20 {
        let (ok, out) = topo.redis_cli(addr, &["SET", &format!("k{i}"), &format!("v{i}")]);
        assert!(ok && out.trim() == "OK", "SET: {out}");
    }

    // A second agent on a host refuses; a restarted one keeps the VM processes.
    let (placement, _) = fleet.placements[vm].clone();
    let primary = placement.primary.clone().unwrap();
    let index: u32 = primary[1..].parse().unwrap();
    let twin = topo
        .command(&primary, env!("CARGO_BIN_EXE_ftvm"))
        .args([
            "agent",
            "--etcd",
            etcd.endpoint(),
            "--host",
            &primary,
            "--repl-addr",
            "192.168.100.9",
            "--memory-mib",
            "512",
            "--vcpus",
            "4",
        ])
        .arg("--secret-file")
        .arg(&secret)
        .arg("--state-dir")
        .arg(dir.join(&primary))
        .output()
        .unwrap();
    assert!(!twin.status.success() && String::from_utf8_lossy(&twin.stderr).contains("an agent is running already"), "{twin:?}");
    let pid = fleet.reports[vm][&primary].pid;
    let _ = agents[index as usize - 1].kill();
    agents[index as usize - 1] = agent(&topo, dir.path(), etcd.endpoint(), index, &secret);
    std::thread::sleep(Duration::from_secs(3));
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(10), "kva still protected", |f| f.protected(vm));
    assert_eq!(f.reports[vm][&primary].pid, pid, "the restarted agent started the VM again");
    assert_eq!(f.placements[vm].0, placement, "the VM was moved while its agent restarted");

    // etcd stalls longer than the leases: when it resumes every lease has
    // expired at once; the agents join again and nothing moves or restarts.
    let etcd_pid = Command::new("pgrep").args(["-f", &format!("etcd.*{}", dir.join("etcd").display())]).output().unwrap();
    let etcd_pid: i32 = String::from_utf8_lossy(&etcd_pid.stdout).split_whitespace().next().expect("etcd's pid").parse().unwrap();
    // SAFETY: SIGSTOP and SIGCONT to the test's own etcd.
    unsafe { libc::kill(etcd_pid, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_secs(4));
    for i in 0..5 {
        let (ok, out) = topo.redis_cli(addr, &["SET", &format!("stall{i}"), "x"]);
        assert!(ok && out.trim() == "OK", "the VM stopped serving while etcd stalled: {out}");
    }
    // SAFETY: as above.
    unsafe { libc::kill(etcd_pid, libc::SIGCONT) };
    std::thread::sleep(Duration::from_secs(4));
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(20), "kva protected after the etcd stall", |f| f.protected(vm));
    assert_eq!(f.reports[vm][&primary].pid, pid, "a stalled etcd restarted the VM");
    let now = &f.placements[vm].0;
    assert_eq!((&now.primary, &now.backup), (&placement.primary, &placement.backup), "a stalled etcd moved the VM");

    // Drain the primary's host: the VM is handed over to its backup, and
    // protected again on the third host.
    cli(&topo, &["host", "drain", "--etcd", etcd.endpoint(), &primary]);
    let drained = Instant::now();
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(60), "kva moved off the drained host", |f| {
        !f.placed_on(vm, &primary) && f.protected(vm) && !f.reports.get(vm).is_some_and(|r| r.contains_key(&primary))
    });
    eprintln!("kva handed over and protected again {:?} after the drain", drained.elapsed());
    assert_eq!(f.placements[vm].0.primary, placement.backup, "handed over to its backup");
    assert!(cli(&topo, &["host", "list", "--etcd", etcd.endpoint()]).lines().any(|l| l.starts_with(&primary) && l.contains("draining")));
    topo.forget_guest().unwrap();
    for i in 0..20 {
        let (ok, out) = topo.redis_cli(addr, &["GET", &format!("k{i}")]);
        assert!(ok && out.trim() == format!("v{i}"), "k{i} after the hand-over: {out:?}");
    }
    // Any agent serves the fleet's metrics: its own view of the store,
    // which follows the store's within its refresh, so it is polled.
    let scrape_h3 = || {
        netns::run_in(&topo.ns("h3"), || {
            let mut reply = ureq::get("http://127.0.0.1:9400/metrics").call().unwrap();
            reply.body_mut().read_to_string().unwrap()
        })
        .unwrap()
    };
    let scrape = poll_until(Duration::from_secs(15), scrape_h3, |s| s.contains("ftvm_fleet_vm_protected{vm=\"kva\"} 1"));
    assert!(scrape.contains("ftvm_fleet_vm_protected{vm=\"kva\"} 1"), "{scrape}");
    assert!(scrape.contains("ftvm_fleet_vm_unplaced{vm=\"huge\"} 1"), "{scrape}");
    assert!(scrape.contains(&format!("ftvm_fleet_host_vms{{host=\"{primary}\",role=\"primary\"}} 0")), "{scrape}");
    stop_agents(&mut agents);
}

#[test]
fn vms_stay_protected_when_a_host_dies() {
    let dir = scratch_for("fleet", "host-dies");
    let Rig { topo, etcd, store, mut agents, secret: rig_secret } = Rig::new(&dir);

    for (vm, addr, mac) in VMS {
        let out = create(&topo, dir.path(), etcd.endpoint(), vm, addr, mac, 64, vm == "kva");
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("created {vm}")), "{out:?}");
    }
    let err = ftvm_in(&topo, &["vm", "create", "--etcd", etcd.endpoint(), "--spec", dir.join("kva.toml").to_str().unwrap()]);
    assert!(!err.status.success() && String::from_utf8_lossy(&err.stderr).contains("a VM named kva exists already"));

    let started = Instant::now();
    let fleet = wait_fleet(&topo, &store, None, Duration::from_secs(60), "both VMs protected", all_protected);
    eprintln!("both VMs protected {:?} after creation", started.elapsed());
    let list = cli(&topo, &["vm", "list", "--etcd", etcd.endpoint()]);
    assert_eq!(list.lines().filter(|l| l.contains(" yes ")).count(), 2, "{list}");
    assert!(cli(&topo, &["host", "list", "--etcd", etcd.endpoint()]).contains("leader"));

    // Acknowledged writes into both VMs.
    for (vm, addr, _) in VMS {
        assert!(topo.wait_for_ping(addr, Duration::from_secs(10)), "{vm} does not answer ping");
        for i in 0..20 {
            let (ok, out) = topo.redis_cli(addr, &["SET", &format!("{vm}-{i}"), &format!("v{i}")]);
            assert!(ok && out.trim() == "OK", "SET on {vm}: {out}");
        }
    }

    // The host of kva's primary dies.
    let dead = fleet.placements["kva"].0.primary.clone().unwrap();
    let dead_index: usize = dead[1..].parse().unwrap();
    topo.cut_host(&dead).unwrap();
    let pids = Command::new("ip").args(["netns", "pids", &topo.ns(&dead)]).output().unwrap();
    for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
        // SAFETY: SIGKILL to a process of the test's own namespace.
        unsafe { libc::kill(pid.parse().unwrap(), libc::SIGKILL) };
    }
    let _ = agents[dead_index - 1].kill();
    let died = Instant::now();

    let after = wait_fleet(&topo, &store, Some(&dead), Duration::from_secs(60), "protected again after the host died", |f| {
        !f.hosts.contains_key(&dead) && all_protected(f) && VMS.iter().all(|(vm, _, _)| !f.placed_on(vm, &dead))
    });
    eprintln!("both VMs protected again {:?} after host {dead} died", died.elapsed());
    for (vm, addr, _) in VMS {
        topo.forget_guest().unwrap();
        for i in 0..20 {
            let (ok, out) = topo.redis_cli(addr, &["GET", &format!("{vm}-{i}")]);
            assert!(ok && out.trim() == format!("v{i}"), "{vm}-{i} after {dead} died: {out:?}");
        }
    }
    assert_ne!(after.placements["kva"].0.primary.as_deref(), Some(dead.as_str()));
    // kva's disk went with it: its log on the new primary's host has every write.
    let host = after.placements["kva"].0.primary.clone().unwrap();
    let sets = common::logged_sets(&dir.join(&host).join("vms/kva/disk.img"));
    for i in 0..20 {
        assert_eq!(sets.get(&format!("kva-{i}")).map(Vec::as_slice), Some(format!("v{i}").as_bytes()), "kva-{i} in the disk on {host}");
    }

    // The host comes back with a fresh agent: the fleet, at rest, moves
    // replicas onto it one at a time, and nothing acknowledged is lost.
    topo.up_fleet(3).unwrap();
    agents[dead_index - 1] = agent(&topo, dir.path(), etcd.endpoint(), dead_index as u32, &rig_secret);
    let back = Instant::now();
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(60), "replicas on the host that came back", |f| {
        f.hosts.contains_key(&dead)
            && all_protected(f)
            && VMS.iter().any(|(vm, _, _)| f.placed_on(vm, &dead))
            && ftvm_fleet::placement::settled(f)
    });
    eprintln!("the fleet evened out onto {dead} {:?} after it came back: {:?}", back.elapsed(), f.placements);
    for (vm, addr, _) in VMS {
        topo.forget_guest().unwrap();
        for i in 0..20 {
            let (ok, out) = topo.redis_cli(addr, &["GET", &format!("{vm}-{i}")]);
            assert!(ok && out.trim() == format!("v{i}"), "{vm}-{i} after the fleet evened out: {out:?}");
        }
    }

    // Deleting a VM stops its processes.
    cli(&topo, &["vm", "delete", "--etcd", etcd.endpoint(), "kvb"]);
    wait_fleet(&topo, &store, None, Duration::from_secs(20), "kvb's reports gone", |f| !f.reports.contains_key("kvb"));
    stop_agents(&mut agents);
}

/// Tracked writers (a SET every 20 ms per connection) from the client
/// namespace to the kv guest at `addr`.
fn writers(topo: &Topology, addr: &str, prefix: &str) -> Writers {
    let config = writers::Config {
        addr: SocketAddr::new(addr.parse().unwrap(), 6379),
        netns: Some(topo.ns("client")),
        connections: 4,
        pipeline: 1,
        value_len: 64,
        prefix: prefix.into(),
        timeout: Duration::from_millis(500),
    };
    Writers::start_paced(config, Duration::from_millis(20)).unwrap()
}

fn wait_acked_beyond(w: &Writers, n: u64, what: &str) {
    let t0 = Instant::now();
    while w.acked() <= n {
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}: no write acknowledged beyond {n}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every write `w` saw acknowledged reads back from the guest at `addr`
/// (the client having forgotten where the guest was: it may have moved);
/// their keys.
fn verify(topo: &Topology, addr: &str, w: Writers, vm: &str) -> Vec<String> {
    topo.forget_guest().unwrap();
    let gap = w.longest_gap();
    let report = w.stop();
    assert!(!report.acked.is_empty(), "{vm}: no write was acknowledged");
    let guest = SocketAddr::new(addr.parse().unwrap(), 6379);
    let v = writers::verify(guest, Some(&topo.ns("client")), &report.acked, 64, Instant::now() + Duration::from_secs(30)).unwrap();
    assert_eq!(
        v.lost(),
        0,
        "{vm}: acknowledged writes lost: {} missing, {} wrong of {} (e.g. {:?})",
        v.missing.len(),
        v.wrong.len(),
        v.checked,
        v.missing.iter().chain(&v.wrong).take(5).collect::<Vec<_>>()
    );
    eprintln!("{vm}: {} acknowledged writes, none lost; the longest a client went without an acknowledgement: {gap:?}", v.checked);
    report.acked
}

/// Host `host` dies: its links cut, its processes SIGKILLed (its agent too).
fn kill_host(topo: &Topology, host: &str, agents: &mut [Process]) {
    topo.cut_host(host).unwrap();
    let pids = Command::new("ip").args(["netns", "pids", &topo.ns(host)]).output().unwrap();
    for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
        // SAFETY: SIGKILL to a process of the test's own namespace.
        unsafe { libc::kill(pid.parse().unwrap(), libc::SIGKILL) };
    }
    let index: usize = host[1..].parse().unwrap();
    let _ = agents[index - 1].kill();
}

/// The hosts of VSMR VM `vm`'s replicas: (id, host) in id order, and the
/// host of the one that reports leading.
fn replicas(f: &Fleet, vm: &str) -> (Vec<(u64, String)>, Option<String>) {
    let p = &f.placements[vm].0;
    let leader = f.vsmr_leader(vm, p).map(|r| r.host.clone());
    (p.replicas.iter().map(|s| (s.id, s.host.clone())).collect(), leader)
}

/// A VSMR VM (with a disk, the kv guest's log on it) and a primary-backup
/// VM on four hosts, both under tracked writers. The VSMR VM's three
/// replicas are on three hosts; the host of
/// its leader dies (links cut, every process SIGKILLed). Its secondary
/// takes over by itself (the group's election), the fleet places a new
/// replica (id 4) on the host that had none, the leader's agent asks the
/// group to replace the lost replica by it, and the fleet shows the VM
/// protected again with the new replica as a member. No acknowledged
/// write of either VM is lost (the new replica's disk logs each), and the
/// clients kept being served. Before,
/// a restarted agent kept its replica; after, two more of its hosts go
/// (the witness's killed, a VM replica's cut off): the fleet says the
/// quorum is lost and replaces nothing; they come back with new agents
/// (the witness started again under its id) and the group is whole again
/// with its acknowledged writes.
#[test]
fn a_vsmr_vm_gets_a_new_replica_when_a_host_dies() {
    let dir = scratch_for("fleet", "vsmr");
    let Rig { topo, etcd, store, mut agents, secret, .. } = Rig::with_hosts(&dir, 4);
    let (pb, pb_addr, pb_mac) = VMS[1];
    let (vm, addr, mac) = ("kvv", "10.0.0.13", "52:54:00:00:00:13");
    let vsmr = "protection = \"vsmr\"\ndisk_mib = 8\n";
    let out = create_with(&topo, dir.path(), etcd.endpoint(), vm, addr, mac, 64, " aof=on", vsmr);
    assert!(out.status.success(), "{out:?}");
    assert!(create(&topo, dir.path(), etcd.endpoint(), pb, pb_addr, pb_mac, 64, false).status.success());
    let started = Instant::now();
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(90), "both VMs protected", |f| f.protected(vm) && f.protected(pb));
    eprintln!("both VMs protected {:?} after creation", started.elapsed());
    let (members, leader) = replicas(&f, vm);
    assert_eq!(members.iter().map(|m| m.0).collect::<Vec<_>>(), [1, 2, 3], "{members:?}");
    assert_eq!(members.iter().map(|m| &m.1).collect::<std::collections::BTreeSet<_>>().len(), 3, "{members:?}");
    let leader = leader.expect("a replica leads");
    let list = cli(&topo, &["vm", "list", "--etcd", etcd.endpoint()]);
    let row = list.lines().find(|l| l.starts_with("kvv ")).unwrap_or_default();
    assert!(row.contains(" vsmr ") && row.contains(" yes ") && row.contains(&format!(" {leader} ")), "{list}");
    // The agents' metrics say so too (as their last look read the fleet).
    let witness = f.placements[vm].0.replicas.iter().find(|s| s.witness).unwrap().host.clone();
    let says = [
        "ftvm_fleet_vm_protected{vm=\"kvv\"} 1".to_string(),
        format!("ftvm_fleet_host_vms{{host=\"{leader}\",role=\"replica\"}} 1"),
        format!("ftvm_fleet_vm_placed{{vm=\"kvv\",part=\"witness\",host=\"{witness}\"}} 1"),
    ];
    let t0 = Instant::now();
    loop {
        let scrape = netns::run_in(&topo.ns(&leader), || {
            let mut reply = ureq::get("http://127.0.0.1:9400/metrics").call().unwrap();
            reply.body_mut().read_to_string().unwrap()
        })
        .unwrap();
        if says.iter().all(|s| scrape.contains(s.as_str())) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "the metrics never said {says:?}: {scrape}");
        std::thread::sleep(Duration::from_millis(100));
    }

    // A restarted agent keeps the replica it runs (no new process, no new
    // member).
    let other = members.iter().find(|m| m.1 != leader).unwrap().1.clone();
    let index: usize = other[1..].parse().unwrap();
    let pid = f.reports[vm][&other].pid;
    let _ = agents[index - 1].kill();
    agents[index - 1] = agent(&topo, dir.path(), etcd.endpoint(), index as u32, &secret);
    std::thread::sleep(Duration::from_secs(3));
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(10), "kvv still protected", |f| f.protected(vm));
    assert_eq!(f.reports[vm][&other].pid, pid, "the restarted agent started the replica again");
    assert_eq!(replicas(&f, vm).0, members, "the replicas moved while an agent restarted");

    for a in [addr, pb_addr] {
        assert!(topo.wait_for_ping(a, Duration::from_secs(10)), "{a} does not answer ping");
    }
    let w = writers(&topo, addr, "v");
    let wpb = writers(&topo, pb_addr, "p");
    wait_acked_beyond(&w, 100, "VSMR VM before the host died");
    wait_acked_beyond(&wpb, 100, "primary-backup VM before the host died");

    // The host of the VSMR leader dies.
    let dead = leader;
    kill_host(&topo, &dead, &mut agents);
    let died = Instant::now();
    let acked = w.acked();
    wait_acked_beyond(&w, acked + 50, "the VSMR VM after its leader's host died");
    eprintln!("the VSMR VM served again {:?} after its leader's host {dead} died", died.elapsed());

    let spare = (1..=4).map(|h| format!("h{h}")).find(|h| !members.iter().any(|m| &m.1 == h)).unwrap();
    let after = wait_fleet(&topo, &store, Some(&dead), Duration::from_secs(90), "the VSMR VM protected again", |f| {
        !f.hosts.contains_key(&dead) && f.protected(vm) && !f.placed_on(vm, &dead) && f.protected(pb) && !f.placed_on(pb, &dead)
    });
    eprintln!("both VMs protected again {:?} after host {dead} died", died.elapsed());
    let (now, leader) = replicas(&after, vm);
    let lost = members.iter().find(|m| m.1 == dead).unwrap().0;
    let mut ids: Vec<u64> = members.iter().map(|m| m.0).filter(|id| *id != lost).collect();
    ids.push(4);
    assert_eq!(now.iter().map(|m| m.0).collect::<Vec<_>>(), ids, "replica 4 replaced replica {lost}: {now:?}");
    assert!(now.contains(&(4, spare.clone())), "the new replica is on the host that had none ({spare}): {now:?}");
    assert!(leader.is_some_and(|l| l != dead));
    let voters = &after.reports[vm][&now[0].1].voters;
    assert_eq!(voters, &ids, "the group's voters");
    assert!(after.placements[vm].0.next_id == 5 && after.placements[vm].0.replacing.is_none(), "{:?}", after.placements[vm]);
    let list = cli(&topo, &["vm", "list", "--etcd", etcd.endpoint()]);
    assert!(list.lines().any(|l| l.starts_with("kvv ") && l.contains(" yes ")), "{list}");

    // Served on, protected by the new replica.
    let acked = w.acked();
    wait_acked_beyond(&w, acked + 100, "the VSMR VM protected again");
    wait_acked_beyond(&wpb, wpb.acked() + 100, "the primary-backup VM protected again");
    let acked = verify(&topo, addr, w, vm);
    verify(&topo, pb_addr, wpb, pb);
    // The new replica's disk (a zeroed file where it started, brought up
    // to date by the leader's syncvms) logs every acknowledged write.
    let sets = common::logged_sets(&dir.join(&spare).join("vms").join(vm).join("disk.img"));
    for key in &acked {
        assert_eq!(sets.get(key).map(Vec::as_slice), Some(writers::value(key, 64).as_slice()), "{key} in replica 4's disk on {spare}");
    }

    // Two more hosts of the VSMR VM go: the witness's dies (every process
    // killed), a VM replica's is cut off with its replica running. The
    // last replica has no quorum, and the fleet says so rather than
    // replacing anything. (The primary-backup VM goes first: it would
    // start afresh meanwhile.) Both VM replicas keep their VM: whichever
    // the group elects ran what its log holds. (Were the cut-off VM
    // replica's VM lost too, the survivor might have run entries the group
    // never committed, and no replica would be in step: replicas.md.)
    cli(&topo, &["vm", "delete", "--etcd", etcd.endpoint(), pb]);
    wait_fleet(&topo, &store, Some(&dead), Duration::from_secs(20), "kvb's processes stopped", |f| !f.reports.contains_key(pb));
    let witness = after.placements[vm].0.replicas.iter().find(|s| s.witness).map(|s| s.host.clone()).unwrap();
    let vm_replicas: Vec<&(u64, String)> = now.iter().filter(|m| m.1 != witness).collect();
    let (survivor_id, survivor) = vm_replicas[0].clone();
    let (killed, cut) = (witness, vm_replicas[1].1.clone());
    kill_host(&topo, &killed, &mut agents);
    topo.cut_host(&cut).unwrap();
    let cut_index: usize = cut[1..].parse().unwrap();
    let _ = agents[cut_index - 1].kill();
    let f = wait_fleet(&topo, &store, Some(&dead), Duration::from_secs(30), "the VSMR VM's quorum lost", |f| {
        f.unplaced.get(vm).is_some_and(|why| why.starts_with("quorum lost"))
    });
    assert!(f.placements[vm].0.replacing.is_none(), "{:?}", f.placements[vm]);
    let list = cli(&topo, &["vm", "list", "--etcd", etcd.endpoint()]);
    eprintln!("{list}");
    let row = list.lines().find(|l| l.starts_with("kvv ")).unwrap_or_default();
    assert!(
        row.contains(&format!("quorum lost: only replica {survivor_id} on {survivor} of 3 survives")) && row.contains(" no "),
        "{list}"
    );

    // The two hosts come back with new agents: the killed witness is
    // started again under its id and kept vote, the cut-off replica adopted;
    // the group has its quorum back, with the same members, and the VM
    // its acknowledged writes.
    topo.up_fleet(4).unwrap();
    for host in [&killed, &cut] {
        let index: usize = host[1..].parse().unwrap();
        agents[index - 1] = agent(&topo, dir.path(), etcd.endpoint(), index as u32, &secret);
    }
    let back = Instant::now();
    let f = wait_fleet(&topo, &store, Some(&dead), Duration::from_secs(90), "the VSMR VM whole again", |f| {
        f.protected(vm) && !f.unplaced.contains_key(vm)
    });
    eprintln!("the VSMR VM protected again {:?} after its lost hosts came back", back.elapsed());
    assert_eq!(replicas(&f, vm).0, now, "the group's members changed");
    topo.forget_guest().unwrap();
    for key in acked.iter().step_by(acked.len() / 20 + 1) {
        let (ok, out) = topo.redis_cli(addr, &["GET", key]);
        let value = writers::value(key, 64);
        assert!(ok && out.trim().as_bytes() == value.as_slice(), "{key} after the quorum came back: {out:?}");
    }
    stop_agents(&mut agents);
}

/// `ftvm status` of host `host`'s process for `vm` (empty if it does not answer).
fn status_on(dir: &std::path::Path, host: &str, vm: &str) -> String {
    let socket = dir.join(host).join("vms").join(vm).join("api.sock");
    let out = common::ftvm().args(["status", "--timeout", "1", "--api-socket"]).arg(socket).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A VSMR VM on five hosts: the host of its leader dies, and the new
/// replica (id 4) cannot start where it is placed (its raft state file is
/// a directory there: it exits at once, again and again), so the group
/// keeps it a learner. Then that host dies too: the fleet places another
/// new replica (id 5) on the last host, the group's leader drops learner
/// 4 when asked for 5, and the VM is protected by replica 5, with every
/// acknowledged write.
#[test]
fn a_vsmr_replacement_lost_before_it_joined_is_replaced_again() {
    let dir = scratch_for("fleet", "vsmr-again");
    let Rig { topo, etcd, store, mut agents, .. } = Rig::with_hosts(&dir, 5);
    let (vm, addr, mac) = ("kvv", "10.0.0.13", "52:54:00:00:00:13");
    let out = create_with(&topo, dir.path(), etcd.endpoint(), vm, addr, mac, 64, "", "protection = \"vsmr\"\n");
    assert!(out.status.success(), "{out:?}");
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(90), "kvv protected", |f| f.protected(vm));
    let (members, leader) = replicas(&f, vm);
    let leader = leader.expect("a replica leads");
    // Replica 4 cannot keep its vote on either host without a replica.
    let spares: Vec<String> = (1..=5).map(|h| format!("h{h}")).filter(|h| !members.iter().any(|m| &m.1 == h)).collect();
    for h in &spares {
        std::fs::create_dir_all(dir.join(h).join("vms").join(vm).join("raft-4.state")).unwrap();
    }
    assert!(topo.wait_for_ping(addr, Duration::from_secs(10)), "{addr} does not answer ping");
    let w = writers(&topo, addr, "a");
    wait_acked_beyond(&w, 100, "before the host died");

    kill_host(&topo, &leader, &mut agents);
    let lost = members.iter().find(|m| m.1 == leader).unwrap().0;
    let f = wait_fleet(&topo, &store, Some(&leader), Duration::from_secs(30), "a replacement placed", |f| {
        f.placements[vm].0.replacing.is_some()
    });
    let first = f.placements[vm].0.replacing.clone().unwrap();
    assert_eq!((first.slot.id, first.replaces), (4, lost));
    // The group's new leader was asked: replica 4 is its learner, and stays one.
    let serving = members.iter().find(|m| m.1 != leader && !f.placements[vm].0.replicas.iter().any(|s| s.id == m.0 && s.witness));
    let serving = serving.unwrap().1.clone();
    let t0 = Instant::now();
    while !status_on(dir.path(), &serving, vm).contains(&format!("4 learner {}", first.slot.addr())) {
        assert!(t0.elapsed() < Duration::from_secs(20), "replica 4 never became a learner: {}", status_on(dir.path(), &serving, vm));
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(status_on(dir.path(), &serving, vm).contains("4 learner"), "replica 4 could not have caught up");
    wait_acked_beyond(&w, w.acked() + 50, "with replica 4 a learner");

    kill_host(&topo, &first.slot.host, &mut agents);
    let died = Instant::now();
    let last = spares.iter().find(|h| **h != first.slot.host).unwrap().clone();
    let f = wait_fleet(&topo, &store, Some(&leader), Duration::from_secs(90), "kvv protected by replica 5", |f| {
        f.protected(vm) && f.placements[vm].0.replicas.iter().any(|s| s.id == 5)
    });
    eprintln!("kvv protected by replica 5 {:?} after the host of replica 4 died", died.elapsed());
    let (now, _) = replicas(&f, vm);
    assert!(now.contains(&(5, last.clone())), "{now:?}");
    assert!(!now.iter().any(|m| m.0 == lost || m.0 == 4), "{now:?}");
    let st = status_on(dir.path(), &last, vm);
    let members_line = st.lines().find(|l| l.starts_with("members:")).unwrap_or_default();
    let ids: Vec<&str> = members_line["members:".len()..].split(',').filter_map(|m| m.split_whitespace().next()).collect();
    assert_eq!(ids.len(), 3, "{st}");
    assert!(!ids.contains(&"4"), "learner 4 is still in the group: {st}");
    wait_acked_beyond(&w, w.acked() + 100, "protected by replica 5");
    verify(&topo, addr, w, vm);
    stop_agents(&mut agents);
}

/// A VSMR VM on four hosts loses the hosts of all three replicas (two
/// killed, one cut off with its replica running): it is placed nowhere
/// (one host is left). Two of them come back: the VM starts afresh on
/// three new replicas with new ids, its state lost; the replica still
/// running on the cut-off host (an id of the old group) is stopped and
/// replaced by the new group's.
#[test]
fn a_vsmr_vm_whose_replicas_all_died_starts_afresh() {
    let dir = scratch_for("fleet", "vsmr-afresh");
    let Rig { topo, etcd, store, mut agents, secret, .. } = Rig::with_hosts(&dir, 4);
    let (vm, addr, mac) = ("kvv", "10.0.0.13", "52:54:00:00:00:13");
    let out = create_with(&topo, dir.path(), etcd.endpoint(), vm, addr, mac, 64, "", "protection = \"vsmr\"\n");
    assert!(out.status.success(), "{out:?}");
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(90), "kvv protected", |f| f.protected(vm));
    let (members, _) = replicas(&f, vm);
    assert!(topo.wait_for_ping(addr, Duration::from_secs(10)), "{addr} does not answer ping");
    let (ok, out) = topo.redis_cli(addr, &["SET", "before", "1"]);
    assert!(ok && out.trim() == "OK", "SET: {out}");

    let (killed, cut) = (&members[..2], &members[2].1);
    for (_, host) in killed {
        kill_host(&topo, host, &mut agents);
    }
    let old_pid = f.reports[vm][cut].pid;
    topo.cut_host(cut).unwrap();
    let cut_index: usize = cut[1..].parse().unwrap();
    let _ = agents[cut_index - 1].kill();
    // (Until the last of them counts as gone, the quorum is said lost.)
    wait_fleet(&topo, &store, None, Duration::from_secs(30), "kvv placed nowhere", |f| {
        f.placements[vm].0.replicas.is_empty()
            && f.unplaced.get(vm).is_some_and(|why| why == "no second host with 64 MiB and 1 vCPUs free for its second VM replica")
    });

    topo.up_fleet(4).unwrap();
    for host in [&killed[0].1, cut] {
        let index: usize = host[1..].parse().unwrap();
        agents[index - 1] = agent(&topo, dir.path(), etcd.endpoint(), index as u32, &secret);
    }
    let back = Instant::now();
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(90), "kvv afresh", |f| f.protected(vm));
    eprintln!("kvv protected afresh {:?} after two hosts came back", back.elapsed());
    let (now, _) = replicas(&f, vm);
    // Ids the old group never had (4 may have gone to a replacement for
    // the first host found gone, before the others were).
    let next = f.placements[vm].0.next_id;
    assert!(next >= 7, "{:?}", f.placements[vm]);
    assert_eq!(now.iter().map(|m| m.0).collect::<Vec<_>>(), [next - 3, next - 2, next - 1], "a new group: {now:?}");
    assert!(!now.iter().any(|m| m.1 == killed[1].1), "{now:?}");
    let on_cut = now.iter().find(|m| &m.1 == cut).expect("a new replica on the host that was cut off");
    assert_ne!(f.reports[vm][cut].pid, old_pid, "the old group's replica still runs");
    let st = status_on(dir.path(), cut, vm);
    assert!(st.contains(&format!("{} voter", on_cut.0)), "{st}");
    topo.forget_guest().unwrap();
    let (ok, out) = topo.redis_cli(addr, &["GET", "before"]);
    assert!(ok && out.trim().is_empty(), "the VM's state was lost, yet: {out:?}");
    let (ok, out) = topo.redis_cli(addr, &["SET", "after", "1"]);
    assert!(ok && out.trim() == "OK", "SET: {out}");
    stop_agents(&mut agents);
}

/// A VSMR VM on four hosts under tracked writers; the host of its leader
/// is drained. Once the group is in step a new replica (id 4) is placed on
/// the host that had none; asked to replace itself the leader hands
/// leadership to its secondary, whose agent asks again; the drained
/// replica leaves the group and its process stops. The VM is protected
/// again off the drained host, with every acknowledged write.
#[test]
fn a_drained_host_hands_its_vsmr_replica_over() {
    let dir = scratch_for("fleet", "vsmr-drain");
    let Rig { topo, etcd, store, mut agents, .. } = Rig::with_hosts(&dir, 4);
    let (vm, addr, mac) = ("kvv", "10.0.0.13", "52:54:00:00:00:13");
    let out = create_with(&topo, dir.path(), etcd.endpoint(), vm, addr, mac, 64, "", "protection = \"vsmr\"\n");
    assert!(out.status.success(), "{out:?}");
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(90), "kvv protected", |f| f.protected(vm));
    let (members, leader) = replicas(&f, vm);
    let leader = leader.expect("a replica leads");
    let lost = members.iter().find(|m| m.1 == leader).unwrap().0;
    let spare = (1..=4).map(|h| format!("h{h}")).find(|h| !members.iter().any(|m| &m.1 == h)).unwrap();
    assert!(topo.wait_for_ping(addr, Duration::from_secs(10)), "{addr} does not answer ping");
    let w = writers(&topo, addr, "d");
    wait_acked_beyond(&w, 100, "before the drain");

    cli(&topo, &["host", "drain", "--etcd", etcd.endpoint(), &leader]);
    let drained = Instant::now();
    let f = wait_fleet(&topo, &store, None, Duration::from_secs(60), "kvv off the drained host", |f| {
        !f.placed_on(vm, &leader) && f.protected(vm) && !f.reports.get(vm).is_some_and(|r| r.contains_key(&leader))
    });
    eprintln!("kvv protected off the drained host {:?} after the drain", drained.elapsed());
    let (now, serving) = replicas(&f, vm);
    assert!(now.contains(&(4, spare.clone())), "{now:?}");
    assert!(!now.iter().any(|m| m.0 == lost), "{now:?}");
    assert!(serving.is_some_and(|s| s != leader));
    let log = std::fs::read_to_string(dir.join(&leader).join("vms").join(vm).join("log")).unwrap();
    assert!(log.contains("asked to replace this replica, which leads: handing leadership over"), "{log}");
    wait_acked_beyond(&w, w.acked() + 100, "after the drain");
    verify(&topo, addr, w, vm);
    stop_agents(&mut agents);
}

#[test]
fn bad_fleet_input_is_refused_with_one_line() {
    let dir = scratch_for("fleet", "bad-input");
    let run = |args: &[&str]| {
        let out = common::ftvm().args(args).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&["vm", "list", "--etcd", "localhost:2379"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not http://HOST:PORT"), "{err}");
    let spec = dir.join("bad.toml");
    std::fs::write(&spec, "name = \"kv 1\"\nimage = \"/kv.elf\"\nmac = \"52:54:00:00:00:01\"\n").unwrap();
    let (code, err) = run(&["vm", "create", "--etcd", "http://127.0.0.1:1", "--spec", spec.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("bad VM spec: name \"kv 1\""), "{err}");
    let (code, err) = run(&["host", "list", "--etcd", "http://127.0.0.1:1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("etcd at http://127.0.0.1:1 is unreachable"), "{err}");
    let open_secret = dir.join("secret");
    std::fs::write(&open_secret, "s").unwrap();
    std::fs::set_permissions(&open_secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let agent = |host: &str| {
        run(&["agent", "--etcd", "http://127.0.0.1:1", "--host", host, "--repl-addr", "127.0.0.1", "--memory-mib", "64", "--vcpus", "1"]
            .iter()
            .copied()
            .chain(["--secret-file", open_secret.to_str().unwrap(), "--state-dir", dir.join("state").to_str().unwrap()])
            .collect::<Vec<_>>())
    };
    let (code, err) = agent("a/b");
    assert_eq!(code, Some(2));
    assert!(err.contains("'--host <NAME>'"), "{err}");
    let (code, err) = agent("h1");
    assert_eq!(code, Some(1));
    assert!(err.contains("accessible by group or others"), "{err}");
}
