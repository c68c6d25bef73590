//! A Redis-protocol guest under redis-benchmark, against redis-server run
//! natively in the same run as the ceiling, and the same guest protected
//! against itself unreplicated.
//!
//! `--app kv` (the default): the kv guest, against Debian's redis-server.
//! `--app redis`: the static redis-server of scripts/build-redis.sh on the
//! Linux personality, against the very same binary run natively.
//!
//! One private topology (scripts/netns.sh): the VMM runs the guest in
//! `NAME-h1` (guest 10.0.0.2 behind tap0 on br0), the native redis-server
//! runs in `NAME-h2` with 10.0.0.3 on that host's br0, and redis-benchmark
//! runs in `NAME-client`. Both servers are reached over the same path
//! (client veth, LAN bridge, host veth, host bridge); the guest adds the TAP
//! and the VMM. Protected, the guest replicates to a backup in `NAME-h2`
//! over the hosts' replication link.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use ftvm_testkit::process::Process;
use ftvm_testkit::scratch::Scratch;
use ftvm_testkit::topology::{Topology, GUEST_ADDR};

use crate::redis_benchmark::{self, Figures};
use crate::redis_guest::{check_alive, ftvm_binary, wait_serving, App, Guest, Protection, PORT, REDIS_ARGS};
use crate::report::{self, Row};
use crate::threads;

type BoxError = Box<dyn std::error::Error>;

const NATIVE_ADDR: &str = "10.0.0.3";

#[derive(clap::Args)]
pub struct Options {
    /// Requests per redis-benchmark run (-n).
    #[arg(long, default_value_t = 200_000)]
    requests: u64,
    /// Parallel connections (-c).
    #[arg(long, default_value_t = 50)]
    clients: u32,
    /// Pipeline depths to measure (-P), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 16])]
    pipeline: Vec<u32>,
    /// Runs per configuration and server; the median run (by rps) is kept.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// The guest: `kv` (the ftvm runtime's server, against Debian's
    /// redis-server) or `redis` (the static redis-server on the Linux
    /// personality, against the same binary run natively).
    #[arg(long, value_enum, default_value_t = App::Kv)]
    app: App,
    /// Checkpoint interval of the protected runs, in milliseconds.
    #[arg(long, default_value_t = 20)]
    epoch_ms: u64,
    /// With `--app redis`: also measure the guest with these runtime
    /// options (the words before `--` on its command line, e.g.
    /// `vdso=off`), unreplicated against native in the same run: one switch
    /// on and off. Words starting with `--` are `ftvm run` options instead
    /// (e.g. `--variant='--net-offload=off'`). Repeatable; one extra VM per
    /// value.
    #[arg(long)]
    variant: Vec<String>,
    /// Skip the protected runs (only unreplicated against native).
    #[arg(long)]
    no_protected: bool,
    /// Directory holding kv.elf and redis-server.
    #[arg(long, default_value = "target/images")]
    images: PathBuf,
    /// The ftvm binary (default: next to ftvm-bench).
    #[arg(long)]
    ftvm: Option<PathBuf>,
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// One redis-benchmark run of SET, then one of GET, against `addr`.
fn benchmark(topo: &Topology, addr: &str, opts: &Options, pipeline: u32) -> Result<(Figures, Figures), BoxError> {
    Ok((benchmark_one(topo, addr, opts, pipeline, "SET")?, benchmark_one(topo, addr, opts, pipeline, "GET")?))
}

/// One redis-benchmark run of `test` (SET or GET) against `addr`: one test
/// per run, so that the CPU time around it is that test's.
fn benchmark_one(topo: &Topology, addr: &str, opts: &Options, pipeline: u32, test: &str) -> Result<Figures, BoxError> {
    let args = ["-n".into(), opts.requests.to_string(), "-c".into(), opts.clients.to_string(), "-P".into(), pipeline.to_string()];
    Ok(redis_benchmark::run(topo, addr, &[test], &args)?.remove(0))
}

/// One unmeasured run at the deepest pipeline: a fresh server first grows
/// its memory (in a VM, each new page costs a shadow page fault), which the
/// measured runs should not pay for one server and not the other.
fn warm_up(topo: &Topology, addr: &str, opts: &Options) -> Result<(), BoxError> {
    let depth = opts.pipeline.iter().copied().max().unwrap_or(1);
    benchmark(topo, addr, opts, depth).map(|_| ())
}

/// The run with the median rps of `runs`.
fn median(mut runs: Vec<Figures>) -> Figures {
    runs.sort_by(|a, b| a.rps.total_cmp(&b.rps));
    runs.swap_remove(runs.len() / 2)
}

/// What the table shows per test: name, unit, and the figure.
type Metric = (&'static str, &'static str, fn(&Figures) -> f64);
const METRICS: [Metric; 3] = [("throughput", "req/s", |f| f.rps), ("latency p50", "ms", |f| f.p50_ms), ("latency p99", "ms", |f| f.p99_ms)];

/// Per pipeline depth: (depth, guest [SET, GET], native [SET, GET], CPU
/// time per request (guest, native, the guest's device threads alone) in
/// microseconds, then context switches per request (guest, native)).
/// Per request, medians over the runs: the VMM's CPU time (us), native's,
/// the VMM's device threads', the VMM's context switches, native's.
/// Then per test (SET, GET): the VMM's CPU time per request, its device
/// threads', native's.
type CpuCounts = (f64, f64, f64, f64, f64, [[f64; 3]; 2]);
type Paired = Vec<(u32, [Figures; 2], [Figures; 2], CpuCounts)>;
/// One figure of `CpuCounts` and native's, for a row.
type PickCounts = fn(&CpuCounts) -> (f64, f64);

/// CPU time every thread of process `pid` has had so far, in nanoseconds
/// (`/proc/PID/task/*/schedstat`): the VMM's vCPU, device and other threads,
/// or the native redis-server's; that of the VMM's device threads (named
/// `deviceN`: the TAP I/O) alone; and the context switches of all its
/// threads, voluntary and not (`/proc/PID/task/*/status`), which cost more
/// than their share under nested KVM.
fn cpu_ns(pid: u32) -> Result<(u64, u64, u64), BoxError> {
    let (mut total, mut device, mut switches) = (0, 0, 0);
    for t in threads::tasks(pid)? {
        total += t.cpu_ns;
        if t.kind == "device" {
            device += t.cpu_ns;
        }
        switches += t.switches;
    }
    Ok((total, device, switches))
}

/// [`benchmark`], with the CPU time `server` used per request meanwhile,
/// in microseconds. Unlike throughput, it hardly depends on what else the
/// host runs at the time. Also the device threads' share of it, the
/// server's context switches per request, and the CPU time per request of
/// each test alone ([`PerTest`]).
fn benchmark_cpu(
    topo: &Topology,
    addr: &str,
    opts: &Options,
    pipeline: u32,
    server: u32,
) -> Result<(Figures, Figures, f64, f64, f64, PerTest), BoxError> {
    let before = cpu_ns(server)?;
    let set = benchmark_one(topo, addr, opts, pipeline, "SET")?;
    let between = cpu_ns(server)?;
    let get = benchmark_one(topo, addr, opts, pipeline, "GET")?;
    let after = cpu_ns(server)?;
    let requests = (2 * opts.requests) as f64;
    let per_request = |ns: u64| ns as f64 / 1000.0 / requests;
    let switches = after.2.saturating_sub(before.2) as f64 / requests;
    // Each test alone: twice the share of both tests' requests.
    let test =
        |a: (u64, u64, u64), b: (u64, u64, u64)| [2.0 * per_request(b.0.saturating_sub(a.0)), 2.0 * per_request(b.1.saturating_sub(a.1))];
    let per_test = [test(before, between), test(between, after)];
    Ok((set, get, per_request(after.0.saturating_sub(before.0)), per_request(after.1.saturating_sub(before.1)), switches, per_test))
}

/// CPU time per request of SET and of GET, each `[all threads, device
/// threads]` in microseconds.
type PerTest = [[f64; 2]; 2];

/// Iterations of each [`in_server`] loop.
const IN_SERVER_OPS: u32 = 1_000_000;

/// The commands alone, without the network: the CPU time `server` (every
/// thread) spends per SET and per GET of redis-benchmark's key when a Lua
/// script calls them in a loop (`EVAL`), in nanoseconds. redis-server's own
/// work (parsing aside) with no frames, system calls or exits, so the same
/// binary in the guest and natively should cost the same: what the network
/// figures add on top of it is the I/O path.
fn in_server(topo: &Topology, addr: &str, server: u32) -> Result<[f64; 2], BoxError> {
    let mut per_op = [0.0; 2];
    let key = "key:__rand_int__";
    for (slot, call) in per_op.iter_mut().zip([format!("redis.call('set','{key}','xxx')"), format!("redis.call('get','{key}')")]) {
        let script = format!("for i=1,{IN_SERVER_OPS} do {call} end return 1");
        let before = cpu_ns(server)?.0;
        let (ok, reply) = topo.redis_cli(addr, &["EVAL", &script, "0"]);
        let after = cpu_ns(server)?.0;
        if !ok || reply.trim() != "1" {
            return Err(format!("EVAL at {addr} failed: {reply}").into());
        }
        *slot = after.saturating_sub(before) as f64 / f64::from(IN_SERVER_OPS);
    }
    Ok(per_op)
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Counts per request over a Linux guest's whole life (warm-up included),
/// from the lines its runtime prints when redis-server exits: system calls
/// and their traps (`linux: syscall=MODE trapped=T ... calls=C`), then the
/// network's frames, device notifications, WAIT hypercalls and idle-poll
/// hits (`linux: net rx_frames=... waits=...`). Each is (name, per request).
type SyscallCounts = Option<Vec<(String, f64)>>;
/// [`in_server`] of the guest and of native (Linux personality only).
type InServer = Option<[[f64; 2]; 2]>;

/// Stop redis-server in `guest` (SHUTDOWN NOSAVE) after it served `served`
/// requests, and read its runtime's counts.
fn syscall_counts(topo: &Topology, guest: &mut Guest, served: u64) -> Result<Vec<(String, f64)>, BoxError> {
    // No reply comes: the VM stops, and its connection with it.
    let _ = topo
        .command("client", "timeout")
        .args(["3", "redis-cli", "-h", GUEST_ADDR, "-p", PORT, "SHUTDOWN", "NOSAVE"])
        .stdin(Stdio::null())
        .output();
    let deadline = Instant::now() + Duration::from_secs(30);
    while guest.vmm.try_wait().is_none() {
        if Instant::now() > deadline {
            return Err(format!("the guest did not stop after SHUTDOWN: {}", guest.vmm.output()).into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = guest.vmm.stdout();
    let line = out.lines().find(|l| l.starts_with("linux: syscall=")).ok_or_else(|| format!("no system-call counts at exit: {out}"))?;
    let per_request = |line: &str, key: &str| -> Result<f64, BoxError> {
        let v = line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('=')).and_then(|v| v.parse::<u64>().ok());
        Ok(v.ok_or_else(|| format!("no {key}= in {line:?}"))? as f64 / served.max(1) as f64)
    };
    let mut counts = vec![("calls".to_string(), per_request(line, "calls")?), ("traps".to_string(), per_request(line, "trapped")?)];
    if let Some(net) = out.lines().find_map(|l| l.strip_prefix("linux: net ")) {
        for key in net.split_whitespace().filter_map(|w| w.split_once('=').map(|(k, _)| k)) {
            counts.push((key.to_string(), per_request(net, key)?));
        }
    }
    Ok(counts)
}

/// The guest with runtime options `variant`, unreplicated, against the
/// native server, alternating run by run; with `--app redis` also its
/// system calls and traps per request, and [`in_server`] for the guest and
/// native (`[guest, native]`, each `[SET, GET]`).
fn unreplicated(
    topo: &Topology,
    ftvm: &Path,
    image: &Path,
    opts: &Options,
    variant: &str,
    native: &mut Process,
) -> Result<(Paired, SyscallCounts, InServer), BoxError> {
    let mut guest = Guest::start(topo, ftvm, image, opts.app, variant, None)?;
    wait_serving(topo, GUEST_ADDR, &mut guest.vmm)?;
    warm_up(topo, GUEST_ADDR, opts)?;
    let mut figures = Vec::new();
    for &p in &opts.pipeline {
        let (mut g_set, mut g_get, mut n_set, mut n_get) = (vec![], vec![], vec![], vec![]);
        let (mut g_cpu, mut n_cpu, mut d_cpu, mut g_sw, mut n_sw) = (vec![], vec![], vec![], vec![], vec![]);
        // Per test (SET, GET): the VMM's, its device threads', native's.
        let mut tests: [[Vec<f64>; 3]; 2] = Default::default();
        for _ in 0..opts.repeat {
            let (s, g, cpu, device, switches, per_test) = benchmark_cpu(topo, GUEST_ADDR, opts, p, guest.vmm.id())?;
            for (t, [all, dev]) in per_test.into_iter().enumerate() {
                tests[t][0].push(all);
                tests[t][1].push(dev);
            }
            d_cpu.push(device);
            g_sw.push(switches);
            g_set.push(s);
            g_get.push(g);
            g_cpu.push(cpu);
            guest.check_alive()?;
            check_alive(native)?;
            let (s, g, cpu, _, switches, per_test) = benchmark_cpu(topo, NATIVE_ADDR, opts, p, native.id())?;
            for (t, [all, _]) in per_test.into_iter().enumerate() {
                tests[t][2].push(all);
            }
            n_sw.push(switches);
            n_set.push(s);
            n_get.push(g);
            n_cpu.push(cpu);
        }
        figures.push((
            p,
            [median(g_set), median(g_get)],
            [median(n_set), median(n_get)],
            (median_f64(g_cpu), median_f64(n_cpu), median_f64(d_cpu), median_f64(g_sw), median_f64(n_sw), tests.map(|t| t.map(median_f64))),
        ));
    }
    let (counts, in_server) = match opts.app {
        App::Redis => {
            // After the network runs (the key exists, memory has grown),
            // before the counts (the EVALs add two requests to them).
            let both = [in_server(topo, GUEST_ADDR, guest.vmm.id())?, in_server(topo, NATIVE_ADDR, native.id())?];
            // SET and GET per run; one warm-up run, then every measured one.
            let served = 2 * opts.requests * (1 + (opts.repeat * opts.pipeline.len()) as u64);
            (Some(syscall_counts(topo, &mut guest, served)?), Some(both))
        }
        App::Kv => (None, None),
    };
    Ok((figures, counts, in_server))
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let app = opts.app;
    let image = app.existing_image(&opts.images)?;
    let ftvm = ftvm_binary(opts.ftvm.as_deref())?;
    if opts.repeat == 0 || opts.pipeline.is_empty() {
        return Err("--repeat and --pipeline need at least one run".into());
    }
    if app == App::Kv && !opts.variant.is_empty() {
        return Err("--variant sets Linux-personality runtime options: use it with --app redis".into());
    }
    let topo = Topology::new("kvb")?;
    let dir = Scratch::new("bench-kv")?;

    // The reference: redis-server on h2's bridge, no persistence: Debian's
    // for kv, the guest's own binary for redis.
    let addr = topo.command("h2", "ip").args(["addr", "add", &format!("{NATIVE_ADDR}/24"), "dev", "br0"]).output()?;
    if !addr.status.success() {
        return Err(format!("cannot give h2's br0 {NATIVE_ADDR}: {}", text(&addr)).into());
    }
    let mut redis = match app {
        App::Kv => topo.command("h2", "redis-server"),
        App::Redis => topo.command("h2", &image),
    };
    redis.args(REDIS_ARGS.map(|a| if a == "''" { "" } else { a })).args(["--bind", NATIVE_ADDR]);
    redis.args(["--daemonize", "no", "--dir", "/tmp", "--logfile", ""]);
    let mut native = Process::spawn_collected("redis-server", &mut redis).map_err(|e| format!("{e} (scripts/setup.sh installs it)"))?;
    wait_serving(&topo, NATIVE_ADDR, &mut native)?;
    warm_up(&topo, NATIVE_ADDR, opts)?;

    // Unreplicated, one vCPU (the default), alternating with the native
    // server so that drift on the host hits both alike; then each variant
    // the same way.
    let (figures, counts, in_server) = unreplicated(&topo, &ftvm, &image, opts, "", &mut native)?;
    let mut variants = Vec::new();
    for v in &opts.variant {
        variants.push((v.as_str(), unreplicated(&topo, &ftvm, &image, opts, v, &mut native)?));
    }
    drop(native);

    // Protected: a backup in h2, checkpoints every --epoch-ms.
    let mut protected = Vec::new();
    if !opts.no_protected {
        let mut guest =
            Guest::start(&topo, &ftvm, &image, app, "", Some(Protection { dir: dir.path(), epoch_ms: Some(opts.epoch_ms), extra: &[] }))?;
        wait_serving(&topo, GUEST_ADDR, &mut guest.vmm)?;
        warm_up(&topo, GUEST_ADDR, opts)?;
        for &p in &opts.pipeline {
            let (mut set, mut get) = (vec![], vec![]);
            for _ in 0..opts.repeat {
                let (s, g) = benchmark(&topo, GUEST_ADDR, opts, p)?;
                set.push(s);
                get.push(g);
                guest.check_alive()?;
            }
            protected.push(Some([median(set), median(get)]));
        }
    }
    protected.resize(figures.len(), None);
    drop(topo);

    let mut rows = Vec::new();
    let mut chart = Vec::new();
    let name = app.name();
    // Counted, not timed: system calls, traps and exits per request hardly
    // depend on what else the host runs.
    let all = std::iter::once(("", &counts)).chain(variants.iter().map(|(v, (_, c, _))| (*v, c)));
    for (v, c) in all {
        let label = if v.is_empty() { String::new() } else { format!(", {v}") };
        let group = format!("{name} system calls and exits, whole guest run");
        for (key, value) in c.iter().flatten() {
            rows.push(Row { group: group.clone(), case: format!("{key} per request{label}"), value: *value, unit: "", reference: None });
        }
    }
    // The commands alone (no network), each VM against native measured
    // right after it.
    let all = std::iter::once(("", &in_server)).chain(variants.iter().map(|(v, (_, _, e))| (*v, e)));
    for (v, e) in all {
        let Some([guest, native]) = e else { continue };
        let label = if v.is_empty() { String::new() } else { format!(", {v}") };
        for (i, test) in ["SET", "GET"].into_iter().enumerate() {
            rows.push(Row {
                group: format!("{name} commands inside the server (EVAL loop, no network)"),
                case: format!("CPU per {test} unreplicated{label} (ref: native)"),
                value: guest[i],
                unit: "ns",
                reference: Some(native[i]),
            });
        }
    }
    for (k, ((p, unrep, native, cpu), prot)) in figures.into_iter().zip(protected).enumerate() {
        let group = format!("{name} SET+GET -P {p} -c {}", opts.clients);
        // CPU time and (counted) the server threads' context switches, for
        // the default VM and each variant, each against native's.
        let per_request: [(&str, &str, PickCounts); 2] = [("CPU", "us", |c| (c.0, c.1)), ("context switches", "", |c| (c.3, c.4))];
        for (what, unit, pick) in per_request {
            let all = std::iter::once(("", &cpu)).chain(variants.iter().map(|(v, runs)| (*v, &runs.0[k].3)));
            for (v, c) in all {
                let label = if v.is_empty() { String::new() } else { format!(", {v}") };
                let (value, native) = pick(c);
                let case = format!("{what} per request unreplicated{label} (ref: native)");
                rows.push(Row { group: group.clone(), case, value, unit, reference: Some(native) });
            }
        }
        // Of which the VMM's device threads (frames through the TAP): the
        // part of the VMM's CPU that is not the guest.
        rows.push(Row {
            group: group.clone(),
            case: "CPU per request unreplicated, device threads only (ref: native)".into(),
            value: cpu.2,
            unit: "us",
            reference: Some(cpu.1),
        });
        for (i, test) in ["SET", "GET"].into_iter().enumerate() {
            let group = format!("{name} {test} -P {p} -c {}", opts.clients);
            let (g, n) = (&unrep[i], &native[i]);
            // This test alone: the VMM's CPU per request and its device
            // threads', against native's.
            let [all, device, native_all] = cpu.5[i];
            for (case, value) in [("CPU per request unreplicated", all), ("CPU per request unreplicated, device threads only", device)] {
                rows.push(Row {
                    group: group.clone(),
                    case: format!("{case} (ref: native)"),
                    value,
                    unit: "us",
                    reference: Some(native_all),
                });
            }
            for (what, unit, pick) in METRICS {
                rows.push(Row {
                    group: group.clone(),
                    case: format!("{what} unreplicated (ref: native)"),
                    value: pick(g),
                    unit,
                    reference: Some(pick(n)),
                });
                for (v, runs) in &variants {
                    let (_, vg, vn, _) = &runs.0[k];
                    rows.push(Row {
                        group: group.clone(),
                        case: format!("{what} unreplicated, {v} (ref: native)"),
                        value: pick(&vg[i]),
                        unit,
                        reference: Some(pick(&vn[i])),
                    });
                }
                if let Some(pr) = &prot {
                    rows.push(Row {
                        group: group.clone(),
                        case: format!("{what} protected, {} ms epochs (ref: unreplicated)", opts.epoch_ms),
                        value: pick(&pr[i]),
                        unit,
                        reference: Some(pick(g)),
                    });
                }
            }
            chart.push((format!("{group}: native"), n.rps));
            chart.push((format!("{group}: ftvm"), g.rps));
            for (v, runs) in &variants {
                chart.push((format!("{group}: ftvm {v}"), runs.0[k].1[i].rps));
            }
            if let Some(pr) = &prot {
                chart.push((format!("{group}: ftvm protected"), pr[i].rps));
            }
        }
    }
    let (file, title) = match app {
        App::Kv => ("kv", format!("redis-benchmark, -n {}: kv in ftvm vs native redis-server", opts.requests)),
        App::Redis => ("kv-redis", format!("redis-benchmark, -n {}: redis-server in ftvm vs the same binary natively", opts.requests)),
    };
    report::publish(
        out,
        file,
        &rows,
        &report::BarChart {
            title: &title,
            category: "test, pipeline depth, connections; server",
            quantity: "throughput (requests/s)",
            bars: chart,
            reference: None,
        },
    )?;
    Ok(())
}
