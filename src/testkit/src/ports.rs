//! Loopback ports for a server a test starts (a backup, a replica, etcd).
//!
//! The usual trick, binding port 0 and handing the kernel's choice to the
//! server, races on a busy host: between the probe's close and the server's
//! bind, any outgoing connection (a primary's, a client's) may take the
//! same number as its source port, because both come from the ephemeral
//! range, and the server then fails to start. The ports handed out here lie
//! below that range, where the kernel never picks, and differ within one
//! process (the tests of one binary run side by side).

use std::io;
use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out: above the well-known ports of services a
/// host may run (databases, 8080s and the like sit below it).
const FIRST: u32 = 20_000;

/// How many ports we step over before giving up: a host whose range below
/// the ephemeral one is full is not one tests can run on.
const TRIES: u32 = 512;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The low end of the kernel's ephemeral range (32768 unless configured).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(32_768)
}

/// A port on 127.0.0.1 nothing listens on, outside the ephemeral range when
/// the range leaves room below it (else the kernel's pick, as before).
pub fn free_port() -> io::Result<u16> {
    let end = ephemeral_start();
    if end <= FIRST + TRIES {
        return Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
    }
    let span = end - FIRST;
    // Start where another test binary run at the same time (a developer's
    // second `cargo test`) is unlikely to be.
    let offset = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..TRIES {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (offset + n) % span;
        let port = u16::try_from(port).expect("below the ephemeral range");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(io::Error::new(io::ErrorKind::AddrInUse, format!("no free loopback port in {FIRST}..{end}")))
}

/// Whether a TCP socket of this network namespace listens on `port` (read
/// from /proc, so asking does not knock on the server's door: a backup
/// logs every connection it accepts and refuses).
pub fn listening(port: u16) -> bool {
    let table = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    [table("/proc/net/tcp"), table("/proc/net/tcp6")].iter().flat_map(|t| t.lines().skip(1)).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "sl local_address rem_address st ...": ADDR:PORT in hex, 0A = LISTEN.
        let local_port = fields.get(1).and_then(|a| a.rsplit_once(':')).and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
        local_port == Some(port) && fields.get(3) == Some(&"0A")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_differ_and_lie_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        if ephemeral_start() > FIRST + TRIES {
            assert!(ports.iter().all(|&p| u32::from(p) >= FIRST && u32::from(p) < ephemeral_start()), "{ports:?}");
        }
        // Each is bindable by the server it is for.
        assert!(!listening(ports[0]));
        let server = TcpListener::bind(("127.0.0.1", ports[0])).unwrap();
        assert!(listening(ports[0]));
        drop(server);
        assert!(!listening(ports[0]));
    }
}
