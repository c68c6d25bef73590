//! TCP/IP for guests: smoltcp over the VMM's virtio-net device, polled.
//!
//! There are no interrupts. A program calls [`Stack::poll`] to move frames
//! and run TCP, works on its sockets, and when nothing progressed calls
//! [`Stack::wait_idle`], which sleeps in WAIT until smoltcp's next timer or
//! a device event (the VMM bumps the event sequence number whenever the
//! device places a used buffer: a received frame, a finished transmit):
//!
//! ```ignore
//! let mut stack = Stack::new(NetConfig::from_cmdline(args.cmdline)?)?;
//! loop {
//!     let progress = stack.poll();
//!     let worked = serve(stack.sockets_mut());
//!     if !progress && !worked {
//!         stack.wait_idle();
//!     }
//! }
//! ```

mod csum;
mod device;
mod event_idx;
mod listen;

use alloc::vec::Vec;
use core::fmt;
use core::net::Ipv4Addr;

use smoltcp::iface::{Config, Interface, PollIngressSingleResult, PollResult, SocketHandle, SocketSet};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, IpEndpoint, Ipv4Cidr};

pub use device::NetStats;
pub use event_idx::set_exact as set_exact_notify;
pub use listen::ListenConfig;

use crate::time;
use crate::virtio::OpenError;
use device::VirtioNet;
use listen::Listener;

/// Egress passes per poll: bounds a poll's work when sockets have a lot
/// queued (each pass sends up to one segment per socket).
const MAX_EGRESS_PASSES: usize = 64;
/// Longest [`Stack::wait_idle`] sleep: a lost wakeup costs at most this.
const MAX_IDLE_NS: u64 = 100 * time::NS_PER_MS;

#[derive(Debug)]
pub enum Error {
    /// A bad or missing network setting.
    Config(&'static str),
    /// No usable network device.
    Open(OpenError),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Error::Config(what) => f.write_str(what),
            Error::Open(e) => write!(f, "network device: {e}"),
        }
    }
}

impl From<OpenError> for Error {
    fn from(e: OpenError) -> Self {
        Error::Open(e)
    }
}

/// The guest's address; there is no DHCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// Address and prefix, e.g. 10.0.0.2/24.
    pub ip: Ipv4Cidr,
    /// Default route, if any (peers outside the prefix are unreachable
    /// without it).
    pub gateway: Option<Ipv4Addr>,
}

impl NetConfig {
    /// From the command line words `ip=A.B.C.D/N` (required) and
    /// `gw=A.B.C.D` (optional); other words are ignored.
    pub fn from_cmdline(cmdline: &str) -> Result<NetConfig, Error> {
        let mut ip = None;
        let mut gateway = None;
        for word in cmdline.split_ascii_whitespace() {
            if let Some(v) = word.strip_prefix("ip=") {
                ip = Some(parse_cidr(v).ok_or(Error::Config("bad ip=, expected A.B.C.D/N"))?);
            } else if let Some(v) = word.strip_prefix("gw=") {
                let gw = v.parse().map_err(|_| Error::Config("bad gw=, expected A.B.C.D"))?;
                gateway = Some(gw);
            }
        }
        let ip = ip.ok_or(Error::Config("missing ip=A.B.C.D/N"))?;
        Ok(NetConfig { ip, gateway })
    }
}

fn parse_cidr(s: &str) -> Option<Ipv4Cidr> {
    let (addr, prefix) = s.split_once('/')?;
    let addr: Ipv4Addr = addr.parse().ok()?;
    let prefix: u8 = prefix.parse().ok()?;
    if prefix > 32 || addr.is_unspecified() || addr.is_broadcast() || addr.is_multicast() {
        return None;
    }
    Some(Ipv4Cidr::new(addr, prefix))
}

/// The ends of a received TCP segment (over IPv4): its sender, and the
/// local port it is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub remote: IpEndpoint,
    pub local_port: u16,
}

impl Flow {
    const ETHERTYPE_IPV4: [u8; 2] = [0x08, 0x00];
    const PROTO_TCP: u8 = 6;

    /// The flow of Ethernet `frame`, if it is a TCP segment over IPv4
    /// (first fragment or whole: ports are only in those).
    pub(crate) fn of(frame: &[u8]) -> Option<Flow> {
        let ip = frame.get(14..)?;
        if frame.get(12..14)? != Self::ETHERTYPE_IPV4 || ip.first()? >> 4 != 4 || *ip.get(9)? != Self::PROTO_TCP {
            return None;
        }
        let fragment_offset = u16::from_be_bytes([*ip.get(6)?, *ip.get(7)?]) & 0x1fff;
        if fragment_offset != 0 {
            return None;
        }
        let src: [u8; 4] = ip.get(12..16)?.try_into().ok()?;
        let src = Ipv4Addr::from(src);
        let tcp = ip.get(usize::from(ip[0] & 0xf) * 4..)?;
        let src_port = u16::from_be_bytes([*tcp.first()?, *tcp.get(1)?]);
        let dst_port = u16::from_be_bytes([*tcp.get(2)?, *tcp.get(3)?]);
        Some(Flow { remote: IpEndpoint::new(IpAddress::Ipv4(src), src_port), local_port: dst_port })
    }
}

/// smoltcp's clock: guest time (monotonic across snapshot/restore).
pub fn now() -> Instant {
    Instant::from_micros((time::now_ns() / 1000) as i64)
}

/// The network stack: the device, the smoltcp interface and the sockets.
pub struct Stack {
    device: VirtioNet,
    iface: Interface,
    sockets: SocketSet<'static>,
    listeners: Vec<Listener>,
    config: NetConfig,
}

impl Stack {
    /// Bring up the first network device with `config`.
    pub fn new(config: NetConfig) -> Result<Stack, Error> {
        let mut device = VirtioNet::open()?;
        let mac = device.mac();
        let mut iface_config = Config::new(HardwareAddress::Ethernet(EthernetAddress(mac)));
        // Seeds TCP initial sequence numbers and ephemeral ports: different
        // per boot and per guest.
        // SAFETY: rdtsc is allowed at CPL3 (ABI); it only reads the TSC.
        let tsc = unsafe { core::arch::x86_64::_rdtsc() };
        let mut seed = time::now_ns() ^ tsc;
        for b in mac {
            seed = seed.rotate_left(8) ^ u64::from(b);
        }
        iface_config.random_seed = seed;
        let mut iface = Interface::new(iface_config, &mut device, now());
        iface.update_ip_addrs(|addrs| {
            // The list is empty and holds at least one address.
            let _ = addrs.push(IpCidr::Ipv4(config.ip));
        });
        if let Some(gw) = config.gateway {
            iface.routes_mut().add_default_ipv4_route(gw).map_err(|_| Error::Config("cannot add the default route"))?;
        }
        announce(&mut device, mac, config.ip.address().octets());
        Ok(Stack { device, iface, sockets: SocketSet::new(Vec::new()), listeners: Vec::new(), config })
    }

    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    pub fn mac(&self) -> EthernetAddress {
        EthernetAddress(self.device.mac())
    }

    pub fn stats(&self) -> NetStats {
        self.device.stats()
    }

    /// Whether the device took checksum offload (the VMM's `--net-offload
    /// csum`): TCP checksums are left to the host both ways.
    pub fn checksum_offload(&self) -> bool {
        self.device.checksum_offload()
    }

    pub fn sockets(&self) -> &SocketSet<'static> {
        &self.sockets
    }

    pub fn sockets_mut(&mut self) -> &mut SocketSet<'static> {
        &mut self.sockets
    }

    pub fn iface_mut(&mut self) -> &mut Interface {
        &mut self.iface
    }

    /// Receive and process every frame the device has, send what the
    /// sockets have queued, and notify the device. Returns whether anything
    /// happened (frames moved or socket state changed).
    pub fn poll(&mut self) -> bool {
        self.poll_each(|_, _| {})
    }

    /// [`Stack::poll`], calling `after` with the sockets after each
    /// received TCP segment smoltcp processed, with its flow: a program can
    /// tell which of its connections became readable in which order, even
    /// when several segments arrived between two polls.
    pub fn poll_each(&mut self, mut after: impl FnMut(&mut SocketSet<'static>, Flow)) -> bool {
        let now = now();
        let before = self.device.stats();
        let mut changed = false;
        // One frame at a time so that listening sockets taken by SYNs are
        // replaced before the next SYN of a burst is processed.
        loop {
            match self.iface.poll_ingress_single(now, &mut self.device, &mut self.sockets) {
                PollIngressSingleResult::None => break,
                PollIngressSingleResult::PacketProcessed => {}
                PollIngressSingleResult::SocketStateChanged => {
                    changed = true;
                    for l in &mut self.listeners {
                        l.maintain(&mut self.sockets);
                    }
                }
            }
            if let Some(flow) = self.device.take_flow() {
                after(&mut self.sockets, flow);
            }
        }
        // smoltcp sends at most one segment per socket per egress pass; more
        // passes fill the TX ring, so one notification covers a whole window.
        for _ in 0..MAX_EGRESS_PASSES {
            let sent = self.device.stats().tx_frames;
            if self.iface.poll_egress(now, &mut self.device, &mut self.sockets) == PollResult::SocketStateChanged {
                changed = true;
            }
            if self.device.stats().tx_frames == sent {
                break;
            }
        }
        for l in &mut self.listeners {
            l.maintain(&mut self.sockets);
        }
        self.listeners.retain(|l| !l.is_gone());
        self.device.notify();
        changed || self.device.stats() != before
    }

    /// Sleep until smoltcp's next timer (at most 100 ms) or a device event.
    /// Call it only after a [`Stack::poll`] (and the program's own work)
    /// found nothing to do.
    pub fn wait_idle(&mut self) {
        self.wait_idle_until(u64::MAX);
    }

    /// Like [`Stack::wait_idle`], but also wake at guest time `deadline_ns`.
    pub fn wait_idle_until(&mut self, deadline_ns: u64) {
        let now_ns = time::now_ns();
        let delay_ns = match self.iface.poll_delay(now(), &self.sockets) {
            Some(d) => d.total_micros().saturating_mul(1000),
            None => u64::MAX,
        };
        let deadline = now_ns.saturating_add(delay_ns.min(MAX_IDLE_NS)).min(deadline_ns);
        if deadline > now_ns {
            time::wait(deadline);
        }
    }

    /// Whether everything the sockets had to send at once has left: smoltcp
    /// has nothing to transmit now (only timers: retransmissions,
    /// keep-alives) and the device has sent every frame queued to it. A
    /// program about to end calls [`Stack::poll`] and [`Stack::wait_idle_until`]
    /// until this holds, so that its last segments (FIN, RST) are not lost
    /// with the VM.
    pub fn flushed(&mut self) -> bool {
        let now_pending = self.iface.poll_delay(now(), &self.sockets) == Some(smoltcp::time::Duration::ZERO);
        !now_pending && self.device.tx_in_flight() == 0
    }

    /// Accept connections on `config.port` from now on; see
    /// [`ListenConfig`] and [`Stack::accept`].
    pub fn listen(&mut self, config: ListenConfig) -> Result<(), Error> {
        if config.port == 0 || config.backlog == 0 || config.max_conns == 0 {
            return Err(Error::Config("listen: port, backlog and max_conns must be non-zero"));
        }
        if let Some(l) = self.listeners.iter_mut().find(|l| l.port() == config.port) {
            if l.is_open() {
                return Err(Error::Config("listen: port already listening"));
            }
            // Closed, with connections still to release: listen again.
            l.reopen(config, &mut self.sockets);
            return Ok(());
        }
        let mut l = Listener::new(config);
        l.maintain(&mut self.sockets);
        self.listeners.push(l);
        Ok(())
    }

    /// A newly connected socket on `port` (a `smoltcp::socket::tcp::Socket`
    /// in `sockets_mut()`), if any. Give it back with [`Stack::release`].
    pub fn accept(&mut self, port: u16) -> Option<SocketHandle> {
        let l = self.listeners.iter_mut().find(|l| l.port() == port)?;
        l.maintain(&mut self.sockets);
        l.accept()
    }

    /// Stop accepting connections on `port`: SYNs are refused with RST from
    /// now on; connections already accepted stay until released. Returns
    /// false if nothing listens there.
    pub fn unlisten(&mut self, port: u16) -> bool {
        match self.listeners.iter_mut().find(|l| l.port() == port && l.is_open()) {
            Some(l) => {
                l.close(&mut self.sockets);
                true
            }
            None => false,
        }
    }

    /// Give back an accepted socket once done with it: closed sockets are
    /// reused for listening; one still connected is aborted (RST). Returns
    /// false for a handle `accept` did not return.
    pub fn release(&mut self, handle: SocketHandle) -> bool {
        self.listeners.iter_mut().any(|l| l.release(&mut self.sockets, handle))
    }
}

/// Broadcast a gratuitous ARP for our address. A server that only ever
/// answers would otherwise stay unknown to the switches until a client's
/// frame reaches it, and frames for its MAC would go wherever it (or a VM
/// with the same MAC, such as a replica) last spoke from.
fn announce(device: &mut VirtioNet, mac: [u8; 6], ip: [u8; 4]) {
    use smoltcp::phy::{Device, TxToken};
    let Some(tx) = device.transmit(now()) else { return };
    tx.consume(42, |f| {
        f[0..6].fill(0xff);
        f[6..12].copy_from_slice(&mac);
        f[12..14].copy_from_slice(&[0x08, 0x06]); // ARP
        f[14..22].copy_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]); // Ethernet/IPv4, request
        f[22..28].copy_from_slice(&mac);
        f[28..32].copy_from_slice(&ip);
        f[32..38].fill(0);
        f[38..42].copy_from_slice(&ip);
    });
    device.notify();
}
