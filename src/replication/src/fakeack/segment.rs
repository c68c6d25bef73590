//! TCP over IPv4 in the network card's frames (virtio-net header, Ethernet,
//! IPv4, TCP): find the fields the proxy reads, rewrite a segment's
//! acknowledgement and window, make up a pure ACK. Checksums are always
//! recomputed whole: frames are small, and a header that asked for a
//! partial checksum (`NEEDS_CSUM`) gets a complete one.

use ftvm_vmm::devices::virtio::net::VNET_HDR_LEN;

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;

const ETH: usize = 14;
const ETHERTYPE_IPV4: [u8; 2] = [0x08, 0x00];
const PROTO_TCP: u8 = 6;
const IP_MIN: usize = 20;
const TCP_MIN: usize = 20;
/// TCP option kinds.
const OPT_END: u8 = 0;
const OPT_NOP: u8 = 1;
const OPT_WSCALE: u8 = 3;
/// The largest window shift TCP allows (RFC 7323).
pub const MAX_SHIFT: u8 = 14;

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
    pub flags: u8,
    /// As on the wire (not scaled).
    pub window: u16,
    /// Payload bytes.
    pub len: u32,
    /// The window scale option (in SYN segments).
    pub wscale: Option<u8>,
    ip: usize,
    tcp: usize,
    /// End of the IP datagram in the frame (Ethernet padding follows).
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
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The TCP segment in `frame` (with its virtio-net header), if it is an
/// unfragmented TCP/IPv4 one whose lengths add up.
pub fn parse(frame: &[u8]) -> Option<Segment> {
    let ip = VNET_HDR_LEN + ETH;
    if frame.len() < ip + IP_MIN + TCP_MIN || frame[VNET_HDR_LEN + 12..ip] != ETHERTYPE_IPV4 {
        return None;
    }
    let ihl = usize::from(frame[ip] & 0x0f) * 4;
    let total = usize::from(be16(frame, ip + 2));
    let fragment = be16(frame, ip + 6) & 0x3fff;
    if frame[ip] >> 4 != 4
        || ihl < IP_MIN
        || frame[ip + 9] != PROTO_TCP
        || fragment != 0
        || total < ihl + TCP_MIN
        || ip + total > frame.len()
    {
        return None;
    }
    let tcp = ip + ihl;
    let doff = usize::from(frame[tcp + 12] >> 4) * 4;
    if doff < TCP_MIN || ihl + doff > total {
        return None;
    }
    let mac = |at: usize| -> [u8; 6] { frame[at..at + 6].try_into().expect("6 bytes") };
    let ipv4 = |at: usize| -> [u8; 4] { frame[at..at + 4].try_into().expect("4 bytes") };
    Some(Segment {
        dst_mac: mac(VNET_HDR_LEN),
        src_mac: mac(VNET_HDR_LEN + 6),
        src: Endpoint { ip: ipv4(ip + 12), port: be16(frame, tcp) },
        dst: Endpoint { ip: ipv4(ip + 16), port: be16(frame, tcp + 2) },
        seq: be32(frame, tcp + 4),
        ack: be32(frame, tcp + 8),
        flags: frame[tcp + 13],
        window: be16(frame, tcp + 14),
        len: (total - ihl - doff) as u32,
        wscale: window_scale(&frame[tcp + TCP_MIN..tcp + doff]),
        ip,
        tcp,
        end: ip + total,
    })
}

/// The window scale option among `options`, clamped to what TCP allows.
fn window_scale(options: &[u8]) -> Option<u8> {
    let mut i = 0;
    while i < options.len() {
        match options[i] {
            OPT_END => return None,
            OPT_NOP => i += 1,
            kind => {
                let len = usize::from(*options.get(i + 1)?);
                if len < 2 || i + len > options.len() {
                    return None;
                }
                if kind == OPT_WSCALE && len == 3 {
                    return Some(options[i + 2].min(MAX_SHIFT));
                }
                i += len;
            }
        }
    }
    None
}

/// Ones' complement sum of `data` (as big-endian 16-bit words) onto `sum`.
fn sum16(mut sum: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The ones'-complement sum of `seg`'s pseudo-header and TCP segment, as
/// `frame` holds them (checksum field included).
fn tcp_sum(frame: &[u8], seg: &Segment) -> u32 {
    let tcp_len = (seg.end - seg.tcp) as u32;
    let sum = sum16(0, &frame[seg.ip + 12..seg.ip + 20]) + u32::from(PROTO_TCP) + tcp_len;
    sum16(sum, &frame[seg.tcp..seg.end])
}

/// Recompute the TCP checksum of `seg` in `frame` (pseudo-header included).
fn tcp_checksum(frame: &mut [u8], seg: &Segment) {
    frame[seg.tcp + 16..seg.tcp + 18].fill(0);
    let sum = fold(tcp_sum(frame, seg));
    frame[seg.tcp + 16..seg.tcp + 18].copy_from_slice(&sum.to_be_bytes());
    // The checksum is complete now: clear the header's NEEDS_CSUM.
    frame[0] &= !1;
}

/// Whether the TCP checksum of `frame`'s segment is right.
#[cfg(test)]
pub fn checksum_ok(frame: &[u8]) -> bool {
    parse(frame).is_some_and(|seg| fold(tcp_sum(frame, &seg)) == 0)
}

/// Whether the IPv4 header checksum of `frame` is right.
#[cfg(test)]
pub fn ip_checksum_ok(frame: &[u8]) -> bool {
    let Some(seg) = parse(frame) else { return false };
    fold(sum16(0, &frame[seg.ip..seg.tcp])) == 0
}

/// Give `seg` (parsed from `frame`) acknowledgement `ack` and window
/// `window`, with its checksum fixed.
pub fn set_ack_window(frame: &mut [u8], seg: &Segment, ack: u32, window: u16) {
    frame[seg.tcp + 8..seg.tcp + 12].copy_from_slice(&ack.to_be_bytes());
    frame[seg.tcp + 14..seg.tcp + 16].copy_from_slice(&window.to_be_bytes());
    tcp_checksum(frame, seg);
}

/// A pure ACK from `seg`'s destination to its source (the reverse of a
/// segment the guest sent): sequence number `seq`, acknowledging `ack`,
/// advertising `window` (as on the wire), with a zeroed virtio-net header.
pub fn pure_ack(seg: &Segment, seq: u32, ack: u32, window: u16) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN + ETH + IP_MIN + TCP_MIN];
    let e = VNET_HDR_LEN;
    f[e..e + 6].copy_from_slice(&seg.src_mac);
    f[e + 6..e + 12].copy_from_slice(&seg.dst_mac);
    f[e + 12..e + 14].copy_from_slice(&ETHERTYPE_IPV4);
    let ip = e + ETH;
    f[ip] = 0x45;
    f[ip + 2..ip + 4].copy_from_slice(&((IP_MIN + TCP_MIN) as u16).to_be_bytes());
    // Don't fragment; identification 0 (allowed with DF, RFC 6864).
    f[ip + 6] = 0x40;
    f[ip + 8] = 64;
    f[ip + 9] = PROTO_TCP;
    f[ip + 12..ip + 16].copy_from_slice(&seg.dst.ip);
    f[ip + 16..ip + 20].copy_from_slice(&seg.src.ip);
    let ip_sum = fold(sum16(0, &f[ip..ip + IP_MIN]));
    f[ip + 10..ip + 12].copy_from_slice(&ip_sum.to_be_bytes());
    let tcp = ip + IP_MIN;
    f[tcp..tcp + 2].copy_from_slice(&seg.dst.port.to_be_bytes());
    f[tcp + 2..tcp + 4].copy_from_slice(&seg.src.port.to_be_bytes());
    f[tcp + 4..tcp + 8].copy_from_slice(&seq.to_be_bytes());
    f[tcp + 8..tcp + 12].copy_from_slice(&ack.to_be_bytes());
    f[tcp + 12] = ((TCP_MIN / 4) as u8) << 4;
    f[tcp + 13] = ACK;
    f[tcp + 14..tcp + 16].copy_from_slice(&window.to_be_bytes());
    let made = parse(&f).expect("a well-formed segment");
    tcp_checksum(&mut f, &made);
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
        let seg = Segment {
            src_mac: dst_mac,
            dst_mac: src_mac,
            src: to,
            dst: from,
            seq: 0,
            ack: 0,
            flags: 0,
            window: 0,
            len: 0,
            wscale: None,
            ip: 0,
            tcp: 0,
            end: 0,
        };
        // A pure ACK in the right direction, then grown.
        let mut f = pure_ack(&seg, seq, ack, window);
        let tcp = VNET_HDR_LEN + ETH + IP_MIN;
        f[tcp + 12] = (((TCP_MIN + options.len()) / 4) as u8) << 4;
        f[tcp + 13] = flags;
        f.extend_from_slice(options);
        f.extend_from_slice(payload);
        let ip = VNET_HDR_LEN + ETH;
        let total = (f.len() - ip) as u16;
        f[ip + 2..ip + 4].copy_from_slice(&total.to_be_bytes());
        f[ip + 10..ip + 12].fill(0);
        let ip_sum = fold(sum16(0, &f[ip..ip + IP_MIN]));
        f[ip + 10..ip + 12].copy_from_slice(&ip_sum.to_be_bytes());
        let s = parse(&f).expect("valid");
        tcp_checksum(&mut f, &s);
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
    }

    #[test]
    fn a_made_up_ack_goes_the_other_way() {
        let sent = parse(&frame(GUEST, PEER, 1000, 77, ACK, 512, &[], &[1; 100])).unwrap();
        let a = pure_ack(&sent, 77, 1100, 300);
        let s = parse(&a).unwrap();
        assert_eq!((s.src, s.dst, s.src_mac, s.dst_mac), (PEER, GUEST, PEER_MAC, GUEST_MAC));
        assert_eq!((s.seq, s.ack, s.flags, s.window, s.len), (77, 1100, ACK, 300, 0));
        assert!(checksum_ok(&a) && ip_checksum_ok(&a));
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
