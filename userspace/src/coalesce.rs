//! Coalescing the TCP segments that arrive back to back for one flow into one GSO
//! super-packet, written to the TUN device with one `write` (the receive side of TSO, as
//! the kernel's GRO does). A packet joins the one being built when it continues it
//! exactly: same addresses, ports, IP fields, TCP options and ACK; its sequence number
//! is the next byte; its flags are ACK (PSH allowed, which ends the packet); its payload
//! is no longer than the first segment's (a shorter one ends the packet); the whole stays
//! within 64 KiB. Anything else is written as it came, after what was being built, so
//! the order of packets never changes. Segments with a wrong checksum are never merged
//! (the merged packet's checksum is recomputed by the kernel and would hide the error).
//!
//! The receiving side decrypts each packet straight into the buffer being built
//! (`landing`, then `landed`), not into a buffer of its own to be copied from: a packet
//! that continues the one being built lands with its headers over the last bytes of that
//! packet's payload (kept aside meanwhile and put back), so its payload is already where
//! it belongs. Only a packet that does not continue it is moved (at most one packet's
//! bytes, when a flow changes).

use super::checksum;
use super::segment::{addresses, read_u16, read_u32, write_u16};
use super::vnet::{self, Header};

const TCP: u8 = 6;
const TCP_ACK: u8 = 0x10;
const TCP_PSH: u8 = 0x08;
/// The largest IP packet (IPv4 total length; IPv6 payload plus header kept within it too).
const MAX_PACKET: usize = 65535;

/// Where a coalescing candidate's headers sit.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Tcp {
    v6: bool,
    /// IP header length (the TCP header's offset).
    l4: usize,
    /// IP plus TCP header length (the payload's offset).
    payload: usize,
}

fn candidate(pkt: &[u8]) -> Option<Tcp> {
    let version = pkt.first()? >> 4;
    let (v6, l4) = match version {
        4 => {
            let ihl = usize::from(pkt[0] & 0xf) * 4;
            let fragment = pkt.len() >= 20 && read_u16(pkt, 6) & 0x3fff != 0;
            if pkt.len() < 20 || ihl < 20 || pkt[9] != TCP || fragment {
                return None;
            }
            if usize::from(read_u16(pkt, 2)) != pkt.len() {
                return None;
            }
            (false, ihl)
        }
        6 => {
            if pkt.len() < 40 || pkt[6] != TCP || usize::from(read_u16(pkt, 4)) + 40 != pkt.len() {
                return None;
            }
            (true, 40)
        }
        _ => return None,
    };
    if pkt.len() < l4 + 20 {
        return None;
    }
    let payload = l4 + usize::from(pkt[l4 + 12] >> 4) * 4;
    let flags = pkt[l4 + 13];
    if payload < l4 + 20 || payload >= pkt.len() || flags & !TCP_PSH != TCP_ACK {
        return None;
    }
    let (src, dst) = addresses(pkt, v6);
    checksum::transport_valid(src, dst, TCP, &pkt[l4..]).then_some(Tcp { v6, l4, payload })
}

/// The super-packet being built: `buf` holds the vnet header and the packet.
struct Open {
    tcp: Tcp,
    segments: usize,
    /// The first segment's payload length (the GSO size).
    mss: usize,
    next_seq: u32,
    /// A short segment or PSH came: nothing more may join.
    closed: bool,
}

/// The largest headers a merged packet has (IPv4 with options or IPv6, and TCP with
/// options): what a landing packet may cover of the one being built.
const MAX_HEADERS: usize = 60 + 60;
/// The buffer's size: the vnet header, the largest packet being built, and room behind it
/// for any datagram to land (a UDP datagram is at most 64 KiB).
const ROOM: usize = vnet::LEN + MAX_PACKET + 65_536;

pub struct Coalescer {
    /// The vnet header, then the packet being built (`len` bytes in all); `ROOM` bytes,
    /// allocated and zeroed once.
    buf: Vec<u8>,
    len: usize,
    open: Option<Open>,
    /// Whether packets are merged: only a device with vnet headers takes GSO writes.
    merge: bool,
    /// Where the last `landing` put the packet to come, and the bytes of the packet being
    /// built that it covers (kept here until `landed` puts them back).
    landing: usize,
    covered: [u8; MAX_HEADERS],
    covered_len: usize,
    /// A landed packet that does not continue the one being built waits here while that
    /// one is written.
    spill: Vec<u8>,
}

impl Default for Coalescer {
    fn default() -> Self {
        Coalescer::new(true)
    }
}

/// Whether `pkt` (a candidate laid out as `tcp`) continues the packet in `built`.
fn continues(open: &Open, built: &[u8], pkt: &[u8], tcp: Tcp) -> bool {
    if open.closed || tcp != open.tcp {
        return false;
    }
    let l4 = tcp.l4;
    let len = pkt.len() - tcp.payload;
    if len > open.mss || built.len() + len > MAX_PACKET {
        return false;
    }
    let same_ip = if tcp.v6 {
        // version, traffic class, flow label; next header and hop limit; addresses
        built[0..4] == pkt[0..4] && built[6..40] == pkt[6..40]
    } else {
        // version/IHL, TOS; flags (DF), TTL, protocol; addresses and options
        built[0..2] == pkt[0..2]
            && built[6] == pkt[6]
            && built[8..10] == pkt[8..10]
            && built[12..l4] == pkt[12..l4]
    };
    let same_tcp = built[l4..l4 + 4] == pkt[l4..l4 + 4] // ports
        && built[l4 + 8..l4 + 12] == pkt[l4 + 8..l4 + 12] // ack
        && built[l4 + 20..tcp.payload] == pkt[l4 + 20..tcp.payload]; // options
    same_ip && same_tcp && read_u32(pkt, l4 + 4) == open.next_seq
}

impl Coalescer {
    /// A coalescer that merges (`merge`), or passes every packet on as it came.
    pub fn new(merge: bool) -> Coalescer {
        Coalescer {
            buf: vec![0; ROOM],
            len: 0,
            open: None,
            merge,
            landing: vnet::LEN,
            covered: [0; MAX_HEADERS],
            covered_len: 0,
            spill: Vec::new(),
        }
    }

    /// Takes one decrypted packet; calls `write` with each finished packet (vnet header
    /// first) that is ready to go to the device.
    pub fn push(&mut self, pkt: &[u8], write: &mut impl FnMut(&[u8])) {
        let room = self.landing(pkt.len(), write);
        let Some(dst) = room.get_mut(..pkt.len()) else {
            return self.landed(None, write); // larger than any datagram
        };
        dst.copy_from_slice(pkt);
        self.landed(Some((0, pkt.len())), write);
    }

    /// Where the next packet, of at most `need` bytes, is to be written (decrypted): a
    /// slice of at least `need` bytes, whose first bytes may cover the end of the packet
    /// being built. `landed` must follow before anything else is asked of the coalescer.
    pub fn landing(&mut self, need: usize, write: &mut impl FnMut(&[u8])) -> &mut [u8] {
        let at = match &self.open {
            Some(open) if !open.closed => {
                let headers = open.tcp.payload;
                // Over the end of the built payload when the payload is longer than the
                // headers (they must stay readable), else right behind it.
                let at = if self.len >= vnet::LEN + 2 * headers {
                    self.len - headers
                } else {
                    self.len
                };
                (at + need <= ROOM).then_some(at)
            }
            _ => None,
        };
        let at = at.unwrap_or_else(|| {
            self.flush(write);
            vnet::LEN
        });
        self.covered_len = self.len.saturating_sub(at).min(MAX_HEADERS);
        self.covered[..self.covered_len].copy_from_slice(&self.buf[at..at + self.covered_len]);
        self.landing = at;
        &mut self.buf[at..]
    }

    /// The packet asked for by `landing` was written there (`Some((offset, len))`: at
    /// `offset` in the slice `landing` gave), or nothing was (`None`: whatever was
    /// written there is not a packet).
    pub fn landed(&mut self, packet: Option<(usize, usize)>, write: &mut impl FnMut(&[u8])) {
        let at = self.landing;
        let Some((offset, len)) = packet else {
            self.uncover();
            return;
        };
        if offset != 0 {
            self.buf.copy_within(at + offset..at + offset + len, at);
        }
        if self.open.is_none() {
            // Nothing was being built: the packet landed at the start.
            return self.start(len, write);
        }
        let pkt = &self.buf[at..at + len];
        let tcp = if self.merge { candidate(pkt) } else { None };
        let joins = match (tcp, &self.open) {
            (Some(tcp), Some(open)) => {
                continues(open, &self.buf[vnet::LEN..self.len], pkt, tcp).then_some(tcp)
            }
            _ => None,
        };
        let Some(tcp) = joins else {
            // Another flow (or not TCP): what was built goes first, then this one starts
            // again from the front.
            self.spill.clear();
            self.spill.extend_from_slice(&self.buf[at..at + len]);
            self.uncover();
            self.flush(write);
            self.buf[vnet::LEN..vnet::LEN + len].copy_from_slice(&self.spill);
            return self.start(len, write);
        };
        let payload = len - tcp.payload;
        let psh = self.buf[at + tcp.l4 + 13] & TCP_PSH != 0;
        // Its payload goes right behind the built one's (it is there already when it
        // landed over the built payload's end).
        let from = at + tcp.payload;
        if from != self.len {
            self.buf.copy_within(from..from + payload, self.len);
        }
        self.uncover();
        self.len += payload;
        if psh {
            self.buf[vnet::LEN + tcp.l4 + 13] |= TCP_PSH;
        }
        if let Some(open) = self.open.as_mut() {
            open.segments += 1;
            open.next_seq = open.next_seq.wrapping_add(payload as u32);
            open.closed = payload < open.mss || psh;
        }
    }

    /// Puts back the bytes of the built packet that the last landing covered.
    fn uncover(&mut self) {
        let (at, n) = (self.landing, self.covered_len);
        self.buf[at..at + n].copy_from_slice(&self.covered[..n]);
        self.covered_len = 0;
    }

    /// Starts a packet from the `len` bytes at the front (after the vnet header): kept
    /// open if it may be merged, else written at once.
    fn start(&mut self, len: usize, write: &mut impl FnMut(&[u8])) {
        self.buf[..vnet::LEN].fill(0);
        self.len = vnet::LEN + len;
        let pkt = &self.buf[vnet::LEN..self.len];
        match self.merge.then(|| candidate(pkt)).flatten() {
            Some(tcp) => {
                let mss = len - tcp.payload;
                self.open = Some(Open {
                    tcp,
                    segments: 1,
                    mss,
                    next_seq: read_u32(pkt, tcp.l4 + 4).wrapping_add(mss as u32),
                    closed: pkt[tcp.l4 + 13] & TCP_PSH != 0,
                });
            }
            None => self.emit(write),
        }
    }

    /// Whether a packet is being built (held for more segments).
    pub fn holds(&self) -> bool {
        self.open.is_some()
    }

    /// Writes what is being built, if anything.
    pub fn flush(&mut self, write: &mut impl FnMut(&[u8])) {
        let Some(open) = self.open.take() else {
            return;
        };
        if open.segments > 1 {
            self.finish_super_packet(&open);
        }
        self.emit(write);
    }

    /// Writes `buf` as it is (a plain packet has an all-zero vnet header).
    fn emit(&mut self, write: &mut impl FnMut(&[u8])) {
        write(&self.buf[..self.len]);
        self.len = 0;
    }

    /// Turns the merged segments in `buf` into a GSO packet: lengths for the whole, IPv4
    /// header checksum, the TCP checksum field seeded with the pseudo-header's sum (the
    /// kernel completes it), and the vnet header describing the segmentation.
    fn finish_super_packet(&mut self, open: &Open) {
        let Tcp { v6, l4, payload } = open.tcp;
        let pkt = &mut self.buf[vnet::LEN..self.len];
        let len = pkt.len();
        if v6 {
            write_u16(pkt, 4, (len - 40) as u16);
        } else {
            write_u16(pkt, 2, len as u16);
            checksum::ipv4_header(&mut pkt[..l4]);
        }
        let (src, dst) = addresses(pkt, v6);
        let pseudo = checksum::pseudo_header(src, dst, TCP, len - l4);
        write_u16(pkt, l4 + 16, checksum::fold(pseudo));
        let header = Header {
            flags: vnet::F_NEEDS_CSUM,
            gso_type: if v6 { vnet::GSO_TCPV6 } else { vnet::GSO_TCPV4 },
            hdr_len: payload as u16,
            gso_size: open.mss as u16,
            csum_start: l4 as u16,
            csum_offset: 16,
        };
        header.encode(&mut self.buf[..vnet::LEN]);
    }
}
