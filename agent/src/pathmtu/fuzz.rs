//! The path-MTU prober's datagram handling as a fuzz target (`path_mtu`): datagrams from
//! four sources (the keyed peer, an unkeyed host that was probed, and two strangers) to a
//! prober that knows one peer's key and has two probes pending (one keyed, one not). It
//! panics when an answer breaks what the prober promises: one source gets at most `BURST`
//! acks at one instant, an ack is small, and a pending probe counts as acknowledged only
//! from the address it was sent to, for the size it had.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Instant;

use weft_crypto::PrivateKey;

use super::auth::Probing;
use super::limit::BURST;
use super::{lock, wire, Pending, Prober};

const PEER: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 2));
const PLAIN: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 3));
const SOURCES: [IpAddr; 4] = [
    PEER,
    PLAIN,
    IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9)),
    IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10)),
];
const KEYED: wire::Nonce = [1; 16];
const UNKEYED: wire::Nonce = [2; 16];
const SIZE: u16 = 1400;

fn own() -> PrivateKey {
    PrivateKey::from_bytes([7; 32])
}

fn peer() -> PrivateKey {
    PrivateKey::from_bytes([9; 32])
}

/// A prober with the peer's key and the two probes pending.
fn prober() -> Prober {
    let prober = Prober::new(None, None);
    let pair = {
        let mut auth = lock(&prober.auth);
        auth.update(Some(&own()), &BTreeMap::from([(PEER, peer().public_key())]));
        match auth.probing(PEER) {
            Probing::Keyed { pair, .. } => Some(pair),
            _ => None,
        }
    };
    let mut pending = lock(&prober.pending);
    pending.insert(
        KEYED,
        Pending {
            to: PEER,
            size: SIZE,
            key: pair,
            acked: false,
        },
    );
    pending.insert(
        UNKEYED,
        Pending {
            to: PLAIN,
            size: SIZE,
            key: None,
            acked: false,
        },
    );
    drop(pending);
    prober
}

/// Records: a source (its index, modulo 4), a length (two bytes, little-endian), then
/// that many bytes of datagram.
pub fn path_mtu(data: &[u8]) {
    let p = prober();
    let now = Instant::now();
    let mut answered = [0u32; 4];
    let mut rest = data;
    while let [who, a, b, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*a, *b])).min(tail.len());
        let (datagram, next) = tail.split_at(len);
        rest = next;
        let i = usize::from(*who) % SOURCES.len();
        let from = SocketAddr::new(SOURCES[i], 4000);
        if let Some(ack) = p.on_datagram(datagram, from, now) {
            answered[i] += 1;
            assert!(ack.len() <= 64, "an ack of {} bytes", ack.len());
            assert!(answered[i] <= BURST, "source {i} got more than its burst");
        }
    }
    let pending = lock(&p.pending);
    for (nonce, to) in [(KEYED, PEER), (UNKEYED, PLAIN)] {
        if let Some(probe) = pending.get(&nonce) {
            assert!(
                probe.to == to && probe.size == SIZE,
                "a pending probe changed"
            );
        }
    }
}

/// Inputs that reach each path: probes (keyed by the peer, by a stranger's key, and
/// untagged), the peer's tagged ack, the unkeyed host's ack, and acks that must not count.
pub fn seeds() -> Vec<Vec<u8>> {
    let record = |who: u8, d: &[u8]| {
        let mut r = vec![who];
        r.extend_from_slice(&(d.len() as u16).to_le_bytes());
        r.extend_from_slice(d);
        r
    };
    let to = PLAIN;
    let keyed = wire::keyed_probe([3; 16], 1280, to, &peer().public_key()).unwrap_or_default();
    let stranger = wire::keyed_probe(
        [4; 16],
        1280,
        to,
        &PrivateKey::from_bytes([5; 32]).public_key(),
    )
    .unwrap_or_default();
    let plain = wire::probe([6; 16], 1280, to).unwrap_or_default();
    let p = prober();
    let tagged = match lock(&p.auth).probing(PEER) {
        Probing::Keyed { pair, .. } => wire::tagged_ack(KEYED, SIZE, &pair),
        _ => Vec::new(),
    };
    let unkeyed_ack = wire::ack(UNKEYED, SIZE);
    vec![
        record(0, &keyed),
        record(2, &stranger),
        record(1, &plain),
        record(0, &tagged),
        record(1, &unkeyed_ack),
        [
            record(2, &tagged),
            record(3, &unkeyed_ack),
            record(0, &wire::ack(KEYED, SIZE)),
        ]
        .concat(),
        (0..80).flat_map(|_| record(2, &plain)).collect(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds reach what they are for: a keyed probe from the peer is answered, one
    /// naming a stranger's key is not, the peer's tagged ack counts and an untagged or
    /// misplaced one does not, and a flood from one source gets its burst.
    #[test]
    fn the_seeds_reach_each_path() {
        let p = prober();
        let now = Instant::now();
        let from = |ip| SocketAddr::new(ip, 4000);
        let s = seeds();
        let datagram = |r: &[u8]| r[3..].to_vec();
        assert!(p.on_datagram(&datagram(&s[0]), from(PEER), now).is_some());
        assert!(p
            .on_datagram(&datagram(&s[1]), from(SOURCES[2]), now)
            .is_none());
        assert!(p
            .on_datagram(&wire::ack(KEYED, SIZE), from(PEER), now)
            .is_none());
        assert!(
            !lock(&p.pending)[&KEYED].acked,
            "an untagged ack for a keyed probe"
        );
        assert!(p
            .on_datagram(&datagram(&s[3]), from(SOURCES[2]), now)
            .is_none());
        assert!(
            !lock(&p.pending)[&KEYED].acked,
            "the tag from another address"
        );
        let _ = p.on_datagram(&datagram(&s[3]), from(PEER), now);
        assert!(lock(&p.pending)[&KEYED].acked);
        let _ = p.on_datagram(&datagram(&s[4]), from(PLAIN), now);
        assert!(lock(&p.pending)[&UNKEYED].acked);
        let answered = (0..80)
            .filter(|_| {
                p.on_datagram(&datagram(&s[2]), from(SOURCES[3]), now)
                    .is_some()
            })
            .count();
        assert_eq!(answered as u32, BURST);
        path_mtu(&s.concat());
    }
}
