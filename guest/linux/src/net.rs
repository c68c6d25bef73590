//! TCP and UDP sockets over the runtime's TCP/IP stack (smoltcp on
//! virtio-net).
//!
//! A listening socket is a `ftvm_rt::net` listener (a pool of smoltcp
//! sockets in LISTEN; smoltcp has no accept queue) whose connected sockets
//! are moved into the socket's own accept queue.
//!
//! Closing a connection does what Linux's `tcp_close` does: with received
//! data left unread, or with SO_LINGER on and a zero timeout, the
//! connection is reset (RST) at once (after sending what the program wrote
//! and the peer's window takes, which Linux would have sent at the write);
//! otherwise it sends its FIN, and data that arrives after that resets it
//! (nobody is left to read it). Either
//! way it stays in `closing` until TCP is done with it (the RST sent, or
//! the FIN handshake over, at most [`LINGER_NS`]), then goes back to its
//! listener's pool. SO_LINGER with a non-zero timeout is the orderly close
//! too, without the wait: `close` returns at once (the program runs on
//! after it, as it would once Linux's linger wait ended).
//!
//! When the program ends, [`close_all`] closes every socket as `close`
//! would and sends what that produced (FINs, RSTs) before the VM stops, as
//! Linux closes the sockets of a process that exits.
//!
//! Each socket keeps a stamp of when it last became ready for more (epoll
//! reports descriptors in the order they became ready): a connection is
//! looked at after each segment the stack receives for it (`flows` finds
//! it; segments that arrived between two polls keep their order), every
//! socket after every stack poll that moved something, and a socket after
//! every call on it that may take readiness away (a read, a write, an
//! accept), so that the next rise is seen as one.
//!
//! A UDP socket is a smoltcp UDP socket from creation, bound to an
//! ephemeral port when it first sends unbound; `connect` only sets the
//! default destination and, as on Linux, filters what is received.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::vec;
use alloc::vec::Vec;
use core::net::Ipv4Addr;

use ftvm_rt::net::{ListenConfig, NetConfig, Stack};
use ftvm_rt::time;
use smoltcp::iface::SocketHandle;
use smoltcp::socket::tcp::{self, State};
use smoltcp::socket::udp;
use smoltcp::wire::{IpAddress, IpEndpoint};
use spin::Mutex;

use crate::errno::*;
use crate::fd::{EPOLLERR, EPOLLHUP, EPOLLIN, EPOLLOUT, EPOLLRDHUP};

const LINGER_NS: u64 = 60 * time::NS_PER_SEC;
/// How long the end of the program waits for its sockets' last segments to
/// leave: the FIN or RST, not the peer's answer.
const EXIT_FLUSH_NS: u64 = 100 * time::NS_PER_MS;
/// Buffers of a connection this side opens.
const CONNECT_BUFFER: usize = 64 * 1024;
const FIRST_EPHEMERAL_PORT: u16 = 49152;
/// Bytes and datagrams a UDP socket buffers each way.
const UDP_BUFFER: usize = 64 * 1024;
const UDP_DATAGRAMS: usize = 64;
/// Largest UDP payload in one IPv4 datagram.
const UDP_MAX_PAYLOAD: usize = 65507;

enum Sock {
    /// Created, maybe bound (port 0: not bound).
    New {
        port: u16,
        nodelay: bool,
    },
    Listening {
        port: u16,
        queue: VecDeque<SocketHandle>,
    },
    /// `accepted`: from a listener (given back to it when done), else
    /// opened by `connect` (removed from the socket set when done).
    Conn {
        handle: SocketHandle,
        accepted: bool,
    },
    /// A UDP socket; `peer` is its `connect`ed destination.
    Udp {
        handle: SocketHandle,
        peer: Option<IpEndpoint>,
    },
}

struct Closing {
    handle: SocketHandle,
    accepted: bool,
    deadline: u64,
}

/// What a socket keeps besides its state.
#[derive(Clone, Copy, Default)]
struct Meta {
    /// SO_LINGER: None when off, else its timeout in seconds.
    linger: Option<u32>,
    /// Readiness when last looked at.
    seen: u32,
    /// A connection's key in `Net::flows`.
    flow: Option<FlowKey>,
    /// Stamps of the last rise of its input side (EPOLLIN, RDHUP, HUP,
    /// ERR) and of its output side (EPOLLOUT): a program waiting to read
    /// is woken by the one, a program waiting to write by the other.
    since: Since,
}

impl Meta {
    /// Readiness is `bits` now: stamp the sides that rose. Returns the
    /// stamps.
    fn note(&mut self, bits: u32, stamp: &mut u64) -> Since {
        let rose = bits & !self.seen;
        if rose & !EPOLLOUT != 0 {
            *stamp += 1;
            self.since.input = *stamp;
        }
        if rose & EPOLLOUT != 0 {
            *stamp += 1;
            self.since.output = *stamp;
        }
        self.seen = bits;
        self.since
    }
}

/// When a socket last became ready for input and for output.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Since {
    pub input: u64,
    pub output: u64,
}

/// A TCP connection's peer and local port.
type FlowKey = (IpEndpoint, u16);

struct Net {
    stack: Stack,
    socks: BTreeMap<u32, Sock>,
    meta: BTreeMap<u32, Meta>,
    /// Connections by flow, for the segments the stack receives.
    flows: BTreeMap<FlowKey, u32>,
    /// The last readiness stamp given out.
    stamp: u64,
    next_id: u32,
    closing: Vec<Closing>,
    /// Ports with a listener in the stack.
    listeners: BTreeSet<u16>,
    next_port: u16,
}

static NET: Mutex<Option<Net>> = Mutex::new(None);

pub fn init(config: NetConfig) -> Result<(), ftvm_rt::net::Error> {
    let stack = Stack::new(config)?;
    let ip = config.ip;
    let offload = if stack.checksum_offload() { "csum" } else { "none" };
    *NET.lock() = Some(Net {
        stack,
        socks: BTreeMap::new(),
        meta: BTreeMap::new(),
        flows: BTreeMap::new(),
        stamp: 0,
        next_id: 1,
        closing: Vec::new(),
        listeners: BTreeSet::new(),
        next_port: FIRST_EPHEMERAL_PORT,
    });
    ftvm_rt::println!("linux: network up ip={ip} offload={offload}");
    Ok(())
}

fn tcp_mut(net: &mut Net, h: SocketHandle) -> &mut tcp::Socket<'static> {
    net.stack.sockets_mut().get_mut::<tcp::Socket>(h)
}

impl Net {
    /// Move connections the stack accepted into their sockets' queues, and
    /// give lingering closed sockets back.
    fn maintain(&mut self) {
        for (_, s) in self.socks.iter_mut() {
            if let Sock::Listening { port, queue } = s {
                while let Some(h) = self.stack.accept(*port) {
                    queue.push_back(h);
                }
            }
        }
        let now = time::now_ns();
        let mut i = 0;
        while i < self.closing.len() {
            let c = &self.closing[i];
            let s = self.stack.sockets_mut().get_mut::<tcp::Socket>(c.handle);
            // Data for a connection the program has closed has nobody to
            // read it: reset, as Linux does (its TCPAbortOnData).
            if s.recv_queue() > 0 && s.state() != State::Closed {
                s.abort();
            }
            // A reset socket is done once the RST is out (smoltcp forgets
            // the peer when it sends it).
            let done = match s.state() {
                State::TimeWait => true,
                State::Closed => s.remote_endpoint().is_none(),
                _ => false,
            };
            if done || now >= c.deadline {
                let c = self.closing.swap_remove(i);
                self.finish(c.handle, c.accepted);
            } else {
                i += 1;
            }
        }
    }

    /// A new socket `id` with `meta`.
    fn add(&mut self, sock: Sock, meta: Meta) -> u32 {
        let id = self.next_id;
        self.next_id += 1;
        self.socks.insert(id, sock);
        self.meta.insert(id, meta);
        id
    }

    /// Note `id`'s readiness now; a rise (a bit it did not have) is
    /// stamped. Returns (readiness, stamps).
    fn observe(&mut self, id: u32) -> (u32, Since) {
        let bits = self.bits(id);
        match self.meta.get_mut(&id) {
            Some(m) => (bits, m.note(bits, &mut self.stamp)),
            None => (bits, Since::default()),
        }
    }

    /// Index connection `id` by its flow, for [`poll`].
    fn index_flow(&mut self, id: u32, h: SocketHandle) {
        let s = tcp_mut(self, h);
        let (Some(remote), Some(local)) = (s.remote_endpoint(), s.local_endpoint()) else { return };
        let key = (remote, local.port);
        self.flows.insert(key, id);
        if let Some(m) = self.meta.get_mut(&id) {
            m.flow = Some(key);
        }
    }

    fn observe_all(&mut self) {
        let ids: Vec<u32> = self.socks.keys().copied().collect();
        for id in ids {
            self.observe(id);
        }
    }

    /// Close socket `id` as `close(2)` does (see the module's header).
    fn close(&mut self, id: u32) {
        let meta = self.meta.remove(&id).unwrap_or_default();
        if let Some(key) = meta.flow {
            self.flows.remove(&key);
        }
        match self.socks.remove(&id) {
            Some(Sock::Conn { handle, accepted }) => {
                let s = tcp_mut(self, handle);
                if s.recv_queue() > 0 || meta.linger == Some(0) {
                    // Linux's write sends at once, so what the program
                    // wrote has left before its close resets the
                    // connection; here writes wait for the next poll.
                    if s.send_queue() > 0 {
                        self.stack.poll();
                    }
                    tcp_mut(self, handle).abort();
                } else {
                    s.close();
                }
                self.closing.push(Closing { handle, accepted, deadline: time::now_ns().saturating_add(LINGER_NS) });
            }
            Some(Sock::Udp { handle, .. }) => {
                self.stack.sockets_mut().remove(handle);
            }
            Some(Sock::Listening { port, queue }) => {
                // Queued connections are reset; new ones refused (RST).
                for h in queue {
                    self.stack.release(h);
                }
                self.stack.unlisten(port);
                self.listeners.remove(&port);
            }
            _ => {}
        }
    }

    fn finish(&mut self, h: SocketHandle, accepted: bool) {
        if accepted {
            self.stack.release(h);
        } else {
            self.stack.sockets_mut().get_mut::<tcp::Socket>(h).abort();
            self.stack.sockets_mut().remove(h);
        }
    }
}

/// Stack polls made, for the counts printed at exit.
static POLLS: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);

/// What the network did over the program's life, for diagnostics: one
/// line with the frames, the device notifications (VM exits), the WAIT
/// hypercalls (VM exits) and the stack polls; None without a network.
pub fn report() -> Option<alloc::string::String> {
    let g = NET.lock();
    let st = g.as_ref()?.stack.stats();
    let polls = POLLS.load(core::sync::atomic::Ordering::Relaxed);
    Some(alloc::format!(
        "rx_frames={} rx_bad_csum={} tx_frames={} rx_notifies={} tx_notifies={} waits={} polls={polls}",
        st.rx_frames,
        st.rx_bad_csum,
        st.tx_frames,
        st.rx_notifies,
        st.tx_notifies,
        time::waits()
    ))
}

/// Run the stack: frames in and out. True if anything happened.
pub fn poll() -> bool {
    let mut g = NET.lock();
    let Some(net) = g.as_mut() else { return false };
    POLLS.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
    let Net { stack, socks, meta, flows, stamp, .. } = net;
    let progress = stack.poll_each(|sockets, flow| {
        let Some(&id) = flows.get(&(flow.remote, flow.local_port)) else { return };
        if let (Some(Sock::Conn { handle, .. }), Some(m)) = (socks.get(&id), meta.get_mut(&id)) {
            m.note(conn_bits(sockets.get::<tcp::Socket>(*handle)), stamp);
        }
    });
    net.maintain();
    if progress {
        net.observe_all();
    }
    progress
}

/// The program is ending: close every socket as `close` would, and give
/// the segments that makes (FINs, RSTs: refusals of handshakes under way
/// too) up to [`EXIT_FLUSH_NS`] to leave for the device.
pub fn close_all() {
    let mut g = NET.lock();
    let Some(net) = g.as_mut() else { return };
    let ids: Vec<u32> = net.socks.keys().copied().collect();
    for id in ids {
        net.close(id);
    }
    let deadline = time::now_ns().saturating_add(EXIT_FLUSH_NS);
    loop {
        net.stack.poll();
        net.maintain();
        if net.stack.flushed() || time::now_ns() >= deadline {
            return;
        }
        net.stack.wait_idle_until(deadline);
    }
}

/// Sleep until guest time `deadline`, a device event, or the stack's next
/// timer.
pub fn wait_idle_until(deadline: u64) {
    let mut g = NET.lock();
    match g.as_mut() {
        Some(net) => net.stack.wait_idle_until(deadline),
        None => {
            drop(g);
            time::wait(deadline);
        }
    }
}

fn with<R>(f: impl FnOnce(&mut Net) -> Result<R, Errno>) -> Result<R, Errno> {
    let mut g = NET.lock();
    let net = g.as_mut().ok_or(ENETDOWN)?;
    f(net)
}

/// [`with`] for a call on socket `id` that may take readiness away: its
/// readiness is looked at afterwards (see the module's header).
fn with_sock<R>(id: u32, f: impl FnOnce(&mut Net) -> Result<R, Errno>) -> Result<R, Errno> {
    with(|net| {
        let r = f(net);
        net.observe(id);
        r
    })
}

pub fn socket() -> Result<u32, Errno> {
    with(|net| Ok(net.add(Sock::New { port: 0, nodelay: false }, Meta::default())))
}

pub fn close(id: u32) {
    let mut g = NET.lock();
    let Some(net) = g.as_mut() else { return };
    net.close(id);
    drop(g);
    crate::sched::wake_io();
}

/// SO_LINGER: None off, else (on) the timeout in seconds.
pub fn set_linger(id: u32, linger: Option<u32>) -> Result<(), Errno> {
    with(|net| {
        let m = net.meta.get_mut(&id).ok_or(EBADF)?;
        m.linger = linger;
        Ok(())
    })
}

pub fn linger(id: u32) -> Result<Option<u32>, Errno> {
    with(|net| net.meta.get(&id).map(|m| m.linger).ok_or(EBADF))
}

pub fn bind(id: u32, addr: Ipv4Addr, port: u16) -> Result<(), Errno> {
    with(|net| {
        if !addr.is_unspecified() && addr != net.stack.config().ip.address() {
            return Err(EADDRNOTAVAIL);
        }
        let in_use =
            net.socks.values().any(|s| matches!(s, Sock::Listening { port: p, .. } | Sock::New { port: p, .. } if *p == port && port != 0));
        if let Some(Sock::Udp { handle, .. }) = net.socks.get(&id) {
            let h = *handle;
            return udp_bind(net, h, addr, port);
        }
        match net.socks.get_mut(&id) {
            Some(Sock::New { port: p, .. }) if *p == 0 => {
                if in_use {
                    return Err(EADDRINUSE);
                }
                *p = port;
                Ok(())
            }
            Some(_) => Err(EINVAL),
            None => Err(EBADF),
        }
    })
}

pub fn listen(id: u32, backlog: i32) -> Result<(), Errno> {
    with(|net| {
        let port = match net.socks.get(&id) {
            Some(Sock::New { port, .. }) if *port != 0 => *port,
            Some(Sock::Listening { .. }) => return Ok(()),
            Some(_) => return Err(EINVAL),
            None => return Err(EBADF),
        };
        if !net.listeners.contains(&port) {
            let mut config = ListenConfig::new(port);
            config.backlog = (backlog.max(1) as usize).min(config.backlog);
            net.stack.listen(config).map_err(|_| EADDRINUSE)?;
            net.listeners.insert(port);
        }
        net.socks.insert(id, Sock::Listening { port, queue: VecDeque::new() });
        Ok(())
    })
}

/// A connection from `id`'s queue: (new socket id, peer).
pub fn accept(id: u32) -> Result<(u32, IpEndpoint), Errno> {
    with_sock(id, |net| {
        net.maintain();
        let h = match net.socks.get_mut(&id) {
            Some(Sock::Listening { queue, .. }) => queue.pop_front().ok_or(EAGAIN)?,
            Some(_) => return Err(EINVAL),
            None => return Err(EBADF),
        };
        let peer = tcp_mut(net, h).remote_endpoint().unwrap_or(IpEndpoint::new(IpAddress::v4(0, 0, 0, 0), 0));
        // As on Linux, the connection inherits the listener's options.
        let linger = net.meta.get(&id).and_then(|m| m.linger);
        let nid = net.add(Sock::Conn { handle: h, accepted: true }, Meta { linger, ..Meta::default() });
        net.index_flow(nid, h);
        Ok((nid, peer))
    })
}

pub fn connect(id: u32, addr: Ipv4Addr, port: u16) -> Result<(), Errno> {
    with(|net| {
        if let Some(Sock::Udp { handle, peer }) = net.socks.get_mut(&id) {
            *peer = Some(IpEndpoint::new(IpAddress::Ipv4(addr), port));
            let h = *handle;
            return udp_ensure_bound(net, h);
        }
        let nodelay = match net.socks.get(&id) {
            Some(Sock::New { nodelay, .. }) => *nodelay,
            Some(Sock::Conn { .. }) => return Err(EISCONN),
            Some(_) => return Err(EINVAL),
            None => return Err(EBADF),
        };
        let rx = tcp::SocketBuffer::new(vec![0u8; CONNECT_BUFFER]);
        let tx = tcp::SocketBuffer::new(vec![0u8; CONNECT_BUFFER]);
        let mut s = tcp::Socket::new(rx, tx);
        s.set_nagle_enabled(!nodelay);
        let local = net.next_port;
        net.next_port = if local == u16::MAX { FIRST_EPHEMERAL_PORT } else { local + 1 };
        let remote = IpEndpoint::new(IpAddress::Ipv4(addr), port);
        let cx = net.stack.iface_mut().context();
        s.connect(cx, remote, local).map_err(|_| ENETUNREACH)?;
        let h = net.stack.sockets_mut().add(s);
        net.socks.insert(id, Sock::Conn { handle: h, accepted: false });
        net.index_flow(id, h);
        Ok(())
    })
}

/// Where a connect stands: Ok(true) connected, Ok(false) in progress.
pub fn connect_state(id: u32) -> Result<bool, Errno> {
    with(|net| match net.socks.get(&id) {
        Some(Sock::Udp { .. }) => Ok(true),
        Some(Sock::Conn { handle, .. }) => {
            let h = *handle;
            match tcp_mut(net, h).state() {
                State::SynSent | State::SynReceived => Ok(false),
                State::Closed => Err(ECONNREFUSED),
                _ => Ok(true),
            }
        }
        _ => Err(ENOTCONN),
    })
}

fn conn(net: &Net, id: u32) -> Result<SocketHandle, Errno> {
    match net.socks.get(&id) {
        Some(Sock::Conn { handle, .. }) => Ok(*handle),
        Some(_) => Err(ENOTCONN),
        None => Err(EBADF),
    }
}

/// Read what has arrived; `Ok(0)` once the peer has closed.
pub fn recv(id: u32, out: &mut [u8]) -> Result<usize, Errno> {
    recv_from(id, out).map(|(n, _)| n)
}

/// As [`recv`], with a UDP datagram's source.
pub fn recv_from(id: u32, out: &mut [u8]) -> Result<(usize, Option<IpEndpoint>), Errno> {
    with_sock(id, |net| {
        if let Some(Sock::Udp { handle, peer }) = net.socks.get(&id) {
            let (h, peer) = (*handle, *peer);
            let s = udp_mut(net, h);
            loop {
                // A datagram longer than `out` is cut, the rest dropped.
                let (data, meta) = s.recv().map_err(|_| EAGAIN)?;
                if peer.is_some_and(|p| p != meta.endpoint) {
                    continue; // not from the connected peer: dropped, as on Linux
                }
                let n = data.len().min(out.len());
                out[..n].copy_from_slice(&data[..n]);
                return Ok((n, Some(meta.endpoint)));
            }
        }
        recv_tcp(net, id, out).map(|n| (n, None))
    })
}

fn recv_tcp(net: &mut Net, id: u32, out: &mut [u8]) -> Result<usize, Errno> {
    let h = conn(net, id)?;
    let s = tcp_mut(net, h);
    if s.can_recv() {
        return s.recv_slice(out).map_err(|_| ECONNRESET);
    }
    match s.state() {
        State::SynSent | State::SynReceived => Err(EAGAIN),
        _ if s.may_recv() => Err(EAGAIN),
        _ => Ok(0),
    }
}

pub fn send(id: u32, data: &[u8]) -> Result<usize, Errno> {
    send_to(id, data, None)
}

/// As [`send`]; a UDP datagram goes to `to`, or else the connected peer.
pub fn send_to(id: u32, data: &[u8], to: Option<IpEndpoint>) -> Result<usize, Errno> {
    with_sock(id, |net| {
        if let Some(Sock::Udp { handle, peer }) = net.socks.get(&id) {
            let (h, to) = (*handle, to.or(*peer).ok_or(EDESTADDRREQ)?);
            if data.len() > UDP_MAX_PAYLOAD {
                return Err(EMSGSIZE);
            }
            udp_ensure_bound(net, h)?;
            return match udp_mut(net, h).send_slice(data, to) {
                Ok(()) => Ok(data.len()),
                Err(udp::SendError::BufferFull) => Err(EAGAIN),
                Err(udp::SendError::Unaddressable) => Err(EINVAL),
            };
        }
        let h = conn(net, id)?;
        let s = tcp_mut(net, h);
        if matches!(s.state(), State::SynSent | State::SynReceived) {
            return Err(EAGAIN);
        }
        if !s.may_send() {
            return Err(EPIPE);
        }
        match s.send_slice(data) {
            Ok(0) if !data.is_empty() => Err(EAGAIN),
            Ok(n) => Ok(n),
            Err(_) => Err(EPIPE),
        }
    })
}

/// A new UDP socket, unbound.
pub fn udp_socket() -> Result<u32, Errno> {
    with(|net| {
        let buffer = || udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; UDP_DATAGRAMS], vec![0u8; UDP_BUFFER]);
        let handle = net.stack.sockets_mut().add(udp::Socket::new(buffer(), buffer()));
        Ok(net.add(Sock::Udp { handle, peer: None }, Meta::default()))
    })
}

pub fn is_udp(id: u32) -> bool {
    with(|net| Ok(matches!(net.socks.get(&id), Some(Sock::Udp { .. })))).unwrap_or(false)
}

fn udp_mut(net: &mut Net, h: SocketHandle) -> &mut udp::Socket<'static> {
    net.stack.sockets_mut().get_mut::<udp::Socket>(h)
}

/// Bind UDP socket `h` to `port` (0: an ephemeral one) on `addr`.
fn udp_bind(net: &mut Net, h: SocketHandle, addr: Ipv4Addr, port: u16) -> Result<(), Errno> {
    let own = net.stack.config().ip.address();
    if !addr.is_unspecified() && addr != own {
        return Err(EADDRNOTAVAIL);
    }
    if udp_mut(net, h).is_open() {
        return Err(EINVAL);
    }
    let port = if port == 0 { udp_free_port(net)? } else { port };
    let in_use = net.socks.values().any(|s| match s {
        Sock::Udp { handle, .. } => {
            let ep = net.stack.sockets().get::<udp::Socket>(*handle).endpoint();
            ep.port == port
        }
        _ => false,
    });
    if in_use {
        return Err(EADDRINUSE);
    }
    let endpoint = smoltcp::wire::IpListenEndpoint { addr: (!addr.is_unspecified()).then_some(IpAddress::Ipv4(addr)), port };
    udp_mut(net, h).bind(endpoint).map_err(|_| EINVAL)
}

fn udp_ensure_bound(net: &mut Net, h: SocketHandle) -> Result<(), Errno> {
    if udp_mut(net, h).is_open() {
        return Ok(());
    }
    udp_bind(net, h, Ipv4Addr::UNSPECIFIED, 0)
}

/// An ephemeral port no UDP socket is bound to.
fn udp_free_port(net: &mut Net) -> Result<u16, Errno> {
    for _ in 0..=(u16::MAX - FIRST_EPHEMERAL_PORT) {
        let port = net.next_port;
        net.next_port = if port == u16::MAX { FIRST_EPHEMERAL_PORT } else { port + 1 };
        let taken = net.socks.values().any(|s| match s {
            Sock::Udp { handle, .. } => net.stack.sockets().get::<udp::Socket>(*handle).endpoint().port == port,
            _ => false,
        });
        if !taken {
            return Ok(port);
        }
    }
    Err(EADDRINUSE)
}

pub fn shutdown(id: u32, how: u64) -> Result<(), Errno> {
    with(|net| {
        let h = conn(net, id)?;
        if how >= 1 {
            tcp_mut(net, h).close();
        }
        Ok(())
    })
}

pub fn set_nodelay(id: u32, on: bool) -> Result<(), Errno> {
    with(|net| {
        match net.socks.get_mut(&id) {
            Some(Sock::New { nodelay, .. }) => *nodelay = on,
            Some(Sock::Conn { handle, .. }) => {
                let h = *handle;
                tcp_mut(net, h).set_nagle_enabled(!on);
            }
            Some(Sock::Listening { .. } | Sock::Udp { .. }) => {}
            None => return Err(EBADF),
        }
        Ok(())
    })
}

/// (local, peer) endpoints; the peer is None for sockets without one.
pub fn endpoints(id: u32) -> Result<(IpEndpoint, Option<IpEndpoint>), Errno> {
    with(|net| {
        let ip = IpAddress::Ipv4(net.stack.config().ip.address());
        match net.socks.get(&id) {
            Some(Sock::New { port, .. }) => Ok((IpEndpoint::new(IpAddress::v4(0, 0, 0, 0), *port), None)),
            Some(Sock::Listening { port, .. }) => Ok((IpEndpoint::new(IpAddress::v4(0, 0, 0, 0), *port), None)),
            Some(Sock::Conn { handle, .. }) => {
                let h = *handle;
                let s = tcp_mut(net, h);
                let local = s.local_endpoint().unwrap_or(IpEndpoint::new(ip, 0));
                Ok((local, s.remote_endpoint()))
            }
            Some(Sock::Udp { handle, peer }) => {
                let ep = net.stack.sockets().get::<udp::Socket>(*handle).endpoint();
                let addr = ep.addr.unwrap_or(IpAddress::v4(0, 0, 0, 0));
                Ok((IpEndpoint::new(addr, ep.port), *peer))
            }
            None => Err(EBADF),
        }
    })
}

/// Socket `id`'s readiness (EPOLL* bits) and the stamps of its last rises.
pub fn readiness(id: u32) -> (u32, Since) {
    let mut g = NET.lock();
    let Some(net) = g.as_mut() else { return (EPOLLERR, Since::default()) };
    net.observe(id)
}

impl Net {
    fn bits(&mut self, id: u32) -> u32 {
        match self.socks.get(&id) {
            None => EPOLLERR,
            Some(Sock::New { .. }) => EPOLLOUT | EPOLLHUP,
            Some(Sock::Listening { port, queue }) => {
                let port = *port;
                if !queue.is_empty() {
                    return EPOLLIN;
                }
                // The stack may hold connections not moved yet.
                let mut moved = VecDeque::new();
                while let Some(h) = self.stack.accept(port) {
                    moved.push_back(h);
                }
                let ready = !moved.is_empty();
                if let Some(Sock::Listening { queue, .. }) = self.socks.get_mut(&id) {
                    queue.extend(moved);
                }
                if ready {
                    EPOLLIN
                } else {
                    0
                }
            }
            Some(Sock::Udp { handle, .. }) => {
                let s = self.stack.sockets().get::<udp::Socket>(*handle);
                let mut r = 0;
                if s.can_recv() {
                    r |= EPOLLIN;
                }
                if s.can_send() {
                    r |= EPOLLOUT;
                }
                r
            }
            Some(Sock::Conn { handle, .. }) => {
                let h = *handle;
                conn_bits(tcp_mut(self, h))
            }
        }
    }
}

/// A connection's readiness.
fn conn_bits(s: &tcp::Socket) -> u32 {
    if matches!(s.state(), State::SynSent | State::SynReceived) {
        return 0;
    }
    let mut r = 0;
    if s.can_recv() {
        r |= EPOLLIN;
    }
    if !s.may_recv() {
        r |= EPOLLIN | EPOLLRDHUP;
    }
    if s.can_send() {
        r |= EPOLLOUT;
    }
    if !s.is_open() {
        r |= EPOLLHUP;
    }
    r
}
