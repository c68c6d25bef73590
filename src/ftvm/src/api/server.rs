//! Server side of the control socket. The VMM's event loop accepts
//! connections; each client is then read and answered on a thread of its
//! own, with deadlines, so a silent or slow client holds up nobody else.
//! Requests themselves are carried out on the event loop, one at a time
//! (`ApiServer::serve_requests`), where the VM lives.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use ftvm_vmm::sync::Lock;

use ftvm_primary_backup::Primary;
use ftvm_replication::StatusCell;
use ftvm_vmm::snapshot;
use ftvm_vmm::Persist;
use ftvm_vmm::Vm;

use super::access::{self, Access};
use super::{LineError, LineReader, Request, Response};

/// A client has this long to send each complete request line.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// And this long to take each reply.
const REPLY_DEADLINE: Duration = Duration::from_secs(5);
/// Clients connected at once; a newcomer beyond them ends the oldest
/// connection that is waiting for its request (or, when every one is busy
/// with a request, is answered with an error and closed).
pub const MAX_CLIENTS: usize = 64;
/// How long a stopping VMM waits for replies still on their way.
const DRAIN: Duration = Duration::from_secs(2);

/// A request read by a client thread, waiting for the event loop.
struct Pending {
    request: Request,
    reply: mpsc::Sender<Response>,
}

pub struct ApiServer {
    listener: UnixListener,
    path: PathBuf,
    requests: mpsc::Receiver<Pending>,
    submit: mpsc::Sender<Pending>,
    /// Readable when requests wait in `requests`.
    wake: Arc<EventFd>,
    clients: Arc<Clients>,
    /// Requests handed to the event loop whose reply is not written yet.
    in_flight: Arc<AtomicUsize>,
    access: Access,
    /// The VM is held paused by `ftvm pause` (replication may hold it too).
    paused_by_operator: AtomicBool,
    /// Where the reply to a switch-over goes once it is done (`reply_switchover`).
    switchover: std::sync::Mutex<Option<mpsc::Sender<Response>>>,
}

/// What the event loop must do after a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    None,
    Stop,
    /// Protect this VM (a promoted backup's) with a backup at this address.
    Protect(String),
    /// Stop the VM and hand it over to its backup; then `reply_switchover`.
    Switchover,
}

impl ApiServer {
    pub fn bind(path: &Path, access: Access) -> std::io::Result<ApiServer> {
        // A socket file left by a VMM that died is stale; a live one is not
        // ours to take, and anything that is not a socket is not ours at all.
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the path exists and is not a socket; not replacing it",
                ));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "another VMM is serving this socket"));
            }
            std::fs::remove_file(path)?;
        }
        let listener = access.bind(path)?;
        listener.set_nonblocking(true)?;
        let (submit, requests) = mpsc::channel();
        Ok(ApiServer {
            listener,
            path: path.to_owned(),
            requests,
            submit,
            wake: Arc::new(EventFd::new(libc::EFD_NONBLOCK)?),
            clients: Arc::new(Clients::default()),
            in_flight: Arc::new(AtomicUsize::new(0)),
            access,
            paused_by_operator: AtomicBool::new(false),
            switchover: std::sync::Mutex::new(None),
        })
    }

    /// Readable when connections wait to be accepted.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// Readable when requests wait for [`ApiServer::serve_requests`].
    pub fn requests_event(&self) -> &EventFd {
        &self.wake
    }

    /// Accept every pending connection and start a thread for each.
    pub fn accept_all(&self) {
        while let Ok((stream, _)) = self.listener.accept() {
            match access::peer(&stream) {
                Ok(peer) if self.access.allows(&peer) => {}
                Ok(peer) => {
                    tracing::warn!(uid = peer.uid, pid = peer.pid, "control socket: refused a client of another user");
                    refuse(&stream, &format!("permission denied: uid {} may not use this control socket", peer.uid));
                    continue;
                }
                Err(e) => {
                    tracing::warn!("control socket: cannot read a client's credentials ({e}); refusing it");
                    continue;
                }
            }
            let Some(slot) = self.clients.admit(&stream) else {
                tracing::warn!("control socket: {MAX_CLIENTS} clients connected, each with a request in progress; refusing one");
                refuse(&stream, &format!("too many control clients ({MAX_CLIENTS}), all busy"));
                continue;
            };
            let client = Client {
                stream,
                slot,
                submit: self.submit.clone(),
                wake: self.wake.clone(),
                clients: self.clients.clone(),
                in_flight: self.in_flight.clone(),
            };
            if let Err(e) = std::thread::Builder::new().name("api-client".into()).spawn(move || {
                ftvm_vmm::seccomp::install_or_exit(ftvm_vmm::seccomp::ThreadKind::Api);
                client.serve()
            }) {
                tracing::warn!("control socket: cannot start a client thread: {e}");
            }
        }
    }

    /// Carry out every request waiting, in order.
    pub fn serve_requests(&self, ctx: &ApiContext) -> Action {
        let _ = self.wake.read();
        let mut action = Action::None;
        while let Ok(pending) = self.requests.try_recv() {
            let (response, a) = self.handle(pending.request, ctx);
            if a == Action::Switchover && matches!(action, Action::None | Action::Protect(_)) {
                // Answered when done: the client learns whether it worked.
                *self.switchover.locked() = Some(pending.reply);
                action = a;
                continue;
            }
            let _ = pending.reply.send(response);
            // Stop wins over everything; a switch-over over a protection.
            if a == Action::Stop || (a != Action::None && action == Action::None) {
                action = a;
            }
        }
        action
    }
}

impl ApiServer {
    /// Answer the client that asked for the switch-over.
    pub fn reply_switchover(&self, response: Response) {
        if let Some(reply) = self.switchover.locked().take() {
            let _ = reply.send(response);
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        // Requests still queued get no answer from a VMM that is going away;
        // their clients hear so. Replies already given get written.
        let t0 = Instant::now();
        loop {
            while let Ok(pending) = self.requests.try_recv() {
                let _ = pending.reply.send(Response::error("the VMM is stopping"));
            }
            if self.in_flight.load(Ordering::SeqCst) == 0 || t0.elapsed() >= DRAIN {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// One connected client, served on its own thread.
struct Client {
    stream: UnixStream,
    /// Its place in `clients`.
    slot: u64,
    submit: mpsc::Sender<Pending>,
    wake: Arc<EventFd>,
    clients: Arc<Clients>,
    in_flight: Arc<AtomicUsize>,
}

impl Client {
    fn serve(self) {
        let mut reader = LineReader::new(&self.stream);
        loop {
            let line = match reader.next_line(Instant::now() + REQUEST_DEADLINE) {
                Ok(Some(line)) => line,
                Ok(None) => break,
                Err(LineError::TimedOut) => {
                    tracing::debug!("control socket: no complete request within {REQUEST_DEADLINE:?}; closing");
                    break;
                }
                Err(LineError::TooLong) => {
                    self.reply(&Response::error("bad request: line too long"));
                    break;
                }
                Err(LineError::Io(e)) => {
                    tracing::debug!("control socket: {e}");
                    break;
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            let _busy = self.clients.busy(self.slot);
            let replied = match Request::from_line(&line) {
                Ok(request) => {
                    self.in_flight.fetch_add(1, Ordering::SeqCst);
                    let replied = self.reply(&self.carry_out(request));
                    self.in_flight.fetch_sub(1, Ordering::SeqCst);
                    replied
                }
                Err(e) => self.reply(&Response::error(e)),
            };
            if !replied {
                break;
            }
        }
    }

    /// Hand `request` to the event loop and wait for its reply.
    fn carry_out(&self, request: Request) -> Response {
        let (tx, rx) = mpsc::channel();
        if self.submit.send(Pending { request, reply: tx }).is_err() {
            return Response::error("the VMM is stopping");
        }
        let _ = self.wake.write(1);
        rx.recv().unwrap_or_else(|_| Response::error("the VMM is stopping"))
    }

    /// Write one reply by its deadline; false if the client is gone.
    fn reply(&self, response: &Response) -> bool {
        self.stream.set_write_timeout(Some(REPLY_DEADLINE)).is_ok() && (&self.stream).write_all(response.to_line().as_bytes()).is_ok()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.clients.leave(self.slot);
    }
}

/// Answer a client we do not serve with one error line, and close.
fn refuse(stream: &UnixStream, why: &str) {
    let _ = stream.set_nonblocking(true);
    let mut stream = stream;
    let _ = stream.write_all(Response::error(why).to_line().as_bytes());
}

/// The clients connected now, oldest first, so that a newcomer can end the
/// oldest one that is only waiting (connections left open by a stuck
/// script, or by somebody holding every place, never lock the operator out).
#[derive(Default)]
struct Clients {
    list: std::sync::Mutex<Vec<Connected>>,
    next: std::sync::atomic::AtomicU64,
}

struct Connected {
    slot: u64,
    /// A handle to shut its connection down with.
    stream: UnixStream,
    /// Carrying out a request (not to be ended).
    busy: bool,
}

impl Clients {
    /// A place for `stream`, ending the oldest waiting client if all are
    /// taken; None when every client is busy.
    fn admit(&self, stream: &UnixStream) -> Option<u64> {
        let handle = stream.try_clone().ok()?;
        let mut list = self.list.locked();
        if list.len() >= MAX_CLIENTS {
            let oldest = list.iter().position(|c| !c.busy)?;
            let ended = list.remove(oldest);
            let _ = ended.stream.shutdown(std::net::Shutdown::Both);
            tracing::warn!("control socket: {MAX_CLIENTS} clients connected; ended the one waiting longest for its request");
        }
        let slot = self.next.fetch_add(1, Ordering::SeqCst);
        list.push(Connected { slot, stream: handle, busy: false });
        Some(slot)
    }

    /// Mark `slot` busy until the guard is dropped.
    fn busy(&self, slot: u64) -> Busy<'_> {
        self.set_busy(slot, true);
        Busy { clients: self, slot }
    }

    fn set_busy(&self, slot: u64, busy: bool) {
        if let Some(c) = self.list.locked().iter_mut().find(|c| c.slot == slot) {
            c.busy = busy;
        }
    }

    fn leave(&self, slot: u64) {
        self.list.locked().retain(|c| c.slot != slot);
    }
}

struct Busy<'a> {
    clients: &'a Clients,
    slot: u64,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.clients.set_busy(self.slot, false);
    }
}

/// Why a VMM that is not a protected primary cannot switch over.
fn no_backup_to_switch_to(has_vm: bool, replication: Option<&ftvm_replication::Status>) -> &'static str {
    match (has_vm, replication) {
        (false, _) => "this VMM is a backup: ask its primary to switch over",
        (true, Some(_)) => "the VM is not protected: there is no backup to hand it over to (`ftvm protect` gives it one)",
        (true, None) => "the VM is not replicated (started without --replicate-to): there is no backup to hand it over to",
    }
}

/// What the control socket can see: a backup has no VM until it takes over.
pub struct ApiContext<'a> {
    pub vm: Option<&'a Vm>,
    pub status: Option<&'a StatusCell>,
    pub primary: Option<&'a Primary>,
    /// A VSMR replica's group (`ftvm replica`, the witness too).
    pub replica: Option<&'a ftvm_vsmr::membership::Control>,
}

impl ApiServer {
    fn handle(&self, request: Request, ctx: &ApiContext) -> (Response, Action) {
        let replication = ctx.status.map(|s| s.get());
        let state = |s: &str| Response { state: Some(s.into()), ..Response::ok() };
        match (request, ctx.vm) {
            (Request::Status, vm) => {
                let mut response = Response {
                    replication,
                    write_errors: Some(super::WriteErrors::now()),
                    members: ctx.replica.map(|c| c.membership()),
                    ..Response::ok()
                };
                match vm {
                    Some(vm) => {
                        response.state = Some(if vm.is_held() { "paused" } else { "running" }.into());
                        response.vcpus = Some(vm.config().vcpus);
                        response.memory_mib = Some(vm.config().mem_size >> 20);
                    }
                    None => response.state = Some("standby".into()),
                }
                (response, Action::None)
            }
            (Request::Protect { backup }, _) => match (ctx.primary, replication) {
                (Some(_), Some(st)) if st.protected => (Response::error("the VM is already protected"), Action::None),
                (Some(p), _) => {
                    p.protect(backup);
                    (Response::ok(), Action::None)
                }
                // A backup that took over runs the VM alone: it becomes a
                // replicating primary (`roles::backup` starts one).
                (None, Some(st)) if ctx.vm.is_some() && st.role == ftvm_replication::Role::Primary => {
                    (Response::ok(), Action::Protect(backup))
                }
                (None, _) => (Response::error("this VMM is not a replicating primary"), Action::None),
            },
            (Request::Stop, _) => (state("stopping"), Action::Stop),
            (Request::Switchover, _) => match (ctx.primary, &replication) {
                (Some(_), Some(st)) if st.protected => (state("switching over"), Action::Switchover),
                (Some(_), _) => (Response::error("the VM is not protected: there is no backup to hand it over to"), Action::None),
                (None, _) => (Response::error(no_backup_to_switch_to(ctx.vm.is_some(), replication.as_ref())), Action::None),
            },
            // Answered by the consensus thread at once: the change itself
            // completes in the background (`status` shows it).
            (Request::ReplicaReplace { remove, add, addr }, _) => match ctx.replica {
                Some(group) => match group.replace(remove, add, addr) {
                    Ok(message) => (Response { message: Some(message), ..Response::ok() }, Action::None),
                    Err(e) => (Response::error(e), Action::None),
                },
                None => (Response::error("this VMM is not a VSMR replica (`ftvm replica`)"), Action::None),
            },
            (_, None) => (Response::error("no VM is running here yet (a backup before takeover)"), Action::None),
            (Request::Pause, Some(vm)) => {
                if !self.paused_by_operator.swap(true, Ordering::SeqCst) {
                    vm.hold();
                }
                (state("paused"), Action::None)
            }
            (Request::Resume, Some(vm)) => {
                if self.paused_by_operator.swap(false, Ordering::SeqCst) {
                    vm.release();
                }
                if vm.is_held() {
                    // Only replication holds it now (its backup is lost, or it
                    // waits for the arbiter); that hold is not the operator's to end.
                    return (Response::error("the VM stays paused: replication holds it (see `ftvm status`)"), Action::None);
                }
                (state("running"), Action::None)
            }
            // The VMM's working directory is nobody's business: `ftvm
            // snapshot` sends the path made absolute where it was typed.
            (Request::Snapshot { path, .. }, Some(_)) if !Path::new(&path).is_absolute() => {
                (Response::error(format!("snapshot path {path} is not absolute")), Action::None)
            }
            (Request::Snapshot { path, stop }, Some(vm)) => {
                let t0 = Instant::now();
                vm.pause();
                let result = vm.save().map_err(|e| e.to_string()).and_then(|state| {
                    let pending = ftvm_vmm::devices::requests_in_flight(state.iter());
                    snapshot::write(Path::new(&path), &state, vm.ram()).map(|bytes| (bytes, pending)).map_err(|e| e.to_string())
                });
                let pause_us = t0.elapsed().as_micros() as u64;
                if !stop {
                    vm.resume();
                }
                match result {
                    Ok((bytes, disk_pending)) => {
                        tracing::info!(path, bytes, pause_us, disk_pending, "snapshot written");
                        let action = if stop { Action::Stop } else { Action::None };
                        (
                            Response { bytes: Some(bytes), pause_us: Some(pause_us), disk_pending: Some(disk_pending), ..Response::ok() },
                            action,
                        )
                    }
                    Err(e) => (Response::error(e), Action::None),
                }
            }
        }
    }
}
