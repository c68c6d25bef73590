//! Frames over one TCP connection.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Transport;
use crate::liveness::Pulse;
use crate::protocol::{self, Kind, ProtocolError};
use crate::ReplicationError;

pub struct TcpTransport {
    stream: TcpStream,
    /// Beaten by every read that brings bytes.
    pulse: Option<Arc<Pulse>>,
}

impl TcpTransport {
    pub(crate) fn new(stream: TcpStream) -> io::Result<TcpTransport> {
        // Checkpoints and acknowledgements are latency-bound: no Nagle.
        stream.set_nodelay(true)?;
        Ok(TcpTransport { stream, pulse: None })
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
        match &self.pulse {
            Some(pulse) => protocol::read_frame(&mut Observed { stream: &mut self.stream, pulse }, limit, buf),
            None => protocol::read_frame(&mut self.stream, limit, buf),
        }
    }

    fn set_recv_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.stream.set_read_timeout(timeout)
    }

    fn try_clone(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(TcpTransport { stream: self.stream.try_clone()?, pulse: self.pulse.clone() }))
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
        // Small and large frames, more than one writev's worth.
        let frames: Vec<Vec<u8>> = (0..1500u32).map(|i| protocol::frame(Kind::Raft, &vec![i as u8; (i as usize % 7) * 300])).collect();
        let expected: Vec<Vec<u8>> = (0..1500u32).map(|i| vec![i as u8; (i as usize % 7) * 300]).collect();
        let server = std::thread::spawn(move || {
            let mut t = accept(&listener).unwrap();
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
