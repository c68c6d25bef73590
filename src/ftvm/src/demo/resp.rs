//! A small blocking Redis (RESP2) client with timeouts: enough to write
//! keys, read them back and ask for TIME. Shared by `ftvm demo` and the
//! failover tests (`src/ftvm/tests/failover.rs` includes this file).
#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A parsed reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

impl Reply {
    pub fn is_ok(&self) -> bool {
        matches!(self, Reply::Simple(s) if s == "OK")
    }
}

/// Append `args` as a RESP array of bulk strings.
pub fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Read one reply. Any error leaves the stream at an unknown position: the
/// caller must drop the connection.
pub fn read_reply(r: &mut impl BufRead) -> io::Result<Reply> {
    let mut line = Vec::with_capacity(32);
    r.read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"));
    }
    if line.len() < 3 || !line.ends_with(b"\r\n") {
        return Err(bad("reply line without CRLF"));
    }
    let body = &line[1..line.len() - 2];
    let text = || String::from_utf8_lossy(body).into_owned();
    let int = || -> io::Result<i64> { text().parse().map_err(|_| bad(format!("bad integer {:?}", text()))) };
    match line[0] {
        b'+' => Ok(Reply::Simple(text())),
        b'-' => Ok(Reply::Error(text())),
        b':' => Ok(Reply::Int(int()?)),
        b'$' => {
            let n = int()?;
            if n < 0 {
                return Ok(Reply::Bulk(None));
            }
            let mut data = vec![0u8; n as usize + 2];
            r.read_exact(&mut data)?;
            if !data.ends_with(b"\r\n") {
                return Err(bad("bulk string without CRLF"));
            }
            data.truncate(n as usize);
            Ok(Reply::Bulk(Some(data)))
        }
        b'*' => {
            let n = int()?;
            if n < 0 {
                return Ok(Reply::Array(None));
            }
            let mut items = Vec::with_capacity(n.min(1024) as usize);
            for _ in 0..n {
                items.push(read_reply(r)?);
            }
            Ok(Reply::Array(Some(items)))
        }
        c => Err(bad(format!("unknown reply type {:?}", c as char))),
    }
}

/// One connection. Every read and write has `timeout`; a timed-out reply
/// is an error, and the connection should then be dropped.
pub struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<Client> {
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        Ok(Client { reader: BufReader::with_capacity(64 * 1024, s.try_clone()?), writer: s })
    }

    pub fn set_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        self.writer.set_read_timeout(Some(timeout))?;
        self.writer.set_write_timeout(Some(timeout))
    }

    /// Send already encoded requests.
    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.writer.write_all(bytes)
    }

    pub fn read(&mut self) -> io::Result<Reply> {
        read_reply(&mut self.reader)
    }

    pub fn call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        let mut buf = Vec::new();
        encode(&mut buf, args);
        self.send(&buf)?;
        self.read()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse() {
        let input = b"+OK\r\n-ERR no\r\n:-5\r\n$3\r\nabc\r\n$-1\r\n*2\r\n$1\r\n7\r\n$2\r\n10\r\n*-1\r\n";
        let mut r = &input[..];
        assert!(read_reply(&mut r).unwrap().is_ok());
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Error("ERR no".into()));
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Int(-5));
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Bulk(Some(b"abc".to_vec())));
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Bulk(None));
        assert_eq!(
            read_reply(&mut r).unwrap(),
            Reply::Array(Some(vec![Reply::Bulk(Some(b"7".to_vec())), Reply::Bulk(Some(b"10".to_vec()))]))
        );
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Array(None));
        assert_eq!(read_reply(&mut r).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        assert!(read_reply(&mut &b"$5\r\nab\r\n"[..]).is_err());
        let mut v = Vec::new();
        encode(&mut v, &[b"SET", b"k", b""]);
        assert_eq!(v, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n");
    }
}
