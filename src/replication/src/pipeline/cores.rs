//! Work over many pages split across the host's cores: copying pages
//! aside (`capture::aside`) and hashing them (`encode::hash_compare`),
//! both in a pause.

use std::sync::OnceLock;

/// Counted once: `available_parallelism` reads the cgroup's CPU quota from
/// files each call (25 µs here), which was a tenth of a 250 µs pause.
fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(16))
}

/// Below this many pages one thread does the work (`on_cores`).
pub(crate) const PARALLEL_FROM: usize = 256;

/// `work` over `pages` and their part of `out` (`per` items of it a page),
/// split over the cores once the pages are many.
pub(crate) fn on_cores<T: Send, E: Send>(
    pages: &[u64],
    out: &mut [T],
    per: usize,
    work: impl Fn(&[u64], &mut [T]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let threads = threads();
    if pages.len() < PARALLEL_FROM || threads == 1 {
        return work(pages, out);
    }
    let chunk = pages.len().div_ceil(threads);
    let work = &work;
    std::thread::scope(|s| {
        let workers: Vec<_> = pages.chunks(chunk).zip(out.chunks_mut(chunk * per)).map(|(p, o)| s.spawn(move || work(p, o))).collect();
        workers.into_iter().try_for_each(|w| w.join().expect("a worker thread panicked"))
    })
}
