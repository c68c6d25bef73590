//! A small blocking Redis (RESP2) client with timeouts: enough to write
//! keys, read them back and ask for TIME, and the reply parser on its own
//! (for replies read from a capture).

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

    fn parse(bytes: &[u8]) -> io::Result<Reply> {
        read_reply(&mut &bytes[..])
    }

    #[test]
    fn nested_empty_and_binary_replies_parse() {
        assert_eq!(
            parse(b"*2\r\n*1\r\n:0\r\n$0\r\n\r\n").unwrap(),
            Reply::Array(Some(vec![Reply::Array(Some(vec![Reply::Int(0)])), Reply::Bulk(Some(Vec::new()))]))
        );
        assert_eq!(parse(b"*0\r\n").unwrap(), Reply::Array(Some(Vec::new())));
        // Bulk strings are binary: CR, LF and NUL inside are data.
        assert_eq!(parse(b"$4\r\na\r\n\0\r\n").unwrap(), Reply::Bulk(Some(b"a\r\n\0".to_vec())));
        assert_eq!(parse(b"+\r\n").unwrap(), Reply::Simple(String::new()));
        assert!(!Reply::Simple("PONG".into()).is_ok() && Reply::Simple("OK".into()).is_ok());
    }

    #[test]
    fn malformed_and_cut_replies_are_errors() {
        use io::ErrorKind::{InvalidData, UnexpectedEof};
        for (bytes, kind) in [
            (&b"+OK\n"[..], InvalidData),
            (b"+OK", InvalidData),
            (b":12x\r\n", InvalidData),
            (b"$abc\r\n", InvalidData),
            (b"!3\r\n", InvalidData),
            (b"$3\r\nabcXY", InvalidData),
            (b"$10\r\nabc\r\n", UnexpectedEof),
            (b"*2\r\n:1\r\n", UnexpectedEof),
            (b"", UnexpectedEof),
        ] {
            assert_eq!(parse(bytes).map_err(|e| e.kind()), Err(kind), "{:?}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn a_client_sends_requests_and_reads_replies_with_a_timeout() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let want = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n";
            let mut got = vec![0u8; want.len()];
            s.read_exact(&mut got).unwrap();
            assert_eq!(got, want);
            s.write_all(b"$2\r\nv1\r\n").unwrap();
            // Then silence: the next call must time out, not hang.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let mut c = Client::connect(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(c.call(&[b"GET", b"k"]).unwrap(), Reply::Bulk(Some(b"v1".to_vec())));
        c.set_timeout(Duration::from_millis(50)).unwrap();
        let e = c.call(&[b"PING"]).unwrap_err();
        assert!(matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{e}");
        drop(c);
        server.join().unwrap();
    }
}
