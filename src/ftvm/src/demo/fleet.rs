//! `ftvm demo --fleet`: a fleet keeps six VMs protected while its hosts
//! die, come back and are drained, on this machine.
//!
//! Four hosts (network namespaces, `scripts/netns.sh up-fleet`) run an
//! agent each against one etcd; six VMs (four kv guests, two unmodified
//! redis-servers) are created from spec files, and tracked writers record
//! every write whose `+OK` arrived. Then: the host with most primaries
//! dies (its links are cut and everything in it SIGKILLed), then another;
//! the first comes back with a fresh agent and the fleet evens out onto
//! it (one VM at a time, while every VM is protected); one of the two hosts that
//! never died is drained. After each step every VM must be protected
//! again (the goal: within 10 s of a host's death). At the end every
//! acknowledged write is read back, and a capture of each host's uplink
//! shows whether a VM's frames ever came from two hosts at once.
//!
//! Exit status 0 only if no acknowledged write was lost, every VM was
//! protected again within 10 s of each death, and no VM had two primaries.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ftvm_fleet::placement::{settled, Fleet};
use ftvm_fleet::Store;
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::netns;
use ftvm_testkit::pcap::Tcpdump;
use ftvm_testkit::process::Process;
use ftvm_testkit::topology::{Topology, FLEET_ETCD_ADDR};
use ftvm_testkit::writers::{self, Writers};

use super::{preflight, sleep, spawn, write_secret, Error};
use crate::output::outln;

const HOSTS: u32 = 4;
/// What each host offers the fleet.
const HOST_MEMORY_MIB: u64 = 1536;
const HOST_VCPUS: u32 = 8;
const VALUE_LEN: usize = 100;
/// The goal: every VM protected again this soon after its host died.
const REPROTECT_GOAL: Duration = Duration::from_secs(10);

/// One VM of the demo.
struct DemoVm {
    name: String,
    redis: bool,
    addr: String,
    mac: String,
}

fn vms() -> Vec<DemoVm> {
    (1..=6u8)
        .map(|i| DemoVm {
            name: if i <= 4 { format!("kv{i}") } else { format!("redis{}", i - 4) },
            redis: i > 4,
            addr: format!("10.0.0.{}", 10 + i),
            mac: format!("52:54:00:00:00:{:02x}", 0x10 + i),
        })
        .collect()
}

fn read(topo: &Topology, store: &Store) -> Result<Fleet, Error> {
    let store = store.clone();
    netns::run_in(&topo.ns("lan"), move || store.read()).map_err(|e| e.to_string())?.map_err(|e| e.to_string())
}

/// The live table: one line per VM.
fn table(f: &Fleet, vms: &[DemoVm], t0: Instant) {
    let cells: Vec<String> = vms
        .iter()
        .map(|vm| {
            let p = f.placements.get(&vm.name).map(|(p, _)| p.clone()).unwrap_or_default();
            let mark = if f.protected(&vm.name) { "+" } else { "-" };
            format!("{}{mark}{}/{}", vm.name, p.primary.as_deref().unwrap_or("?"), p.backup.as_deref().unwrap_or("?"))
        })
        .collect();
    outln!("  [{:>6.1}s] {}", t0.elapsed().as_secs_f64(), cells.join("  "));
}

/// Wait until `done`, printing the table every second; how long it took.
fn wait(
    topo: &Topology,
    store: &Store,
    vms: &[DemoVm],
    t0: Instant,
    limit: Duration,
    done: impl Fn(&Fleet) -> bool,
) -> Result<Duration, Error> {
    let start = Instant::now();
    let mut shown = Instant::now() - Duration::from_secs(1);
    loop {
        let f = read(topo, store)?;
        if shown.elapsed() >= Duration::from_secs(1) || done(&f) {
            table(&f, vms, t0);
            shown = Instant::now();
        }
        if done(&f) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            return Err(format!("not done within {limit:?}"));
        }
        sleep(Duration::from_millis(100))?;
    }
}

struct Hosts<'a> {
    topo: &'a Topology,
    dir: &'a Path,
    etcd: String,
    secret: PathBuf,
    ftvm: PathBuf,
    agents: BTreeMap<String, Process>,
    captures: Vec<(String, Tcpdump)>,
}

impl Hosts<'_> {
    fn start(&mut self, host: u32) -> Result<(), Error> {
        let name = format!("h{host}");
        let mut cmd = self.topo.command(&name, &self.ftvm);
        cmd.args(["agent", "--etcd", &self.etcd, "--host", &name, "--repl-addr", &format!("192.168.100.{host}")])
            .args(["--memory-mib", &HOST_MEMORY_MIB.to_string(), "--vcpus", &HOST_VCPUS.to_string(), "--secret-file"])
            .arg(&self.secret)
            .arg("--state-dir")
            .arg(self.dir.join(&name))
            .env("FTVM_LOG", "info");
        let n = self.captures.len();
        self.agents.insert(name.clone(), spawn(cmd, self.dir, &format!("agent-{name}-{n}"))?);
        // What leaves the host towards the LAN: its guests' frames.
        let capture = Tcpdump::start(
            self.topo,
            &name,
            self.dir,
            &format!("{name}-uplink-{n}.pcap"),
            &["-i", "uplink", "-Q", "out", "ether[6:4] = 0x52540000 and ether[10] = 0"],
        );
        self.captures.push((name, capture.map_err(|e| e.to_string())?));
        Ok(())
    }

    /// The host dies: its links go and everything in it is SIGKILLed.
    fn kill(&mut self, host: &str) -> Result<(), Error> {
        self.topo.cut_host(host).map_err(|e| e.to_string())?;
        let pids = Command::new("ip").args(["netns", "pids", &self.topo.ns(host)]).output().map_err(|e| e.to_string())?;
        for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            // SAFETY: SIGKILL to a process of the demo's own namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if let Some(mut agent) = self.agents.remove(host) {
            agent.kill();
        }
        Ok(())
    }
}

/// The host with most primaries among `among`.
fn busiest(f: &Fleet, among: &[String]) -> String {
    let primaries = |h: &String| f.placements.values().filter(|(p, _)| p.primary.as_ref() == Some(h)).count();
    among.iter().max_by_key(|h| (primaries(h), std::cmp::Reverse((*h).clone()))).cloned().unwrap_or_default()
}

/// Frames of each VM's MAC by host, from every capture: interleavings (a
/// VM's frames from host A, then B, then A again within a second: two
/// primaries at once) and hand-offs.
fn two_primaries(captures: Vec<(String, Tcpdump)>, vms: &[DemoVm]) -> Result<BTreeMap<String, (usize, usize)>, Error> {
    let mut frames: Vec<(u64, String, [u8; 6])> = Vec::new();
    for (host, capture) in captures {
        for f in capture.finish().map_err(|e| e.to_string())? {
            if let Some(mac) = f.src_mac() {
                frames.push((f.ts_ns, host.clone(), mac));
            }
        }
    }
    frames.sort();
    let mut out = BTreeMap::new();
    for vm in vms {
        let mac = ftvm_testkit::frames::parse_mac(&vm.mac).map_err(|e| e.to_string())?;
        let runs: Vec<(u64, u64, &str)> = frames.iter().filter(|f| f.2 == mac).fold(Vec::new(), |mut runs, (ts, host, _)| {
            match runs.last_mut() {
                Some((_, end, h)) if *h == host.as_str() => *end = *ts,
                _ => runs.push((*ts, *ts, host.as_str())),
            }
            runs
        });
        let interleaved = runs.windows(3).filter(|w| w[0].2 == w[2].2 && w[2].0 - w[0].1 < 1_000_000_000).count();
        out.insert(vm.name.clone(), (interleaved, runs.len().saturating_sub(1)));
    }
    Ok(out)
}

pub fn run(dir: &Path, seconds: f64) -> Result<bool, Error> {
    let root = preflight(&["ip", "redis-cli", "etcd", "tcpdump"])?;
    let (kv, redis) = (root.join("target/images/kv.elf"), root.join("target/images/redis-server"));
    for (image, build) in [(&kv, "scripts/build-images.sh"), (&redis, "scripts/build-redis.sh")] {
        if !image.exists() {
            return Err(format!("{} missing: run {build}", image.display()));
        }
    }
    let t0 = Instant::now();
    outln!("== ftvm demo --fleet: four hosts keep six VMs protected while two die, one comes back and one is drained");
    let topo = Topology::fleet("demf", HOSTS).map_err(|e| e.to_string())?;
    outln!(
        "network: namespaces {0}-{{lan,client,h1..h4}}; guests 10.0.0.11-16 on one LAN, hosts on a replication network 192.168.100.0/24",
        topo.name()
    );
    std::fs::create_dir_all(dir.join("etcd")).map_err(|e| e.to_string())?;
    let etcd = Etcd::start_in(&dir.join("etcd"), &topo.ns("lan"), &[FLEET_ETCD_ADDR]).map_err(|e| e.to_string())?;
    outln!("etcd: {} (the fleet's state and the VMs' arbiter)", etcd.endpoint());
    let secret = dir.join("secret");
    write_secret(&secret)?;
    let ftvm = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut hosts = Hosts {
        topo: &topo,
        dir,
        etcd: etcd.endpoint().to_string(),
        secret,
        ftvm: ftvm.clone(),
        agents: BTreeMap::new(),
        captures: Vec::new(),
    };
    for h in 1..=HOSTS {
        hosts.start(h)?;
    }
    outln!("agents: one per host, {HOST_MEMORY_MIB} MiB and {HOST_VCPUS} vCPUs offered each");
    let store = Store::new(etcd.endpoint());
    let vms = vms();
    for vm in &vms {
        let (image, memory, cmdline) = if vm.redis {
            (&redis, 256, format!("ip={}/24 -- redis-server --port 6379 --save '' --protected-mode no", vm.addr))
        } else {
            (&kv, 128, format!("ip={}/24", vm.addr))
        };
        let spec = dir.join(format!("{}.toml", vm.name));
        let text = format!(
            "name = \"{}\"\nimage = \"{}\"\nmemory_mib = {memory}\ncmdline = \"{}\"\nmac = \"{}\"\n",
            vm.name,
            image.display(),
            cmdline.replace('"', "\\\""),
            vm.mac
        );
        std::fs::write(&spec, text).map_err(|e| e.to_string())?;
        let out = topo
            .command("lan", &ftvm)
            .args(["vm", "create", "--etcd", etcd.endpoint(), "--spec"])
            .arg(&spec)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("ftvm vm create: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
    }
    outln!("created 6 VMs (kv1-kv4: the kv guest, redis1-2: an unmodified redis-server); table: VM+PRIMARY/BACKUP, + protected");
    let placed = wait(&topo, &store, &vms, t0, Duration::from_secs(120), |f| vms.iter().all(|vm| f.protected(&vm.name)))?;
    outln!("all six placed and protected in {:.1} s", placed.as_secs_f64());

    let mut load = BTreeMap::new();
    for vm in &vms {
        let config = writers::Config {
            addr: SocketAddr::new(vm.addr.parse().map_err(|e| format!("{e}"))?, 6379),
            netns: Some(topo.ns("client")),
            connections: 1,
            pipeline: 1,
            value_len: VALUE_LEN,
            prefix: vm.name.clone(),
            timeout: Duration::from_secs(2),
        };
        load.insert(vm.name.clone(), Writers::start_paced(config, Duration::from_millis(20)).map_err(|e| e.to_string())?);
    }
    outln!("load: a tracked writer per VM (a SET every 20 ms, each +OK recorded)");
    sleep(Duration::from_secs_f64(seconds))?;

    let mut deaths = Vec::new();
    let mut alive: Vec<String> = (1..=HOSTS).map(|h| format!("h{h}")).collect();
    for round in 1..=2 {
        let f = read(&topo, &store)?;
        let victim = busiest(&f, &alive);
        outln!("-- host {victim} dies ({round} of 2): links cut, its agent and VMMs SIGKILLed");
        hosts.kill(&victim)?;
        alive.retain(|h| *h != victim);
        let v = victim.clone();
        let took = wait(&topo, &store, &vms, t0, Duration::from_secs(60), |f| {
            vms.iter().all(|vm| f.protected(&vm.name) && !f.placed_on(&vm.name, &v))
        })?;
        outln!("every VM protected again {:.1} s after {victim} died", took.as_secs_f64());
        deaths.push((victim, took));
        sleep(Duration::from_secs_f64(seconds))?;
    }

    let back = deaths[0].0.clone();
    outln!("-- host {back} comes back (links restored, a fresh agent)");
    topo.up_fleet(HOSTS).map_err(|e| format!("restoring {back}: {e}"))?;
    hosts.start(back[1..].parse().map_err(|e| format!("{e}"))?)?;
    let b = back.clone();
    wait(&topo, &store, &vms, t0, Duration::from_secs(30), |f| f.hosts.contains_key(&b))?;
    // The fleet, at rest again, evens out onto it one VM at a time.
    let took = wait(&topo, &store, &vms, t0, Duration::from_secs(90), |f| {
        vms.iter().all(|vm| f.protected(&vm.name)) && vms.iter().any(|vm| f.placed_on(&vm.name, &b)) && settled(f)
    })?;
    let f = read(&topo, &store)?;
    let held = vms.iter().filter(|vm| f.placed_on(&vm.name, &back)).count();
    outln!("{back} holds {held} of the VMs' replicas, every VM protected, {:.1} s after it came back", took.as_secs_f64());

    let drained = alive[0].clone();
    outln!("-- host {drained} is drained (ftvm host drain): its primaries are handed over, its backups rebuilt elsewhere");
    let out =
        topo.command("lan", &ftvm).args(["host", "drain", "--etcd", etcd.endpoint(), &drained]).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("ftvm host drain: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    let d = drained.clone();
    let took = wait(&topo, &store, &vms, t0, Duration::from_secs(60), |f| {
        vms.iter().all(|vm| f.protected(&vm.name) && !f.placed_on(&vm.name, &d))
    })?;
    outln!("{drained} empty and every VM protected in {:.1} s", took.as_secs_f64());
    sleep(Duration::from_secs_f64(seconds))?;

    outln!("-- reading every acknowledged write back");
    let mut ok = true;
    outln!("{:<8} {:>9} {:>5} {:>16} {:>12} {:>9}", "VM", "acked", "lost", "longest gap (s)", "interleaved", "hand-offs");
    let mut results = Vec::new();
    for vm in &vms {
        let w = load.remove(&vm.name).expect("a writer per VM");
        let gap = w.longest_gap();
        let report = w.stop();
        let addr = SocketAddr::new(vm.addr.parse().map_err(|e| format!("{e}"))?, 6379);
        let verified = writers::verify(addr, Some(&topo.ns("client")), &report.acked, VALUE_LEN, Instant::now() + Duration::from_secs(30))
            .map_err(|e| format!("reading {}'s writes back: {e}", vm.name))?;
        results.push((vm.name.clone(), report.acked.len(), verified.lost(), gap));
    }
    let captures = two_primaries(std::mem::take(&mut hosts.captures), &vms)?;
    for (name, acked, lost, gap) in results {
        let (interleaved, handoffs) = captures.get(&name).copied().unwrap_or_default();
        outln!("{name:<8} {acked:>9} {lost:>5} {:>16.2} {interleaved:>12} {handoffs:>9}", gap.as_secs_f64());
        ok &= lost == 0 && interleaved == 0 && acked > 0;
    }
    for (host, took) in &deaths {
        let met = *took <= REPROTECT_GOAL;
        outln!(
            "after {host} died: every VM protected again in {:.1} s (goal {} s): {}",
            took.as_secs_f64(),
            REPROTECT_GOAL.as_secs(),
            if met { "met" } else { "missed" }
        );
        ok &= met;
    }
    outln!("{}", if ok { "PASS: nothing acknowledged was lost, no VM ever had two primaries" } else { "FAIL" });
    Ok(ok)
}
