//! Server side of the control socket, served from the VMM's event loop.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm::snapshot::{self, SnapshotHeader};
use vmm::Vm;

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
    pub fn accept_all(&self, vm: &Vm) -> bool {
        let mut stop = false;
        while let Ok((stream, _)) = self.listener.accept() {
            stop |= serve(stream, vm);
        }
        stop
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(stream: UnixStream, vm: &Vm) -> bool {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    if BufReader::new(&stream).read_line(&mut line).is_err() {
        return false;
    }
    let (response, stop) = match serde_json::from_str::<Request>(&line) {
        Ok(request) => handle(request, vm),
        Err(e) => (Response::error(format!("bad request: {e}")), false),
    };
    let mut reply = serde_json::to_string(&response).expect("responses serialize");
    reply.push('\n');
    let _ = (&stream).write_all(reply.as_bytes());
    stop
}

fn handle(request: Request, vm: &Vm) -> (Response, bool) {
    match request {
        Request::Status => {
            let state = if vm.is_running() { "running" } else { "paused" };
            let cfg = vm.config();
            let response = Response {
                ok: true,
                state: Some(state.into()),
                vcpus: Some(cfg.vcpus),
                memory_mib: Some(cfg.mem_size >> 20),
                ..Default::default()
            };
            (response, false)
        }
        Request::Pause => {
            vm.pause();
            (Response { ok: true, state: Some("paused".into()), ..Default::default() }, false)
        }
        Request::Resume => {
            vm.resume();
            (Response { ok: true, state: Some("running".into()), ..Default::default() }, false)
        }
        Request::Snapshot { path, stop } => {
            let was_running = vm.is_running();
            let t0 = Instant::now();
            vm.pause();
            let result = vm.save_state().map_err(|e| e.to_string()).and_then(|state| {
                let cfg = vm.config();
                let header = SnapshotHeader { mem_size: cfg.mem_size, vcpus: cfg.vcpus, state };
                snapshot::write(Path::new(&path), &header, vm.ram()).map_err(|e| e.to_string())
            });
            let pause_us = t0.elapsed().as_micros() as u64;
            if was_running && !stop {
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
