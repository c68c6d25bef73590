//! Server side of the control socket, served from the VMM's event loop.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ftvm_replication::{Primary, StatusCell};
use ftvm_vmm::snapshot;
use ftvm_vmm::Persist;
use ftvm_vmm::Vm;

use super::{Request, Response};

pub struct ApiServer {
    listener: UnixListener,
    path: PathBuf,
}

impl ApiServer {
    pub fn bind(path: &Path) -> std::io::Result<ApiServer> {
        // A socket file left by a VMM that died is stale; a live one is not ours to take.
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "another VMM is serving this socket"));
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        Ok(ApiServer { listener, path: path.to_owned() })
    }

    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// Serve every pending connection. Returns true if the VM should stop.
    pub fn accept_all(&self, ctx: &ApiContext) -> bool {
        let mut stop = false;
        while let Ok((stream, _)) = self.listener.accept() {
            stop |= serve(stream, ctx);
        }
        stop
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What the control socket can see: a backup has no VM until it takes over.
pub struct ApiContext<'a> {
    pub vm: Option<&'a Vm>,
    pub status: Option<&'a StatusCell>,
    pub primary: Option<&'a Primary>,
}

fn serve(stream: UnixStream, ctx: &ApiContext) -> bool {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    if BufReader::new(&stream).read_line(&mut line).is_err() {
        return false;
    }
    let (response, stop) = match serde_json::from_str::<Request>(&line) {
        Ok(request) => handle(request, ctx),
        Err(e) => (Response::error(format!("bad request: {e}")), false),
    };
    let mut reply = serde_json::to_string(&response).expect("responses serialize");
    reply.push('\n');
    let _ = (&stream).write_all(reply.as_bytes());
    stop
}

fn handle(request: Request, ctx: &ApiContext) -> (Response, bool) {
    let replication = ctx.status.map(|s| s.get());
    if let Request::Status = request {
        let mut response = Response { ok: true, replication, ..Default::default() };
        match ctx.vm {
            Some(vm) => {
                response.state = Some(if vm.is_held() { "paused" } else { "running" }.into());
                response.vcpus = Some(vm.config().vcpus);
                response.memory_mib = Some(vm.config().mem_size >> 20);
            }
            None => response.state = Some("standby".into()),
        }
        return (response, false);
    }
    if let Request::Protect { backup } = request {
        return match (ctx.primary, replication) {
            (Some(_), Some(st)) if st.protected => (Response::error("the VM is already protected"), false),
            (Some(p), _) => {
                p.protect(backup);
                (Response { ok: true, ..Default::default() }, false)
            }
            (None, _) => (Response::error("this VMM is not a replicating primary"), false),
        };
    }
    let Some(vm) = ctx.vm else {
        return (Response::error("no VM is running here yet (a backup before takeover)"), false);
    };
    match request {
        Request::Status | Request::Protect { .. } => unreachable!("handled above"),
        Request::Pause => {
            vm.hold();
            (Response { ok: true, state: Some("paused".into()), ..Default::default() }, false)
        }
        Request::Resume => {
            vm.release();
            (Response { ok: true, state: Some("running".into()), ..Default::default() }, false)
        }
        Request::Snapshot { path, stop } => {
            let t0 = Instant::now();
            vm.pause();
            let result = vm
                .save()
                .map_err(|e| e.to_string())
                .and_then(|state| snapshot::write(Path::new(&path), &state, vm.ram()).map_err(|e| e.to_string()));
            let pause_us = t0.elapsed().as_micros() as u64;
            if !stop {
                vm.resume();
            }
            match result {
                Ok(bytes) => {
                    tracing::info!(path, bytes, pause_us, "snapshot written");
                    (Response { ok: true, bytes: Some(bytes), pause_us: Some(pause_us), ..Default::default() }, stop)
                }
                Err(e) => (Response::error(e), false),
            }
        }
    }
}
