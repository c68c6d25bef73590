//! Shared test helpers: a server with a recording log and a clock.
#![allow(dead_code)]

use ftvm_kv::{Connection, Flow, LogError, LogSink, Server};

/// Records every appended record; fails with `fail` when set.
#[derive(Default)]
pub struct MemLog {
    pub records: Vec<Vec<u8>>,
    pub fail: Option<LogError>,
}

impl LogSink for MemLog {
    fn append(&mut self, record: &[u8]) -> Result<(), LogError> {
        if let Some(e) = self.fail {
            return Err(e);
        }
        self.records.push(record.to_vec());
        Ok(())
    }
}

/// A RESP array of bulk strings.
pub fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut v = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        v.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        v.extend_from_slice(a);
        v.extend_from_slice(b"\r\n");
    }
    v
}

pub fn words(cmd: &str) -> Vec<&[u8]> {
    cmd.split(' ').map(str::as_bytes).collect()
}

pub struct H {
    pub srv: Server,
    pub conn: Connection,
    pub log: MemLog,
    pub now: u64,
}

impl H {
    pub fn new() -> H {
        H { srv: Server::new(), conn: Connection::new(), log: MemLog::default(), now: 1_000_000 }
    }

    /// Feed raw bytes; returns the replies as a lossy string and the flow.
    pub fn feed(&mut self, input: &[u8]) -> (String, Flow) {
        let mut out = Vec::new();
        let flow = self.srv.handle(&mut self.conn, input, self.now, &mut self.log, &mut out);
        (String::from_utf8_lossy(&out).into_owned(), flow)
    }

    /// Run one command given as space-separated words (sent as RESP).
    pub fn cmd(&mut self, cmd: &str) -> String {
        self.args(&words(cmd))
    }

    /// Run each command in turn, checking its reply: a session as a
    /// table of (command, the reply Redis sends).
    pub fn replies(&mut self, session: &[(&str, &str)]) {
        for (cmd, want) in session {
            assert_eq!(self.cmd(cmd), *want, "{cmd}");
        }
    }

    pub fn args(&mut self, args: &[&[u8]]) -> String {
        let (out, flow) = self.feed(&resp(args));
        assert_eq!(flow, Flow::Continue, "{args:?} closed the connection: {out}");
        out
    }
}

/// The records as readable strings: words joined by spaces.
pub fn show(record: &[u8]) -> String {
    let mut h = Vec::new();
    let mut rest = record;
    // Minimal RESP array reader for assertions.
    let nl = rest.iter().position(|&c| c == b'\n').unwrap();
    let n: usize = std::str::from_utf8(&rest[1..nl - 1]).unwrap().parse().unwrap();
    rest = &rest[nl + 1..];
    for _ in 0..n {
        let nl = rest.iter().position(|&c| c == b'\n').unwrap();
        let len: usize = std::str::from_utf8(&rest[1..nl - 1]).unwrap().parse().unwrap();
        h.push(String::from_utf8_lossy(&rest[nl + 1..nl + 1 + len]).into_owned());
        rest = &rest[nl + 1 + len + 2..];
    }
    assert!(rest.is_empty());
    h.join(" ")
}
