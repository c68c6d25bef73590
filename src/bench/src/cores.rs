//! `--serving-core N`: the serving VMM on a core of its own, everything
//! else on the others, as when it has a host to itself. On a 2-core host
//! every setting otherwise shares both cores among all its processes and
//! the clients, which charges a design that runs more processes (VSMR's
//! second VM replica and witness) for work that would be on other hosts.

use std::io;

/// The online CPUs this process may use.
fn allowed() -> io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a cpu_set_t of the size passed; 0 is this thread.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET reads `set` for an index below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

fn pin(tid: libc::pid_t, cpus: &[usize]) -> io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c` came from `allowed`, below CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a cpu_set_t of the size passed.
    if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The serving VMM's CPU (the rest run on the others).
pub struct Cores {
    serving: usize,
}

impl Cores {
    /// `serving` for the serving VMM; this process (and so every process
    /// it starts from now on) moves to the other CPUs it may use.
    pub fn split(serving: usize) -> Result<Cores, String> {
        let all = allowed().map_err(|e| format!("reading this process's CPUs: {e}"))?;
        if !all.contains(&serving) {
            return Err(format!("--serving-core {serving}: not one of this process's CPUs {all:?}"));
        }
        let rest: Vec<usize> = all.into_iter().filter(|&c| c != serving).collect();
        if rest.is_empty() {
            return Err(format!("--serving-core {serving}: no other CPU is left for the rest"));
        }
        pin(0, &rest).map_err(|e| format!("moving to CPUs {rest:?}: {e}"))?;
        Ok(Cores { serving })
    }

    /// Every thread of process `pid` to the serving CPU (threads it starts
    /// later inherit it).
    pub fn serve(&self, pid: u32) -> io::Result<()> {
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            let Some(tid) = task?.file_name().to_str().and_then(|t| t.parse::<libc::pid_t>().ok()) else { continue };
            match pin(tid, &[self.serving]) {
                // A thread that ended meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                other => other?,
            }
        }
        Ok(())
    }
}
