//! The fork-join helper: run one closure on several vCPUs at once.
//!
//! Secondary vCPUs idle in `secondary_loop`, sleeping in WAIT. vCPU 0
//! publishes a job and KICKs; participants run it and the last to finish
//! KICKs vCPU 0 back.

use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::vcpu::{vcpu_count, vcpu_id};
use crate::{hypercall, time};

/// The current job as `generation << 16 | participants`. One word, so a
/// secondary can never pair one job's generation with another's size.
static JOB: AtomicU64 = AtomicU64::new(0);
/// Points at a `&(dyn Fn(usize) + Sync)` on vCPU 0's stack; valid while the
/// job is in flight, which is as long as any participant can read it.
static JOB_FN: AtomicPtr<()> = AtomicPtr::new(core::ptr::null_mut());
/// Secondary participants that finished the current job.
static JOB_DONE: AtomicUsize = AtomicUsize::new(0);
static JOB_RUNNING: AtomicBool = AtomicBool::new(false);

/// Secondaries re-check for work at least this often even if a kick is lost.
const IDLE_POLL_NS: u64 = 100 * time::NS_PER_MS;

type Job<'a> = &'a (dyn Fn(usize) + Sync);

/// Run `job(cpu)` on vCPUs `0..n` concurrently (vCPU 0 runs `job(0)` itself)
/// and return when all have finished. Call it from vCPU 0 only, not nested.
pub fn run_on_all(n: usize, job: Job<'_>) {
    assert!(n >= 1 && n <= vcpu_count(), "run_on_all: {n} vCPUs requested, VM has {}", vcpu_count());
    assert_eq!(vcpu_id(), 0, "run_on_all must be called from vCPU 0");
    assert!(!JOB_RUNNING.swap(true, Ordering::Acquire), "run_on_all is not reentrant");
    if n > 1 {
        JOB_DONE.store(0, Ordering::Relaxed);
        JOB_FN.store(&job as *const Job<'_> as *mut (), Ordering::Relaxed);
        let generation = (JOB.load(Ordering::Relaxed) >> 16) + 1;
        // Release: the stores above are visible to whoever sees this word.
        JOB.store(generation << 16 | n as u64, Ordering::Release);
        hypercall::kick();
    }
    job(0);
    if n > 1 {
        while JOB_DONE.load(Ordering::Acquire) < n - 1 {
            time::wait(time::now_ns() + IDLE_POLL_NS);
        }
        // Defensive: a stale read now faults on null instead of calling a
        // closure whose frame is gone.
        JOB_FN.store(core::ptr::null_mut(), Ordering::Relaxed);
    }
    JOB_RUNNING.store(false, Ordering::Release);
}

/// Where vCPUs other than 0 spend their life.
pub(crate) fn secondary_loop(cpu: usize) -> ! {
    let mut seen_generation = 0;
    loop {
        let word = JOB.load(Ordering::Acquire);
        let (generation, n) = (word >> 16, (word & 0xffff) as usize);
        if generation == seen_generation {
            // A kick between the load above and this wait makes it return at
            // once (time::wait passes the last seen sequence number).
            time::wait(time::now_ns() + IDLE_POLL_NS);
            continue;
        }
        seen_generation = generation;
        if cpu >= n {
            continue;
        }
        // SAFETY: JOB_FN was stored before JOB (Release/Acquire) and points
        // at vCPU 0's `job` argument, which outlives the job because
        // run_on_all returns only after every participant (us included)
        // has counted itself done below.
        let job = unsafe { *(JOB_FN.load(Ordering::Relaxed) as *const Job<'_>) };
        job(cpu);
        if JOB_DONE.fetch_add(1, Ordering::AcqRel) + 1 == n - 1 {
            hypercall::kick();
        }
    }
}
