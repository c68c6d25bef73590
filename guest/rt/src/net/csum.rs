//! Checksum offload (VIRTIO_NET_F_CSUM and GUEST_CSUM), the driver's part.
//!
//! Sending, smoltcp leaves TCP checksums to the device: the frame's TCP
//! checksum field gets only the pseudo-header's sum and the virtio-net
//! header says where the rest starts (NEEDS_CSUM), so the host's stack
//! completes it, or skips it altogether when the frame stays on this host
//! (a veth peer trusts a partial checksum). Receiving, smoltcp checks no
//! TCP or UDP checksum: frames the host marked (partial, or checked) are
//! taken as they are, and the others are checked here first, so a frame
//! damaged on a real wire is still dropped.

use smoltcp::wire::{EthernetFrame, EthernetProtocol, IpAddress, IpProtocol, Ipv4Packet, TcpPacket, UdpPacket};

use ftvm_abi::virtio::net::{HDR_F_DATA_VALID, HDR_F_NEEDS_CSUM, HDR_LEN};

const ETH_LEN: usize = 14;
/// Where the checksum sits in a TCP header.
const TCP_CSUM_OFFSET: u16 = 16;

/// Header bytes: flags, then (little-endian u16s) gso_type+flags share the
/// first two bytes, hdr_len, gso_size, csum_start, csum_offset.
const CSUM_START: usize = 6;
const CSUM_OFFSET: usize = 8;

/// The ones' complement sum of `bytes` as big-endian 16-bit words, folded.
fn sum16(mut acc: u32, bytes: &[u8]) -> u32 {
    let mut words = bytes.chunks_exact(2);
    for w in &mut words {
        acc += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The IPv4 header's length and the L4 protocol, if `frame` (no virtio-net
/// header) is an unfragmented IPv4 packet whose lengths fit the frame.
fn ipv4(frame: &[u8]) -> Option<(usize, u8, usize)> {
    if frame.len() < ETH_LEN + 20 || frame[12..14] != [0x08, 0x00] {
        return None;
    }
    let ip = &frame[ETH_LEN..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let fragment = u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0;
    if ip[0] >> 4 != 4 || ihl < 20 || total < ihl || total > ip.len() || fragment {
        return None;
    }
    Some((ihl, ip[9], total))
}

/// Make the TCP segment in `buf` (virtio-net header, then the frame
/// smoltcp built with its TCP checksum left zero) a partial-checksum frame
/// for the device. Other frames keep an all-zero header: smoltcp
/// completed their checksums.
pub(crate) fn offload_tx(buf: &mut [u8]) {
    buf[..HDR_LEN].fill(0);
    let frame = &buf[HDR_LEN..];
    let Some((ihl, proto, total)) = ipv4(frame) else { return };
    if proto != 6 || total < ihl + 20 {
        return;
    }
    let ip = ETH_LEN;
    let l4_len = (total - ihl) as u32;
    // Pseudo-header: source, destination, protocol, TCP length.
    let acc = sum16(u32::from(proto) + l4_len, &frame[ip + 12..ip + 20]);
    let at = HDR_LEN + ip + ihl + usize::from(TCP_CSUM_OFFSET);
    buf[at..at + 2].copy_from_slice(&fold(acc).to_be_bytes());
    buf[0] = HDR_F_NEEDS_CSUM;
    buf[CSUM_START..CSUM_START + 2].copy_from_slice(&((ip + ihl) as u16).to_le_bytes());
    buf[CSUM_OFFSET..CSUM_OFFSET + 2].copy_from_slice(&TCP_CSUM_OFFSET.to_le_bytes());
}

/// Whether a received frame (header `flags`, then `frame`) may go to
/// smoltcp, which checks no TCP or UDP checksum under offload: yes when
/// the host marked it (partial or already checked), otherwise only when its
/// TCP or UDP checksum is right.
pub(crate) fn rx_ok(flags: u8, frame: &[u8]) -> bool {
    if flags & (HDR_F_NEEDS_CSUM | HDR_F_DATA_VALID) != 0 {
        return true;
    }
    let Ok(eth) = EthernetFrame::new_checked(frame) else { return true };
    if eth.ethertype() != EthernetProtocol::Ipv4 || ipv4(frame).is_none() {
        return true; // smoltcp checks or drops what is not whole TCP/UDP over IPv4
    }
    let Ok(ip) = Ipv4Packet::new_checked(eth.payload()) else { return true };
    let (src, dst) = (IpAddress::Ipv4(ip.src_addr()), IpAddress::Ipv4(ip.dst_addr()));
    match ip.next_header() {
        IpProtocol::Tcp => TcpPacket::new_checked(ip.payload()).is_ok_and(|t| t.verify_checksum(&src, &dst)),
        IpProtocol::Udp => UdpPacket::new_checked(ip.payload()).is_ok_and(|u| u.verify_checksum(&src, &dst)),
        _ => true,
    }
}
