//! Copy-on-write capture (`--capture cow`): the guest resumes right after
//! the freeze, and the dirty pages are copied while it runs.
//!
//! In the pause, the pages left writable by write prediction (hot: the guest
//! is about to write them again) are copied at once; every other dirty page
//! is write-protected through userfaultfd (`ftvm_vmm::memory::WriteProtect`).
//! After the resume a copier thread copies the protected pages in page order
//! and lifts their protection, a run at a time. A write to a page not yet
//! copied, by a vCPU or by a VMM thread (a device writing a used ring or a
//! received frame), waits in the kernel; the fault-handler thread copies that
//! page first and lifts its protection, which wakes the writer. Neither
//! thread ever waits for a vCPU or a device, so a writer never deadlocks, and
//! no page is written before it is copied. `finish` waits for every page.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use ftvm_vmm::memory::{WriteProtect, WriteProtectError, PAGE};
use ftvm_vmm::sync::Lock;
use ftvm_vmm::{PageBitmap, Vm};

use super::{Capture, Captured};
use crate::error::ReplicationError;

/// Most pages the copier unprotects with one call (a writer waiting on one
/// of them waits for the whole run's copies: 64 × 0.7 µs).
const RUN: usize = 64;

const PENDING: u8 = 0;
const COPYING: u8 = 1;
const COPIED: u8 = 2;

/// What the threads share with the capture.
struct Shared {
    wp: WriteProtect,
    /// The job whose pages are protected now, for the fault handler.
    current: Mutex<Option<Arc<Job>>>,
    /// The job for the copier.
    work: Mutex<Option<Arc<Job>>>,
    work_ready: Condvar,
    stop: AtomicBool,
}

#[derive(Default)]
struct Progress {
    /// Pages neither copied nor unprotected yet.
    left: usize,
    /// Fault-handler calls working on this job's pages.
    active: usize,
    failed: Option<WriteProtectError>,
}

/// One checkpoint's pages: slot `i` of the capture buffer receives page `numbers[i]`.
struct Job {
    numbers: Vec<u64>,
    slots: *mut u8,
    state: Vec<AtomicU8>,
    progress: Mutex<Progress>,
    changed: Condvar,
}

// SAFETY: `slots` points into the capture's buffer, which is neither moved
// nor touched by the capture while the job is live (`finish` waits for it);
// each slot is written by exactly the one thread that moved its state from
// PENDING to COPYING.
unsafe impl Send for Job {}
// SAFETY: as for Send; everything else is atomics and mutexes.
unsafe impl Sync for Job {}

impl Job {
    /// Claim slot `i` for copying.
    fn take(&self, i: usize) -> bool {
        self.state[i].compare_exchange(PENDING, COPYING, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// Slot `i`, which the caller took.
    #[allow(clippy::mut_from_ref)]
    fn slot(&self, i: usize) -> &mut [u8] {
        assert!(i < self.numbers.len() && self.state[i].load(Ordering::Relaxed) == COPYING);
        // SAFETY: slot `i` lies inside the buffer of `numbers.len()` pages
        // and belongs to the one caller that took it (PENDING -> COPYING).
        unsafe { std::slice::from_raw_parts_mut(self.slots.add(i * PAGE), PAGE) }
    }

    /// Copy page `numbers[i]` into its slot; the slot must have been taken.
    fn copy(&self, wp: &WriteProtect, i: usize) {
        let src = wp.page_ptr(self.numbers[i]).expect("job pages are inside RAM");
        // SAFETY: the page is write-protected, so no vCPU or VMM thread can
        // write it while it is read; the slot is ours alone (we took it) and
        // lies inside the buffer of `numbers.len()` pages.
        unsafe { std::ptr::copy_nonoverlapping(src, self.slots.add(i * PAGE), PAGE) };
        self.state[i].store(COPIED, Ordering::Release);
    }

    fn done(&self, pages: usize, failed: Option<WriteProtectError>) {
        let mut p = self.progress.locked();
        p.left -= pages;
        if p.failed.is_none() {
            p.failed = failed;
        }
        self.changed.notify_all();
    }
}

pub struct CopyOnWrite {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    pages: Captured,
    job: Option<Arc<Job>>,
}

impl CopyOnWrite {
    pub fn new(vm: &Vm) -> Result<CopyOnWrite, ReplicationError> {
        let wp = WriteProtect::new(vm.ram()).map_err(ReplicationError::WriteProtect)?;
        let shared = Arc::new(Shared {
            wp,
            current: Mutex::new(None),
            work: Mutex::new(None),
            work_ready: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let spawn = |name: &str, f: fn(&Shared)| {
            let shared = shared.clone();
            std::thread::Builder::new().name(name.into()).spawn(move || f(&shared)).map_err(ReplicationError::Thread)
        };
        let threads = vec![spawn("cow-copier", copier)?, spawn("cow-faults", fault_handler)?];
        Ok(CopyOnWrite { shared, threads, pages: Captured::default(), job: None })
    }

    /// Wait until every page of the job is copied and unprotected and no
    /// fault handler works on it any more.
    fn wait(&mut self) -> Result<(), ReplicationError> {
        let Some(job) = self.job.take() else { return Ok(()) };
        let mut p = job.progress.locked();
        while p.left > 0 {
            p = job.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        drop(p);
        // From here the handler finds no job: a late fault event is a page
        // that is no longer protected.
        self.shared.current.locked().take();
        let mut p = job.progress.locked();
        while p.active > 0 {
            p = job.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        match p.failed.take() {
            Some(e) => Err(ReplicationError::WriteProtect(e)),
            None => Ok(()),
        }
    }
}

impl Capture for CopyOnWrite {
    fn in_pause(&mut self, vm: &Vm, dirty: &PageBitmap, hot: &PageBitmap) -> Result<(), ReplicationError> {
        self.wait()?;
        self.pages.prepare(dirty)?;
        let numbers = self.pages.numbers().to_vec();
        let job = Arc::new(Job {
            state: numbers.iter().map(|_| AtomicU8::new(PENDING)).collect(),
            slots: self.pages.slots_mut(),
            progress: Mutex::new(Progress { left: numbers.len(), ..Progress::default() }),
            changed: Condvar::new(),
            numbers,
        });
        // Published before any page is protected: a write to a protected
        // page always finds its job.
        *self.shared.current.locked() = Some(job.clone());
        self.job = Some(job.clone());
        let protected = self.protect_or_copy(vm, &job, hot);
        // Whatever happened, the copier finishes the job.
        *self.shared.work.locked() = Some(job);
        self.shared.work_ready.notify_one();
        protected
    }

    fn finish(&mut self, _vm: &Vm) -> Result<&mut Captured, ReplicationError> {
        self.wait()?;
        Ok(&mut self.pages)
    }
}

impl CopyOnWrite {
    /// In the pause: copy the hot pages, protect runs of the others (or
    /// copy them if that fails).
    fn protect_or_copy(&self, vm: &Vm, job: &Job, hot: &PageBitmap) -> Result<(), ReplicationError> {
        let copy_now = |k: usize| -> Result<(), ReplicationError> {
            if !job.take(k) {
                return Ok(()); // the fault handler was quicker
            }
            vm.ram().read_page(job.numbers[k], job.slot(k)).map_err(ftvm_vmm::VmError::from)?;
            job.state[k].store(COPIED, Ordering::Release);
            job.done(1, None);
            Ok(())
        };
        let mut i = 0;
        while i < job.numbers.len() {
            let first = job.numbers[i];
            if hot.is_set(first) {
                // About to be written again: copying it now is cheaper than a fault.
                copy_now(i)?;
                i += 1;
                continue;
            }
            let mut end = i + 1;
            while end < job.numbers.len() && job.numbers[end] == first + (end - i) as u64 && !hot.is_set(job.numbers[end]) {
                end += 1;
            }
            if let Err(e) = self.shared.wp.protect(first, (end - i) as u64) {
                // Not protected: copy the run now, while the guest is paused.
                tracing::warn!(error = %e, "copy-on-write: copying pages in the pause instead");
                for k in i..end {
                    copy_now(k)?;
                }
            }
            i = end;
        }
        Ok(())
    }
}

impl Drop for CopyOnWrite {
    fn drop(&mut self) {
        let _ = self.wait();
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.work_ready.notify_all();
        self.shared.wp.stop();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Copy each job's pages in page order, unprotecting them a run at a time.
fn copier(shared: &Shared) {
    loop {
        let job = {
            let mut work = shared.work.locked();
            loop {
                if shared.stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(job) = work.take() {
                    break job;
                }
                work = shared.work_ready.wait(work).unwrap_or_else(|e| e.into_inner());
            }
        };
        let mut i = 0;
        while i < job.numbers.len() {
            // A run of consecutive pages this thread claims.
            let start = i;
            while i < job.numbers.len() && i - start < RUN && job.numbers[i] == job.numbers[start] + (i - start) as u64 && job.take(i) {
                job.copy(&shared.wp, i);
                i += 1;
            }
            if i > start {
                let result = shared.wp.unprotect(job.numbers[start], (i - start) as u64);
                job.done(i - start, result.err());
            } else {
                i += 1; // the fault handler has this one
            }
        }
    }
}

/// Serve writes to protected pages: copy the page first if nobody has.
fn fault_handler(shared: &Shared) {
    loop {
        let page = match shared.wp.next_fault() {
            Ok(Some(page)) => page,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(error = %e, "copy-on-write: cannot read write faults");
                return;
            }
        };
        // Counted as active while `current` is held: once `wait` has taken
        // the job out of `current` and seen no active handler, none touches
        // its pages any more.
        let job = shared.current.locked().clone().inspect(|j| j.progress.locked().active += 1);
        let Some(job) = job else {
            // No job: the page is not protected (any more); wake its writer.
            let _ = shared.wp.unprotect(page, 1);
            continue;
        };
        match job.numbers.binary_search(&page) {
            Ok(i) if job.take(i) => {
                job.copy(&shared.wp, i);
                let result = shared.wp.unprotect(page, 1);
                job.done(1, result.err());
            }
            Ok(i) => {
                // The copier has it: unprotect only once it is copied.
                while job.state[i].load(Ordering::Acquire) != COPIED {
                    std::hint::spin_loop();
                }
                let _ = shared.wp.unprotect(page, 1);
            }
            Err(_) => {
                let _ = shared.wp.unprotect(page, 1);
            }
        }
        let mut p = job.progress.locked();
        p.active -= 1;
        job.changed.notify_all();
    }
}
