//! Accepting many connections on one TCP port.
//!
//! smoltcp has no accept queue: a socket in LISTEN *becomes* the connection
//! when a SYN arrives, and a SYN that finds no listening socket is refused
//! with RST. So a listener here is a pool of sockets kept in LISTEN
//! (`backlog` of them), topped up as soon as one of them starts a handshake
//! (after every ingress frame, see `Stack::poll`), and connected sockets are
//! handed out by [`Listener::accept`]. Released sockets are reused in place
//! (buffers included) instead of being freed and reallocated.

use alloc::collections::{BTreeSet, VecDeque};
use alloc::vec::Vec;

use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::tcp::{self, State};

use crate::heap::try_zeroed;

/// How to listen on a port; see [`crate::net::Stack::listen`].
#[derive(Clone, Copy, Debug)]
pub struct ListenConfig {
    pub port: u16,
    /// Sockets kept in LISTEN at once: how many SYNs can arrive in one burst
    /// before the stack gets to replace the sockets they took.
    pub backlog: usize,
    /// Most sockets of this port at once (connections, handshakes and
    /// listening sockets); at the limit, new SYNs are refused.
    pub max_conns: usize,
    /// Receive and send buffer of every connection, in bytes.
    pub rx_buffer: usize,
    pub tx_buffer: usize,
    /// Disable Nagle's algorithm: request/response protocols would otherwise
    /// hold back small replies until the client's (delayed) ACK.
    pub nodelay: bool,
}

impl ListenConfig {
    /// 16 listening, up to 256 connections, 64 KiB buffers, no Nagle.
    pub fn new(port: u16) -> ListenConfig {
        ListenConfig { port, backlog: 16, max_conns: 256, rx_buffer: 64 * 1024, tx_buffer: 64 * 1024, nodelay: true }
    }
}

pub(crate) struct Listener {
    config: ListenConfig,
    /// Sockets in LISTEN or SYN-RECEIVED.
    pending: Vec<SocketHandle>,
    /// Connected, not yet handed out.
    ready: VecDeque<SocketHandle>,
    /// Handed out by accept and not yet released.
    live: BTreeSet<SocketHandle>,
    /// Released while still connected: aborted, and kept until the RST is
    /// out (smoltcp forgets the peer once it has sent it).
    dying: Vec<SocketHandle>,
    /// False once closed: no socket listens, and the listener is gone when
    /// its last connection is released and reset.
    open: bool,
}

fn tcp<'a>(sockets: &'a mut SocketSet<'static>, h: SocketHandle) -> &'a mut tcp::Socket<'static> {
    sockets.get_mut::<tcp::Socket>(h)
}

impl Listener {
    pub(crate) fn new(config: ListenConfig) -> Listener {
        Listener { config, pending: Vec::new(), ready: VecDeque::new(), live: BTreeSet::new(), dying: Vec::new(), open: true }
    }

    /// Stop listening: new SYNs find no socket and are refused with RST;
    /// handshakes under way and connections not yet accepted are reset.
    /// Accepted connections live on until released.
    pub(crate) fn close(&mut self, sockets: &mut SocketSet<'static>) {
        self.open = false;
        for h in self.pending.drain(..).chain(self.ready.drain(..)) {
            let s = tcp(sockets, h);
            if s.state() == State::Listen {
                sockets.remove(h);
            } else {
                s.abort();
                self.dying.push(h);
            }
        }
    }

    /// Listen again (after [`Listener::close`]) with `config`.
    pub(crate) fn reopen(&mut self, config: ListenConfig, sockets: &mut SocketSet<'static>) {
        self.config = config;
        self.open = true;
        self.maintain(sockets);
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open
    }

    /// Closed, with nothing left to release or reset.
    pub(crate) fn is_gone(&self) -> bool {
        !self.open && self.total() == 0
    }

    pub(crate) fn port(&self) -> u16 {
        self.config.port
    }

    fn total(&self) -> usize {
        self.pending.len() + self.ready.len() + self.live.len() + self.dying.len()
    }

    /// Hand out connected sockets' handles, recycle failed handshakes and
    /// dead sockets, and top the LISTEN pool up.
    pub(crate) fn maintain(&mut self, sockets: &mut SocketSet<'static>) {
        let mut listening = 0;
        let mut i = 0;
        while i < self.pending.len() {
            let h = self.pending[i];
            match tcp(sockets, h).state() {
                State::Listen => {
                    listening += 1;
                    i += 1;
                }
                State::SynReceived => i += 1,
                // A handshake that timed out or was reset before completing.
                State::Closed | State::TimeWait => {
                    self.pending.swap_remove(i);
                    self.reuse(sockets, h, &mut listening);
                }
                _ => {
                    self.pending.swap_remove(i);
                    self.ready.push_back(h);
                }
            }
        }
        let mut i = 0;
        while i < self.dying.len() {
            let h = self.dying[i];
            if tcp(sockets, h).remote_endpoint().is_none() {
                self.dying.swap_remove(i);
                self.reuse(sockets, h, &mut listening);
            } else {
                i += 1;
            }
        }
        while self.open && listening < self.config.backlog && self.total() < self.config.max_conns {
            // A full heap leaves fewer sockets listening (later SYNs are
            // refused) instead of ending the guest.
            let (Some(rx), Some(tx)) = (try_zeroed(self.config.rx_buffer), try_zeroed(self.config.tx_buffer)) else {
                return;
            };
            let mut s = tcp::Socket::new(tcp::SocketBuffer::new(rx), tcp::SocketBuffer::new(tx));
            s.set_nagle_enabled(!self.config.nodelay);
            if s.listen(self.config.port).is_err() {
                // Only a zero port fails, which Stack::listen refuses.
                return;
            }
            self.pending.push(sockets.add(s));
            listening += 1;
        }
    }

    /// Put a closed socket back in LISTEN if the pool needs one, else free it.
    fn reuse(&mut self, sockets: &mut SocketSet<'static>, h: SocketHandle, listening: &mut usize) {
        if self.open && *listening < self.config.backlog && self.total() < self.config.max_conns {
            let s = tcp(sockets, h);
            // Forgets the peer without sending anything (listen resets the
            // socket), which is all a TIME-WAIT socket has left to do.
            s.abort();
            if s.listen(self.config.port).is_ok() {
                self.pending.push(h);
                *listening += 1;
                return;
            }
        }
        sockets.remove(h);
    }

    pub(crate) fn accept(&mut self) -> Option<SocketHandle> {
        let h = self.ready.pop_front()?;
        self.live.insert(h);
        Some(h)
    }

    /// Take back a handle from [`Listener::accept`]; false if it is not one
    /// of this listener's. A socket that is still connected is aborted (RST).
    pub(crate) fn release(&mut self, sockets: &mut SocketSet<'static>, h: SocketHandle) -> bool {
        if !self.live.remove(&h) {
            return false;
        }
        let s = tcp(sockets, h);
        let finished = match s.state() {
            State::TimeWait => true,
            State::Closed => s.remote_endpoint().is_none(),
            _ => false,
        };
        if finished {
            let mut listening = self.listening(sockets);
            self.reuse(sockets, h, &mut listening);
        } else {
            s.abort();
            self.dying.push(h);
        }
        true
    }

    fn listening(&self, sockets: &SocketSet<'static>) -> usize {
        self.pending.iter().filter(|&&h| sockets.get::<tcp::Socket>(h).state() == State::Listen).count()
    }
}
