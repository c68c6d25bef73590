//! Network namespaces from inside this process, one thread at a time:
//! enter one (`setns` affects only the calling thread), delete a link at
//! once (netlink, no `ip` process to start, so a host dies exactly when
//! asked), and read a TCP socket's send queue. Needs root.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::thread::JoinHandle;

/// Move the calling thread into network namespace `ns` (a name under
/// /var/run/netns, as `ip netns add` creates). Sockets it opens afterwards
/// live there; other threads are not affected.
pub fn enter(ns: &str) -> io::Result<()> {
    let f = File::open(Path::new("/var/run/netns").join(ns))?;
    // SAFETY: setns on a valid namespace fd; CLONE_NEWNET only changes this thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Run `f` on a new thread inside network namespace `ns`.
pub fn spawn_in<T: Send + 'static>(ns: &str, name: &str, f: impl FnOnce() -> T + Send + 'static) -> io::Result<JoinHandle<io::Result<T>>> {
    let ns = ns.to_owned();
    std::thread::Builder::new().name(name.into()).spawn(move || {
        enter(&ns)?;
        Ok(f())
    })
}

/// Run `f` inside `ns` and wait for it.
pub fn run_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    spawn_in(ns, "netns", f)?.join().map_err(|_| io::Error::other("thread panicked"))?
}

fn netlink_socket(protocol: libc::c_int) -> io::Result<OwnedFd> {
    crate::sock::raw_socket(libc::AF_NETLINK, protocol)
}

/// Send one netlink request to the kernel and read its reply into `reply`;
/// returns the reply's length.
fn exchange(sock: &OwnedFd, msg: &[u8], reply: &mut [u8]) -> io::Result<usize> {
    // SAFETY: an all-zero sockaddr_nl is the kernel's address.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as u16;
    crate::sock::send_to(sock, msg, &kernel)?;
    // SAFETY: reply is valid for its length.
    let n = unsafe { libc::recv(sock.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Delete link `ifname` of the calling thread's namespace (both ends, for
/// a veth) with one RTM_DELLINK: the link is gone when this returns.
pub fn del_link(ifname: &str) -> io::Result<()> {
    let name = CString::new(ifname).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a NUL-terminated name. The lookup uses a socket of this thread's namespace.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(io::Error::last_os_error());
    }
    let sock = netlink_socket(libc::NETLINK_ROUTE)?;
    // nlmsghdr (16 bytes) + ifinfomsg (16 bytes).
    let mut msg = [0u8; 32];
    msg[0..4].copy_from_slice(&32u32.to_ne_bytes());
    msg[4..6].copy_from_slice(&libc::RTM_DELLINK.to_ne_bytes());
    msg[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
    msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
    msg[16] = libc::AF_UNSPEC as u8;
    msg[20..24].copy_from_slice(&(index as i32).to_ne_bytes());
    let mut reply = [0u8; 1024];
    let n = exchange(&sock, &msg, &mut reply)?;
    // NLMSG_ERROR carries the errno (0: success) right after the header.
    let kind = u16::from_ne_bytes([reply[4], reply[5]]);
    if n >= 20 && kind == libc::NLMSG_ERROR as u16 {
        let errno = i32::from_ne_bytes(reply[16..20].try_into().expect("4 bytes"));
        if errno != 0 {
            return Err(io::Error::from_raw_os_error(-errno));
        }
        return Ok(());
    }
    Err(io::Error::other("unexpected netlink reply"))
}

/// An established TCP connection of the calling thread's namespace, owned
/// by a live process (an orphaned socket of a dead one is not), whose send
/// queue can be read cheaply and often: `unacked` asks sock_diag about
/// exactly this connection (a hash lookup), where /proc/net/tcp walks the
/// whole table (milliseconds).
pub struct TcpWatch {
    sock: OwnedFd,
    local: SocketAddrV4,
    peer: SocketAddrV4,
}

impl TcpWatch {
    /// Find the connection to `peer`; None if there is none.
    pub fn find(peer: SocketAddrV4) -> io::Result<Option<TcpWatch>> {
        let table = std::fs::read_to_string("/proc/thread-self/net/tcp")?;
        let hex = |a: &SocketAddrV4| format!("{:08X}:{:04X}", u32::from_ne_bytes(a.ip().octets()), a.port());
        let want = hex(&peer);
        let local = table.lines().skip(1).find_map(|line| {
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[2] != want || f[3] != "01" || f[9] == "0" {
                return None;
            }
            let (ip, port) = f[1].split_once(':')?;
            let ip = u32::from_str_radix(ip, 16).ok()?.to_ne_bytes();
            Some(SocketAddrV4::new(ip.into(), u16::from_str_radix(port, 16).ok()?))
        });
        let Some(local) = local else { return Ok(None) };
        Ok(Some(TcpWatch { sock: netlink_socket(libc::NETLINK_SOCK_DIAG)?, local, peer }))
    }

    pub fn local(&self) -> SocketAddrV4 {
        self.local
    }

    /// Bytes written and not yet acknowledged by the peer; None once the
    /// connection is gone.
    pub fn unacked(&self) -> io::Result<Option<u64>> {
        // nlmsghdr (16) + inet_diag_req_v2 (56): family, protocol, ext, pad,
        // states u32, then inet_diag_sockid: sport, dport (big-endian),
        // src[4], dst[4] (network order), if, cookie[2] (no cookie: all ones).
        let mut msg = [0u8; 72];
        msg[0..4].copy_from_slice(&72u32.to_ne_bytes());
        msg[4..6].copy_from_slice(&20u16.to_ne_bytes()); // SOCK_DIAG_BY_FAMILY
        msg[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
        msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
        msg[16] = libc::AF_INET as u8;
        msg[17] = libc::IPPROTO_TCP as u8;
        msg[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
        msg[24..26].copy_from_slice(&self.local.port().to_be_bytes());
        msg[26..28].copy_from_slice(&self.peer.port().to_be_bytes());
        msg[28..32].copy_from_slice(&self.local.ip().octets());
        msg[44..48].copy_from_slice(&self.peer.ip().octets());
        msg[64..72].copy_from_slice(&[0xff; 8]);
        let mut reply = [0u8; 2048];
        let n = exchange(&self.sock, &msg, &mut reply)?;
        let kind = u16::from_ne_bytes([reply[4], reply[5]]);
        if kind == libc::NLMSG_ERROR as u16 {
            // ENOENT: no such connection (any more).
            return Ok(None);
        }
        // inet_diag_msg after the header: family, state, timer, retrans,
        // sockid (48), expires, rqueue, wqueue, uid, inode.
        if n < 16 + 72 || kind != 20 {
            return Err(io::Error::other("unexpected sock_diag reply"));
        }
        let at = 16 + 4 + 48 + 8;
        Ok(Some(u32::from_ne_bytes(reply[at..at + 4].try_into().expect("4 bytes")) as u64))
    }
}
