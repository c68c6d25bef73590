//! The control API (`docs/api.md`): JSON lines over a Unix socket. Every
//! request and every reply carries the API version; a request of another
//! version gets an error reply naming both.

pub mod access;
pub mod client;
pub mod server;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The version of the requests and replies this VMM speaks.
pub const API_VERSION: u32 = 1;

/// Longest request or reply line accepted.
const MAX_LINE: usize = 1 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Status,
    /// Hold the VM paused until `Resume`.
    Pause,
    Resume,
    /// Stop the VM (the VMM exits 0), or a backup that has not taken over.
    Stop,
    /// Pause, write a snapshot to `path`, then resume (or stop if `stop`).
    Snapshot {
        path: String,
        stop: bool,
    },
    /// Protect a running primary again with the backup at `backup`.
    Protect {
        backup: String,
    },
    /// Stop the guest, checkpoint it a last time and hand the VM over to the
    /// backup; answered once that is done (or failed).
    Switchover,
    /// A VSMR leader: replace member `remove` by a new replica `add`
    /// listening at `addr` (raft's configuration change); answered once
    /// the change is proposed.
    ReplicaReplace {
        remove: u64,
        add: u64,
        addr: String,
    },
}

/// A request as it travels: the version, then the request's own fields.
#[derive(Serialize)]
struct Envelope<'a> {
    version: u32,
    #[serde(flatten)]
    request: &'a Request,
}

impl Request {
    /// The request's line on the wire (with its newline).
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(&Envelope { version: API_VERSION, request: self }).expect("requests serialize");
        line.push('\n');
        line
    }

    /// Parse one request line; the error is the reply's message.
    pub fn from_line(line: &str) -> Result<Request, String> {
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("bad request: not JSON: {e}"))?;
        match value.get("version").map(|v| v.as_u64()) {
            None => return Err(format!("bad request: no \"version\" field (this VMM speaks control API version {API_VERSION})")),
            Some(Some(v)) if v == u64::from(API_VERSION) => {}
            Some(v) => {
                let theirs = v.map_or_else(|| value["version"].to_string(), |v| v.to_string());
                return Err(format!("unsupported control API version {theirs}: this VMM speaks version {API_VERSION}"));
            }
        }
        serde_json::from_value(value).map_err(|e| format!("bad request: {e}"))
    }
}

/// Fields a reply does not have are left out of its JSON.
#[serde_with::skip_serializing_none]
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Response {
    /// The API version of the VMM that answered (0: a VMM without versions).
    #[serde(default)]
    pub version: u32,
    pub ok: bool,
    pub error: Option<String>,
    pub state: Option<String>,
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u64>,
    pub bytes: Option<u64>,
    pub pause_us: Option<u64>,
    /// A snapshot's disk requests in flight (saved, issued again on restore).
    pub disk_pending: Option<u64>,
    pub replication: Option<ftvm_replication::Status>,
    /// `status`: output this VMM could not write and dropped (counted since it started).
    pub write_errors: Option<WriteErrors>,
    /// `status` of a VSMR replica: the group's members as it applied them.
    pub members: Option<ftvm_vsmr::membership::Membership>,
    /// What a request set going (`replica_replace`).
    pub message: Option<String>,
}

/// Lines of the `--metrics` file and guest console writes to stdout that
/// failed (a full disk, a closed pipe): dropped, the VM went on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteErrors {
    pub metrics: u64,
    pub console: u64,
}

impl WriteErrors {
    /// This process's counts now.
    pub fn now() -> WriteErrors {
        WriteErrors { metrics: ftvm_replication::metrics::write_errors(), console: ftvm_vmm::hooks::console_write_errors() }
    }
}

impl Response {
    pub fn ok() -> Response {
        Response { version: API_VERSION, ok: true, ..Default::default() }
    }

    pub fn error(msg: impl Into<String>) -> Response {
        Response { version: API_VERSION, ok: false, error: Some(msg.into()), ..Default::default() }
    }

    /// The reply's line on the wire (with its newline).
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).expect("responses serialize");
        line.push('\n');
        line
    }
}

/// Why a line could not be read.
#[derive(Debug)]
pub enum LineError {
    /// The deadline passed first.
    TimedOut,
    TooLong,
    Io(std::io::Error),
}

/// Reads newline-terminated lines from a stream, each by a deadline (a peer
/// sending one byte at a time cannot stretch it).
pub struct LineReader<'a> {
    stream: &'a UnixStream,
    buf: Vec<u8>,
}

impl<'a> LineReader<'a> {
    pub fn new(stream: &'a UnixStream) -> LineReader<'a> {
        LineReader { stream, buf: Vec::new() }
    }

    /// The next line without its newline; `None` at end of stream.
    pub fn next_line(&mut self, deadline: Instant) -> Result<Option<String>, LineError> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                return Ok(Some(String::from_utf8_lossy(&line[..end]).into_owned()));
            }
            if self.buf.len() > MAX_LINE {
                return Err(LineError::TooLong);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LineError::TimedOut);
            }
            self.stream.set_read_timeout(Some(left.max(Duration::from_millis(1)))).map_err(LineError::Io)?;
            let mut stream = self.stream;
            match stream.read(&mut chunk) {
                Ok(0) if self.buf.is_empty() => return Ok(None),
                Ok(0) => return Err(LineError::Io(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LineError::Io(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn requests_carry_the_version() {
        let line = Request::Snapshot { path: "/x".into(), stop: true }.to_line();
        assert_eq!(line, "{\"version\":1,\"op\":\"snapshot\",\"path\":\"/x\",\"stop\":true}\n");
        assert!(matches!(Request::from_line(&line), Ok(Request::Snapshot { stop: true, .. })));
        assert!(matches!(Request::from_line(r#"{"version":1,"op":"stop"}"#), Ok(Request::Stop)));
    }

    #[test]
    fn other_versions_are_refused_by_name() {
        let e = Request::from_line(r#"{"version":7,"op":"status"}"#).unwrap_err();
        assert!(e.contains("version 7") && e.contains("version 1"), "{e}");
        let e = Request::from_line(r#"{"version":"one","op":"status"}"#).unwrap_err();
        assert!(e.contains("version \"one\""), "{e}");
        assert!(Request::from_line(r#"{"op":"status"}"#).unwrap_err().contains("no \"version\""));
        assert!(Request::from_line(r#"{"version":1,"op":"fly"}"#).unwrap_err().contains("fly"));
        assert!(Request::from_line("status").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn replies_leave_out_what_they_do_not_have() {
        let reply = Response { version: 1, ok: true, pause_us: Some(7), ..Response::default() };
        let line = serde_json::to_string(&reply).unwrap();
        assert_eq!(line, r#"{"version":1,"ok":true,"pause_us":7}"#);
        let back: Response = serde_json::from_str(&line).unwrap();
        assert_eq!((back.pause_us, back.error), (Some(7), None));
    }

    #[test]
    fn lines_are_read_by_a_deadline() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut reader = LineReader::new(&b);
        (&a).write_all(b"one\ntw").unwrap();
        let soon = || Instant::now() + Duration::from_millis(50);
        assert_eq!(reader.next_line(soon()).unwrap().as_deref(), Some("one"));
        assert!(matches!(reader.next_line(soon()), Err(LineError::TimedOut)));
        (&a).write_all(b"o\n").unwrap();
        assert_eq!(reader.next_line(soon()).unwrap().as_deref(), Some("two"));
        drop(a);
        assert!(reader.next_line(soon()).unwrap().is_none());
    }
}
