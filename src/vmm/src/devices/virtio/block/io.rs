//! Where a disk request's file I/O runs (`--disk-io`): on the device thread
//! while it serves the queue (`sync`), or on an I/O worker thread of the
//! disk's own (`async`), so a pause of the VM, which waits for the device
//! thread's pass, never waits for the disk.
//!
//! The I/O side never touches guest memory: a write's data is copied out
//! of the guest's buffers by the device thread when it issues the request,
//! and a read's data comes back in a buffer of its own, which the device
//! thread copies into the guest's when it completes the request (only
//! while the VM runs). Operations run one at a time in the order they were
//! submitted, and their results come back in that order.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

use super::{STATUS_IOERR, STATUS_OK};
use crate::hooks::Hooks;
use crate::sync::{self, Lock};

/// How a disk runs its requests' I/O.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DiskIo {
    /// On the device thread, one request at a time: a pause waits for the
    /// request in progress.
    Sync,
    /// On an I/O worker thread: requests in flight at a pause stay on the
    /// device's pending list, saved with it, and complete after the resume.
    #[default]
    Async,
}

impl fmt::Display for DiskIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DiskIo::Sync => "sync",
            DiskIo::Async => "async",
        })
    }
}

impl FromStr for DiskIo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sync" => Ok(DiskIo::Sync),
            "async" => Ok(DiskIo::Async),
            _ => Err(format!("unknown disk I/O mode {s:?} (expected sync or async)")),
        }
    }
}

/// Tests only: `FTVM_TEST_FAULT=slow-disk:MS` makes every disk write take
/// MS milliseconds longer, so requests are in flight when the VM pauses.
pub fn write_delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        let spec = std::env::var("FTVM_TEST_FAULT").ok()?;
        let ms: u64 = spec.strip_prefix("slow-disk:")?.parse().ok()?;
        tracing::warn!(ms, "test fault injected: every disk write takes {ms} ms longer");
        Some(Duration::from_millis(ms))
    })
}

/// What the I/O side does for one request.
#[derive(Debug)]
pub enum Op {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    Flush,
    /// Nothing to do on the disk: the status (and data) the request gets,
    /// decided when it was issued (a bad request, the device id). It goes
    /// through the same queue so completions keep their order.
    Reply {
        status: u8,
        data: Vec<u8>,
    },
}

/// A finished operation: the `seq` it was submitted with, its status byte,
/// and the data for the guest's buffers (a read's).
#[derive(Debug)]
pub struct Done {
    pub seq: u64,
    pub status: u8,
    pub data: Vec<u8>,
}

/// The disk image and what its writes are reported to.
pub struct DiskFile {
    pub file: File,
    pub path: PathBuf,
    pub hooks: Arc<Hooks>,
}

impl DiskFile {
    fn run(&self, op: Op) -> (u8, Vec<u8>) {
        match op {
            Op::Read { offset, len } => {
                let mut buf = vec![0u8; len];
                match self.file.read_exact_at(&mut buf, offset) {
                    Ok(()) => (STATUS_OK, buf),
                    Err(_) => (STATUS_IOERR, Vec::new()),
                }
            }
            Op::Write { offset, data } => {
                if let Some(delay) = write_delay() {
                    std::thread::sleep(delay);
                }
                match self.file.write_all_at(&data, offset) {
                    Ok(()) => {
                        // Told once the data is in the image, before the
                        // request can complete: a replicated VM journals it
                        // into the epoch it reached the disk in.
                        if let Some(observer) = self.hooks.disk_writes() {
                            observer.written(offset, &data);
                        }
                        (STATUS_OK, Vec::new())
                    }
                    // ENOSPC on a full host disk lands here: the guest sees IOERR
                    // for this write and everything written before stays intact.
                    Err(e) => {
                        tracing::warn!(disk = %self.path.display(), offset, error = %e, "disk write failed");
                        (STATUS_IOERR, Vec::new())
                    }
                }
            }
            Op::Flush => match self.file.sync_data() {
                Ok(()) => (STATUS_OK, Vec::new()),
                Err(_) => (STATUS_IOERR, Vec::new()),
            },
            Op::Reply { status, data } => (status, data),
        }
    }
}

/// Runs a disk's operations and hands their results back in order.
pub struct Backend {
    disk: Arc<DiskFile>,
    mode: Mode,
}

enum Mode {
    Sync { done: VecDeque<Done> },
    Async(Worker),
}

struct Worker {
    jobs: Option<mpsc::Sender<(u64, Op)>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<WorkerState>,
    idle: Condvar,
    /// Rung after each result: the device thread's doorbell.
    doorbell: Mutex<Option<EventFd>>,
}

#[derive(Default)]
struct WorkerState {
    done: VecDeque<Done>,
    /// Submitted and not finished.
    queued: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, WorkerState> {
        self.state.locked()
    }
}

impl Backend {
    /// A backend for `disk`; `async` starts its worker thread (named
    /// `disk-io`, under the device threads' seccomp filter).
    pub fn new(disk: DiskFile, io: DiskIo) -> std::io::Result<Backend> {
        let disk = Arc::new(disk);
        let mode = match io {
            DiskIo::Sync => Mode::Sync { done: VecDeque::new() },
            DiskIo::Async => {
                let (tx, rx) = mpsc::channel::<(u64, Op)>();
                let shared = Arc::new(Shared::default());
                let (d, s) = (disk.clone(), shared.clone());
                let thread = std::thread::Builder::new().name("disk-io".into()).spawn(move || work(&d, &s, &rx))?;
                Mode::Async(Worker { jobs: Some(tx), shared, thread: Some(thread) })
            }
        };
        Ok(Backend { disk, mode })
    }

    pub fn io(&self) -> DiskIo {
        match self.mode {
            Mode::Sync { .. } => DiskIo::Sync,
            Mode::Async(_) => DiskIo::Async,
        }
    }

    /// Where the worker says a result is ready (async only).
    pub fn set_doorbell(&self, doorbell: EventFd) {
        if let Mode::Async(w) = &self.mode {
            *w.shared.doorbell.locked() = Some(doorbell);
        }
    }

    /// Run `op` (sync: now, on this thread); its result comes back from
    /// `next_done` after those of every operation submitted before.
    pub fn submit(&mut self, seq: u64, op: Op) {
        match &mut self.mode {
            Mode::Sync { done } => {
                let (status, data) = self.disk.run(op);
                done.push_back(Done { seq, status, data });
            }
            Mode::Async(w) => {
                w.shared.lock().queued += 1;
                let sent = w.jobs.as_ref().is_some_and(|jobs| jobs.send((seq, op)).is_ok());
                if !sent {
                    // The worker is gone (it cannot be while the device lives).
                    let mut st = w.shared.lock();
                    st.queued -= 1;
                    st.done.push_back(Done { seq, status: STATUS_IOERR, data: Vec::new() });
                }
            }
        }
    }

    /// The oldest result not taken yet.
    pub fn next_done(&mut self) -> Option<Done> {
        match &mut self.mode {
            Mode::Sync { done } => done.pop_front(),
            Mode::Async(w) => w.shared.lock().done.pop_front(),
        }
    }

    /// Wait until every submitted operation has finished (their results
    /// may wait in `next_done`).
    pub fn wait_idle(&self) {
        if let Mode::Async(w) = &self.mode {
            let mut st = w.shared.lock();
            while st.queued > 0 {
                st = sync::wait(&w.shared.idle, st);
            }
        }
    }
}

/// The worker: operations in order, each result queued, then the doorbell.
fn work(disk: &DiskFile, shared: &Shared, jobs: &mpsc::Receiver<(u64, Op)>) {
    crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Device);
    crate::seccomp::forbidden_call_for_tests("disk-io");
    while let Ok((seq, op)) = jobs.recv() {
        let (status, data) = disk.run(op);
        {
            let mut st = shared.lock();
            st.done.push_back(Done { seq, status, data });
            st.queued -= 1;
            if st.queued == 0 {
                shared.idle.notify_all();
            }
        }
        if let Some(doorbell) = shared.doorbell.locked().as_ref() {
            // A doorbell already rung stays rung: nothing to do.
            let _ = doorbell.write(1);
        }
    }
}

impl Drop for Backend {
    /// Operations already submitted still reach the disk (a write the guest
    /// issued is not dropped on the floor); then the worker ends.
    fn drop(&mut self) {
        if let Mode::Async(w) = &mut self.mode {
            drop(w.jobs.take());
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_as_the_command_line_names_them() {
        for io in [DiskIo::Sync, DiskIo::Async] {
            assert_eq!(io.to_string().parse::<DiskIo>(), Ok(io));
        }
        assert!("fast".parse::<DiskIo>().unwrap_err().contains("sync or async"));
    }
}
