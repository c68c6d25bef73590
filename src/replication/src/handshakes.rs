//! Accepted connections still in their handshake, on a port anyone can
//! reach (the backup's, a replica's peer port). Each costs a thread and up
//! to a handshake frame of memory until it has said who it is, so there are
//! at most `MAX` at once, each for at most its time: a newcomer ends the
//! oldest (strangers holding every slot do not keep a real peer out, whose
//! handshake takes a round trip), and the owner's tick (`expire`) ends any
//! past its time (a read timeout alone lets a peer sending a byte at a time
//! stay for good, and waiting for the next arrival lets it stay until then).
//! Lines about refused connections go through `Refusals` (rate-limited).

use std::collections::VecDeque;
use std::fmt::Display;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ftvm_vmm::sync::Lock;

use crate::refusals::Refusals;

/// Connections in their handshake at once.
pub const MAX: usize = 16;
/// How often owners call `expire`.
pub const TICK: Duration = Duration::from_millis(100);

pub struct Handshakes {
    /// What is handshaken, plural, for log lines ("connections", "peer links").
    name: &'static str,
    time: Duration,
    next: AtomicU64,
    open: Mutex<VecDeque<Open>>,
    refusals: Refusals,
}

struct Open {
    ticket: u64,
    deadline: Instant,
    stream: TcpStream,
    ended: Arc<AtomicBool>,
}

/// A connection's place among those in their handshake, given up when
/// dropped (the handshake is over, whichever way).
pub struct Slot {
    ticket: u64,
    deadline: Instant,
    ended: Arc<AtomicBool>,
    of: Arc<Handshakes>,
}

impl Slot {
    /// When its handshake must be over.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether `expire` ended it at its deadline (its reads then say "the
    /// peer closed", which is not what happened).
    pub fn expired(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// The refusal of this connection, in the rate-limited log.
    pub fn refuse(&self, peer: &dyn Display, line: &dyn Display) {
        self.of.refusals.warn(peer, line);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.of.open.locked().retain(|o| o.ticket != self.ticket);
    }
}

impl Handshakes {
    pub fn new(name: &'static str, time: Duration) -> Arc<Handshakes> {
        Arc::new(Handshakes { name, time, next: AtomicU64::new(0), open: Mutex::default(), refusals: Refusals::new(name) })
    }

    /// The handshake time.
    pub fn time(&self) -> Duration {
        self.time
    }

    /// Take a place for `stream` (a handle on the accepted socket from
    /// `peer`), ending the oldest when all places are taken; an ended
    /// connection's reader sees its socket close. `None` when the socket
    /// cannot be watched (then it is not served).
    pub fn admit(self: &Arc<Self>, stream: &TcpStream, peer: SocketAddr) -> Option<Slot> {
        let watch = stream.try_clone().ok()?;
        let deadline = Instant::now() + self.time;
        let mut open = self.open.locked();
        while open.len() >= MAX {
            let Some(oldest) = open.pop_front() else { break };
            let _ = oldest.stream.shutdown(Shutdown::Both);
            let line = format!("{MAX} {} were in their handshake: ended the oldest for this one", self.name);
            self.refusals.warn(&peer, &line);
        }
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        let ended = Arc::new(AtomicBool::new(false));
        open.push_back(Open { ticket, deadline, stream: watch, ended: ended.clone() });
        Some(Slot { ticket, deadline, ended, of: self.clone() })
    }

    /// End the connections past their time (their readers see the socket
    /// close and their `Slot::expired` is true), and roll the refusal
    /// log's interval. The owner calls it every `TICK`.
    pub fn expire(&self) {
        let now = Instant::now();
        self.open.locked().retain(|o| {
            if now < o.deadline {
                return true;
            }
            o.ended.store(true, Ordering::SeqCst);
            let _ = o.stream.shutdown(Shutdown::Both);
            false
        });
        self.refusals.tick();
    }

    /// A refusal of a connection that holds no slot, in the rate-limited log.
    pub fn refuse(&self, peer: &dyn Display, line: &dyn Display) {
        self.refusals.warn(peer, line);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.open.locked().len()
    }
}

/// Sleep until `listener` is readable, `also` (if any) is readable, or a
/// `TICK` passes.
pub fn wait_readable(listener: &impl std::os::fd::AsRawFd, also: Option<&impl std::os::fd::AsRawFd>) {
    let mut fds = [
        libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: also.map_or(-1, |a| a.as_raw_fd()), events: libc::POLLIN, revents: 0 },
    ];
    // SAFETY: two valid pollfds (a negative fd is ignored) that outlive the
    // call; poll only writes `revents`.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, TICK.as_millis() as i32) };
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

    fn addr(s: &TcpStream) -> SocketAddr {
        s.peer_addr().unwrap()
    }

    #[test]
    fn a_newcomer_ends_the_oldest_and_a_finished_handshake_frees_its_place() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let slots = Handshakes::new("connections", Duration::from_secs(60));
        let mut held = Vec::new();
        let mut peers = Vec::new();
        for _ in 0..MAX {
            let (s, p) = pair(&listener);
            held.push(slots.admit(&s, addr(&s)).unwrap());
            peers.push(p);
        }
        let (s, _newcomer) = pair(&listener);
        let _slot = slots.admit(&s, addr(&s)).unwrap();
        assert_eq!(slots.len(), MAX);
        assert!(closed(peers.remove(0)), "the oldest was not closed");
        assert!(!held[0].expired(), "ended for a newcomer is not expired");
        drop(held.pop());
        assert_eq!(slots.len(), MAX - 1, "a finished handshake keeps its place");
    }

    #[test]
    fn links_past_their_time_are_ended_on_the_tick_without_another_arrival() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let slots = Handshakes::new("peer links", Duration::from_millis(50));
        let (s, slow) = pair(&listener);
        let held = slots.admit(&s, addr(&s)).unwrap();
        slots.expire();
        assert_eq!(slots.len(), 1, "ended before its time");
        std::thread::sleep(Duration::from_millis(100));
        slots.expire();
        assert_eq!(slots.len(), 0);
        assert!(held.expired());
        assert!(closed(slow), "the slow link was not closed");
    }
}
