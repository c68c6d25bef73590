//! The backup's door: it accepts connections until one of them turns out to
//! be its primary. Each connection is handshaken on its own thread within a
//! deadline (authentication with a secret, then the primary's Hello), so a
//! stranger (a port probe, an HTTP request, garbage, an idle socket, a
//! wrong secret) is logged with its address and dropped, and never keeps
//! the real primary waiting (when every handshake slot is taken, a new
//! connection ends the oldest).

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ftvm_replication::handshakes::{self, Handshakes};
use ftvm_replication::pipeline::transport::{self, Auth, AuthTransport, TcpTransport, Transport};
use ftvm_replication::protocol::{self, Hello, Kind, ProtocolError, HANDSHAKE_LIMIT};
use ftvm_replication::ReplicationError;

/// A peer that completed the handshake and said Hello.
pub struct Candidate {
    pub link: Box<dyn Transport>,
    pub hello: Hello,
    pub peer: String,
}

/// The accepting thread; closed (and the listening socket with it) on drop.
pub struct Gate {
    stop: Arc<AtomicBool>,
    /// Closed on drop: wakes the thread at once (it polls the other end).
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
    candidates: Receiver<Candidate>,
}

impl Gate {
    pub fn open(listener: TcpListener, auth: Option<Auth>, timeout: Duration) -> Result<Gate, ReplicationError> {
        listener.set_nonblocking(true).map_err(ReplicationError::Thread)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (wake, woken) = UnixStream::pair().map_err(ReplicationError::Thread)?;
        let (tx, candidates) = mpsc::channel();
        let handshakes = Handshakes::new("connections", timeout);
        let door = Door { listener, woken, auth, candidates: tx, handshakes };
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new().name("backup-accept".into()).spawn(move || door.run(&stop)).map_err(ReplicationError::Thread)?
        };
        Ok(Gate { stop, wake: Some(wake), thread: Some(thread), candidates })
    }

    /// The next peer that passed the handshake.
    pub fn next(&self) -> Result<Candidate, ReplicationError> {
        self.candidates.recv().map_err(|_| ReplicationError::Thread(std::io::Error::other("the accepting thread ended")))
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        drop(self.wake.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Door {
    listener: TcpListener,
    /// Readable (closed) when the gate closes.
    woken: UnixStream,
    auth: Option<Auth>,
    candidates: Sender<Candidate>,
    handshakes: Arc<Handshakes>,
}

impl Door {
    fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            // Until a connection arrives, the gate closes or a tick passes.
            handshakes::wait_readable(&self.listener, Some(&self.woken));
            self.handshakes.expire();
            loop {
                match self.listener.accept() {
                    Ok((stream, peer)) => self.admit(stream, peer),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // Out of descriptors and the like: try again next tick.
                        tracing::warn!("accepting a connection failed: {e}");
                        break;
                    }
                }
            }
        }
    }

    fn admit(&mut self, stream: TcpStream, peer: SocketAddr) {
        // When every slot is taken, the oldest goes, not the newcomer:
        // strangers that keep the slots filled must not turn the real
        // primary away, and a primary's handshake takes a round trip, not
        // the deadline.
        let Some(slot) = self.handshakes.admit(&stream, peer) else {
            self.handshakes.refuse(&peer, &"dropped a connection: cannot watch its socket");
            return;
        };
        let (auth, timeout, candidates) = (self.auth.clone(), self.handshakes.time(), self.candidates.clone());
        let spawned = std::thread::Builder::new().name("backup-handshake".into()).spawn(move || {
            let deadline = slot.deadline();
            let raw = stream.try_clone();
            let result = handshake(stream, auth.as_ref(), deadline);
            // Logged before the gentle close, which takes a while: the
            // refusal is on its way, and so is the line saying why.
            match &result {
                Ok(_) => tracing::info!(%peer, "a primary completed the handshake"),
                // (The door shut it down at the deadline: what the read
                // then says, "the peer closed", is not what happened.)
                Err(_) if slot.expired() || Instant::now() >= deadline => {
                    slot.refuse(&peer, &format_args!("refused a connection: no complete handshake within {} ms", timeout.as_millis()))
                }
                Err(e) => slot.refuse(&peer, &format_args!("refused a connection: {e}")),
            }
            drop(slot);
            if let (Err(_), Ok(raw)) = (&result, &raw) {
                close_gently(raw);
            }
            if let Ok((link, hello)) = result {
                let _ = candidates.send(Candidate { link, hello, peer: peer.to_string() });
            }
        });
        if let Err(e) = spawned {
            self.handshakes.refuse(&peer, &format_args!("dropped a connection: cannot start its handshake: {e}"));
        }
    }
}

/// Authenticate the peer (with a secret) and read its Hello.
fn handshake(stream: TcpStream, auth: Option<&Auth>, deadline: Instant) -> Result<(Box<dyn Transport>, Hello), ReplicationError> {
    // Accepted sockets do not inherit the listener's non-blocking mode on
    // Linux; make sure, since the handshake relies on read timeouts.
    stream.set_nonblocking(false).map_err(ReplicationError::Send)?;
    let mut link = TcpTransport::new(stream).map_err(ReplicationError::Send)?;
    link.set_recv_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
        .map_err(ReplicationError::Send)?;
    let mut buf = Vec::new();
    let first = match link.recv(HANDSHAKE_LIMIT, &mut buf) {
        Ok(kind) => kind,
        Err(e @ ProtocolError::Version { .. }) => {
            // Tell the primary in words it can read (the frame header is versioned, the refusal text is not).
            transport::refuse(&mut link, &e.to_string());
            return Err(e.into());
        }
        Err(e) => return Err(e.into()),
    };
    let (mut link, kind): (Box<dyn Transport>, Kind) = match auth {
        Some(auth) => {
            let mut secure = AuthTransport::respond(link, first, &buf, auth)?;
            let kind = secure.recv(HANDSHAKE_LIMIT, &mut buf)?;
            (Box::new(secure), kind)
        }
        None if first == Kind::AuthHello => {
            transport::refuse(&mut link, "this backup has no --secret-file: start it with the primary's secret");
            return Err(ReplicationError::Auth("the peer wants to authenticate; this backup has no --secret-file".into()));
        }
        None => (Box::new(link), first),
    };
    if kind != Kind::Hello {
        return Err(ProtocolError::Corrupt(format!("expected Hello, got {kind:?}")).into());
    }
    let hello = protocol::decode(&buf)?;
    link.set_recv_timeout(None).map_err(ReplicationError::Send)?;
    Ok((link, hello))
}

/// Close a refused connection so that the refusal reaches the peer: a
/// socket closed with unread input is reset, and a reset can discard the
/// refusal before the peer read it. Reads (and drops) what is left for a
/// moment, at most 64 KiB.
fn close_gently(stream: &TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match std::io::Read::read(&mut &*stream, &mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
}
