//! Frames over one TCP connection.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Transport;
use crate::error::ReplicationError;
use crate::liveness::Pulse;
use crate::protocol::{self, Kind, ProtocolError};
use crate::sockopt;

/// Bytes read ahead of the frame being parsed (`with_read_ahead`).
const READ_AHEAD: usize = 64 << 10;

pub struct TcpTransport {
    stream: TcpStream,
    /// Beaten by every read that brings bytes.
    pulse: Option<Arc<Pulse>>,
    /// `with_read_ahead`: what one read brought beyond the frame parsed.
    ahead: Option<ReadAhead>,
}

impl TcpTransport {
    pub fn new(stream: TcpStream) -> io::Result<TcpTransport> {
        // Checkpoints and acknowledgements are latency-bound: no Nagle.
        stream.set_nodelay(true)?;
        Ok(TcpTransport { stream, pulse: None, ahead: None })
    }

    /// Sends fail once bytes sent have gone unacknowledged for `timeout`
    /// (TCP_USER_TIMEOUT), instead of TCP retransmitting with a backoff
    /// that doubles up to two minutes: a link that lost its peer in a
    /// network partition is then dropped and dialled again, rather than
    /// waiting after the partition heals for the next retransmission
    /// (27.7 s after a 28 s cut once).
    pub fn set_user_timeout(&self, timeout: Duration) -> io::Result<()> {
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        sockopt::set(self.stream.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, ms)
    }

    /// Read what has arrived, up to 64 KiB, in one call and parse frames
    /// from it, instead of three reads per frame (header, payload,
    /// checksum; twice that with a seal). Only for a handle that alone
    /// receives on its connection: a clone does not see what this one
    /// read ahead.
    pub fn with_read_ahead(self) -> TcpTransport {
        TcpTransport { ahead: Some(ReadAhead { buf: vec![0; READ_AHEAD].into_boxed_slice(), start: 0, end: 0 }), ..self }
    }
}

/// A buffer of bytes read from the stream and not parsed yet: `buf[start..end]`.
struct ReadAhead {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

/// A reader through a `ReadAhead`: reads from `inner` only when the
/// buffer is empty, as much as fits (a read at least as large as the
/// buffer goes straight to the caller's memory).
struct Buffered<'a, R: Read> {
    inner: R,
    ahead: &'a mut ReadAhead,
}

impl<R: Read> Read for Buffered<'_, R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let a = &mut *self.ahead;
        if a.start == a.end {
            if out.len() >= a.buf.len() {
                return self.inner.read(out);
            }
            a.end = self.inner.read(&mut a.buf)?;
            a.start = 0;
        }
        let n = (a.end - a.start).min(out.len());
        out[..n].copy_from_slice(&a.buf[a.start..a.start + n]);
        a.start += n;
        Ok(n)
    }
}

/// The stream, read through: every read that brings bytes beats the pulse.
struct Observed<'a> {
    stream: &'a mut TcpStream,
    pulse: &'a Pulse,
}

impl Read for Observed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.stream.read(buf)?;
        if n > 0 {
            self.pulse.beat();
        }
        Ok(n)
    }
}

/// Reach the backup at `addr`, retrying until `timeout` passes.
pub fn connect(addr: &str, timeout: Duration) -> Result<TcpTransport, ReplicationError> {
    connect_unless(addr, timeout, &AtomicBool::new(false))
}

/// `connect`, giving up with `ReplicationError::Stopped` between attempts
/// once `stop` is set (each attempt takes at most a second).
pub fn connect_unless(addr: &str, timeout: Duration, stop: &AtomicBool) -> Result<TcpTransport, ReplicationError> {
    let deadline = Instant::now() + timeout;
    let unreachable = |err: String| ReplicationError::Unreachable { addr: addr.into(), err };
    loop {
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(|e| unreachable(e.to_string()))?.collect();
        let mut last = String::from("no address");
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(1)) {
                Ok(s) => return TcpTransport::new(s).map_err(ReplicationError::Send),
                Err(e) => last = e.to_string(),
            }
        }
        if stop.load(Ordering::SeqCst) {
            return Err(ReplicationError::Stopped);
        }
        if Instant::now() >= deadline {
            return Err(unreachable(last));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Wait for a primary on `listener`.
pub fn accept(listener: &TcpListener) -> io::Result<TcpTransport> {
    let (stream, _) = listener.accept()?;
    TcpTransport::new(stream)
}

impl Transport for TcpTransport {
    fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        self.stream.write_all(frame)
    }

    fn send_batch(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        // IOV_MAX pieces per writev at most.
        for chunk in frames.chunks(1024) {
            let mut slices: Vec<IoSlice> = chunk.iter().map(|f| IoSlice::new(f)).collect();
            let mut rest = &mut slices[..];
            // Skip empty slices, or a write of nothing would look like a closed socket.
            IoSlice::advance_slices(&mut rest, 0);
            while !rest.is_empty() {
                match self.stream.write_vectored(rest) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(n) => IoSlice::advance_slices(&mut rest, n),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    fn recv(&mut self, limit: u64, buf: &mut Vec<u8>) -> Result<Kind, ProtocolError> {
        let TcpTransport { stream, pulse, ahead } = self;
        match (pulse, ahead) {
            (Some(pulse), Some(ahead)) => protocol::read_frame(&mut Buffered { inner: Observed { stream, pulse }, ahead }, limit, buf),
            (Some(pulse), None) => protocol::read_frame(&mut Observed { stream, pulse }, limit, buf),
            (None, Some(ahead)) => protocol::read_frame(&mut Buffered { inner: stream, ahead }, limit, buf),
            (None, None) => protocol::read_frame(stream, limit, buf),
        }
    }

    fn set_recv_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.stream.set_read_timeout(timeout)
    }

    fn try_clone(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(TcpTransport { stream: self.stream.try_clone()?, pulse: self.pulse.clone(), ahead: None }))
    }

    fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn peer(&self) -> String {
        self.stream.peer_addr().map_or_else(|_| "an unknown peer".into(), |a| a.to_string())
    }

    fn addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        Some((self.stream.local_addr().ok()?, self.stream.peer_addr().ok()?))
    }

    fn observe(&mut self, pulse: Arc<Pulse>) {
        self.pulse = Some(pulse);
    }

    /// Half the send buffer (the kernel counts its bookkeeping in
    /// SO_SNDBUF, which it sets to twice what is asked) less what is
    /// queued in it, unsent or unacknowledged.
    fn room(&self) -> Option<usize> {
        let fd = self.stream.as_raw_fd();
        let mut queued: libc::c_int = 0;
        // SAFETY: TIOCOUTQ (SIOCOUTQ) on this stream's open descriptor
        // writes one c_int, into `queued`.
        if unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) } != 0 {
            return None;
        }
        let size = sockopt::get(fd, libc::SOL_SOCKET, libc::SO_SNDBUF).ok()?;
        usize::try_from(size / 2 - queued).ok()
    }

    fn busy(&self) -> Option<Duration> {
        sockopt::tcp_busy(self.stream.as_raw_fd()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_cross_a_connection_both_ways() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let mut t = accept(&listener).unwrap();
            let mut buf = Vec::new();
            assert_eq!(t.recv(100, &mut buf).unwrap(), Kind::Ack);
            t.send(&protocol::message(Kind::Bye, &3i32)).unwrap();
        });
        let mut t = connect(&addr, Duration::from_secs(5)).unwrap();
        t.send(&protocol::ack(1)).unwrap();
        let mut rx = t.try_clone().unwrap();
        let mut buf = Vec::new();
        assert_eq!(rx.recv(100, &mut buf).unwrap(), Kind::Bye);
        assert_eq!(protocol::decode::<i32>(&buf).unwrap(), 3);
        server.join().unwrap();
        assert!(matches!(rx.recv(100, &mut buf), Err(ProtocolError::Closed)));
    }

    #[test]
    fn a_batch_arrives_as_its_frames_in_order() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        // Small and large frames (some larger than the read-ahead buffer),
        // more than one writev's worth; read through the read-ahead buffer.
        let len = |i: u32| if i.is_multiple_of(100) { 3 * READ_AHEAD + 5 } else { (i as usize % 7) * 300 };
        let frames: Vec<Vec<u8>> = (0..1500u32).map(|i| protocol::frame(Kind::Raft, &vec![i as u8; len(i)])).collect();
        let expected: Vec<Vec<u8>> = (0..1500u32).map(|i| vec![i as u8; len(i)]).collect();
        let server = std::thread::spawn(move || {
            let mut t = accept(&listener).unwrap().with_read_ahead();
            let mut buf = Vec::new();
            expected.iter().for_each(|e| {
                assert_eq!(t.recv(1 << 20, &mut buf).unwrap(), Kind::Raft);
                assert_eq!(&buf, e);
            });
        });
        let mut t = connect(&addr, Duration::from_secs(5)).unwrap();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        t.send_batch(&refs).unwrap();
        server.join().unwrap();
    }

    #[test]
    fn an_unreachable_backup_is_an_error_after_the_timeout() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let r = connect(&format!("127.0.0.1:{port}"), Duration::from_millis(200));
        assert!(matches!(r, Err(ReplicationError::Unreachable { .. })));
    }
}
