//! The probe protocol on the wire: a UDP datagram of `MAGIC`, a kind, a 16-byte nonce and
//! the size of the whole IP packet the prober sent, padded with zeros to that size. A
//! probe is answered with a short ack carrying the nonce and the size that arrived: an
//! ack is never larger than its probe, so the responder amplifies nothing, and a stranger
//! off the path cannot forge an ack for a nonce it never saw.

use std::net::IpAddr;

pub const MAGIC: &[u8; 8] = b"WEFTPMTU";
const PROBE: u8 = 1;
const ACK: u8 = 2;
/// Magic, kind, nonce and size.
pub const HEADER: usize = 8 + 1 + 16 + 2;

pub type Nonce = [u8; 16];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// A probe of `size` bytes of IP packet.
    Probe { nonce: Nonce, size: u16 },
    /// The answer to a probe that arrived whole, at `size` bytes.
    Ack { nonce: Nonce, size: u16 },
}

/// The IP and UDP headers in front of a datagram to or from `addr`.
pub fn headers(addr: IpAddr) -> usize {
    (if addr.is_ipv6() { 40 } else { 20 }) + 8
}

/// A probe that makes an IP packet of `size` bytes to `to`; `None` if `size` cannot hold
/// the probe's header.
pub fn probe(nonce: Nonce, size: u16, to: IpAddr) -> Option<Vec<u8>> {
    let payload = usize::from(size).checked_sub(headers(to))?;
    if payload < HEADER {
        return None;
    }
    let mut out = encode(PROBE, nonce, size);
    out.resize(payload, 0);
    Some(out)
}

pub fn ack(nonce: Nonce, size: u16) -> Vec<u8> {
    encode(ACK, nonce, size)
}

fn encode(kind: u8, nonce: Nonce, size: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER);
    out.extend_from_slice(MAGIC);
    out.push(kind);
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&size.to_be_bytes());
    out
}

/// Reads a datagram that came from `from`. A probe counts only if it arrived at the size
/// it says it was sent at (headers included), so a probe cut short is not answered.
pub fn decode(datagram: &[u8], from: IpAddr) -> Option<Message> {
    let rest = datagram.strip_prefix(MAGIC)?;
    let (&kind, rest) = rest.split_first()?;
    let nonce: Nonce = rest.get(..16)?.try_into().ok()?;
    let size = u16::from_be_bytes(rest.get(16..18)?.try_into().ok()?);
    match kind {
        PROBE if datagram.len() + headers(from) == usize::from(size) => {
            Some(Message::Probe { nonce, size })
        }
        ACK if datagram.len() == HEADER => Some(Message::Ack { nonce, size }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 2));
    const V6: IpAddr = IpAddr::V6(std::net::Ipv6Addr::LOCALHOST);

    #[test]
    fn a_probe_is_as_large_as_it_says_and_an_ack_is_small() {
        let nonce = [7; 16];
        let p = probe(nonce, 1400, V4).unwrap();
        assert_eq!(p.len(), 1400 - 28);
        assert_eq!(decode(&p, V4), Some(Message::Probe { nonce, size: 1400 }));
        let p6 = probe(nonce, 1280, V6).unwrap();
        assert_eq!(p6.len(), 1280 - 48);
        assert_eq!(decode(&p6, V6), Some(Message::Probe { nonce, size: 1280 }));
        let a = ack(nonce, 1400);
        assert_eq!(a.len(), HEADER);
        assert_eq!(decode(&a, V4), Some(Message::Ack { nonce, size: 1400 }));
    }

    #[test]
    fn cut_short_foreign_or_tiny_datagrams_are_not_probes() {
        let nonce = [1; 16];
        let p = probe(nonce, 1400, V4).unwrap();
        assert_eq!(decode(&p[..p.len() - 1], V4), None, "cut short");
        assert_eq!(decode(&p, V6), None, "the size counts the family's headers");
        assert_eq!(decode(b"WEFTPMTU", V4), None);
        assert_eq!(decode(&[0u8; 64], V4), None);
        assert_eq!(decode(&[], V4), None);
        assert_eq!(probe(nonce, 40, V4), None, "too small to hold a probe");
        let mut long_ack = ack(nonce, 1400);
        long_ack.push(0);
        assert_eq!(decode(&long_ack, V4), None);
    }
}
