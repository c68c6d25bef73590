//! Transport: frames between primary and backup. TCP today; a shared-memory
//! transport for two processes on one host, or RDMA verbs, implement the
//! same trait and nothing around it changes.

mod tcp;

use std::io;
use std::time::Duration;

pub use tcp::{accept, connect, TcpTransport};

use crate::protocol::{Kind as FrameKind, ProtocolError};

/// `--transport`: how frames travel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kind {
    #[default]
    Tcp,
}

impl std::str::FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcp" => Ok(Kind::Tcp),
            _ => Err(format!("unknown value '{s}' (expected tcp)")),
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Tcp => "tcp",
        })
    }
}

/// One end of a replication channel: ordered, reliable, both ways.
pub trait Transport: Send {
    /// Send one complete frame.
    fn send(&mut self, frame: &[u8]) -> io::Result<()>;
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
}
