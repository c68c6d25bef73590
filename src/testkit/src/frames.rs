//! Ethernet frames a test makes up and puts straight onto one interface of
//! a namespace (a packet socket: no bridge, no routing), and the parsing
//! needed to recognise the answers in a capture: ICMP echo, IPv4.

use std::io;
use std::net::Ipv4Addr;

const ETHERTYPE_IPV4: u16 = 0x0800;
const ICMP: u8 = 1;
const ECHO_REPLY: u8 = 0;
const ECHO_REQUEST: u8 = 8;

/// `52:54:00:12:34:56` as bytes.
pub fn parse_mac(s: &str) -> io::Result<[u8; 6]> {
    let bytes: Vec<u8> = s.trim().split(':').filter_map(|b| u8::from_str_radix(b, 16).ok()).collect();
    bytes.try_into().map_err(|_| io::Error::other(format!("`{s}` is not a MAC address")))
}

/// The Internet checksum of `data`.
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An ICMP echo request from (`src_mac`, `src`) to (`dst_mac`, `dst`)
/// with identifier `id` and sequence number `seq`.
pub fn echo_request(src_mac: [u8; 6], dst_mac: [u8; 6], src: Ipv4Addr, dst: Ipv4Addr, id: u16, seq: u16) -> Vec<u8> {
    let mut icmp = vec![ECHO_REQUEST, 0, 0, 0];
    icmp.extend_from_slice(&id.to_be_bytes());
    icmp.extend_from_slice(&seq.to_be_bytes());
    icmp.extend_from_slice(b"ftvm test frame");
    let sum = checksum(&icmp);
    icmp[2..4].copy_from_slice(&sum.to_be_bytes());
    let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, ICMP, 0, 0];
    ip[2..4].copy_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let sum = checksum(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = dst_mac.to_vec();
    frame.extend_from_slice(&src_mac);
    frame.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&icmp);
    frame
}

/// The identifier of `frame` if it is an ICMP echo reply (as a capture
/// gives it: Ethernet first).
pub fn echo_reply_id(frame: &[u8]) -> Option<u16> {
    if frame.get(12..14)? != ETHERTYPE_IPV4.to_be_bytes() || *frame.get(23)? != ICMP {
        return None;
    }
    let icmp = 14 + usize::from(frame.get(14)? & 0x0f) * 4;
    (*frame.get(icmp)? == ECHO_REPLY).then(|| u16::from_be_bytes([frame[icmp + 4], frame[icmp + 5]]))
}

/// Transmit `frames` on interface `ifname` of namespace `ns` as they are
/// (a TAP hands them to the program that reads it).
pub fn send_on(ns: &str, ifname: &str, frames: Vec<Vec<u8>>) -> io::Result<()> {
    let ifname = std::ffi::CString::new(ifname).map_err(io::Error::other)?;
    crate::netns::run_in(ns, move || {
        let sock = crate::sock::raw_socket(libc::AF_PACKET, 0)?;
        // SAFETY: a NUL-terminated name.
        let index = unsafe { libc::if_nametoindex(ifname.as_ptr()) };
        if index == 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: all-zero is a valid sockaddr_ll, filled in below.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = index as i32;
        addr.sll_halen = 6;
        for frame in &frames {
            addr.sll_addr[..6].copy_from_slice(&frame[..6]);
            crate::sock::send_to(&sock, frame, &addr)?;
        }
        Ok(())
    })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echo_request_has_valid_checksums_and_a_reply_is_recognised() {
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let mac = parse_mac("52:54:00:12:34:56").unwrap();
        let f = echo_request([2, 0, 0, 0, 0, 1], mac, a, b, 0xf00d, 3);
        assert_eq!(checksum(&f[14..34]), 0, "IPv4 header");
        assert_eq!(checksum(&f[34..]), 0, "ICMP");
        assert_eq!(echo_reply_id(&f), None, "a request is no reply");
        let mut reply = f.clone();
        reply[34] = ECHO_REPLY;
        assert_eq!(echo_reply_id(&reply), Some(0xf00d));
        assert!(parse_mac("52:54:00").is_err());
    }
}
