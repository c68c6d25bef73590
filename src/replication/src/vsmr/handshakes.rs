//! Accepted links still in their handshake. Each costs a thread and up to
//! a handshake frame of memory until it has said who it is, so there are at
//! most `MAX` at once, each for at most its time: a newcomer ends the
//! oldest (strangers holding every slot do not keep a real peer out, whose
//! handshake takes a round trip) and any past its time (the reads' timeout
//! alone lets a peer sending a byte at a time stay for good).

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ftvm_vmm::sync::Lock;

/// Links in their handshake at once.
pub const MAX: usize = 16;

pub struct Handshakes {
    time: Duration,
    next: AtomicU64,
    open: Mutex<VecDeque<(u64, Instant, TcpStream)>>,
}

/// A link's place among those in their handshake, given up when dropped
/// (the handshake is over, whichever way).
pub struct Slot {
    ticket: u64,
    of: Arc<Handshakes>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.of.open.locked().retain(|(t, _, _)| *t != self.ticket);
    }
}

impl Handshakes {
    pub fn new(time: Duration) -> Arc<Handshakes> {
        Arc::new(Handshakes { time, next: AtomicU64::new(0), open: Mutex::default() })
    }

    /// Take a place for `stream` (a handle on the accepted socket), ending
    /// the links past their time and, when all places are taken, the
    /// oldest; each ended link's reader sees its socket close. `None`
    /// when the socket cannot be watched (then it is not served).
    pub fn admit(self: &Arc<Self>, stream: &TcpStream) -> Option<Slot> {
        let watch = stream.try_clone().ok()?;
        let now = Instant::now();
        let mut open = self.open.locked();
        while let Some((_, since, s)) = open.front() {
            let expired = now.duration_since(*since) >= self.time;
            if !expired && open.len() < MAX {
                break;
            }
            if expired {
                tracing::warn!("a peer link was not through its handshake within {} ms: closed", self.time.as_millis());
            } else {
                tracing::warn!("{MAX} peer links were in their handshake: closed the oldest for a new one");
            }
            let _ = s.shutdown(Shutdown::Both);
            open.pop_front();
        }
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        open.push_back((ticket, now, watch));
        Some(Slot { ticket, of: self.clone() })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.open.locked().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    /// A connected pair: (what the accepting side holds, the peer's end).
    fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (listener.accept().unwrap().0, peer)
    }

    fn closed(mut peer: TcpStream) -> bool {
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        matches!(peer.read(&mut [0; 1]), Ok(0) | Err(_))
    }

    #[test]
    fn a_newcomer_ends_the_oldest_and_a_finished_handshake_frees_its_place() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let slots = Handshakes::new(Duration::from_secs(60));
        let mut held = Vec::new();
        let mut peers = Vec::new();
        for _ in 0..MAX {
            let (s, p) = pair(&listener);
            held.push(slots.admit(&s).unwrap());
            peers.push(p);
        }
        let (s, _newcomer) = pair(&listener);
        let _slot = slots.admit(&s).unwrap();
        assert_eq!(slots.len(), MAX);
        assert!(closed(peers.remove(0)), "the oldest was not closed");
        drop(held.pop());
        assert_eq!(slots.len(), MAX - 1, "a finished handshake keeps its place");
    }

    #[test]
    fn links_past_their_time_are_ended_at_the_next_arrival() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let slots = Handshakes::new(Duration::from_millis(50));
        let (s, slow) = pair(&listener);
        let _held = slots.admit(&s).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let (s, _next) = pair(&listener);
        let _slot = slots.admit(&s).unwrap();
        assert_eq!(slots.len(), 1);
        assert!(closed(slow), "the slow link was not closed");
    }
}
