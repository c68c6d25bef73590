//! Calibration at start: what dirty tracking costs the guest on this host.
//!
//! The replication policies weigh a tracked first write (the write-protection
//! fault KVM takes on a guest's first write to a page after a checkpoint
//! re-armed tracking) against host-side costs such as copying a page. That
//! fault costs microseconds on a nested host without PML (3-8 µs on this
//! project's, depending on the day) and a fraction of one on hardware with
//! it, so it is measured where the VMM runs, in a throwaway VM whose guest
//! (`guest.rs`) is built in memory: the calibration needs no file beyond
//! the VMM itself.

mod guest;

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};

use ftvm_abi::layout::VCPU_STACK_SIZE;

use crate::boot::MIN_HEAP;
use crate::exit::VmExit;
use crate::hooks::Console;
use crate::memory::{PageBitmap, WriteProtect, WriteProtectError, PAGE};
use crate::vm::{Vm, VmConfig, VmError};
use crate::DirtyBackend;

/// Pages per pass by default: enough that a pass lasts over a millisecond
/// at 3 µs a page, so the TSC reads around it are lost in the noise; few
/// enough that a pass is rarely cut by preemption on a busy host, and the
/// whole calibration stays well under 200 ms (256, 512 and 1024 pages gave
/// the same per-page figures here).
pub const DEFAULT_PAGES: u64 = 512;
/// The most pages a pass may write (256 MiB of guest memory).
pub const MAX_PAGES: u64 = 65536;
/// Measured rounds (a warm-up round before them is not counted).
pub const ROUNDS: u32 = 7;
/// How long the guest may take for everything before the calibration gives up.
const TIMEOUT: Duration = Duration::from_secs(10);

const _: () = assert!(ROUNDS < guest::MAX_ROUNDS);

#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error("calibration page count must be between 1 and {MAX_PAGES}, got {0}")]
    BadPageCount(u64),
    #[error("cannot hold the calibration guest image in memory: {0}")]
    Image(std::io::Error),
    #[error("calibration VM: {0}")]
    Vm(#[from] VmError),
    #[error("cannot start the calibration VM: {0}")]
    Start(std::io::Error),
    #[error("cannot reach the calibration guest's memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("the calibration guest stopped before its last round ({exit}){console}")]
    GuestStopped { exit: VmExit, console: String },
    #[error("the calibration guest did not finish within {} s", TIMEOUT.as_secs())]
    Timeout,
}

/// What a guest write costs per page, tracked and not, on this host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FirstWriteCost {
    /// Nanoseconds of a write to a page dirty tracking write-protected: the
    /// first write after a re-arm (median over the rounds).
    pub tracked_ns: f64,
    /// Nanoseconds of a write to the same page once writable (median).
    pub untracked_ns: f64,
    /// Pages written per pass.
    pub pages: u64,
    /// Rounds measured.
    pub rounds: u32,
    /// Nanoseconds of write-protecting a page the guest has mapped, as
    /// copy-on-write capture does in the pause (userfaultfd, runs of
    /// `PROTECT_RUN` pages a call): None where userfaultfd write
    /// protection is not available.
    pub protect_ns: Option<f64>,
    /// Wall time of the whole calibration, VM creation and teardown included.
    pub elapsed: Duration,
}

impl FirstWriteCost {
    /// What tracking adds to a page's first write in an epoch.
    pub fn tracking_ns(&self) -> f64 {
        (self.tracked_ns - self.untracked_ns).max(0.0)
    }
}

/// Measure a tracked first write per page: a throwaway one-vCPU VM with
/// dirty tracking on writes one word to each of `pages` pages right after
/// the pages were re-armed (each write faults), then again (none does);
/// [`ROUNDS`] times, re-arming between rounds as a checkpoint does.
///
/// Measured on this project's nested 2-core host (no PML), quiet, with
/// [`DEFAULT_PAGES`]: the whole call, VM creation and teardown included,
/// 25-60 ms wall (1024 pages: 45-85 ms); tracked first write 2.8-3.8 µs
/// (2.8-3.0 within one quiet minute), untracked write 6-9 ns. A loaded host (load average 4-5) read 3-18 µs
/// and up to 270 ms.
pub fn tracked_first_write(pages: u64) -> Result<FirstWriteCost, CalibrationError> {
    if !(1..=MAX_PAGES).contains(&pages) {
        return Err(CalibrationError::BadPageCount(pages));
    }
    let started = Instant::now();
    let rounds = ROUNDS + 1;
    let image = ImageFile::new(&guest::image(pages, rounds)).map_err(CalibrationError::Image)?;
    let mem_size = (guest::end(pages) + VCPU_STACK_SIZE + MIN_HEAP).next_multiple_of(2 << 20);
    let (console, out) = Console::capture();
    let config = VmConfig { mem_size, vcpus: 1, prefault: true, dirty_backend: DirtyBackend::Bitmap, console, ..Default::default() };
    let vm = Vm::new(config)?;
    vm.boot(&image.path(), None, "")?;
    drop(image);
    vm.start_dirty_tracking()?;
    vm.start().map_err(CalibrationError::Start)?;
    let ticks = run_rounds(&vm, rounds, &out).inspect_err(|_| vm.request_stop())?;
    let exit = vm.wait();
    if exit != VmExit::Exited(0) {
        return Err(stopped(exit, &out));
    }
    let ns_per_tick = vm.guest_clock().ns_per_tick();
    let protect_ns = protect_cost(&vm, pages).inspect_err(|err| tracing::debug!(%err, "no write protection to measure")).ok();
    drop(vm);
    // The first round built the guest's mappings; it is not counted.
    let per_page = |pass: usize| {
        let mut v: Vec<f64> = ticks[1..].iter().map(|t| t[pass] as f64 * ns_per_tick / pages as f64).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let cost = FirstWriteCost {
        tracked_ns: per_page(0),
        untracked_ns: per_page(1),
        pages,
        rounds: ROUNDS,
        protect_ns,
        elapsed: started.elapsed(),
    };
    tracing::debug!(?cost, "calibrated the tracked first write");
    Ok(cost)
}

/// Let the guest run `rounds` rounds, re-arming tracking for the pages it
/// wrote before each but the first; the TSC ticks of each round's passes.
fn run_rounds(vm: &Vm, rounds: u32, out: &Mutex<Vec<u8>>) -> Result<Vec<[u64; 2]>, CalibrationError> {
    let mem = vm.ram().memory();
    let pages = vm.ram().pages();
    let (mut dirty, none) = (PageBitmap::new(pages), PageBitmap::new(pages));
    let deadline = Instant::now() + TIMEOUT;
    for round in 1..=u64::from(rounds) {
        if round > 1 {
            // The guest only spins on the go word now, so its pages need not
            // be paused to be re-armed.
            vm.collect_dirty(&mut dirty, &none)?;
        }
        mem.write_obj(round, GuestAddress(guest::GO))?;
        while mem.read_obj::<u64>(GuestAddress(guest::DONE))? < round {
            if vm.exit_reason().is_some() {
                return Err(stopped(vm.wait(), out));
            }
            if Instant::now() > deadline {
                return Err(CalibrationError::Timeout);
            }
            // Spin rather than sleep: a host thread waking up in the middle
            // of a pass can land on the vCPU's core and preempt it, which
            // here made the tracked write read 5-15 µs instead of 3.
            std::thread::yield_now();
        }
    }
    (0..u64::from(rounds))
        .map(|r| {
            let at = |i: u64| mem.read_obj::<u64>(GuestAddress(guest::RESULTS + r * 16 + i * 8));
            Ok([at(0)?, at(1)?])
        })
        .collect()
}

/// Pages write-protected per call in `protect_cost`: dirty pages come in
/// runs, and copy-on-write capture protects a run per call.
const PROTECT_RUN: u64 = 8;

/// Write-protect the guest's `pages` pages (mapped by KVM since the guest
/// wrote them) as copy-on-write capture does, and lift the protection
/// again: the nanoseconds per page of protecting them. Protection drops the
/// guest's mappings of each page (KVM's MMU notifier), which is what makes
/// it cost about as much as a copy on some hosts.
fn protect_cost(vm: &Vm, pages: u64) -> Result<f64, WriteProtectError> {
    let wp = WriteProtect::new(vm.ram())?;
    let first = guest::PAGES / PAGE as u64;
    let t0 = Instant::now();
    for run in (0..pages).step_by(PROTECT_RUN as usize) {
        wp.protect(first + run, PROTECT_RUN.min(pages - run))?;
    }
    let took = t0.elapsed();
    wp.unprotect(first, pages)?;
    Ok(took.as_nanos() as f64 / pages as f64)
}

fn stopped(exit: VmExit, out: &Mutex<Vec<u8>>) -> CalibrationError {
    let text = out.lock().map(|o| String::from_utf8_lossy(&o).trim().to_string()).unwrap_or_default();
    CalibrationError::GuestStopped { exit, console: if text.is_empty() { text } else { format!(": {text}") } }
}

/// The image as a file no other process sees: a memfd, which the boot path
/// opens by its `/proc/self/fd` name like any image file.
struct ImageFile(File);

impl ImageFile {
    fn new(bytes: &[u8]) -> std::io::Result<ImageFile> {
        // SAFETY: a NUL-terminated name and valid flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"ftvm-calibrate".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        let mut file = unsafe { File::from_raw_fd(fd) };
        file.write_all(bytes)?;
        Ok(ImageFile(file))
    }

    fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.0.as_raw_fd()))
    }
}
