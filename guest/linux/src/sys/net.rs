//! Sockets: IPv4 TCP and UDP over the runtime's stack (see `crate::net`).

use alloc::vec::Vec;
use core::net::Ipv4Addr;

use smoltcp::wire::{IpAddress, IpEndpoint};

use super::{blocking, user, SysResult};
use crate::errno::*;
use crate::fd::{self, Desc, Object, O_NONBLOCK, O_RDWR};
use crate::net;

const AF_INET: u64 = 2;
const SOCK_STREAM: u64 = 1;
const SOCK_DGRAM: u64 = 2;
const SOCK_TYPE_MASK: u64 = 0xf;
const SOCK_NONBLOCK: u64 = 0o4000;
const SOCK_CLOEXEC: u64 = 0o2000000;
const MSG_DONTWAIT: u64 = 0x40;
const SOL_SOCKET: u64 = 1;
const SO_REUSEADDR: u64 = 2;
const SO_TYPE: u64 = 3;
const SO_ERROR: u64 = 4;
const SO_SNDBUF: u64 = 7;
const SO_RCVBUF: u64 = 8;
const SO_LINGER: u64 = 13;
const IPPROTO_TCP: u64 = 6;
const TCP_NODELAY: u64 = 1;

fn sock(fd: u64) -> Result<(alloc::sync::Arc<Desc>, u32), Errno> {
    let d = fd::get(fd)?;
    match d.obj {
        Object::Socket(id) => Ok((d.clone(), id)),
        _ => Err(ENOTSOCK),
    }
}

fn read_sockaddr(addr: u64, len: u64) -> Result<(Ipv4Addr, u16), Errno> {
    if len < 16 {
        return Err(EINVAL);
    }
    let b = user::bytes(addr, 16)?;
    if u16::from_le_bytes([b[0], b[1]]) as u64 != AF_INET {
        return Err(EAFNOSUPPORT);
    }
    Ok((Ipv4Addr::new(b[4], b[5], b[6], b[7]), u16::from_be_bytes([b[2], b[3]])))
}

fn write_sockaddr(addr: u64, lenp: u64, ep: IpEndpoint) -> Result<(), Errno> {
    if addr == 0 {
        return Ok(());
    }
    let len: u32 = user::read(lenp)?;
    let mut b = [0u8; 16];
    b[0..2].copy_from_slice(&(AF_INET as u16).to_le_bytes());
    b[2..4].copy_from_slice(&ep.port.to_be_bytes());
    let IpAddress::Ipv4(ip) = ep.addr;
    b[4..8].copy_from_slice(&ip.octets());
    let n = (len as usize).min(16);
    user::bytes_mut(addr, n as u64)?.copy_from_slice(&b[..n]);
    user::write(lenp, 16u32)
}

pub fn socket(domain: u64, kind: u64, _proto: u64) -> SysResult {
    if domain != AF_INET {
        return Err(EAFNOSUPPORT);
    }
    let id = match kind & SOCK_TYPE_MASK {
        SOCK_STREAM => net::socket()?,
        SOCK_DGRAM => net::udp_socket()?,
        _ => return Err(EPROTONOSUPPORT),
    };
    let mut flags = O_RDWR;
    if kind & SOCK_NONBLOCK != 0 {
        flags |= O_NONBLOCK;
    }
    if kind & SOCK_CLOEXEC != 0 {
        flags |= fd::O_CLOEXEC;
    }
    fd::install(Desc::new(Object::Socket(id), flags), flags)
}

pub fn bind(fd: u64, addr: u64, len: u64) -> SysResult {
    let (_, id) = sock(fd)?;
    let (ip, port) = read_sockaddr(addr, len)?;
    net::bind(id, ip, port).map(|_| 0)
}

pub fn listen(fd: u64, backlog: u64) -> SysResult {
    let (_, id) = sock(fd)?;
    net::listen(id, backlog as i32).map(|_| 0)
}

pub fn accept(fd: u64, addr: u64, lenp: u64, flags: u64) -> SysResult {
    let (d, id) = sock(fd)?;
    let (nid, peer) = blocking(d.nonblocking(), u64::MAX, || net::accept(id))?;
    let mut nflags = O_RDWR;
    if flags & SOCK_NONBLOCK != 0 {
        nflags |= O_NONBLOCK;
    }
    if flags & SOCK_CLOEXEC != 0 {
        nflags |= fd::O_CLOEXEC;
    }
    let nfd = fd::install(Desc::new(Object::Socket(nid), nflags), nflags)?;
    write_sockaddr(addr, lenp, peer)?;
    Ok(nfd)
}

pub fn connect(fd: u64, addr: u64, len: u64) -> SysResult {
    let (d, id) = sock(fd)?;
    let (ip, port) = read_sockaddr(addr, len)?;
    net::connect(id, ip, port)?;
    if net::is_udp(id) {
        return Ok(0); // a destination, no handshake
    }
    if d.nonblocking() {
        return Err(EINPROGRESS);
    }
    blocking(false, u64::MAX, || match net::connect_state(id)? {
        true => Ok(0),
        false => Err(EAGAIN),
    })
}

/// `addr` is used by UDP sockets (TCP ignores it, as Linux does once
/// connected).
pub fn sendto(fd: u64, buf: u64, len: u64, flags: u64, addr: u64, addr_len: u64) -> SysResult {
    let (d, id) = sock(fd)?;
    let data = user::bytes(buf, len)?;
    let to = if addr != 0 && net::is_udp(id) {
        let (ip, port) = read_sockaddr(addr, addr_len)?;
        Some(IpEndpoint::new(IpAddress::Ipv4(ip), port))
    } else {
        None
    };
    blocking(d.nonblocking() || flags & MSG_DONTWAIT != 0, u64::MAX, || net::send_to(id, data, to)).map(|n| n as u64)
}

pub fn recvfrom(fd: u64, buf: u64, len: u64, flags: u64, addr: u64, lenp: u64) -> SysResult {
    let (d, id) = sock(fd)?;
    let out = user::bytes_mut(buf, len)?;
    let (n, source) = blocking(d.nonblocking() || flags & MSG_DONTWAIT != 0, u64::MAX, || net::recv_from(id, out))?;
    if addr != 0 {
        // A datagram's source, or a connection's peer.
        let from = match source {
            Some(s) => Some(s),
            None => net::endpoints(id)?.1,
        };
        if let Some(from) = from {
            write_sockaddr(addr, lenp, from)?;
        }
    }
    Ok(n as u64)
}

/// Most bytes one sendmsg/recvmsg moves (its iovecs are gathered into, or
/// scattered from, one buffer): a stream call may move less, as on Linux.
const MAX_MSG: u64 = 1 << 20;

/// What sendmsg/recvmsg use of a `struct msghdr`; control data is neither
/// sent nor received.
struct MsgHdr {
    name: u64,
    namelen: u64,
    /// (base, len) pairs.
    iovs: Vec<(u64, u64)>,
}

fn read_msghdr(msg: u64) -> Result<MsgHdr, Errno> {
    let name: u64 = user::read(msg)?;
    let namelen: u32 = user::read(msg + 8)?;
    let iov: u64 = user::read(msg + 16)?;
    let iovlen: u64 = user::read(msg + 24)?;
    Ok(MsgHdr { name, namelen: u64::from(namelen), iovs: user::iovecs(iov, iovlen)? })
}

pub fn sendmsg(fd: u64, msg: u64, flags: u64) -> SysResult {
    let MsgHdr { name, namelen, iovs } = read_msghdr(msg)?;
    let mut data = Vec::new();
    for (base, len) in iovs {
        let room = MAX_MSG - data.len() as u64;
        data.extend_from_slice(user::bytes(base, len.min(room))?);
    }
    let (d, id) = sock(fd)?;
    let to = if name != 0 && net::is_udp(id) {
        let (ip, port) = read_sockaddr(name, namelen)?;
        Some(IpEndpoint::new(IpAddress::Ipv4(ip), port))
    } else {
        None
    };
    blocking(d.nonblocking() || flags & MSG_DONTWAIT != 0, u64::MAX, || net::send_to(id, &data, to)).map(|n| n as u64)
}

pub fn recvmsg(fd: u64, msg: u64, flags: u64) -> SysResult {
    let MsgHdr { name, iovs, .. } = read_msghdr(msg)?;
    let want = iovs.iter().map(|&(_, len)| len).sum::<u64>().min(MAX_MSG);
    let mut buf = alloc::vec![0u8; want as usize];
    let (d, id) = sock(fd)?;
    let (n, source) = blocking(d.nonblocking() || flags & MSG_DONTWAIT != 0, u64::MAX, || net::recv_from(id, &mut buf))?;
    let mut done = 0;
    for (base, len) in iovs {
        if done == n {
            break;
        }
        let k = (len as usize).min(n - done);
        user::bytes_mut(base, k as u64)?.copy_from_slice(&buf[done..done + k]);
        done += k;
    }
    if name != 0 {
        let from = match source {
            Some(s) => Some(s),
            None => net::endpoints(id)?.1,
        };
        if let Some(from) = from {
            write_sockaddr(name, msg + 8, from)?;
        }
    }
    // No control data, no flags (a cut datagram is not flagged MSG_TRUNC).
    user::write(msg + 40, 0u64)?;
    user::write(msg + 48, 0u32)?;
    Ok(n as u64)
}

pub fn shutdown(fd: u64, how: u64) -> SysResult {
    let (_, id) = sock(fd)?;
    net::shutdown(id, how).map(|_| 0)
}

pub fn getsockname(fd: u64, addr: u64, lenp: u64, peer: bool) -> SysResult {
    let (_, id) = sock(fd)?;
    let (local, remote) = net::endpoints(id)?;
    let ep = if peer { remote.ok_or(ENOTCONN)? } else { local };
    write_sockaddr(addr, lenp, ep)?;
    Ok(0)
}

pub fn setsockopt(fd: u64, level: u64, opt: u64, val: u64, len: u64) -> SysResult {
    let (_, id) = sock(fd)?;
    if level == IPPROTO_TCP && opt == TCP_NODELAY {
        if len < 4 {
            return Err(EINVAL);
        }
        let on: i32 = user::read(val)?;
        net::set_nodelay(id, on != 0)?;
    }
    if level == SOL_SOCKET && opt == SO_LINGER {
        // struct linger { int l_onoff; int l_linger; } (seconds); a
        // negative timeout is a very long one, as on Linux.
        if len < 8 {
            return Err(EINVAL);
        }
        let [onoff, secs]: [i32; 2] = user::read(val)?;
        net::set_linger(id, (onoff != 0).then_some(secs as u32))?;
    }
    // Buffer sizes, keepalive, reuse and the like: accepted, and the
    // stack's defaults stay.
    Ok(0)
}

pub fn getsockopt(fd: u64, level: u64, opt: u64, val: u64, lenp: u64) -> SysResult {
    let (_, id) = sock(fd)?;
    if (level, opt) == (SOL_SOCKET, SO_LINGER) {
        let len: u32 = user::read(lenp)?;
        let linger = net::linger(id)?;
        let value = [i32::from(linger.is_some()), linger.unwrap_or(0) as i32];
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&value[0].to_le_bytes());
        bytes[4..].copy_from_slice(&value[1].to_le_bytes());
        let n = (len as usize).min(8);
        user::bytes_mut(val, n as u64)?.copy_from_slice(&bytes[..n]);
        user::write(lenp, n as u32)?;
        return Ok(0);
    }
    let v: i32 = match (level, opt) {
        (SOL_SOCKET, SO_ERROR) => match net::connect_state(id) {
            Err(ECONNREFUSED) => ECONNREFUSED as i32,
            _ => 0,
        },
        (SOL_SOCKET, SO_TYPE) if net::is_udp(id) => SOCK_DGRAM as i32,
        (SOL_SOCKET, SO_TYPE) => SOCK_STREAM as i32,
        (SOL_SOCKET, SO_SNDBUF | SO_RCVBUF) => 64 * 1024,
        (SOL_SOCKET, SO_REUSEADDR) => 1,
        (IPPROTO_TCP, TCP_NODELAY) => 1,
        _ => 0,
    };
    user::write(val, v)?;
    user::write(lenp, 4u32)?;
    Ok(0)
}
