//! The receiving side's two ways of opening a run of data messages (straight into the
//! packet being coalesced, or in parts across helper threads) deliver the same packets.

use std::net::SocketAddr;

use boringtun::x25519::{PublicKey, StaticSecret};

use super::super::peers::{lock, PeerConfig, State};
use super::super::udp::Endpoint;
use super::super::wg::TunnResult;
use super::{Outputs, Receiver};
use std::time::Instant;

#[derive(Default)]
struct Kept {
    delivered: Vec<Vec<u8>>,
}

impl Outputs for &mut Kept {
    fn send(&mut self, _: Endpoint, _: &[u8]) {}
    fn deliver(&mut self, pkt: &[u8]) {
        // Without offloads the coalescer's vnet header is not the TUN device's.
        self.delivered.push(pkt[super::super::vnet::LEN..].to_vec());
    }
}

fn node(secret: u8, peer: u8, allowed: &str) -> State {
    let mut state = State::default();
    state.set_private_key(Some(StaticSecret::from([secret; 32])));
    let key = PublicKey::from(&StaticSecret::from([peer; 32])).to_bytes();
    let config = PeerConfig {
        allowed_ips: vec![allowed.parse().unwrap()],
        ..PeerConfig::default()
    };
    state.upsert(key, config, None);
    state.commit();
    state
}

/// Runs `f` on `state`'s one peer's current tunnel.
fn with_tunnel<T>(state: &State, f: impl FnOnce(&mut super::super::wg::Tunnel) -> T) -> T {
    let peer = state.peers.values().next().unwrap().clone();
    let mut noise = lock(&peer.noise);
    f(state.session(&mut noise, &peer).unwrap())
}

fn net(r: TunnResult<'_>) -> Vec<u8> {
    match r {
        TunnResult::WriteToNetwork(b) => b.to_vec(),
        other => panic!("expected a datagram, got {other:?}"),
    }
}

/// A UDP packet from `src` of `len` bytes, its payload tagged `tag`.
fn udp_packet(src: [u8; 4], len: usize, tag: u8) -> Vec<u8> {
    let mut p = vec![tag; len];
    p[..20].copy_from_slice(&[
        0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    p[12..16].copy_from_slice(&src);
    p[16..20].copy_from_slice(&[10, 0, 1, 2]);
    p
}

/// A batch from b to a, as a's socket hands it over: `segment` bytes a message but the
/// last. 11 messages of one size (one forged, one from outside b's AllowedIPs), the first
/// again (a replay), and a shorter last one. With the packets a must deliver, in order.
fn batch(a: &State, b: &State) -> (Vec<u8>, usize, Vec<Vec<u8>>) {
    let mut buf = vec![0u8; 2048];
    let init = with_tunnel(b, |t| {
        net(t.format_handshake_initiation(Instant::now(), &mut buf, false))
    });
    let response = with_tunnel(a, |t| net(t.decapsulate(&init, Instant::now(), &mut buf)));
    let keepalive = with_tunnel(b, |t| {
        net(t.decapsulate(&response, Instant::now(), &mut buf))
    });
    assert!(with_tunnel(a, |t| matches!(
        t.decapsulate(&keepalive, Instant::now(), &mut buf),
        TunnResult::Done
    )));
    let mut packets: Vec<Vec<u8>> = (0..10)
        .map(|i| udp_packet([10, 0, 0, 9], 1000, i))
        .collect();
    packets.insert(6, udp_packet([10, 9, 9, 9], 1000, 66));
    let mut sealed: Vec<Vec<u8>> = packets
        .iter()
        .map(|p| with_tunnel(b, |t| net(t.encapsulate(p, Instant::now(), &mut buf))))
        .collect();
    sealed[3][100] ^= 1;
    sealed.push(sealed[0].clone());
    let last = udp_packet([10, 0, 0, 9], 300, 99);
    sealed.push(with_tunnel(b, |t| {
        net(t.encapsulate(&last, Instant::now(), &mut buf))
    }));
    let segment = sealed[0].len();
    let mut want: Vec<Vec<u8>> = (packets.into_iter().enumerate())
        .filter(|(i, _)| *i != 3 && *i != 6)
        .map(|(_, p)| p)
        .collect();
    want.push(last);
    (sealed.concat(), segment, want)
}

#[test]
fn a_run_opened_in_parts_delivers_what_one_opened_in_place_delivers() {
    let from: SocketAddr = "198.51.100.2:51820".parse().unwrap();
    for helpers in [0, 1, 3] {
        let a = node(1, 2, "10.0.0.0/24");
        let b = node(2, 1, "10.0.1.0/24");
        let (mut datagrams, segment, want) = batch(&a, &b);
        let mut kept = Kept::default();
        let mut rx = Receiver::with_helpers(&mut kept, false, helpers);
        rx.batch(&a, &mut datagrams, segment, (from, None));
        rx.flush();
        drop(rx);
        assert_eq!(kept.delivered.len(), want.len(), "{helpers} helpers");
        assert!(kept.delivered == want, "{helpers} helpers: other packets");
        let peer = a.peers.values().next().unwrap();
        assert_eq!(
            peer.endpoint(),
            Some(from),
            "the verified messages moved the endpoint"
        );
        let (_, _, rx_bytes) = lock(&peer.noise).stats(std::time::Instant::now());
        // Ten opened (one forged of eleven; the one from outside the AllowedIPs counts,
        // as kernel WireGuard counts it), and the short last one.
        assert_eq!(
            rx_bytes,
            10 * 1000 + 300,
            "{helpers} helpers: bytes counted"
        );
    }
}
