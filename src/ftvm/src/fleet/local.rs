//! The VM processes an agent runs on its host: one `ftvm` process per VM
//! (a backup, which becomes the VM's primary when it takes over, a
//! primary, or a VSMR replica), each in its own session with its state in
//! `STATE_DIR/vms/VM/` (pid, control socket, log, a replica's raft vote),
//! so a restarted agent finds and keeps them instead of starting them
//! again.
//!
//! Each VM has a TAP of its own on the host's bridge, named from the VM's
//! name, made before its process starts (the process opens it by name)
//! and removed when the process is gone. A VSMR witness runs no VM and
//! has none.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ftvm_fleet::{Host, Report, Role, Slot, VmSpec};

use crate::api::{self, client};

/// How long the agent waits for a VM process's control socket to answer.
const CALL_TIMEOUT: Duration = Duration::from_millis(500);

/// What the agent was given to run its VMs with.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The fleet's etcd: the VMs' arbiter too.
    pub etcd: String,
    pub bridge: String,
    pub secret_file: PathBuf,
    pub state_dir: PathBuf,
    /// This `ftvm` executable: the VM processes run it.
    pub exe: PathBuf,
}

/// One VM process of this host.
pub struct VmProcess {
    pub pid: u32,
    /// Spawned by this agent (an adopted one is not its child).
    child: Option<Child>,
    pub api: PathBuf,
    /// A VSMR replica's raft id (the same VM's process for another id is
    /// a replica the placement no longer has).
    pub replica: Option<u64>,
    /// Role and protection last seen, and since when.
    pub seen: Option<(Role, bool, u64)>,
    /// A VSMR replica's voters, as it last said.
    pub voters: Vec<u64>,
    /// Asked to hand its VM over: it stops the guest and ends, so it is
    /// no longer reported as running the VM.
    pub leaving: bool,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The TAP of `vm`: at most 15 bytes, as Linux wants, and the same on every host.
pub fn tap_name(vm: &str) -> String {
    // FNV-1a: stable across hosts and releases, unlike std's hasher.
    let hash = vm.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("ftvm{:08x}", hash as u32)
}

fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip").args(args).stdin(Stdio::null()).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

fn make_tap(tap: &str, bridge: &str) -> io::Result<()> {
    if !Path::new("/sys/class/net").join(tap).exists() {
        ip(&["tuntap", "add", "dev", tap, "mode", "tap"])?;
    }
    ip(&["link", "set", tap, "master", bridge, "up"])
}

fn remove_tap(tap: &str) {
    if Path::new("/sys/class/net").join(tap).exists() {
        if let Err(e) = ip(&["link", "del", tap]) {
            tracing::warn!("agent: {e}");
        }
    }
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

/// Whether `pid` is an `ftvm` process serving control socket `api` (a pid
/// file outlives its process, and pids are reused); if so, its replica id
/// if it is a VSMR replica.
fn is_ours(pid: u32, api: &Path) -> Option<Option<u64>> {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    if !args.contains(&api.as_os_str().as_encoded_bytes()) {
        return None;
    }
    let id = args.windows(2).find(|w| w[0] == b"--id").and_then(|w| std::str::from_utf8(w[1]).ok()?.parse().ok());
    Some(id)
}

/// How a VSMR replica finds its group.
pub enum Group {
    /// One of its members: `--peers`, every member's address.
    Member(String),
    /// A new replica: `--join`, the members to reach and its own address.
    Joins(String),
}

/// This host's VM processes.
pub struct Local {
    setup: Setup,
    pub procs: BTreeMap<String, VmProcess>,
}

impl Local {
    /// Adopt the VM processes a previous agent on this host left running.
    pub fn adopt(setup: Setup) -> io::Result<Local> {
        let vms = setup.state_dir.join("vms");
        fs::create_dir_all(&vms)?;
        let mut procs = BTreeMap::new();
        for entry in fs::read_dir(&vms)? {
            let dir = entry?.path();
            let (Some(vm), Ok(pid)) = (dir.file_name().and_then(|n| n.to_str()).map(str::to_string), fs::read_to_string(dir.join("pid")))
            else {
                continue;
            };
            let api = dir.join("api.sock");
            match pid.trim().parse::<u32>().ok().filter(|pid| alive(*pid)).and_then(|pid| Some((pid, is_ours(pid, &api)?))) {
                Some((pid, replica)) => {
                    tracing::info!("agent: adopting {vm}'s process {pid}");
                    procs.insert(vm, VmProcess { pid, child: None, api, replica, seen: None, voters: Vec::new(), leaving: false });
                }
                None => {
                    let _ = fs::remove_file(dir.join("pid"));
                    remove_tap(&tap_name(&vm));
                }
            }
        }
        Ok(Local { setup, procs })
    }

    fn vm_dir(&self, vm: &str) -> PathBuf {
        self.setup.state_dir.join("vms").join(vm)
    }

    /// Start a primary or backup (`args` after `ftvm`) for `vm`. A VM with
    /// a disk gets a new zeroed one here: a primary starting afresh begins
    /// with an empty disk, and a backup's replica is filled by the
    /// primary's pre-copy.
    fn spawn(&mut self, vm: &str, spec: &VmSpec, mut args: Vec<String>) -> io::Result<()> {
        self.new_disk(vm, spec, &mut args)?;
        args.extend(["--arbiter".into(), self.setup.etcd.clone(), "--name".into(), vm.into()]);
        self.launch(vm, Some(spec), args, None)
    }

    /// A new zeroed disk for `vm`'s process here, if its spec has one.
    fn new_disk(&self, vm: &str, spec: &VmSpec, args: &mut Vec<String>) -> io::Result<()> {
        let Some(mib) = spec.disk_mib else { return Ok(()) };
        let dir = self.vm_dir(vm);
        fs::create_dir_all(&dir)?;
        let disk = dir.join("disk.img");
        let file = fs::File::create(&disk)?;
        file.set_len(mib << 20)?;
        args.push("--disk".into());
        args.push(disk.display().to_string());
        Ok(())
    }

    /// Start `args` for `vm`, on the VM's TAP if it has a network card
    /// (`net`), with the fleet's secret and a control socket.
    fn launch(&mut self, vm: &str, net: Option<&VmSpec>, mut args: Vec<String>, replica: Option<u64>) -> io::Result<()> {
        let dir = self.vm_dir(vm);
        fs::create_dir_all(&dir)?;
        let api = dir.join("api.sock");
        if let Some(spec) = net {
            make_tap(&tap_name(vm), &self.setup.bridge)?;
            args.extend(["--net".into(), format!("tap={},mac={}", tap_name(vm), spec.mac)]);
        }
        let log = fs::OpenOptions::new().create(true).append(true).open(dir.join("log"))?;
        let mut cmd = Command::new(&self.setup.exe);
        cmd.args(&args)
            .arg("--secret-file")
            .arg(&self.setup.secret_file)
            .arg("--api-socket")
            .arg(&api)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: setsid is async-signal-safe; the child gets a session of its
        // own, so the agent's terminal or process group ending leaves it running.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        let pid = child.id();
        fs::write(dir.join("pid"), pid.to_string())?;
        tracing::info!("agent: started {vm}: ftvm {} (pid {pid})", args.join(" "));
        self.procs
            .insert(vm.to_string(), VmProcess { pid, child: Some(child), api, replica, seen: None, voters: Vec::new(), leaving: false });
        Ok(())
    }

    /// Start `vm`'s VSMR replica `slot`: a member of the group, or a new
    /// replica that joins it. Its raft vote is kept here across restarts
    /// (`--raft-state`, one file per id). A VM replica boots the image, on
    /// a new zeroed disk if the VM has one; the leader brings both up to
    /// date (pre-copy, then a full `syncvm`, which compares every block).
    pub fn start_replica(&mut self, vm: &str, spec: &VmSpec, slot: &Slot, group: Group) -> io::Result<()> {
        let raft_state = self.vm_dir(vm).join(format!("raft-{}.state", slot.id));
        let mut args = vec!["replica".into(), "--id".into(), slot.id.to_string()];
        args.extend(match group {
            Group::Member(peers) => ["--peers".into(), peers],
            Group::Joins(join) => ["--join".into(), join],
        });
        args.extend(["--raft-state".into(), raft_state.display().to_string()]);
        if slot.witness {
            args.push("--witness".into());
            return self.launch(vm, None, args, Some(slot.id));
        }
        args.extend(vm_args(spec));
        self.new_disk(vm, spec, &mut args)?;
        self.launch(vm, Some(spec), args, Some(slot.id))
    }

    /// Start `vm`'s backup, listening on this host's replication address.
    pub fn start_backup(&mut self, vm: &str, spec: &VmSpec, me: &Host, port: u16) -> io::Result<()> {
        let args = vec!["backup".into(), "--listen".into(), format!("{}:{port}", me.repl_addr)];
        self.spawn(vm, spec, args)
    }

    /// Boot `vm` from its image as a primary replicating to `backup`.
    pub fn start_primary(&mut self, vm: &str, spec: &VmSpec, backup: &str) -> io::Result<()> {
        let mut args = vec!["run".into(), "--replicate-to".into(), backup.to_string()];
        args.extend(vm_args(spec));
        self.spawn(vm, spec, args)
    }

    /// Forget processes that ended (their TAP goes with them); the VMs whose process ended.
    pub fn reap(&mut self) -> Vec<String> {
        let mut ended = Vec::new();
        for (vm, p) in &mut self.procs {
            let gone = match &mut p.child {
                Some(child) => !matches!(child.try_wait(), Ok(None)),
                None => !alive(p.pid),
            };
            if gone {
                ended.push(vm.clone());
            }
        }
        for vm in &ended {
            self.procs.remove(vm);
            let _ = fs::remove_file(self.vm_dir(vm).join("pid"));
            remove_tap(&tap_name(vm));
            tracing::info!("agent: {vm}'s process ended");
        }
        ended
    }

    /// Ask `vm`'s process what it is now; a report if it answered.
    pub fn report(&mut self, vm: &str, host: &str) -> Option<Report> {
        let p = self.procs.get_mut(vm)?;
        if p.leaving {
            return None;
        }
        let reply = client::call(&p.api, &api::Request::Status, CALL_TIMEOUT).ok()?;
        let st = reply.replication?;
        let role = match st.role {
            ftvm_replication::Role::Primary => Role::Primary,
            ftvm_replication::Role::Backup => Role::Backup,
            ftvm_replication::Role::Leader => Role::Leader,
            ftvm_replication::Role::Secondary => Role::Secondary,
            ftvm_replication::Role::Witness => Role::Witness,
        };
        let members = reply.members.map(|m| m.members).unwrap_or_default();
        p.voters = members.iter().filter(|m| m.role == "voter").map(|m| m.id).collect();
        let since = match p.seen {
            Some((r, prot, since)) if r == role && prot == st.protected => since,
            _ => now_ms(),
        };
        p.seen = Some((role, st.protected, since));
        let term = if matches!(role, Role::Primary | Role::Backup) { 0 } else { st.term };
        Some(Report { host: host.to_string(), role, protected: st.protected, pid: p.pid, since_ms: since, voters: p.voters.clone(), term })
    }

    /// Send `request` to `vm`'s process.
    pub fn ask(&mut self, vm: &str, request: api::Request) {
        let Some(p) = self.procs.get_mut(vm) else { return };
        // A switch-over is answered once done; the agent does not wait for it.
        let switchover = matches!(request, api::Request::Switchover);
        p.leaving |= switchover;
        let timeout = if switchover { Duration::from_millis(50) } else { CALL_TIMEOUT };
        match client::call(&p.api, &request, timeout) {
            Ok(r) if !r.ok => tracing::warn!("agent: {vm}: {}", r.error.unwrap_or_default()),
            Err(e) if !switchover => tracing::warn!("agent: {vm}: {e}"),
            _ => {}
        }
    }

    /// Stop `vm`'s process and drop its disk and raft votes here (its log
    /// stays).
    pub fn remove(&mut self, vm: &str) {
        self.stop(vm);
        let dir = self.vm_dir(vm);
        let _ = fs::remove_file(dir.join("disk.img"));
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_name().to_str().is_some_and(|n| n.starts_with("raft-") && n.ends_with(".state")) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }

    /// Stop `vm`'s process: asked first, killed if it does not go.
    fn stop(&mut self, vm: &str) {
        let Some(p) = self.procs.get_mut(vm) else { return };
        tracing::info!("agent: stopping {vm}'s process {}", p.pid);
        let _ = client::call(&p.api, &api::Request::Stop, CALL_TIMEOUT);
        for _ in 0..20 {
            if !alive(p.pid) || p.child.as_mut().is_some_and(|c| !matches!(c.try_wait(), Ok(None))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: a plain kill of the VM's own process, which this agent started or adopted.
        unsafe { libc::kill(p.pid as libc::pid_t, libc::SIGKILL) };
        if let Some(child) = &mut p.child {
            let _ = child.wait();
        }
        self.reap();
    }
}

/// The VM's shape and options from its spec, as `run` and `replica` take them.
fn vm_args(spec: &VmSpec) -> Vec<String> {
    let mut args = vec![
        "--image".into(),
        spec.image.clone(),
        "--memory".into(),
        spec.memory_mib.to_string(),
        "--vcpus".into(),
        spec.vcpus.to_string(),
        "--cmdline".into(),
        spec.cmdline.clone(),
    ];
    args.extend(spec.args.iter().cloned());
    args
}
