//! A child process that cannot outlive its owner: SIGKILLed and reaped on
//! drop (also when a test panics), with its output at hand.
//!
//! Each child leads a process group of its own, and a kill goes to the
//! whole group: a program that runs another one (`timeout redis-cli`,
//! `sh -c`) leaves nothing behind, and nothing keeps the output pipes open.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where the child's stdout and stderr go.
enum Capture {
    /// Wherever the caller's `Command` sent them.
    AsConfigured,
    /// Collected line by line by two threads, so the pipes never fill.
    Memory { stdout: Arc<Mutex<String>>, stderr: Arc<Mutex<String>>, readers: Vec<JoinHandle<()>> },
    /// Written to two files.
    Files { stdout: PathBuf, stderr: PathBuf },
}

/// A running child process, killed (SIGKILL) and reaped when dropped.
pub struct Process {
    /// `None` once handed out by [`Process::wait_with_output`].
    child: Option<Child>,
    name: String,
    capture: Capture,
    /// Its exit status once reaped; its pid may belong to another process then.
    status: Option<ExitStatus>,
}

/// Why [`Process::wait_until`] gave up.
#[derive(Debug)]
pub enum WaitError {
    /// The process ended first.
    Exited(ExitStatus),
    TimedOut(Duration),
}

impl std::fmt::Display for WaitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitError::Exited(status) => write!(f, "exited ({status})"),
            WaitError::TimedOut(d) => write!(f, "still waiting after {d:?}"),
        }
    }
}

fn collect(pipe: impl Read + Send + 'static, into: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let mut s = into.lock().unwrap_or_else(|p| p.into_inner());
            s.push_str(&line);
            s.push('\n');
        }
    })
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
}

impl Process {
    fn new(name: &str, child: Child, capture: Capture) -> Process {
        Process { child: Some(child), name: name.to_owned(), capture, status: None }
    }

    /// Spawn `cmd` with the stdio it was given (inherited unless set).
    pub fn spawn(name: &str, cmd: &mut Command) -> io::Result<Process> {
        let child = cmd.process_group(0).spawn().map_err(|e| io::Error::new(e.kind(), format!("cannot start {name}: {e}")))?;
        Ok(Process::new(name, child, Capture::AsConfigured))
    }

    /// Spawn `cmd` with stdin from /dev/null and its stdout and stderr
    /// collected in memory ([`Process::stdout`], [`Process::stderr`]).
    pub fn spawn_collected(name: &str, cmd: &mut Command) -> io::Result<Process> {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut p = Process::spawn(name, cmd)?;
        let child = p.child.as_mut().expect("just spawned");
        let (stdout, stderr) = (Arc::new(Mutex::new(String::new())), Arc::new(Mutex::new(String::new())));
        let readers = vec![
            collect(child.stdout.take().expect("piped"), stdout.clone()),
            collect(child.stderr.take().expect("piped"), stderr.clone()),
        ];
        p.capture = Capture::Memory { stdout, stderr, readers };
        Ok(p)
    }

    /// Spawn `cmd` with stdin from /dev/null, stdout into `dir/STEM.out`
    /// and stderr into `dir/STEM.err` (they stay there for a post mortem).
    pub fn spawn_logged(name: &str, cmd: &mut Command, dir: &Path, stem: &str) -> io::Result<Process> {
        let (out, err) = (dir.join(format!("{stem}.out")), dir.join(format!("{stem}.err")));
        cmd.stdin(Stdio::null()).stdout(File::create(&out)?).stderr(File::create(&err)?);
        let mut p = Process::spawn(name, cmd)?;
        p.capture = Capture::Files { stdout: out, stderr: err };
        Ok(p)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its pid (as `ip netns exec` execs its program, that of the program).
    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The child itself, e.g. to take a piped stdout.
    pub fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("the child was handed out by wait_with_output")
    }

    /// Its exit status if it has ended (and is now reaped).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Some(child) = self.child.as_mut() {
                // An error here (ECHILD) means someone else reaped it.
                self.status = child.try_wait().ok().flatten();
            }
        }
        self.status
    }

    pub fn running(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// Send `signal` (e.g. SIGTERM); does nothing once it has been reaped.
    pub fn signal(&mut self, signal: i32) -> io::Result<()> {
        if self.try_wait().is_some() {
            return Ok(());
        }
        let pid = i32::try_from(self.id()).map_err(|_| io::Error::other("pid out of range"))?;
        // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our
        // child, not reaped yet, so the number cannot name another process.
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// SIGKILL (as a host crash would) to it and its process group, reap
    /// it, and let the output readers finish; returns how it ended.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        self.kill_group();
        self.join_readers();
        self.status
    }

    fn kill_group(&mut self) {
        if let (Some(child), None) = (self.child.as_mut(), self.status) {
            if let Ok(pid) = i32::try_from(child.id()) {
                // SAFETY: kill(2) has no memory-safety preconditions. The
                // group is our child's (it leads it, see `spawn`), and the
                // child is not reaped, so the id cannot name another group.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
            }
            let _ = child.kill();
            self.status = child.wait().ok();
        }
    }

    /// Wait for it to end by itself.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        if self.status.is_none() {
            self.status = Some(self.child_mut().wait()?);
        }
        self.join_readers();
        Ok(self.status.expect("set above"))
    }

    /// Wait for it to end and take what it wrote to the pipes the caller's
    /// `Command` set up (as `Child::wait_with_output`).
    pub fn wait_with_output(mut self) -> io::Result<Output> {
        self.child.take().expect("the child was handed out already").wait_with_output()
    }

    /// `wait_with_output`, but a process (group) still running after
    /// `timeout` is killed and the wait fails with what it printed: a test
    /// that went wrong ends with its output instead of hanging the suite.
    pub fn wait_with_output_within(mut self, timeout: Duration) -> io::Result<Output> {
        let child = self.child.take().expect("the child was handed out already");
        let pid = child.id() as i32;
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let watchdog = std::thread::spawn(move || {
            if finished.recv_timeout(timeout).is_err() {
                // SAFETY: kill(2) has no memory-safety preconditions; the
                // group is our child's, which is not reaped yet: the waiter
                // reaps it only once it ended, and tells us before anything else.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
                return true;
            }
            false
        });
        let output = child.wait_with_output();
        let _ = done.send(());
        let timed_out = watchdog.join().unwrap_or(false);
        let output = output?;
        if timed_out {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{} still running after {timeout:?}, killed\nstdout:\n{}stderr:\n{}",
                    self.name,
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
            ));
        }
        Ok(output)
    }

    /// Poll every 10 ms until `done(self)`; fails when the process ends
    /// first or `timeout` passes.
    pub fn wait_until(&mut self, timeout: Duration, mut done: impl FnMut(&Process) -> bool) -> Result<(), WaitError> {
        let t0 = Instant::now();
        loop {
            if done(self) {
                return Ok(());
            }
            if let Some(status) = self.try_wait() {
                // What it printed last may still be on its way.
                self.join_readers();
                return if done(self) { Ok(()) } else { Err(WaitError::Exited(status)) };
            }
            if t0.elapsed() >= timeout {
                return Err(WaitError::TimedOut(timeout));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What it wrote to stdout so far (empty if the caller's `Command`
    /// decided where it went).
    pub fn stdout(&self) -> String {
        match &self.capture {
            Capture::AsConfigured => String::new(),
            Capture::Memory { stdout, .. } => stdout.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            Capture::Files { stdout, .. } => read_lossy(stdout),
        }
    }

    /// What it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        match &self.capture {
            Capture::AsConfigured => String::new(),
            Capture::Memory { stderr, .. } => stderr.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            Capture::Files { stderr, .. } => read_lossy(stderr),
        }
    }

    /// Both, labelled, for failure messages.
    pub fn output(&self) -> String {
        format!("stdout:\n{}stderr:\n{}", self.stdout(), self.stderr())
    }

    /// Wait for the output readers to reach the end of the pipes, for 2 s
    /// at most (a process that left its group may hold them open).
    fn join_readers(&mut self) {
        if let Capture::Memory { readers, .. } = &mut self.capture {
            let deadline = Instant::now() + Duration::from_secs(2);
            while readers.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            for r in readers.drain(..).filter(JoinHandle::is_finished) {
                let _ = r.join();
            }
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill_group();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    fn alive(pid: u32) -> bool {
        // A zombie still has /proc/PID; its state letter is Z.
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
    }

    #[test]
    fn dropping_kills_and_reaps() {
        let p = Process::spawn("sleep", Command::new("sleep").arg("600")).unwrap();
        let pid = p.id();
        assert!(alive(pid));
        drop(p);
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "pid {pid} still there (not reaped)");
    }

    #[test]
    fn collected_output_and_waiting_for_it() {
        let mut p = Process::spawn_collected("sh", &mut sh("echo one; echo two >&2; sleep 0.2; echo ready; sleep 600")).unwrap();
        p.wait_until(Duration::from_secs(10), |p| p.stdout().contains("ready")).unwrap();
        assert_eq!(p.stdout(), "one\nready\n");
        assert_eq!(p.stderr(), "two\n");
        assert_eq!(p.output(), "stdout:\none\nready\nstderr:\ntwo\n");
        let status = p.kill().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(!p.running());
    }

    #[test]
    fn what_the_child_started_dies_with_it() {
        let mut p = Process::spawn_collected("sh", &mut sh("sleep 600 & echo $!; wait")).unwrap();
        p.wait_until(Duration::from_secs(10), |p| p.stdout().ends_with('\n')).unwrap();
        let grandchild: u32 = p.stdout().trim().parse().unwrap();
        assert!(alive(grandchild));
        p.kill();
        let t0 = Instant::now();
        while alive(grandchild) {
            assert!(t0.elapsed() < Duration::from_secs(5), "sleep {grandchild} outlived its parent");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn waiting_fails_when_the_process_ends_or_time_runs_out() {
        let mut p = Process::spawn_collected("sh", &mut sh("echo bye; exit 3")).unwrap();
        match p.wait_until(Duration::from_secs(10), |p| p.stdout().contains("never")) {
            Err(WaitError::Exited(s)) => assert_eq!(s.code(), Some(3)),
            other => panic!("{other:?}"),
        }
        assert_eq!(p.stdout(), "bye\n", "everything it printed is there once it ended");
        let mut p = Process::spawn_collected("sleep", Command::new("sleep").arg("600")).unwrap();
        assert!(matches!(p.wait_until(Duration::from_millis(50), |_| false), Err(WaitError::TimedOut(_))));
    }

    #[test]
    fn logged_output_lands_in_files() {
        let dir = crate::scratch::Scratch::new("process-test").unwrap();
        let mut p = Process::spawn_logged("sh", &mut sh("echo out; echo err >&2"), dir.path(), "log").unwrap();
        assert!(p.wait().unwrap().success());
        assert_eq!((p.stdout(), p.stderr()), ("out\n".to_owned(), "err\n".to_owned()));
        assert_eq!(std::fs::read_to_string(dir.join("log.err")).unwrap(), "err\n");
    }

    #[test]
    fn signals_reach_a_running_child_only() {
        let mut p = Process::spawn("sleep", Command::new("sleep").arg("600")).unwrap();
        p.signal(libc::SIGTERM).unwrap();
        let status = p.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM));
        // Reaped: nothing is sent to whatever has its pid now.
        p.signal(libc::SIGTERM).unwrap();
    }

    #[test]
    fn wait_with_output_returns_the_piped_output() {
        let mut cmd = sh("echo hello");
        cmd.stdout(Stdio::piped());
        let out = Process::spawn("sh", &mut cmd).unwrap().wait_with_output().unwrap();
        assert_eq!(out.stdout, b"hello\n");
    }
}
