//! CPU time by thread: where a VMM's time per request goes (vCPUs, device
//! threads, consensus, links, ...), from `/proc/PID/task/*/schedstat`.

use std::collections::BTreeMap;
use std::io;

/// One thread of a process, as `/proc/PID/task/TID` tells of it.
pub struct Task {
    /// Its name without its number (`vcpu0` and `vcpu1` are `vcpu`,
    /// `peer-tx-2` is `peer-tx`).
    pub kind: String,
    /// CPU time it has had so far, in nanoseconds (`schedstat`).
    pub cpu_ns: u64,
    /// Its context switches so far, voluntary and not (`status`).
    pub switches: u64,
}

/// Every thread of process `pid` now. A thread that ends between the
/// listing and the reads is left out; anything else unreadable is an error.
pub fn tasks(pid: u32) -> io::Result<Vec<Task>> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?.path();
        let read = |file: &str| match std::fs::read_to_string(task.join(file)) {
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound) || e.raw_os_error() == Some(libc::ESRCH) => Ok(None),
            other => other.map(Some),
        };
        let (Some(stat), Some(comm), Some(status)) = (read("schedstat")?, read("comm")?, read("status")?) else { continue };
        let cpu_ns = stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unreadable schedstat"))?;
        let switches =
            status.lines().filter(|l| l.contains("ctxt_switches:")).filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).sum();
        out.push(Task { kind: kind(comm.trim()).to_string(), cpu_ns, switches });
    }
    Ok(out)
}

/// CPU time (ns) each kind of thread of process `pid` has had so far
/// (`Task::kind`). Threads that ended are not counted.
pub fn cpu_ns_by_thread(pid: u32) -> io::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for t in tasks(pid)? {
        *out.entry(t.kind).or_default() += t.cpu_ns;
    }
    Ok(out)
}

fn kind(name: &str) -> &str {
    name.trim_end_matches(|c: char| c.is_ascii_digit()).trim_end_matches('-')
}

/// What each kind of thread used between two readings.
pub fn spent(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after.iter().map(|(k, &v)| (k.clone(), v.saturating_sub(before.get(k).copied().unwrap_or(0)))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_threads_count_as_one_kind() {
        assert_eq!(kind("vcpu12"), "vcpu");
        assert_eq!(kind("peer-tx-2"), "peer-tx");
        assert_eq!(kind("consensus"), "consensus");
        assert_eq!(kind("sync-acks"), "sync-acks");
    }

    #[test]
    fn a_busy_thread_is_counted_under_its_kind() {
        let before = cpu_ns_by_thread(std::process::id()).unwrap();
        let spin = std::thread::Builder::new()
            .name("spin-7".into())
            .spawn(|| {
                let start = std::time::Instant::now();
                let mut x = 0u64;
                while start.elapsed() < std::time::Duration::from_millis(30) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                // Read while this thread still exists.
                cpu_ns_by_thread(std::process::id()).unwrap()
            })
            .unwrap();
        let during = spin.join().unwrap();
        assert!(spent(&before, &during).get("spin").is_some_and(|&ns| ns > 0), "{during:?}");
    }
}
