//! memtouch: the dirty-memory workload. Every writer vCPU stores into its own
//! partition of a heap-allocated working set (`ftvm_workloads::memtouch`),
//! optionally throttled, and writer 0 reports progress. The final checksum
//! depends only on the configuration and the writes done, so the host can
//! recompute it after snapshots and failovers.
#![no_std]
#![no_main]

extern crate alloc;

use alloc::alloc::{alloc_zeroed, Layout};
use alloc::vec;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

use ftvm_rt::time::{self, NS_PER_MS, NS_PER_SEC};
use ftvm_rt::{println, Args, MAX_VCPUS};
use ftvm_workloads::memtouch::{self, Config, Writer, PAGE_SIZE};

ftvm_rt::entry!(main);

/// Writes between clock checks. Small enough that a batch whose pages all
/// take the ~6 µs tracked first-write fault still ends within a few ms, so
/// deadlines and reports stay on time under checkpointing.
const BATCH: u64 = 1024;

/// State shared by all writers for one run.
struct Run {
    config: Config,
    writers: u32,
    /// Working-set base address (a raw pointer is not `Sync`).
    ws: usize,
    start_ns: u64,
    /// `u64::MAX` when only a write count (or nothing) bounds the run.
    end_ns: u64,
    /// Writes done so far, per writer.
    writes: [AtomicU64; MAX_VCPUS],
    /// Pages first written per report interval, all writers, in a ring
    /// indexed by interval number: a writer running a little behind or
    /// ahead of writer 0 still counts toward the right progress line.
    fresh_pages: [AtomicU64; FRESH_SLOTS as usize],
}

fn main(args: &Args) -> i32 {
    let config = match Config::parse(args.cmdline) {
        Ok(c) => c,
        Err(e) => return error(format_args!("{e}")),
    };
    let writers = if config.writers == 0 { args.vcpu_count as u32 } else { config.writers };
    if writers as usize > args.vcpu_count {
        return error(format_args!("{writers} writers but the VM has {} vCPUs", args.vcpu_count));
    }
    let Some(ws_bytes) = config.ws_pages.checked_mul(PAGE_SIZE).filter(|&b| b <= isize::MAX as u64) else {
        return error(format_args!("working set too large"));
    };
    let layout = Layout::from_size_align(ws_bytes as usize, PAGE_SIZE as usize).expect("page-aligned layout");
    // SAFETY: the layout has a non-zero size (parse rejects an empty set).
    let ws = unsafe { alloc_zeroed(layout) };
    if ws.is_null() {
        return error(format_args!("cannot allocate a {ws_bytes}-byte working set (heap is {} bytes)", args.heap.size));
    }
    println!("memtouch: start ws_addr={:#x} pages={} writers={writers} pattern={:?}", ws as usize, config.ws_pages, config.pattern);

    let start_ns = time::now_ns();
    let end_ns = match config.duration_ms {
        0 => u64::MAX,
        ms => start_ns.saturating_add(ms.saturating_mul(NS_PER_MS)),
    };
    let run = Run {
        config,
        writers,
        ws: ws as usize,
        start_ns,
        end_ns,
        writes: [const { AtomicU64::new(0) }; MAX_VCPUS],
        fresh_pages: [const { AtomicU64::new(0) }; FRESH_SLOTS as usize],
    };
    ftvm_rt::run_on_all(writers as usize, &|w| write_partition(&run, w as u32));
    let elapsed_ns = (time::now_ns() - start_ns).max(1);

    let total: u64 = run.writes.iter().map(|w| w.load(Relaxed)).sum();
    println!("memtouch: writes={total} elapsed_ms={} writes/s={}", elapsed_ns / NS_PER_MS, per_second(total, elapsed_ns));
    // SAFETY: `ws` is our allocation of `ws_bytes` zero-initialized bytes,
    // and every writer has finished.
    let bytes = unsafe { core::slice::from_raw_parts(ws, ws_bytes as usize) };
    println!("memtouch: done checksum={:016x}", memtouch::checksum(bytes));
    0
}

fn error(msg: core::fmt::Arguments) -> i32 {
    println!("memtouch: error: {msg}");
    2
}

const FRESH_SLOTS: u64 = 4;

fn slot(interval: u64) -> usize {
    (interval % FRESH_SLOTS) as usize
}

fn per_second(count: u64, ns: u64) -> u64 {
    (count as u128 * NS_PER_SEC as u128 / ns.max(1) as u128) as u64
}

/// One writer's loop, on vCPU `w`.
fn write_partition(run: &Run, w: u32) {
    let config = &run.config;
    let mut writer = Writer::new(config, w, run.writers);
    let (first_page, pages) = config.partition(w, run.writers);
    // Pages of our partition already written in this report interval.
    let mut written = vec![0u64; pages.div_ceil(64) as usize];
    let report_ns = config.report_ms * NS_PER_MS;
    let mut interval = 0;
    let mut reporter = (w == 0 && report_ns > 0).then(|| Reporter::new(run.start_ns, report_ns));
    let ws = run.ws as *mut u64;
    loop {
        let now = time::now_ns();
        if (config.writes != 0 && writer.done >= config.writes) || now >= run.end_ns {
            break;
        }
        if report_ns > 0 && (now - run.start_ns) / report_ns != interval {
            interval = (now - run.start_ns) / report_ns;
            written.fill(0);
        }
        if let Some(r) = reporter.as_mut() {
            r.maybe_report(run, now);
        }
        let mut batch = BATCH;
        if config.writes != 0 {
            batch = batch.min(config.writes - writer.done);
        }
        if config.rate > 0 {
            let allowed = (config.rate as u128 * (now - run.start_ns) as u128 / NS_PER_SEC as u128) as u64;
            if writer.done >= allowed {
                // Ahead of the rate: sleep until a chunk worth ~1 ms is due,
                // so a WAIT (a VM exit) is not paid per write.
                let chunk = (config.rate / 1000).clamp(1, BATCH);
                let due = (writer.done + chunk) as u128 * NS_PER_SEC as u128 / config.rate as u128;
                let mut until = run.start_ns.saturating_add(due as u64).min(run.end_ns);
                if let Some(r) = &reporter {
                    until = until.min(r.next_ns);
                }
                time::sleep_until(until);
                continue;
            }
            batch = batch.min(allowed - writer.done);
        }
        let mut fresh = 0;
        if report_ns == 0 {
            // Nothing to report: run the bare loop, the one the native
            // comparison in `ftvm-bench vm` runs too.
            // SAFETY: `ws` is the working set of `config.ws_pages` pages,
            // and writer `w` is the only one writing partition `w`.
            unsafe { writer.run(ws, batch, |_| {}) };
            run.writes[w as usize].store(writer.done, Relaxed);
            continue;
        }
        // SAFETY: `ws` is the working set of `config.ws_pages` pages, and
        // writer `w` is the only one writing partition `w`.
        unsafe {
            writer.run(ws, batch, |page| {
                let i = (page - first_page) as usize;
                let (word, bit) = (&mut written[i / 64], 1u64 << (i % 64));
                if *word & bit == 0 {
                    *word |= bit;
                    fresh += 1;
                }
            })
        };
        if fresh != 0 {
            run.fresh_pages[slot(interval)].fetch_add(fresh, Relaxed);
        }
        run.writes[w as usize].store(writer.done, Relaxed);
    }
    run.writes[w as usize].store(writer.done, Relaxed);
}

/// Writer 0's progress lines, aggregated over all writers.
struct Reporter {
    interval_ns: u64,
    /// Intervals `0..reported` have been reported.
    reported: u64,
    next_ns: u64,
    last_ns: u64,
    last_writes: u64,
}

impl Reporter {
    fn new(start_ns: u64, interval_ns: u64) -> Reporter {
        Reporter { interval_ns, reported: 0, next_ns: start_ns + interval_ns, last_ns: start_ns, last_writes: 0 }
    }

    fn maybe_report(&mut self, run: &Run, now: u64) {
        let current = (now - run.start_ns) / self.interval_ns;
        if current <= self.reported {
            return;
        }
        // Intervals finished since the last line; after a stall longer than
        // the slot ring, only the newest ones still have their counts.
        let n = (current - self.reported).min(FRESH_SLOTS - 1);
        let fresh: u64 = (current - n..current).map(|i| run.fresh_pages[slot(i)].swap(0, Relaxed)).sum();
        let writes: u64 = run.writes.iter().map(|w| w.load(Relaxed)).sum();
        let tenths = current * self.interval_ns / (NS_PER_SEC / 10);
        println!(
            "memtouch: t={}.{}s writes/s={} pages/s={}",
            tenths / 10,
            tenths % 10,
            per_second(writes - self.last_writes, now - self.last_ns),
            per_second(fresh, n * self.interval_ns)
        );
        (self.last_ns, self.last_writes, self.reported) = (now, writes, current);
        self.next_ns = run.start_ns + (current + 1) * self.interval_ns;
    }
}
