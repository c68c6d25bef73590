//! Dynamically linked Linux programs, end to end: the runtime's Linux
//! personality loads a PIE and glibc's `ld-linux-x86-64.so.2` from a root
//! file system (`ftvm run --rootfs DIR`, made by scripts/make-rootfs.sh
//! from host files), and the interpreter maps the libraries. The C test
//! programs guest/linux/programs/dynamic/ (dynhello, execer), and Debian's
//! own `/usr/bin/redis-server` and `/usr/bin/memcached` (packages
//! redis-server and memcached, scripts/setup.sh) served over the VM's TAP,
//! under redis-benchmark, through a failover to a backup, and through a
//! snapshot restored without the rootfs.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use ftvm_testkit::process::{Process, WaitError};
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC, H2_REPL_ADDR, TAP};

const BOOT_TIMEOUT: Duration = Duration::from_secs(30);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A scratch root file system, removed when dropped.
struct Rootfs(PathBuf);

impl Drop for Rootfs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `scripts/make-rootfs.sh PROGRAM DIR FILES...` into a fresh directory.
fn make_rootfs(tag: &str, program: &Path, files: &[&str]) -> Rootfs {
    let dir = Rootfs(std::env::temp_dir().join(format!("ftvm-rootfs-{tag}-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    let out =
        Command::new(root().join("scripts/make-rootfs.sh")).arg(program).arg(&dir.0).args(files).output().expect("make-rootfs.sh runs");
    assert!(out.status.success(), "make-rootfs.sh {}: {}{}", program.display(), stdout(&out), stderr(&out));
    dir
}

/// A dynamically linked test program (guest/linux/programs/dynamic).
fn built(name: &str) -> PathBuf {
    let path = root().join("target/images").join(name).canonicalize().unwrap_or_default();
    assert!(path.exists(), "target/images/{name} missing: run scripts/build-images.sh");
    path
}

fn dynhello() -> PathBuf {
    built("linux-dynhello")
}

/// `ftvm run` of `program` with `rootfs` and `cmdline` (the whole
/// `--cmdline=...` argument), to its end.
fn run_in_rootfs(program: &Path, rootfs: &Rootfs, cmdline: impl AsRef<std::ffi::OsStr>) -> std::process::Output {
    ftvm().arg("run").arg("--image").arg(program).arg("--rootfs").arg(&rootfs.0).arg(cmdline).output().expect("ftvm runs")
}

/// The VMM is still running (a test's last check that serving did not kill it).
fn assert_alive(vmm: &mut Process) {
    if let Some(status) = vmm.try_wait() {
        panic!("ftvm died ({status}):\n{}", vmm.output());
    }
}

#[test]
fn a_glibc_pie_runs_with_its_interpreter_and_libc_from_the_rootfs() {
    let program = dynhello();
    let rootfs = make_rootfs("dynhello", &program, &[]);
    let out = run_in_rootfs(&program, &rootfs, format!("--cmdline=-- GREETING='hi there' {} one", program.display()));
    let text = stdout(&out);
    // The program's own exit status, after its last line.
    assert_eq!(out.status.code(), Some(3), "{text}{}", stderr(&out));
    assert!(text.contains(&format!("dynhello: argc=2 argv0={} argv1=one\n", program.display())), "{text}");
    assert!(text.contains("dynhello: GREETING=hi there\n"), "{text}");
    assert!(text.contains("dynhello: pie main_below_entry=1\n"), "{text}");
    // /proc/self/exe names the program in the guest's file system.
    let exe = program.canonicalize().unwrap();
    assert!(text.contains(&format!("dynhello: exe={}\n", exe.display())), "{text}");
    let size = std::fs::metadata(&program).unwrap().len();
    assert!(text.contains(&format!("dynhello: size={size}\n")), "{text}");
    assert!(text.contains("dynhello: mmap ok\n"), "{text}");
    // Refused (ENODEV): no page cache to share with the file.
    assert!(text.contains("dynhello: shared file mapping errno=19\n"), "{text}");
    assert!(text.contains("dynhello: ok\n"), "{text}");
    assert!(!text.contains("unsupported system call"), "{text}");
}

/// A static-pie (glibc, position-independent, no interpreter) is loaded
/// by the runtime too, from the rootfs, and entered at its own entry; a
/// static program at fixed addresses may have a rootfs of files it does
/// not belong to.
#[test]
fn a_static_pie_runs_from_the_rootfs() {
    let program = built("linux-hello-static-pie");
    let rootfs = make_rootfs("spie", &program, &[]);
    let out = run_in_rootfs(&program, &rootfs, format!("--cmdline=-- GREETING=hi {} a", program.display()));
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(text.contains("hello: argc=2 argv[1]=[a]\n"), "{text}");
    assert!(text.contains("hello: env GREETING=hi tls=42 pagesz=4096 random=yes\n"), "{text}");
    let static_hello = root().join("target/images/linux-hello");
    let out = run_in_rootfs(&static_hello, &rootfs, "--cmdline=-- GREETING=hi hello");
    assert_eq!(out.status.code(), Some(0), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("hello: env GREETING=hi tls=42 pagesz=4096 random=yes\n"), "{}", stdout(&out));
}

/// execve: a missing path fails and the program goes on; the program
/// replaces itself (keeping its descriptors but the close-on-exec one, with
/// the environment it passed), then runs another program of the rootfs.
#[test]
fn execve_replaces_the_program_with_one_from_the_rootfs() {
    let (execer, hello) = (built("linux-execer"), dynhello());
    let rootfs = make_rootfs("execer", &execer, &[hello.to_str().unwrap()]);
    let out = run_in_rootfs(&execer, &rootfs, format!("--cmdline=-- {} {}", execer.display(), hello.display()));
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(3), "{text}{}", stderr(&out));
    let expect = format!(
        "execer: missing r=-1 errno=2\nexecer: exec self\nexecer: child argc=5 STAGE=2\nexecer: kept=1 closed=1\n\
         dynhello: argc=2 argv0={} argv1=from-execer\ndynhello: GREETING=exec\n",
        hello.display()
    );
    assert!(text.starts_with(&expect), "{text}");
    assert!(text.contains(&format!("dynhello: exe={}\n", hello.display())), "{text}");
    assert!(text.contains("dynhello: ok\n"), "{text}");
}

#[test]
fn a_dynamic_program_without_a_usable_rootfs_is_refused_in_one_line() {
    let program = dynhello();
    let out = ftvm().arg("run").arg("--image").arg(&program).arg("--cmdline=-- dynhello").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("it is dynamically linked: give its root file system with --rootfs DIR"), "{}", stderr(&out));
    let out =
        ftvm().arg("run").arg("--image").arg(&program).args(["--rootfs", "/nonexistent/rootfs", "--cmdline=-- dynhello"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("root file system /nonexistent/rootfs: No such file or directory"), "{}", stderr(&out));
    // A rootfs without the program.
    let other = make_rootfs("other", Path::new("/usr/bin/redis-cli"), &[]);
    let out = ftvm().arg("run").arg("--image").arg(&program).arg("--rootfs").arg(&other.0).arg("--cmdline=-- dynhello").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("is not in the root file system"), "{}", stderr(&out));
    // An ftvm guest has no use for one.
    let out = ftvm().arg("run").arg("--image").arg(image("probe")).arg("--rootfs").arg(&other.0).arg("--cmdline=hello").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("--rootfs is for Linux programs"), "{}", stderr(&out));
}

/// Debian's redis-server in ftvm in the topology's h1 namespace, serving
/// on GUEST_ADDR:6379 once ready; its rootfs must outlive it.
fn debian_redis(topo: &Topology, rootfs: &Rootfs) -> Process {
    let cmdline = format!("ip={GUEST_ADDR}/24 -- /usr/bin/redis-server --port 6379 --save '' --protected-mode no");
    let mut cmd = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    cmd.arg("run").arg("--image").arg(REDIS).arg("--rootfs").arg(&rootfs.0);
    cmd.args(["--memory", "512", "--net", &format!("tap={TAP},mac={GUEST_MAC}")]).arg(format!("--cmdline={cmdline}"));
    let mut vmm = Process::spawn_collected("ftvm", &mut cmd).expect("ftvm spawns");
    match vmm.wait_until(BOOT_TIMEOUT, |p| p.stdout().contains("Ready to accept connections")) {
        Ok(()) => vmm,
        Err(WaitError::Exited(status)) => panic!("ftvm exited ({status}) before redis was ready:\n{}", vmm.output()),
        Err(WaitError::TimedOut(_)) => panic!("redis not ready within {BOOT_TIMEOUT:?}:\n{}", vmm.output()),
    }
}

const REDIS: &str = "/usr/bin/redis-server";

fn redis_rootfs(tag: &str) -> Rootfs {
    assert!(Path::new(REDIS).exists(), "{REDIS} missing: scripts/setup.sh installs Debian's redis-server");
    make_rootfs(tag, Path::new(REDIS), &[])
}

/// Debian's redis-server (glibc, PIE, 17 shared libraries) serves redis-cli
/// and saves a snapshot in a forked child (BGSAVE).
#[test]
fn debian_redis_server_answers_redis_cli() {
    let rootfs = redis_rootfs("redis");
    let topo = Topology::new("dynredis").unwrap();
    let mut vmm = debian_redis(&topo, &rootfs);
    let cli = |args: &[&str]| redis_cli(&topo, args).trim_end_matches('\n').to_owned();
    assert_eq!(cli(&["PING"]), "PONG");
    assert_eq!(cli(&["SET", "greeting", "hello"]), "OK");
    assert_eq!(cli(&["GET", "greeting"]), "hello");
    assert_eq!(cli(&["INCRBY", "counter", "41"]), "41");
    assert_eq!(cli(&["INCR", "counter"]), "42");
    let big: String = (0..100_000).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    assert_eq!(cli(&["SET", "big", &big]), "OK");
    assert!(cli(&["GET", "big"]) == big, "GET big returned another value");
    // Debian's build, not the project's static one (6.2): its version and
    // its allocator (jemalloc, a shared library here).
    let info = cli(&["INFO", "server"]);
    assert!(info.contains("redis_version:7."), "{info}");
    let memory = cli(&["INFO", "memory"]);
    assert!(memory.contains("mem_allocator:jemalloc"), "{memory}");
    // BGSAVE: the child shares the server's memory and its libraries'
    // text copy-on-write (system-call sites rewritten in shared text are
    // unshared first) and writes the snapshot while the parent serves.
    assert_eq!(cli(&["BGSAVE"]), "Background saving started");
    assert_eq!(cli(&["SET", "after", "the fork"]), "OK");
    let t0 = std::time::Instant::now();
    while !cli(&["INFO", "persistence"]).contains("rdb_bgsave_in_progress:0") {
        assert!(t0.elapsed() < std::time::Duration::from_secs(30), "BGSAVE did not finish");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let persistence = cli(&["INFO", "persistence"]);
    assert!(persistence.contains("rdb_last_bgsave_status:ok"), "{persistence}");
    assert_eq!(cli(&["GET", "greeting"]), "hello");
    assert_alive(&mut vmm);
}

/// redis-benchmark against Debian's redis-server, unpipelined and at depth
/// 16: no errors, and glibc's system calls (in libc.so.6, mapped by the
/// interpreter) come through `syscall=jmp` stubs: write (`mov $nr,%eax`),
/// read and epoll_wait (glibc 2.36's routines, recognised whole).
/// Prints the throughput and the runtime's counts.
#[test]
fn debian_redis_server_serves_redis_benchmark() {
    let rootfs = redis_rootfs("redisbench");
    let topo = Topology::new("dynbench").unwrap();
    let mut vmm = debian_redis(&topo, &rootfs);
    for depth in ["1", "16"] {
        let out = topo
            .command("client", "timeout")
            .args(["120", "redis-benchmark", "-h", GUEST_ADDR, "-t", "set,get", "-n", "100000", "-P", depth, "-c", "50", "-q", "--csv"])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("redis-benchmark runs");
        let text = stdout(&out);
        assert!(out.status.success() && !text.contains("ERR"), "redis-benchmark -P {depth} ({}): {text}{}", out.status, stderr(&out));
        for test in ["SET", "GET"] {
            let line = text.lines().find(|l| l.starts_with(&format!("\"{test}\""))).unwrap_or_else(|| panic!("no {test}:\n{text}"));
            let rps: f64 = line.split(',').nth(1).and_then(|v| v.trim_matches('"').parse().ok()).unwrap_or(0.0);
            assert!(rps > 0.0, "{test}: {line}");
            println!("debian redis-server -P {depth} {test}: {rps:.0} requests/s");
        }
    }
    // SHUTDOWN NOSAVE: no reply comes, the VM is gone.
    let _ = topo
        .command("client", "timeout")
        .args(["3", "redis-cli", "-h", GUEST_ADDR, "SHUTDOWN", "NOSAVE"])
        .stdin(std::process::Stdio::null())
        .output();
    match vmm.wait_until(BOOT_TIMEOUT, |_| false) {
        Err(WaitError::Exited(status)) => assert_eq!(status.code(), Some(0), "{}", vmm.output()),
        other => panic!("ftvm did not exit after SHUTDOWN ({other:?}):\n{}", vmm.output()),
    }
    let text = vmm.stdout();
    let line = text.lines().find(|l| l.starts_with("linux: syscall=jmp ")).unwrap_or_else(|| panic!("no counts:\n{text}"));
    println!("{line}");
    let count = |key: &str| -> u64 {
        line.split_whitespace()
            .filter_map(|w| w.trim_start_matches('(').split_once('='))
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.trim_end_matches(')').parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    assert!(count("mov") >= 2 && count("glibc") == 2, "{line}");
    assert!(count("jumped") > 10 * count("trapped"), "{line}");
}

/// A memcached client in the client namespace (python3): connects (retrying
/// while the server starts), stores, reads, increments, asks for stats,
/// printing each reply on a line of its own, then times 5000 SET+GET round
/// trips.
const MEMCACHED_CLIENT: &str = r#"
import socket, sys, time
deadline = time.time() + 30
while True:
    try:
        s = socket.create_connection(("GUEST", 11211), timeout=5)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.2)
f = s.makefile("rb")
def ask(req, lines):
    s.sendall(req)
    return [f.readline().decode().rstrip("\r\n") for _ in range(lines)]
big = "x" * 100000
print("set:", ask(b"set greeting 0 0 5\r\nhello\r\n", 1))
print("get:", ask(b"get greeting\r\n", 3))
print("incr:", ask(b"set n 0 0 2\r\n41\r\nincr n 1\r\n", 2))
print("big:", ask(("set big 0 0 %d\r\n%s\r\n" % (len(big), big)).encode(), 1), ask(b"get big\r\n", 3)[1] == big)
s.sendall(b"stats\r\n")
stats = []
while True:
    line = f.readline().decode().rstrip("\r\n")
    if line == "END":
        break
    stats.append(line)
print("stats:", [l for l in stats if l.startswith("STAT version") or l.startswith("STAT threads")])
n, t0 = 5000, time.time()
for i in range(n):
    s.sendall(b"set k%d 0 0 1\r\nx\r\nget k%d\r\n" % (i, i))
    f.readline(); f.readline(); f.readline(); f.readline()
print("rate: %d set+get pairs/s" % (n / (time.time() - t0)))
"#;

/// Debian's memcached (glibc, PIE, libevent; four worker threads waking
/// each other through eventfd) serves a client over the TAP.
const MEMCACHED: &str = "/usr/bin/memcached";

/// Debian's memcached in ftvm in `topo`'s h1, serving on GUEST_ADDR:11211
/// (`rootfs` made for it), with `-m MIB` of item memory.
fn memcached_vm(topo: &Topology, rootfs: &Rootfs, mib: u32) -> Process {
    let cmdline = format!("ip={GUEST_ADDR}/24 -- {MEMCACHED} -u root -p 11211 -U 0 -m {mib}");
    let mut cmd = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    cmd.arg("run").arg("--image").arg(MEMCACHED).arg("--rootfs").arg(&rootfs.0);
    cmd.args(["--memory", "512", "--net", &format!("tap={TAP},mac={GUEST_MAC}")]).arg(format!("--cmdline={cmdline}"));
    Process::spawn_collected("ftvm", &mut cmd).expect("ftvm spawns")
}

fn memcached_rootfs(tag: &str) -> Rootfs {
    let program = Path::new(MEMCACHED);
    assert!(program.exists(), "{} missing: scripts/setup.sh installs Debian's memcached", program.display());
    // getpwnam("root") for -u root reads the user database.
    make_rootfs(tag, program, &["/etc/passwd", "/etc/group", "/etc/nsswitch.conf"])
}

#[test]
fn debian_memcached_serves_a_client() {
    let rootfs = memcached_rootfs("memcached");
    let topo = Topology::new("dynmemc").unwrap();
    let mut vmm = memcached_vm(&topo, &rootfs, 64);
    let out =
        topo.command("client", "python3").args(["-c", &MEMCACHED_CLIENT.replace("GUEST", GUEST_ADDR)]).output().expect("python3 runs");
    let text = stdout(&out);
    assert!(out.status.success(), "client: {text}{}\nftvm:\n{}", stderr(&out), vmm.output());
    assert!(text.contains("set: ['STORED']\n"), "{text}");
    assert!(text.contains("get: ['VALUE greeting 0 5', 'hello', 'END']\n"), "{text}");
    assert!(text.contains("incr: ['STORED', '42']\n"), "{text}");
    assert!(text.contains("big: ['STORED'] True\n"), "{text}");
    assert!(text.contains("stats: ['STAT version 1.6."), "{text}");
    assert!(text.contains("'STAT threads 4'"), "{text}");
    println!("{}", text.lines().find(|l| l.starts_with("rate:")).unwrap_or_else(|| panic!("{text}")));
    assert_alive(&mut vmm);
}

/// Debian's memcached under libmemcached's own tools (Debian's
/// libmemcached-tools, scripts/setup.sh): memcapable's protocol checks,
/// ASCII and binary, all pass; then memaslap's load, 16 connections on two
/// threads, 40000 requests (a tenth of them sets, 1000-byte values), runs
/// without an error or a miss.
#[test]
fn debian_memcached_passes_memcapable_and_serves_memaslap_without_errors() {
    for tool in ["memccapable", "memcaslap"] {
        let found = Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().is_ok_and(|o| o.status.success());
        assert!(found, "{tool} missing: scripts/setup.sh installs libmemcached-tools");
    }
    let rootfs = memcached_rootfs("memcload");
    let topo = Topology::new("dynmcld").unwrap();
    let mut vmm = memcached_vm(&topo, &rootfs, 256);
    let tool = |args: &[&str]| {
        let out = topo.command("client", "timeout").arg("120").args(args).output().expect("the tool runs");
        (out.status.success(), format!("{}{}", stdout(&out), stderr(&out)))
    };
    // The server may still be starting: memcapable fails to connect then.
    let deadline = std::time::Instant::now() + BOOT_TIMEOUT;
    let (ok, text) = loop {
        let (ok, text) = tool(&["memccapable", "-h", GUEST_ADDR, "-p", "11211", "-t", "10"]);
        if ok || !text.contains("Failed to connect") || std::time::Instant::now() > deadline {
            break (ok, text);
        }
        assert_alive(&mut vmm);
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(ok && text.contains("All tests passed"), "memcapable:\n{text}\nftvm:\n{}", vmm.output());
    assert!(!text.contains("[fail]"), "{text}");
    assert!(text.contains("ascii set") && text.contains("binary stat"), "{text}");
    let server = format!("{GUEST_ADDR}:11211");
    let (ok, text) = tool(&["memcaslap", "-s", &server, "-T", "2", "-c", "16", "-x", "40000", "-X", "1000"]);
    assert!(ok, "memaslap:\n{text}\nftvm:\n{}", vmm.output());
    let stat = |name: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(&format!("{name}: "))).unwrap_or_else(|| panic!("no {name}:\n{text}"));
        line[name.len() + 2..].trim().parse().unwrap_or_else(|_| panic!("{line}"))
    };
    assert_eq!(stat("cmd_get") + stat("cmd_set"), 40000, "{text}");
    assert!(stat("cmd_set") > 0, "{text}");
    assert_eq!(stat("get_misses"), 0, "{text}");
    assert!(!text.contains("ERROR") && !text.to_lowercase().contains("error"), "{text}");
    println!("{}", text.lines().find(|l| l.starts_with("Run time:")).unwrap_or_default());
    assert_alive(&mut vmm);
}

/// Debian's redis-server protected by a backup: its rootfs, the libraries
/// the interpreter mapped and the rewritten text are guest memory and
/// replicate like any other page, so when the primary's VMM is SIGKILLed
/// the backup takes over with every acknowledged write.
#[test]
fn debian_redis_server_fails_over_to_its_backup() {
    let rootfs = redis_rootfs("redisfail");
    let topo = Topology::new("dynfail").unwrap();
    let dir = scratch_for("dynamic", "failover");
    let repl = format!("{H2_REPL_ADDR}:7000");
    let net = format!("tap={TAP},mac={GUEST_MAC}");
    let mut backup_cmd = topo.command("h2", env!("CARGO_BIN_EXE_ftvm"));
    backup_cmd.args(["backup", "--insecure", "--listen", &repl, "--net", &net]).env("FTVM_LOG", "info");
    let mut backup = Process::spawn_collected("backup", &mut backup_cmd).expect("backup spawns");
    let socket = dir.join("primary.sock");
    let cmdline = format!("ip={GUEST_ADDR}/24 -- /usr/bin/redis-server --port 6379 --save '' --protected-mode no");
    let mut cmd = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    cmd.arg("run").arg("--image").arg(REDIS).arg("--rootfs").arg(&rootfs.0).args(["--memory", "512", "--net", &net]);
    cmd.args(["--insecure", "--replicate-to", &repl, "--epoch-ms", "20", "--api-socket"]).arg(&socket);
    cmd.arg(format!("--cmdline={cmdline}")).env("FTVM_LOG", "info");
    let mut primary = Process::spawn_collected("primary", &mut cmd).expect("primary spawns");
    wait_status(&socket, "protected: yes", &mut primary, Duration::from_secs(30));
    let cli = |args: &[&str]| redis_cli(&topo, args).trim_end_matches('\n').to_owned();
    for i in 0..50 {
        assert_eq!(cli(&["SET", &format!("key{i}"), &format!("value{i}")]), "OK");
    }
    assert_eq!(cli(&["INCRBY", "counter", "42"]), "42");
    primary.kill();
    wait_log(&mut backup, "PRIMARY LOST", Duration::from_secs(10));
    // The backup's VM answers at the same address with everything written.
    assert_eq!(cli(&["GET", "counter"]), "42");
    for i in 0..50 {
        assert_eq!(cli(&["GET", &format!("key{i}")]), format!("value{i}"));
    }
    assert_eq!(cli(&["INCR", "counter"]), "43");
    assert!(backup.running(), "{}", backup.output());
    backup.kill();
}

/// A snapshot of Debian's redis-server restores without its rootfs: the
/// image, the program, its interpreter and libraries are guest memory.
#[test]
fn a_snapshot_of_debian_redis_server_restores_without_the_rootfs() {
    let topo = Topology::new("dynsnap").unwrap();
    let dir = scratch_for("dynamic", "snapshot");
    let (socket, snap) = (dir.join("api.sock"), dir.join("vm.snap"));
    let net = format!("tap={TAP},mac={GUEST_MAC}");
    let rootfs = redis_rootfs("redissnap");
    let cmdline = format!("ip={GUEST_ADDR}/24 -- /usr/bin/redis-server --port 6379 --save '' --protected-mode no");
    let mut cmd = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    cmd.arg("run").arg("--image").arg(REDIS).arg("--rootfs").arg(&rootfs.0).args(["--memory", "512", "--net", &net]);
    cmd.arg("--api-socket").arg(&socket).arg(format!("--cmdline={cmdline}"));
    let mut first = Process::spawn_collected("ftvm run", &mut cmd).expect("ftvm spawns");
    if let Err(e) = first.wait_until(BOOT_TIMEOUT, |p| p.stdout().contains("Ready to accept connections")) {
        panic!("redis not ready ({e}):\n{}", first.output());
    }
    let cli = |args: &[&str]| redis_cli(&topo, args).trim_end_matches('\n').to_owned();
    assert_eq!(cli(&["SET", "before", "1"]), "OK");
    let out = ftvm().args(["snapshot", "--stop", "--api-socket"]).arg(&socket).arg("--output").arg(&snap).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(first.wait().unwrap().success());
    drop(rootfs);
    let mut restored = topo.command("h1", env!("CARGO_BIN_EXE_ftvm"));
    restored.args(["restore", "--net", &net, "--snapshot"]).arg(&snap);
    let mut restored = Process::spawn_collected("ftvm restore", &mut restored).expect("ftvm spawns");
    assert_eq!(cli(&["GET", "before"]), "1");
    assert_eq!(cli(&["SET", "after", "2"]), "OK");
    assert_eq!(cli(&["MGET", "before", "after"]), "1\n2");
    assert!(restored.running(), "{}", restored.output());
}
