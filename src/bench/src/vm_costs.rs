//! Costs of the microVM: guest speed against the same loop run natively,
//! pause/resume, state save/restore, and tracked first writes (also as the
//! VMM's calibration at start measures them).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ftvm_vmm::calibrate;
use ftvm_vmm::{Console, DirtyBackend, PageBitmap, Persist, Vm, VmConfig};
use ftvm_workloads::memtouch::{Config, Writer};

use crate::report::{self, Row};

type BoxError = Box<dyn std::error::Error>;

#[derive(clap::Args)]
pub struct Options {
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 2)]
    seconds: u64,
    /// Pause/resume and save/restore repetitions.
    #[arg(long, default_value_t = 200)]
    reps: usize,
    /// Interval between dirty collections in the first-write measurement.
    #[arg(long, default_value_t = 20)]
    epoch_ms: u64,
    /// Directory holding memtouch.elf.
    #[arg(long, default_value = "target/images")]
    images: PathBuf,
}

/// Guest console output, captured.
type Captured = std::sync::Arc<std::sync::Mutex<Vec<u8>>>;

fn memtouch_vm(opts: &Options, vcpus: u32, backend: DirtyBackend, cmdline: &str) -> Result<(Vm, Captured), BoxError> {
    let (console, out) = Console::capture();
    let config = VmConfig { mem_size: 512 << 20, vcpus, prefault: true, dirty_backend: backend, console, ..Default::default() };
    let vm = Vm::new(config)?;
    vm.boot(&opts.images.join("memtouch.elf"), None, cmdline)?;
    Ok((vm, out))
}

/// Total writes memtouch reported on its `memtouch: writes=` line.
fn total_writes(out: &[u8]) -> Result<u64, BoxError> {
    let text = String::from_utf8_lossy(out);
    text.lines()
        .find_map(|l| l.strip_prefix("memtouch: writes=")?.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("memtouch printed no total: {text}").into())
}

/// The same loop memtouch runs, on host threads, for `seconds`.
fn native_writes_per_sec(cmdline: &str, writers: u32, seconds: u64) -> f64 {
    let config = Config::parse(cmdline).expect("valid cmdline");
    let mut ws = vec![0u64; (config.ws_pages * 512) as usize];
    let base = ws.as_mut_ptr() as usize;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let t0 = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..writers)
            .map(|w| {
                let config = &config;
                s.spawn(move || {
                    let mut writer = Writer::new(config, w, writers);
                    while Instant::now() < deadline {
                        // SAFETY: `ws` holds the whole working set and each
                        // writer only writes its own partition.
                        unsafe { writer.run(base as *mut u64, 1024, |_| {}) };
                    }
                    writer.done
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("writer thread")).sum()
    });
    total as f64 / t0.elapsed().as_secs_f64()
}

fn vm_writes_per_sec(opts: &Options, cmdline: &str, vcpus: u32) -> Result<f64, BoxError> {
    let cmdline = format!("{cmdline} duration={}s report=0", opts.seconds);
    let (vm, out) = memtouch_vm(opts, vcpus, DirtyBackend::Bitmap, &cmdline)?;
    vm.start()?;
    let exit = vm.wait();
    if exit.status() != 0 {
        return Err(format!("memtouch failed: {exit}").into());
    }
    let writes = total_writes(&out.lock().unwrap())?;
    Ok(writes as f64 / opts.seconds as f64)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn pause_and_state(opts: &Options, vcpus: u32, rows: &mut Vec<Row>) -> Result<(), BoxError> {
    let (vm, _out) = memtouch_vm(opts, vcpus, DirtyBackend::Bitmap, "ws=16M duration=600s report=0")?;
    // State is restored only into a VM that has not run: a twin that never starts.
    let (mut twin, _) = memtouch_vm(opts, vcpus, DirtyBackend::Bitmap, "")?;
    vm.start()?;
    std::thread::sleep(Duration::from_millis(200));
    let (mut pause, mut resume, mut save, mut restore) = (vec![], vec![], vec![], vec![]);
    for _ in 0..opts.reps {
        let t = Instant::now();
        vm.pause();
        pause.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let state = vm.save()?;
        save.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        twin.restore(&state)?;
        restore.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        vm.resume();
        resume.push(t.elapsed().as_secs_f64() * 1e6);
        std::thread::sleep(Duration::from_millis(2));
    }
    vm.request_stop();
    vm.wait();
    let group = format!("state, {vcpus} vCPU");
    for (name, mut v) in
        [("pause (all vCPUs parked)", pause), ("resume", resume), ("save full state", save), ("restore full state", restore)]
    {
        v.sort_by(f64::total_cmp);
        for (stat, p) in [("p50", 0.5), ("p99", 0.99)] {
            rows.push(Row { group: group.clone(), case: format!("{name} {stat}"), value: percentile(&v, p), unit: "us", reference: None });
        }
    }
    Ok(())
}

/// Per-page cost of the first write to a page after tracking re-protected
/// it: memtouch sweeps a working set while the VMM collects the dirty set
/// every epoch; the time lost against the untracked rate, minus the time the
/// VM spent paused, divided by the pages collected. Returns that cost (µs).
fn first_write_cost(
    opts: &Options,
    backend: DirtyBackend,
    untracked_rate: f64,
    cmdline: &str,
    rows: &mut Vec<Row>,
) -> Result<f64, BoxError> {
    let cmdline = format!("{cmdline} duration={}s report=0", opts.seconds);
    let (vm, out) = memtouch_vm(opts, 1, backend, &cmdline)?;
    vm.start_dirty_tracking()?;
    let t0 = Instant::now();
    vm.start()?;
    let mut dirty = PageBitmap::new(vm.ram().pages());
    let keep_none = PageBitmap::new(vm.ram().pages());
    let (mut pages, mut paused, mut epochs, mut collect) = (0u64, Duration::ZERO, 0u32, Duration::ZERO);
    while vm.exit_reason().is_none() {
        std::thread::sleep(Duration::from_millis(opts.epoch_ms));
        let p0 = Instant::now();
        vm.pause();
        let c0 = Instant::now();
        dirty.clear();
        vm.collect_dirty(&mut dirty, &keep_none)?;
        collect += c0.elapsed();
        vm.resume();
        paused += p0.elapsed();
        pages += dirty.count();
        epochs += 1;
    }
    let elapsed = t0.elapsed().as_secs_f64().min(opts.seconds as f64 + 0.05);
    vm.wait();
    let writes = total_writes(&out.lock().unwrap())?;
    let lost = elapsed - writes as f64 / untracked_rate - paused.as_secs_f64();
    let per_page_us = lost / pages.max(1) as f64 * 1e6;
    let group = format!("dirty {backend}");
    rows.push(Row {
        group: group.clone(),
        case: "first write after re-protect".into(),
        value: per_page_us,
        unit: "us/page",
        reference: None,
    });
    rows.push(Row {
        group: group.clone(),
        case: "dirty pages per epoch".into(),
        value: pages as f64 / epochs.max(1) as f64,
        unit: "pages",
        reference: None,
    });
    rows.push(Row {
        group: group.clone(),
        case: "collect per epoch".into(),
        value: collect.as_secs_f64() / epochs.max(1) as f64 * 1e6,
        unit: "us",
        reference: None,
    });
    rows.push(Row {
        group,
        case: "guest speed vs untracked".into(),
        value: writes as f64 / opts.seconds as f64,
        unit: "writes/s",
        reference: Some(untracked_rate),
    });
    Ok(per_page_us)
}

/// The calibration `ftvm` runs at start (`ftvm_vmm::calibrate`), beside the
/// memtouch figure of the same run (`memtouch_us`) as its reference: what
/// tracking adds to a first write, measured the two ways, should agree.
fn first_write_calibration(memtouch_us: f64, rows: &mut Vec<Row>) -> Result<(), BoxError> {
    let cost = calibrate::tracked_first_write(calibrate::DEFAULT_PAGES)?;
    let group = "dirty bitmap".to_string();
    let row = |case: &str, value, unit, reference| Row { group: group.clone(), case: case.into(), value, unit, reference };
    rows.push(row("first-write: calibration at start (reference: memtouch)", cost.tracking_ns() / 1e3, "us/page", Some(memtouch_us)));
    rows.push(row("calibration: tracked write", cost.tracked_ns / 1e3, "us/page", None));
    rows.push(row("calibration: untracked write", cost.untracked_ns / 1e3, "us/page", None));
    rows.push(row("calibration: wall time", cost.elapsed.as_secs_f64() * 1e3, "ms", None));
    Ok(())
}

/// Whether re-arming dirty tracking revokes only write permission: the
/// probe guest writes 4096 pages, the VMM re-arms tracking for them (or, for
/// the control, does not), then the guest times a read pass, a second read
/// pass and a write pass over them. HBFT's read-fault
/// reduction is what KVM does if the first reads cost what the second do
/// while the writes take the first-write fault.
fn reads_after_rearm(opts: &Options, rearm: bool, rows: &mut Vec<Row>) -> Result<(), BoxError> {
    const PAGES: u64 = 4096;
    let (console, out) = Console::capture();
    let config = VmConfig { mem_size: 256 << 20, vcpus: 1, prefault: true, console, ..Default::default() };
    let vm = Vm::new(config)?;
    vm.boot(&opts.images.join("probe.elf"), None, &format!("reread={PAGES},300"))?;
    vm.start_dirty_tracking()?;
    vm.start()?;
    let t0 = Instant::now();
    while !String::from_utf8_lossy(&out.lock().unwrap()).contains("probe: reread written") {
        if t0.elapsed() > Duration::from_secs(10) || vm.exit_reason().is_some() {
            return Err(format!("the probe never wrote its pages: {}", String::from_utf8_lossy(&out.lock().unwrap())).into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut dirty = PageBitmap::new(vm.ram().pages());
    if rearm {
        vm.pause();
        vm.collect_dirty(&mut dirty, &PageBitmap::new(vm.ram().pages()))?;
        vm.resume();
    }
    let exit = vm.wait();
    let text = String::from_utf8_lossy(&out.lock().unwrap()).into_owned();
    if exit.status() != 0 {
        return Err(format!("probe failed: {exit}: {text}").into());
    }
    let figure = |key: &str| -> Result<f64, BoxError> {
        let value = text.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok());
        value.ok_or_else(|| format!("probe printed no {key}: {text}").into())
    };
    let group = if rearm { format!("after re-arming {} pages", dirty.count()) } else { "without re-arming (control)".into() };
    for (key, case) in [("read_ns", "first read of a page"), ("read_again_ns", "second read"), ("write_ns", "first write")] {
        rows.push(Row {
            group: group.clone(),
            case: case.into(),
            value: figure(key)? / PAGES as f64 / 1e3,
            unit: "us/page",
            reference: None,
        });
    }
    Ok(())
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let image = opts.images.join("memtouch.elf");
    if !image.exists() {
        return Err(format!("{} missing: run scripts/build-images.sh", image.display()).into());
    }
    let mut rows = Vec::new();
    for (pattern, vcpus) in [("seq", 1), ("random", 1), ("hotcold", 1), ("random", 2)] {
        let cmdline = format!("ws=64M pattern={pattern}");
        let vm = vm_writes_per_sec(opts, &cmdline, vcpus)?;
        let native = native_writes_per_sec(&cmdline, vcpus, opts.seconds);
        rows.push(Row {
            group: "memtouch VM/native".into(),
            case: format!("{pattern}, {vcpus} writer(s), 64 MiB"),
            value: vm,
            unit: "writes/s",
            reference: Some(native),
        });
    }
    for vcpus in [1, 2] {
        pause_and_state(opts, vcpus, &mut rows)?;
    }
    // A sequential sweep of 4096 pages: every page is first-written once
    // per pass, so almost every tracked write is a re-protected first write.
    let sweep = "ws=16M pattern=seq";
    let untracked = vm_writes_per_sec(opts, sweep, 1)?;
    for backend in [DirtyBackend::Bitmap, DirtyBackend::Ring] {
        let memtouch_us = first_write_cost(opts, backend, untracked, sweep, &mut rows)?;
        if backend == DirtyBackend::Bitmap {
            first_write_calibration(memtouch_us, &mut rows)?;
        }
    }
    for rearm in [true, false] {
        reads_after_rearm(opts, rearm, &mut rows)?;
    }

    let bars = rows
        .iter()
        .filter(|r| r.unit == "us" || r.unit == "us/page")
        .map(|r| (format!("{} {} ({})", r.group, r.case, r.unit), r.value))
        .collect();
    report::publish(
        out,
        "vm",
        &rows,
        &report::BarChart { title: "ftvm microVM costs", category: "operation", quantity: "time (microseconds)", bars, reference: None },
    )?;
    Ok(())
}
