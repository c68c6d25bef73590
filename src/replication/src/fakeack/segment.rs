//! TCP over IPv4 in the network card's frames (virtio-net header, Ethernet,
//! IPv4, TCP): find the fields the proxy reads, rewrite a segment's
//! acknowledgement and window, make up a pure ACK. The headers are read and
//! written with `smoltcp::wire`. Checksums are always recomputed whole:
//! frames are small, and a header that asked for a partial checksum
//! (`NEEDS_CSUM`) gets a complete one.

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr, IpAddress, IpProtocol, Ipv4Address, Ipv4Packet, Ipv4Repr, TcpControl,
    TcpOption, TcpPacket, TcpRepr, TcpSeqNumber,
};

use ftvm_vmm::devices::virtio::net::VNET_HDR_LEN;

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;

const ETH: usize = 14;
const IP_MIN: usize = 20;
/// The largest window shift TCP allows (RFC 7323).
pub const MAX_SHIFT: u8 = 14;
/// The TTL of a made-up ACK.
const HOP_LIMIT: u8 = 64;

/// One end of a TCP connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    pub ip: [u8; 4],
    pub port: u16,
}

/// A TCP/IPv4 frame's fields and where its headers are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src: Endpoint,
    pub dst: Endpoint,
    pub seq: u32,
    pub ack: u32,
    /// FIN, SYN, RST and ACK (the flags the proxy reads).
    pub flags: u8,
    /// As on the wire (not scaled).
    pub window: u16,
    /// Payload bytes.
    pub len: u32,
    /// The window scale option (in SYN segments).
    pub wscale: Option<u8>,
    /// Where the TCP header starts in the frame, and where the IP datagram
    /// ends (Ethernet padding follows).
    tcp: usize,
    end: usize,
}

impl Segment {
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// Sequence space it occupies: payload, plus one each for SYN and FIN.
    pub fn seq_len(&self) -> u32 {
        self.len + u32::from(self.has(SYN)) + u32::from(self.has(FIN))
    }

    fn addresses(&self) -> (IpAddress, IpAddress) {
        (IpAddress::Ipv4(Ipv4Address::from(self.src.ip)), IpAddress::Ipv4(Ipv4Address::from(self.dst.ip)))
    }
}

/// The TCP segment in `frame` (with its virtio-net header), if it is an
/// unfragmented TCP/IPv4 one whose lengths add up.
pub fn parse(frame: &[u8]) -> Option<Segment> {
    let eth = EthernetFrame::new_checked(frame.get(VNET_HDR_LEN..)?).ok()?;
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return None;
    }
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    // (smoltcp checks the lengths against the buffer, not the header's minimum.)
    if ip.version() != 4
        || usize::from(ip.header_len()) < IP_MIN
        || ip.next_header() != IpProtocol::Tcp
        || ip.more_frags()
        || ip.frag_offset() != 0
    {
        return None;
    }
    let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
    let flags = [(tcp.fin(), FIN), (tcp.syn(), SYN), (tcp.rst(), RST), (tcp.ack(), ACK)]
        .into_iter()
        .filter(|(set, _)| *set)
        .fold(0, |flags, (_, flag)| flags | flag);
    let at = VNET_HDR_LEN + ETH;
    Some(Segment {
        dst_mac: eth.dst_addr().0,
        src_mac: eth.src_addr().0,
        src: Endpoint { ip: ip.src_addr().octets(), port: tcp.src_port() },
        dst: Endpoint { ip: ip.dst_addr().octets(), port: tcp.dst_port() },
        seq: tcp.seq_number().0 as u32,
        ack: tcp.ack_number().0 as u32,
        flags,
        window: tcp.window_len(),
        len: tcp.payload().len() as u32,
        wscale: window_scale(tcp.options()),
        tcp: at + usize::from(ip.header_len()),
        end: at + usize::from(ip.total_len()),
    })
}

/// The window scale option among `options`, clamped to what TCP allows;
/// none if they are malformed.
fn window_scale(mut options: &[u8]) -> Option<u8> {
    while !options.is_empty() {
        let (rest, option) = TcpOption::parse(options).ok()?;
        match option {
            TcpOption::EndOfList => return None,
            TcpOption::WindowScale(shift) => return Some(shift.min(MAX_SHIFT)),
            _ => options = rest,
        }
    }
    None
}

/// Recompute the TCP checksum of `seg` in `frame` (pseudo-header included).
fn tcp_checksum(frame: &mut [u8], seg: &Segment) {
    let (src, dst) = seg.addresses();
    TcpPacket::new_unchecked(&mut frame[seg.tcp..seg.end]).fill_checksum(&src, &dst);
    // The checksum is complete now: clear the header's NEEDS_CSUM.
    frame[0] &= !1;
}

/// Whether the TCP checksum of `frame`'s segment is right.
#[cfg(test)]
pub fn checksum_ok(frame: &[u8]) -> bool {
    parse(frame).is_some_and(|seg| {
        let (src, dst) = seg.addresses();
        TcpPacket::new_unchecked(&frame[seg.tcp..seg.end]).verify_checksum(&src, &dst)
    })
}

/// Whether the IPv4 header checksum of `frame` is right.
#[cfg(test)]
pub fn ip_checksum_ok(frame: &[u8]) -> bool {
    parse(frame).is_some() && Ipv4Packet::new_unchecked(&frame[VNET_HDR_LEN + ETH..]).verify_checksum()
}

/// Give `seg` (parsed from `frame`) acknowledgement `ack` and window
/// `window`, with its checksum fixed.
pub fn set_ack_window(frame: &mut [u8], seg: &Segment, ack: u32, window: u16) {
    let mut tcp = TcpPacket::new_unchecked(&mut frame[seg.tcp..seg.end]);
    tcp.set_ack_number(TcpSeqNumber(ack as i32));
    tcp.set_window_len(window);
    tcp_checksum(frame, seg);
}

/// Give `seg` (parsed from `frame`) sequence number `seq`, with its
/// checksum fixed.
pub fn set_seq(frame: &mut [u8], seg: &Segment, seq: u32) {
    TcpPacket::new_unchecked(&mut frame[seg.tcp..seg.end]).set_seq_number(TcpSeqNumber(seq as i32));
    tcp_checksum(frame, seg);
}

/// A pure ACK from `seg`'s destination to its source (the reverse of a
/// segment the guest sent): sequence number `seq`, acknowledging `ack`,
/// advertising `window` (as on the wire), with a zeroed virtio-net header.
pub fn pure_ack(seg: &Segment, seq: u32, ack: u32, window: u16) -> Vec<u8> {
    let tcp = TcpRepr {
        src_port: seg.dst.port,
        dst_port: seg.src.port,
        control: TcpControl::None,
        seq_number: TcpSeqNumber(seq as i32),
        ack_number: Some(TcpSeqNumber(ack as i32)),
        window_len: window,
        window_scale: None,
        max_seg_size: None,
        sack_permitted: false,
        sack_ranges: [None; 3],
        timestamp: None,
        payload: &[],
    };
    // Don't fragment; identification 0 (allowed with DF, RFC 6864).
    let ip = Ipv4Repr {
        src_addr: Ipv4Address::from(seg.dst.ip),
        dst_addr: Ipv4Address::from(seg.src.ip),
        next_header: IpProtocol::Tcp,
        payload_len: tcp.buffer_len(),
        hop_limit: HOP_LIMIT,
    };
    let eth =
        EthernetRepr { src_addr: EthernetAddress(seg.dst_mac), dst_addr: EthernetAddress(seg.src_mac), ethertype: EthernetProtocol::Ipv4 };
    let mut f = vec![0u8; VNET_HDR_LEN + eth.buffer_len() + ip.buffer_len() + tcp.buffer_len()];
    let checksums = ChecksumCapabilities::default();
    let mut frame = EthernetFrame::new_unchecked(&mut f[VNET_HDR_LEN..]);
    eth.emit(&mut frame);
    let mut packet = Ipv4Packet::new_unchecked(frame.payload_mut());
    ip.emit(&mut packet, &checksums);
    tcp.emit(&mut TcpPacket::new_unchecked(packet.payload_mut()), &IpAddress::Ipv4(ip.src_addr), &IpAddress::Ipv4(ip.dst_addr), &checksums);
    f
}

/// `a` comes before `b` in sequence space (modulo 2^32).
pub fn before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// The later of `a` and `b` in sequence space.
pub fn later(a: u32, b: u32) -> u32 {
    if before(a, b) {
        b
    } else {
        a
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const TCP_MIN: usize = 20;
    /// TCP option kinds.
    const OPT_NOP: u8 = 1;
    const OPT_WSCALE: u8 = 3;

    pub const GUEST: Endpoint = Endpoint { ip: [10, 0, 0, 2], port: 6379 };
    pub const PEER: Endpoint = Endpoint { ip: [10, 0, 0, 1], port: 40000 };
    pub const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
    pub const PEER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

    /// A frame from `from` to `to` (MACs by direction) with `payload` and
    /// `options`, checksums right.
    #[allow(clippy::too_many_arguments)]
    pub fn frame(from: Endpoint, to: Endpoint, seq: u32, ack: u32, flags: u8, window: u16, options: &[u8], payload: &[u8]) -> Vec<u8> {
        assert_eq!(options.len() % 4, 0);
        let (src_mac, dst_mac) = if from == GUEST { (GUEST_MAC, PEER_MAC) } else { (PEER_MAC, GUEST_MAC) };
        let tcp_len = TCP_MIN + options.len() + payload.len();
        let ip = Ipv4Repr {
            src_addr: Ipv4Address::from(from.ip),
            dst_addr: Ipv4Address::from(to.ip),
            next_header: IpProtocol::Tcp,
            payload_len: tcp_len,
            hop_limit: HOP_LIMIT,
        };
        let eth =
            EthernetRepr { src_addr: EthernetAddress(src_mac), dst_addr: EthernetAddress(dst_mac), ethertype: EthernetProtocol::Ipv4 };
        let mut f = vec![0u8; VNET_HDR_LEN + ETH + IP_MIN + tcp_len];
        let mut e = EthernetFrame::new_unchecked(&mut f[VNET_HDR_LEN..]);
        eth.emit(&mut e);
        let mut p = Ipv4Packet::new_unchecked(e.payload_mut());
        ip.emit(&mut p, &ChecksumCapabilities::default());
        let mut t = TcpPacket::new_unchecked(p.payload_mut());
        t.set_src_port(from.port);
        t.set_dst_port(to.port);
        t.set_seq_number(TcpSeqNumber(seq as i32));
        t.set_ack_number(TcpSeqNumber(ack as i32));
        t.set_header_len((TCP_MIN + options.len()) as u8);
        t.clear_flags();
        t.set_fin(flags & FIN != 0);
        t.set_syn(flags & SYN != 0);
        t.set_rst(flags & RST != 0);
        t.set_psh(flags & 0x08 != 0);
        t.set_ack(flags & ACK != 0);
        t.set_window_len(window);
        t.options_mut().copy_from_slice(options);
        t.payload_mut().copy_from_slice(payload);
        t.fill_checksum(&IpAddress::Ipv4(ip.src_addr), &IpAddress::Ipv4(ip.dst_addr));
        f
    }

    #[test]
    fn parses_what_it_builds() {
        let f = frame(PEER, GUEST, 100, 200, SYN, 64240, &[OPT_NOP, OPT_WSCALE, 3, 7, 2, 4, 5, 0xb4], b"");
        let s = parse(&f).unwrap();
        assert_eq!((s.src, s.dst, s.seq, s.ack, s.flags, s.window, s.len, s.wscale), (PEER, GUEST, 100, 200, SYN, 64240, 0, Some(7)));
        assert_eq!((s.src_mac, s.dst_mac), (PEER_MAC, GUEST_MAC));
        assert_eq!(s.seq_len(), 1);
        assert!(checksum_ok(&f) && ip_checksum_ok(&f));
        let d = frame(GUEST, PEER, 5, 6, ACK | FIN, 100, &[], b"hello");
        let s = parse(&d).unwrap();
        assert_eq!((s.len, s.seq_len(), s.wscale), (5, 6, None));
        assert!(checksum_ok(&d));
        // A shift beyond TCP's limit is clamped; malformed options give none.
        let big = frame(PEER, GUEST, 1, 0, SYN, 1, &[OPT_NOP, OPT_WSCALE, 3, 20], b"");
        assert_eq!(parse(&big).unwrap().wscale, Some(MAX_SHIFT));
        let bad = frame(PEER, GUEST, 1, 0, SYN, 1, &[OPT_NOP, 8, 9, OPT_WSCALE], b"");
        assert_eq!(parse(&bad).unwrap().wscale, None);
    }

    #[test]
    fn rejects_what_is_not_plain_tcp_over_ipv4() {
        let f = frame(PEER, GUEST, 1, 2, ACK, 10, &[], b"data");
        assert!(parse(&f[..f.len() - 10]).is_none(), "truncated");
        let mut udp = f.clone();
        udp[VNET_HDR_LEN + ETH + 9] = 17;
        assert!(parse(&udp).is_none());
        let mut arp = f.clone();
        arp[VNET_HDR_LEN + 12] = 0x08;
        arp[VNET_HDR_LEN + 13] = 0x06;
        assert!(parse(&arp).is_none());
        let mut fragment = f.clone();
        fragment[VNET_HDR_LEN + ETH + 6] = 0x20; // more fragments
        assert!(parse(&fragment).is_none());
        let mut short_ip = f.clone();
        short_ip[VNET_HDR_LEN + ETH] = 0x44; // IHL 4: shorter than an IPv4 header
        assert!(parse(&short_ip).is_none());
        let mut bad_offset = f;
        bad_offset[VNET_HDR_LEN + ETH + IP_MIN + 12] = 0xf0;
        assert!(parse(&bad_offset).is_none());
    }

    #[test]
    fn rewriting_keeps_the_checksum_right_and_completes_a_partial_one() {
        for payload in [&b""[..], b"odd", b"even"] {
            let mut f = frame(PEER, GUEST, 7, 0xffff_fff0, ACK, 1000, &[], payload);
            f[0] = 1; // NEEDS_CSUM
            let s = parse(&f).unwrap();
            set_ack_window(&mut f, &s, 0x10, 55);
            let r = parse(&f).unwrap();
            assert_eq!((r.ack, r.window, r.seq, r.len), (0x10, 55, 7, payload.len() as u32));
            assert!(checksum_ok(&f) && ip_checksum_ok(&f));
            assert_eq!(f[0] & 1, 0);
        }
        // Ethernet padding after the datagram takes no part in the checksum.
        let mut padded = frame(PEER, GUEST, 7, 8, ACK, 1000, &[], b"");
        padded.extend_from_slice(&[0xee; 6]);
        let s = parse(&padded).unwrap();
        set_ack_window(&mut padded, &s, 9, 10);
        assert!(checksum_ok(&padded));
        let mut f = frame(GUEST, PEER, 0xffff_fff0, 8, ACK, 1000, &[], b"");
        f[0] = 1;
        let s = parse(&f).unwrap();
        set_seq(&mut f, &s, 0x20);
        assert_eq!(parse(&f).unwrap().seq, 0x20);
        assert!(checksum_ok(&f) && ip_checksum_ok(&f));
        assert_eq!(f[0] & 1, 0);
    }

    #[test]
    fn a_made_up_ack_goes_the_other_way() {
        let sent = parse(&frame(GUEST, PEER, 1000, 77, ACK, 512, &[], &[1; 100])).unwrap();
        let a = pure_ack(&sent, 77, 1100, 300);
        let s = parse(&a).unwrap();
        assert_eq!((s.src, s.dst, s.src_mac, s.dst_mac), (PEER, GUEST, PEER_MAC, GUEST_MAC));
        assert_eq!((s.seq, s.ack, s.flags, s.window, s.len), (77, 1100, ACK, 300, 0));
        assert!(checksum_ok(&a) && ip_checksum_ok(&a));
        assert_eq!(a.len(), VNET_HDR_LEN + ETH + IP_MIN + TCP_MIN);
        assert_eq!(&a[..VNET_HDR_LEN], &[0; VNET_HDR_LEN], "a zeroed virtio-net header");
    }

    #[test]
    fn sequence_numbers_compare_across_the_wrap() {
        assert!(before(0xffff_fff0, 0x10));
        assert!(!before(0x10, 0xffff_fff0));
        assert!(before(1, 2) && !before(2, 2));
        assert_eq!(later(0xffff_ffff, 3), 3);
        assert_eq!(later(5, 3), 5);
    }
}
