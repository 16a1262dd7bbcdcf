//! Property tests of segmentation (`segment::split`) and coalescing (`Coalescer`) against
//! the kernel's rules, over random IPv4/IPv6, TCP/UDP super-packets: lengths, IPv4 IDs,
//! sequence numbers, flags only where they belong, complete checksums, ≤ 64 KiB, one flow
//! per coalesced packet, and split(coalesce(segments)) giving back the segments.

use super::checksum;
use super::coalesce::Coalescer;
use super::segment::{read_u16, read_u32, split, SplitError};
use super::vnet::{self, Header};
use crate::test_rng::Rng;

const TCP: u8 = 6;
const UDP: u8 = 17;
const FIN: u8 = 0x01;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;
const CWR: u8 = 0x80;

struct Case {
    v6: bool,
    protocol: u8,
    mss: usize,
    flags: u8,
    options: usize,
}

/// A super-packet as a TUN device with offloads hands it over; returns it and its header.
fn super_packet(rng: &mut Rng, c: &Case, payload: &[u8], flow: u8) -> (Header, Vec<u8>) {
    let ip_len = if c.v6 { 40 } else { 20 };
    let l4_len = if c.protocol == TCP { 20 + c.options } else { 8 };
    let mut p = vec![0u8; ip_len + l4_len];
    if c.v6 {
        p[0] = 0x60;
        p[6] = c.protocol;
        p[7] = 64;
        p[8..24].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, flow]);
        p[24..40].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x99]);
    } else {
        p[0] = 0x45;
        p[4..6].copy_from_slice(&(rng.next() as u16).to_be_bytes());
        p[6] = 0x40; // DF
        p[8] = 64;
        p[9] = c.protocol;
        p[12..16].copy_from_slice(&[10, 244, 1, flow]);
        p[16..20].copy_from_slice(&[10, 244, 2, 9]);
    }
    let l4 = ip_len;
    p[l4..l4 + 2].copy_from_slice(&(40000 + u16::from(flow)).to_be_bytes());
    p[l4 + 2..l4 + 4].copy_from_slice(&5201u16.to_be_bytes());
    if c.protocol == TCP {
        p[l4 + 4..l4 + 8].copy_from_slice(&(rng.next() as u32).to_be_bytes());
        p[l4 + 8..l4 + 12].copy_from_slice(&(rng.next() as u32).to_be_bytes());
        p[l4 + 12] = ((l4_len / 4) as u8) << 4;
        p[l4 + 13] = c.flags;
        p[l4 + 14..l4 + 16].copy_from_slice(&502u16.to_be_bytes());
        for (i, b) in p[l4 + 20..l4 + l4_len].iter_mut().enumerate() {
            *b = if i < 2 { 1 } else { (i * 7) as u8 }; // NOPs, then opaque bytes
        }
    }
    p.extend_from_slice(payload);
    let len = p.len();
    if c.v6 {
        p[4..6].copy_from_slice(&((len - 40) as u16).to_be_bytes());
    } else {
        p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        checksum::ipv4_header(&mut p[..20]);
    }
    let gso_type = match (c.protocol, c.v6) {
        (UDP, _) => vnet::GSO_UDP_L4,
        (_, false) => vnet::GSO_TCPV4,
        (_, true) => vnet::GSO_TCPV6,
    };
    let h = Header {
        flags: vnet::F_NEEDS_CSUM,
        gso_type,
        hdr_len: (ip_len + l4_len) as u16,
        gso_size: c.mss as u16,
        csum_start: ip_len as u16,
        csum_offset: if c.protocol == TCP { 16 } else { 6 },
    };
    (h, p)
}

fn addresses(p: &[u8]) -> (&[u8], &[u8]) {
    if p[0] >> 4 == 6 {
        (&p[8..24], &p[24..40])
    } else {
        (&p[12..16], &p[16..20])
    }
}

fn random_case(rng: &mut Rng) -> Case {
    let protocol = if rng.below(3) == 0 { UDP } else { TCP };
    let mut flags = ACK;
    for f in [FIN, PSH, CWR] {
        if rng.below(4) == 0 {
            flags |= f;
        }
    }
    Case {
        v6: rng.below(2) == 0,
        protocol,
        mss: 500 + rng.below(1000) as usize,
        flags,
        options: if rng.below(2) == 0 { 0 } else { 12 },
    }
}

/// Checks every rule on the segments of one super-packet; returns them.
fn check_split(c: &Case, h: &Header, original: &[u8]) -> Vec<Vec<u8>> {
    let mut pkt = original.to_vec();
    let mut segs = Vec::new();
    let mut scratch = Vec::new();
    split(h, &mut pkt, &mut scratch, |s| segs.push(s.to_vec())).expect("splits");
    let l4 = usize::from(h.csum_start);
    let hdr = l4 + if c.protocol == TCP { 20 + c.options } else { 8 };
    let payload = &original[hdr..];
    assert_eq!(segs.len(), payload.len().div_ceil(c.mss));
    let mut joined = Vec::new();
    for (i, s) in segs.iter().enumerate() {
        let last = i + 1 == segs.len();
        let chunk = &s[hdr..];
        assert!(
            chunk.len() == c.mss || (last && chunk.len() <= c.mss),
            "segment length"
        );
        joined.extend_from_slice(chunk);
        if c.v6 {
            assert_eq!(usize::from(read_u16(s, 4)), s.len() - 40);
        } else {
            assert_eq!(usize::from(read_u16(s, 2)), s.len());
            let id = read_u16(original, 4).wrapping_add(i as u16);
            assert_eq!(read_u16(s, 4), id, "IPv4 ID counts up");
            assert_eq!(checksum::fold(checksum::add(0, &s[..20])), 0xffff);
        }
        let (src, dst) = addresses(s);
        assert!(checksum::transport_valid(src, dst, c.protocol, &s[l4..]));
        if c.protocol == TCP {
            let seq = read_u32(original, l4 + 4).wrapping_add((i * c.mss) as u32);
            assert_eq!(read_u32(s, l4 + 4), seq, "sequence numbers");
            let flags = s[l4 + 13];
            assert_eq!(flags & (FIN | PSH) != 0, last && c.flags & (FIN | PSH) != 0);
            assert_eq!(flags & CWR != 0, i == 0 && c.flags & CWR != 0);
        } else {
            assert_eq!(usize::from(read_u16(s, l4 + 4)), s.len() - l4);
        }
    }
    assert_eq!(joined, payload, "the payload, in order");
    segs
}

fn coalesce(packets: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut c = Coalescer::default();
    let mut out = Vec::new();
    let mut write = |p: &[u8]| out.push(p.to_vec());
    for p in packets {
        c.push(p, &mut write);
    }
    c.flush(&mut write);
    out
}

/// Splits coalescer output back into wire packets.
fn resplit(written: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut back = Vec::new();
    let mut scratch = Vec::new();
    for w in written {
        assert!(w.len() <= vnet::LEN + 65535, "within 64 KiB");
        let h = Header::decode(w).expect("a vnet header");
        let mut pkt = w[vnet::LEN..].to_vec();
        split(&h, &mut pkt, &mut scratch, |s| back.push(s.to_vec())).expect("resplits");
    }
    back
}

#[test]
fn split_follows_the_kernel_rules_and_coalescing_undoes_it() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for _ in 0..300 {
        let c = random_case(&mut rng);
        let len = 1 + rng.below(64_000 - 120) as usize;
        let payload: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let (h, p) = super_packet(&mut rng, &c, &payload, 1);
        let segs = check_split(&c, &h, &p);
        if c.protocol != TCP {
            continue;
        }
        let written = coalesce(&segs);
        assert_eq!(resplit(&written), segs, "split(coalesce(x)) == x");
        if c.flags & (FIN | CWR) == 0 && segs.len() > 1 {
            let merged = written.iter().filter(|w| w[1] != vnet::GSO_NONE).count();
            assert!(merged >= 1, "a plain ACK stream is merged");
            assert!(written.len() <= 2, "{} writes for one flow", written.len());
        }
    }
}

#[test]
fn one_flow_per_coalesced_packet() {
    let mut rng = Rng(0x0ddb_a11c_afe0_0002);
    for v6 in [false, true] {
        let c = Case {
            v6,
            protocol: TCP,
            mss: 1380,
            flags: ACK,
            options: 12,
        };
        let payload: Vec<u8> = (0..20_000).map(|_| rng.next() as u8).collect();
        let (ha, pa) = super_packet(&mut rng, &c, &payload, 1);
        let (hb, pb) = super_packet(&mut rng, &c, &payload, 2);
        let a = check_split(&c, &ha, &pa);
        let b = check_split(&c, &hb, &pb);
        // Runs of three from each flow, interleaved.
        let mut mixed = Vec::new();
        for (x, y) in a.chunks(3).zip(b.chunks(3)) {
            mixed.extend_from_slice(x);
            mixed.extend_from_slice(y);
        }
        let written = coalesce(&mixed);
        for w in &written {
            let back = resplit(std::slice::from_ref(w));
            let flow = addresses(&back[0]).0.to_vec();
            assert!(
                back.iter().all(|s| addresses(s).0 == flow),
                "one flow per write"
            );
        }
        assert_eq!(resplit(&written), mixed, "order kept");
        assert!(written.len() < mixed.len(), "runs merged");
    }
}

#[test]
fn a_segment_with_a_bad_checksum_is_never_merged() {
    let mut rng = Rng(7);
    let c = Case {
        v6: false,
        protocol: TCP,
        mss: 1000,
        flags: ACK,
        options: 0,
    };
    let payload = vec![0x5a; 5000];
    let (h, p) = super_packet(&mut rng, &c, &payload, 1);
    let mut segs = check_split(&c, &h, &p);
    segs[2][60] ^= 0xff; // payload corrupted after the checksum was made
    let written = coalesce(&segs);
    assert!(
        written
            .iter()
            .any(|w| w[1] == vnet::GSO_NONE && w[vnet::LEN..] == segs[2][..]),
        "the bad segment goes to the kernel as it came, which drops it"
    );
}

#[test]
fn malformed_super_packets_are_errors_not_panics() {
    let mut rng = Rng(9);
    for _ in 0..2000 {
        let len = rng.below(200) as usize;
        let mut pkt: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let h = Header {
            flags: vnet::F_NEEDS_CSUM,
            gso_type: [vnet::GSO_TCPV4, vnet::GSO_TCPV6, vnet::GSO_UDP_L4, 0]
                [rng.below(4) as usize],
            hdr_len: rng.below(300) as u16,
            gso_size: rng.below(1500) as u16,
            csum_start: rng.below(300) as u16,
            csum_offset: rng.below(300) as u16,
        };
        let _ = split(&h, &mut pkt, &mut Vec::new(), |_| {});
        let _ = coalesce(&[pkt]);
    }
}

/// A TCP header whose data offset is below 5 (shorter than TCP's fixed 20 bytes) is
/// refused: the split would write the flags and checksum past the copied headers.
#[test]
fn a_tcp_data_offset_below_five_is_refused() {
    let mut rng = Rng(0x000f_f5e7);
    let c = Case {
        v6: false,
        protocol: TCP,
        mss: 10,
        flags: 0,
        options: 0,
    };
    for offset in 0..5u8 {
        let (h, mut p) = super_packet(&mut rng, &c, &[0xab; 25], 1);
        p[20 + 12] = offset << 4;
        let mut seen = 0;
        let r = split(&h, &mut p, &mut Vec::new(), |_| seen += 1);
        assert_eq!(
            r,
            Err(SplitError::Malformed("TCP data offset below 5")),
            "data offset {offset}"
        );
        assert_eq!(seen, 0);
    }
}

#[test]
fn a_coalescer_that_must_not_merge_passes_each_segment_on() {
    let mut rng = Rng(0x0ddb_a11c_afe0_0003);
    let c = Case {
        v6: false,
        protocol: TCP,
        mss: 1380,
        flags: ACK,
        options: 0,
    };
    let payload: Vec<u8> = (0..10_000).map(|_| rng.next() as u8).collect();
    let (h, p) = super_packet(&mut rng, &c, &payload, 1);
    let segs = check_split(&c, &h, &p);
    let mut plain = Coalescer::new(false);
    let mut out = Vec::new();
    let mut write = |p: &[u8]| out.push(p.to_vec());
    for s in &segs {
        plain.push(s, &mut write);
    }
    plain.flush(&mut write);
    let back: Vec<Vec<u8>> = out.iter().map(|w| w[vnet::LEN..].to_vec()).collect();
    assert_eq!(back, segs, "every segment as it came, none merged");
    assert!(out.iter().all(|w| w[..vnet::LEN] == [0; vnet::LEN]));
}

/// Coalesces `packets` as the receiving side hands them over: each decrypted where
/// `landing` says (here written at `offset` into it), after a datagram that failed to
/// decrypt (garbage written over the landing place, then `landed(None)`).
fn coalesce_landing(packets: &[Vec<u8>], rng: &mut Rng, offset: usize) -> Vec<Vec<u8>> {
    let mut c = Coalescer::default();
    let mut out = Vec::new();
    let mut write = |p: &[u8]| out.push(p.to_vec());
    for p in packets {
        let room = c.landing(p.len() + 32, &mut write);
        room[..p.len() + 32]
            .iter_mut()
            .for_each(|b| *b = rng.next() as u8);
        c.landed(None, &mut write);
        let room = c.landing(p.len() + offset, &mut write);
        room[offset..offset + p.len()].copy_from_slice(p);
        c.landed(Some((offset, p.len())), &mut write);
    }
    c.flush(&mut write);
    out
}

#[test]
fn packets_decrypted_in_place_coalesce_as_copied_ones_and_failures_leave_no_trace() {
    let mut rng = Rng(0x0ddb_a11c_afe0_0004);
    for round in 0..100 {
        let mut c = random_case(&mut rng);
        c.protocol = TCP;
        // Two flows, interleaved in runs, so packets both join and start anew.
        let mut packets = Vec::new();
        for flow in 1..=2 {
            let len = 1 + rng.below(20_000) as usize;
            let payload: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let (h, p) = super_packet(&mut rng, &c, &payload, flow);
            packets.push(check_split(&c, &h, &p));
        }
        let mut mixed = Vec::new();
        let (mut a, mut b) = (packets[0].iter().peekable(), packets[1].iter().peekable());
        while a.peek().is_some() || b.peek().is_some() {
            let from = if rng.below(2) == 0 { &mut a } else { &mut b };
            for _ in 0..1 + rng.below(8) {
                mixed.extend(from.next().cloned());
            }
        }
        let offset = if round % 2 == 0 { 0 } else { 16 };
        let written = coalesce_landing(&mixed, &mut rng, offset);
        assert_eq!(written, coalesce(&mixed), "round {round}: as if copied");
        assert_eq!(
            resplit(&written),
            mixed,
            "round {round}: split(coalesce(x)) == x"
        );
    }
}
