//! Client side of the control socket: one request, one reply, all of it
//! (connecting included) within a timeout.

use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{LineError, LineReader, Request, Response, API_VERSION};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the VMM at {path}: {err}")]
    Connect { path: String, err: std::io::Error },
    #[error("{path} is not a control socket (a VMM's --api-socket)")]
    NotASocket { path: String },
    #[error("no VMM serves {path} (a socket left by a VMM that ended)")]
    Stale { path: String },
    #[error("the VMM at {path} did not answer within {}", seconds(*.timeout))]
    Timeout { path: String, timeout: Duration },
    #[error("control socket {path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("control socket {path} sent an invalid reply: {err}")]
    Protocol { path: String, err: String },
    #[error("the VMM at {path} speaks control API version {theirs}, this ftvm speaks version {API_VERSION}")]
    Version { path: String, theirs: u32 },
    #[error("the VMM refused: {0}")]
    Refused(String),
}

/// How long a request waits for the VMM unless told (`--timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// `ftvm snapshot`'s: the VMM writes all of guest memory before it answers.
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(600);

/// `5 s`, `1.5 s`.
fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// Connect, giving up at `deadline` (a listener whose backlog is full
/// would block `connect` for good).
fn connect(socket: &Path, deadline: Instant) -> Result<Option<UnixStream>, std::io::Error> {
    let (tx, rx) = mpsc::channel();
    let path = socket.to_owned();
    std::thread::Builder::new().name("api-connect".into()).spawn(move || {
        let _ = tx.send(UnixStream::connect(path));
    })?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(result) => result.map(Some),
        Err(_) => Ok(None),
    }
}

/// Send `request` to the VMM serving `socket` and return its reply; every
/// step counts against `timeout`.
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Response, ClientError> {
    let path = socket.display().to_string();
    let deadline = Instant::now() + timeout;
    let timed_out = || ClientError::Timeout { path: path.clone(), timeout };
    let io = |err: std::io::Error| match err.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => timed_out(),
        _ => ClientError::Io { path: path.clone(), err },
    };
    // (A regular file or a directory would say "connection refused".)
    if std::fs::metadata(socket).is_ok_and(|m| !m.file_type().is_socket()) {
        return Err(ClientError::NotASocket { path });
    }
    let stream = connect(socket, deadline)
        .map_err(|err| match err.kind() {
            std::io::ErrorKind::ConnectionRefused => ClientError::Stale { path: path.clone() },
            _ => ClientError::Connect { path: path.clone(), err },
        })?
        .ok_or_else(timed_out)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left)).map_err(io)?;
    // A VMM that refuses this client (another user's, or too many) answers
    // with one error line and closes before reading the request: that
    // line, not the broken pipe, is what went wrong.
    let written = (&stream).write_all(request.to_line().as_bytes());
    if let Err(err) = written {
        let refused = matches!(err.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset);
        match LineReader::new(&stream).next_line(deadline) {
            Ok(Some(line)) if refused => return reply_of(&path, &line),
            _ => return Err(io(err)),
        }
    }
    let reply = match LineReader::new(&stream).next_line(deadline) {
        Ok(Some(line)) => line,
        Ok(None) => return Err(ClientError::Protocol { path, err: "the VMM closed the connection without a reply".into() }),
        Err(LineError::TimedOut) => return Err(timed_out()),
        Err(LineError::TooLong) => return Err(ClientError::Protocol { path, err: "reply too long".into() }),
        Err(LineError::Io(err)) => return Err(io(err)),
    };
    reply_of(&path, &reply)
}

/// The reply in `line`, or the error it reports.
fn reply_of(path: &str, line: &str) -> Result<Response, ClientError> {
    let path = path.to_owned();
    let response: Response = serde_json::from_str(line).map_err(|e| ClientError::Protocol { path: path.clone(), err: e.to_string() })?;
    if response.version != API_VERSION {
        return Err(ClientError::Version { path, theirs: response.version });
    }
    if !response.ok {
        return Err(ClientError::Refused(response.error.unwrap_or_else(|| "unknown error".into())));
    }
    Ok(response)
}
