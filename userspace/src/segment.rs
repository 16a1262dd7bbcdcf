//! Splitting what a TUN device with offloads hands us (a TCP or UDP "super-packet" of up
//! to 64 KiB, with its checksum left to fill in) into the packets the wire would carry,
//! following the kernel's segmentation rules:
//! - every segment repeats the IP and transport headers; IPv4 total length and IPv6
//!   payload length describe the segment; the IPv4 ID counts up by one per segment;
//! - TCP: the sequence number advances by the bytes before the segment; FIN and PSH stay
//!   on the last segment only, CWR on the first only;
//! - UDP (USO): every segment is a datagram of its own, with its own length;
//! - every checksum is complete (IPv4 header, TCP/UDP over the pseudo-header).

use super::checksum;
use super::vnet::{self, Header};

const TCP: u8 = 6;
const UDP: u8 = 17;
const TCP_FIN: u8 = 0x01;
const TCP_PSH: u8 = 0x08;
const TCP_CWR: u8 = 0x80;

#[derive(Debug, PartialEq, Eq)]
pub enum SplitError {
    /// The packet is shorter than its headers say, or its headers are not what
    /// `csum_start`/`gso_type` announce.
    Malformed(&'static str),
}

/// Where the IP addresses and the transport header sit in a packet.
struct Layout {
    v6: bool,
    /// Offset of the transport header (`csum_start`).
    l4: usize,
    /// Offset of the payload.
    payload: usize,
    protocol: u8,
}

fn layout(h: &Header, pkt: &[u8]) -> Result<Layout, SplitError> {
    let v6 = match pkt.first().map(|b| b >> 4) {
        Some(4) => false,
        Some(6) => true,
        _ => return Err(SplitError::Malformed("not IPv4 or IPv6")),
    };
    let l4 = usize::from(h.csum_start);
    let min_ip = if v6 {
        40
    } else {
        usize::from(pkt[0] & 0xf) * 4
    };
    if min_ip < 20 || l4 < min_ip || pkt.len() < l4 + 8 {
        return Err(SplitError::Malformed("csum_start outside the packet"));
    }
    let gso = h.gso_type & !vnet::GSO_ECN;
    let protocol = if gso == vnet::GSO_UDP_L4 { UDP } else { TCP };
    let l4_len = if protocol == TCP {
        if pkt.len() < l4 + 20 {
            return Err(SplitError::Malformed("TCP header cut short"));
        }
        // The flags and checksum every segment gets lie in TCP's fixed 20 bytes.
        let offset = usize::from(pkt[l4 + 12] >> 4);
        if offset < 5 {
            return Err(SplitError::Malformed("TCP data offset below 5"));
        }
        offset * 4
    } else {
        8
    };
    if l4_len < 8 || pkt.len() < l4 + l4_len {
        return Err(SplitError::Malformed("transport header cut short"));
    }
    Ok(Layout {
        v6,
        l4,
        payload: l4 + l4_len,
        protocol,
    })
}

/// The source and destination addresses of an IPv4 or IPv6 packet.
pub(super) fn addresses(pkt: &[u8], v6: bool) -> (&[u8], &[u8]) {
    if v6 {
        (&pkt[8..24], &pkt[24..40])
    } else {
        (&pkt[12..16], &pkt[16..20])
    }
}

/// Fills in the transport checksum of the packet in `seg` (laid out as `l`), from scratch.
fn finish_transport(seg: &mut [u8], l: &Layout) {
    let at = l.l4 + if l.protocol == TCP { 16 } else { 6 };
    seg[at] = 0;
    seg[at + 1] = 0;
    let (src, dst) = addresses(seg, l.v6);
    let acc = checksum::pseudo_header(src, dst, l.protocol, seg.len() - l.l4);
    let mut sum = !checksum::fold(checksum::add(acc, &seg[l.l4..]));
    if l.protocol == UDP && sum == 0 {
        sum = 0xffff;
    }
    seg[at..at + 2].copy_from_slice(&sum.to_be_bytes());
}

/// Completes a checksum the device left partial (`F_NEEDS_CSUM` without GSO): the field at
/// `csum_start + csum_offset` holds the pseudo-header's sum; the rest is summed here.
pub fn complete_checksum(h: &Header, pkt: &mut [u8]) -> Result<(), SplitError> {
    let start = usize::from(h.csum_start);
    let at = start + usize::from(h.csum_offset);
    if at + 2 > pkt.len() {
        return Err(SplitError::Malformed("checksum offset outside the packet"));
    }
    let sum = !checksum::fold(checksum::add(0, &pkt[start..]));
    pkt[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    Ok(())
}

/// Calls `each` with every packet `pkt` stands for: the packet itself (its checksum
/// completed if the device left it partial), or the segments of a GSO super-packet.
/// Returns how many packets there were.
///
/// Segments are built in place, not copied out: segment `i`'s headers are written just
/// before its payload, over the end of segment `i - 1`'s payload, which `each` is done
/// with by then. `headers` keeps the super-packet's own headers meanwhile. So `pkt` is
/// scribbled on: what it holds afterwards is not the packet.
pub fn split(
    h: &Header,
    pkt: &mut [u8],
    headers: &mut Vec<u8>,
    mut each: impl FnMut(&[u8]),
) -> Result<usize, SplitError> {
    if h.gso_type == vnet::GSO_NONE {
        if h.flags & vnet::F_NEEDS_CSUM != 0 {
            complete_checksum(h, pkt)?;
        }
        each(pkt);
        return Ok(1);
    }
    let l = layout(h, pkt)?;
    let mss = usize::from(h.gso_size);
    if mss == 0 {
        return Err(SplitError::Malformed("gso_size is 0"));
    }
    let hl = l.payload;
    headers.clear();
    headers.extend_from_slice(&pkt[..hl]);
    let payload_len = pkt.len() - hl;
    let count = payload_len.div_ceil(mss).max(1);
    let seq = (l.protocol == TCP).then(|| read_u32(headers, l.l4 + 4));
    let id = (!l.v6).then(|| read_u16(headers, 4));
    let ip_len = usize::from(headers[0] & 0xf) * 4;
    for i in 0..count {
        // Segment i: its headers end where its payload starts.
        let start = i * mss;
        let end = (hl + (i + 1) * mss).min(pkt.len());
        let seg = &mut pkt[start..end];
        if i > 0 {
            seg[..hl].copy_from_slice(headers);
        }
        let len = seg.len();
        if l.v6 {
            write_u16(seg, 4, (len - 40) as u16);
        } else {
            write_u16(seg, 2, len as u16);
            if let Some(id) = id {
                write_u16(seg, 4, id.wrapping_add(i as u16));
            }
            checksum::ipv4_header(&mut seg[..ip_len]);
        }
        if let Some(seq) = seq {
            write_u32(seg, l.l4 + 4, seq.wrapping_add((i * mss) as u32));
            let flags = &mut seg[l.l4 + 13];
            if i + 1 < count {
                *flags &= !(TCP_FIN | TCP_PSH);
            }
            if i > 0 {
                *flags &= !TCP_CWR;
            }
        } else {
            write_u16(seg, l.l4 + 4, (len - l.l4) as u16);
        }
        finish_transport(seg, &l);
        each(seg);
    }
    Ok(count)
}

pub(super) fn read_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

pub(super) fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(super) fn write_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

fn write_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}
