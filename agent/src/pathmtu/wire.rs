//! The probe protocol on the wire: a UDP datagram of `MAGIC`, a kind, a 16-byte nonce and
//! the size of the whole IP packet the prober sent, padded with zeros to that size. A
//! probe is answered with a short ack carrying the nonce and the size that arrived: an
//! ack is never larger than its probe, so the responder amplifies nothing, and a stranger
//! off the path cannot forge an ack for a nonce it never saw.
//!
//! A host on the path sees the nonce, so between nodes that have X25519 keys (WireGuard,
//! ipsec) the probe also names the prober's public key, and the ack carries a 16-byte tag
//! over its fields, under a key only the two nodes can compute (`ACK_LABEL`): an ack that a
//! host on the path made for a probe it saw (or dropped) does not verify. Nodes without
//! keys (vxlan, host-gw, ipip), and older agents, use the untagged kinds.

use std::net::IpAddr;

use weft_crypto::pq::AuthKey;
use weft_crypto::{PublicKey, KEY_LEN};

pub const MAGIC: &[u8; 8] = b"WEFTPMTU";
const PROBE: u8 = 1;
const ACK: u8 = 2;
const KEYED_PROBE: u8 = 3;
const TAGGED_ACK: u8 = 4;
/// Magic, kind, nonce and size.
pub const HEADER: usize = 8 + 1 + 16 + 2;
/// A keyed probe's header: `HEADER` and the prober's public key.
pub const KEYED_HEADER: usize = HEADER + KEY_LEN;
/// An ack's tag.
pub const TAG_LEN: usize = 16;
/// The label of the pair key that tags acks (its own, not the post-quantum exchange's).
pub const ACK_LABEL: &[u8] = b"weft path-mtu ack v1";

pub type Nonce = [u8; 16];
pub type Tag = [u8; TAG_LEN];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// A probe of `size` bytes of IP packet, from the node with key `from` if it names one.
    Probe {
        nonce: Nonce,
        size: u16,
        from: Option<PublicKey>,
    },
    /// The answer to a probe that arrived whole, at `size` bytes, tagged if the probe was
    /// keyed.
    Ack {
        nonce: Nonce,
        size: u16,
        tag: Option<Tag>,
    },
}

/// The IP and UDP headers in front of a datagram to or from `addr`.
pub fn headers(addr: IpAddr) -> usize {
    (if addr.is_ipv6() { 40 } else { 20 }) + 8
}

/// An untagged probe that makes an IP packet of `size` bytes to `to`; `None` if `size`
/// cannot hold the probe's header.
pub fn probe(nonce: Nonce, size: u16, to: IpAddr) -> Option<Vec<u8>> {
    padded(encode(PROBE, nonce, size), size, to)
}

/// A probe naming this node's key `own`, answered by a tagged ack.
pub fn keyed_probe(nonce: Nonce, size: u16, to: IpAddr, own: &PublicKey) -> Option<Vec<u8>> {
    let mut out = encode(KEYED_PROBE, nonce, size);
    out.extend_from_slice(own.as_bytes());
    padded(out, size, to)
}

fn padded(mut out: Vec<u8>, size: u16, to: IpAddr) -> Option<Vec<u8>> {
    let payload = usize::from(size).checked_sub(headers(to))?;
    if payload < out.len() {
        return None;
    }
    out.resize(payload, 0);
    Some(out)
}

/// The untagged ack of an untagged probe.
pub fn ack(nonce: Nonce, size: u16) -> Vec<u8> {
    encode(ACK, nonce, size)
}

/// The tagged ack of a keyed probe, under the pair's `key`.
pub fn tagged_ack(nonce: Nonce, size: u16, key: &AuthKey) -> Vec<u8> {
    let mut out = encode(TAGGED_ACK, nonce, size);
    let tag: Tag = key.tag(&out);
    out.extend_from_slice(&tag);
    out
}

/// Whether `tag` is the pair's (`key`) for the ack of `nonce` at `size`.
pub fn tag_verifies(key: &AuthKey, nonce: Nonce, size: u16, tag: &Tag) -> bool {
    key.verify(&encode(TAGGED_ACK, nonce, size), tag)
}

fn encode(kind: u8, nonce: Nonce, size: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + KEY_LEN);
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
    let whole = datagram.len() + headers(from) == usize::from(size);
    match kind {
        PROBE if whole => Some(Message::Probe {
            nonce,
            size,
            from: None,
        }),
        KEYED_PROBE if whole => {
            let key: [u8; KEY_LEN] = rest.get(18..18 + KEY_LEN)?.try_into().ok()?;
            Some(Message::Probe {
                nonce,
                size,
                from: Some(PublicKey::from_bytes(key)),
            })
        }
        ACK if datagram.len() == HEADER => Some(Message::Ack {
            nonce,
            size,
            tag: None,
        }),
        TAGGED_ACK if datagram.len() == HEADER + TAG_LEN => Some(Message::Ack {
            nonce,
            size,
            tag: Some(rest.get(18..18 + TAG_LEN)?.try_into().ok()?),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_crypto::PrivateKey;

    const V4: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 2));
    const V6: IpAddr = IpAddr::V6(std::net::Ipv6Addr::LOCALHOST);

    #[test]
    fn a_probe_is_as_large_as_it_says_and_an_ack_is_small() {
        let nonce = [7; 16];
        let p = probe(nonce, 1400, V4).unwrap();
        assert_eq!(p.len(), 1400 - 28);
        let untagged = |size| {
            Some(Message::Probe {
                nonce,
                size,
                from: None,
            })
        };
        assert_eq!(decode(&p, V4), untagged(1400));
        let p6 = probe(nonce, 1280, V6).unwrap();
        assert_eq!(p6.len(), 1280 - 48);
        assert_eq!(decode(&p6, V6), untagged(1280));
        let a = ack(nonce, 1400);
        assert_eq!(a.len(), HEADER);
        assert_eq!(
            decode(&a, V4),
            Some(Message::Ack {
                nonce,
                size: 1400,
                tag: None
            })
        );
    }

    #[test]
    fn a_keyed_probe_names_its_key_and_its_ack_verifies_only_for_its_fields() {
        let (a, b) = (
            PrivateKey::generate().unwrap(),
            PrivateKey::generate().unwrap(),
        );
        let at_a = AuthKey::for_purpose(&a, &b.public_key(), ACK_LABEL).unwrap();
        let at_b = AuthKey::for_purpose(&b, &a.public_key(), ACK_LABEL).unwrap();
        let nonce = [3; 16];
        let p = keyed_probe(nonce, 1400, V4, &a.public_key()).unwrap();
        assert_eq!(p.len(), 1400 - 28);
        assert_eq!(
            decode(&p, V4),
            Some(Message::Probe {
                nonce,
                size: 1400,
                from: Some(a.public_key())
            })
        );
        let ack = tagged_ack(nonce, 1400, &at_b);
        assert_eq!(ack.len(), HEADER + TAG_LEN);
        assert!(ack.len() + headers(V4) < usize::from(keyed_smallest()));
        let Some(Message::Ack { tag: Some(tag), .. }) = decode(&ack, V4) else {
            panic!("not a tagged ack: {ack:?}");
        };
        assert!(tag_verifies(&at_a, nonce, 1400, &tag));
        assert!(!tag_verifies(&at_a, nonce, 1500, &tag), "another size");
        assert!(!tag_verifies(&at_a, [4; 16], 1400, &tag), "another nonce");
        let exchange = AuthKey::new(&a, &b.public_key()).unwrap();
        assert!(
            !tag_verifies(&exchange, nonce, 1400, &tag),
            "another purpose's key"
        );
        assert!(AuthKey::for_purpose(&a, &b.public_key(), b"weft pq auth v1").is_err());
    }

    /// The smallest keyed probe, as an IP packet over IPv4.
    fn keyed_smallest() -> u16 {
        (KEYED_HEADER + 28) as u16
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
        let own = PrivateKey::generate().unwrap().public_key();
        assert_eq!(
            keyed_probe(nonce, 80, V4, &own),
            None,
            "too small for its key"
        );
        let mut long_ack = ack(nonce, 1400);
        long_ack.push(0);
        assert_eq!(decode(&long_ack, V4), None);
        let mut short_tagged = tagged_ack(
            nonce,
            1400,
            &AuthKey::for_purpose(&PrivateKey::generate().unwrap(), &own, ACK_LABEL).unwrap(),
        );
        short_tagged.pop();
        assert_eq!(decode(&short_tagged, V4), None);
    }
}
