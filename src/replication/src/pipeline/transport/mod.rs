//! Transport: frames between primary and backup. TCP today; a shared-memory
//! transport for two processes on one host, or RDMA verbs, implement the
//! same trait and nothing around it changes. `AuthTransport` wraps any of
//! them into an authenticated (and optionally encrypted) channel.

mod auth;
mod secret;
mod tcp;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use auth::refuse;
pub use auth::{Auth, AuthTransport};
pub use secret::{Secret, SecretError};
pub use tcp::{accept, connect, connect_unless, TcpTransport};

use crate::liveness::{self, Pulse};
use crate::protocol::{Kind as FrameKind, ProtocolError};
use ftvm_vmm::switch;

switch! {
    /// `--transport`: how frames travel.
    pub enum Kind {
        /// One TCP connection to the backup.
        Tcp = "tcp",
    }
}

/// Frames a caller should hand `send_batch` at most: each may take two
/// pieces of a `writev` (a seal and the frame), whose limit is 1024.
pub const BATCH_FRAMES: usize = 256;

/// One end of a replication channel: ordered, reliable, both ways.
pub trait Transport: Send {
    /// Send one complete frame.
    fn send(&mut self, frame: &[u8]) -> io::Result<()>;
    /// Send complete frames in order, as `send` each, in as few system
    /// calls as the transport can (TCP: one `writev` for up to
    /// [`BATCH_FRAMES`] of them).
    fn send_batch(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        frames.iter().try_for_each(|f| self.send(f))
    }
    /// Receive one whole, verified frame whose payload is at most `limit`
    /// bytes into `buf`.
    fn recv(&mut self, limit: u64, buf: &mut Vec<u8>) -> Result<FrameKind, ProtocolError>;
    /// `recv` gives up with `ProtocolError::Timeout` after this long (None: never).
    fn set_recv_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()>;
    /// Another handle on the same channel, for a thread that only receives.
    fn try_clone(&self) -> io::Result<Box<dyn Transport>>;
    /// Cut the channel: calls blocked on any handle return.
    fn shutdown(&self);
    /// The other end, for messages.
    fn peer(&self) -> String;
    /// This end's address and the other end's, where heartbeats go
    /// (`liveness`), if the transport runs over IP.
    fn addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        None
    }
    /// Beat `pulse` whenever bytes arrive on this handle (and on handles
    /// cloned from it afterwards): the stream, too, shows the peer alive.
    fn observe(&mut self, _pulse: Arc<Pulse>) {}
    /// Keys for tagging this connection's heartbeats, if it is authenticated.
    fn heartbeat_keys(&self) -> Option<liveness::Keys> {
        None
    }
    /// Bytes a send could take now without blocking, if the transport
    /// knows.
    fn room(&self) -> Option<usize> {
        None
    }
    /// How long the link has had data in flight since it was opened, if
    /// the transport knows: against the time passed, how busy the link is.
    fn busy(&self) -> Option<Duration> {
        None
    }
}

impl Transport for Box<dyn Transport> {
    fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        (**self).send(frame)
    }

    fn send_batch(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        (**self).send_batch(frames)
    }

    fn recv(&mut self, limit: u64, buf: &mut Vec<u8>) -> Result<FrameKind, ProtocolError> {
        (**self).recv(limit, buf)
    }

    fn set_recv_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_recv_timeout(timeout)
    }

    fn try_clone(&self) -> io::Result<Box<dyn Transport>> {
        (**self).try_clone()
    }

    fn shutdown(&self) {
        (**self).shutdown()
    }

    fn peer(&self) -> String {
        (**self).peer()
    }

    fn addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        (**self).addrs()
    }

    fn observe(&mut self, pulse: Arc<Pulse>) {
        (**self).observe(pulse)
    }

    fn heartbeat_keys(&self) -> Option<liveness::Keys> {
        (**self).heartbeat_keys()
    }

    fn room(&self) -> Option<usize> {
        (**self).room()
    }

    fn busy(&self) -> Option<Duration> {
        (**self).busy()
    }
}
