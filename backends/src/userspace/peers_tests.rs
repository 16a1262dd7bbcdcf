//! The peer table's tests: session indices, AllowedIPs, in-place changes and the sessions
//! and counts a change keeps.

use super::*;

/// A stranger who saw one peer's session index cannot guess the next one: indices
/// are distinct, never 0, fit 24 bits, and do not follow one another.
#[test]
fn session_indices_are_unique_and_unpredictable() {
    let mut state = State::default();
    let mut indices = Vec::new();
    for i in 0..2000u32 {
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(&i.to_le_bytes());
        state.upsert(key, PeerConfig::default(), None);
        indices.push(lock(&state.peers[&key].noise).index);
    }
    let in_order = indices.clone();
    assert!(indices.iter().all(|i| *i != 0 && *i <= 0x00ff_ffff));
    let consecutive = in_order.windows(2).filter(|w| w[1] == w[0] + 1).count();
    assert!(
        consecutive < 5,
        "{consecutive} indices follow their predecessor"
    );
    indices.sort_unstable();
    indices.dedup();
    assert_eq!(indices.len(), 2000, "every peer has its own index");
}

fn key(n: u8) -> Key {
    [n; 32]
}

fn with(ips: &[&str]) -> PeerConfig {
    PeerConfig {
        allowed_ips: ips.iter().map(|n| n.parse().unwrap()).collect(),
        ..PeerConfig::default()
    }
}

fn routed(state: &State, ip: &str) -> Option<Key> {
    state.route(ip.parse().unwrap()).map(|p| p.key)
}

/// An AllowedIP belongs to one peer: given to another, it leaves the first, in the
/// routes too, once the request is committed; the longest prefix routes.
#[test]
fn an_allowed_ip_moves_whole_and_the_longest_prefix_routes() {
    let mut state = State::default();
    state.upsert(key(1), with(&["10.0.0.0/16", "fd00::/64"]), None);
    state.upsert(key(2), with(&["10.0.1.0/24"]), None);
    state.commit();
    assert_eq!(routed(&state, "10.0.1.9"), Some(key(2)));
    assert_eq!(routed(&state, "10.0.2.9"), Some(key(1)));
    assert_eq!(routed(&state, "fd00::9"), Some(key(1)));
    assert_eq!(routed(&state, "10.1.0.1"), None);
    // Peer 3 takes the /16 (a key switch: the next key's entry takes the AllowedIPs).
    state.upsert(key(3), with(&["10.0.0.0/16"]), None);
    assert_eq!(
        routed(&state, "10.0.2.9"),
        Some(key(1)),
        "routes change at commit"
    );
    state.commit();
    assert_eq!(routed(&state, "10.0.2.9"), Some(key(3)));
    let left: Vec<String> = lock(&state.peers[&key(1)].config)
        .allowed_ips
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(left, ["fd00::/64"]);
    // Removing a peer frees what it held.
    state.remove(&key(3));
    state.commit();
    assert_eq!(routed(&state, "10.0.2.9"), None);
    assert_eq!(routed(&state, "10.0.1.9"), Some(key(2)));
}

/// The routes a commit leaves, updated for what each request touched, are those a table
/// built from every peer's AllowedIPs gives: over random adds, changes, moves, removals
/// and clearing, with prefixes nested in one another and addresses given inside a network.
#[test]
fn routes_kept_up_per_request_equal_routes_built_afresh() {
    let mut rng = crate::test_rng::Rng(0x5eed_0f0a_11ed);
    let mut state = State::default();
    let nets = |rng: &mut crate::test_rng::Rng| -> Vec<IpNet> {
        (0..rng.below(3))
            .map(|_| {
                let len = [8u8, 16, 24, 32][rng.below(4) as usize];
                let addr = std::net::Ipv4Addr::new(
                    10,
                    rng.below(3) as u8,
                    rng.below(3) as u8,
                    rng.below(3) as u8,
                );
                IpNet::new(addr.into(), len).unwrap()
            })
            .collect()
    };
    let probes: Vec<IpAddr> = (0..27u32)
        .map(|i| {
            std::net::Ipv4Addr::new(10, (i / 9) as u8, (i / 3 % 3) as u8, (i % 3) as u8).into()
        })
        .chain([std::net::Ipv4Addr::new(11, 0, 0, 1).into()])
        .collect();
    for round in 0..3000 {
        match rng.below(20) {
            0 => state.remove_all(),
            1..=5 => state.remove(&key(rng.below(12) as u8)),
            _ => {
                let config = PeerConfig {
                    allowed_ips: nets(&mut rng),
                    ..PeerConfig::default()
                };
                state.upsert(key(rng.below(12) as u8), config, None);
            }
        }
        state.commit();
        let mut afresh = Routes::default();
        for peer in state.peers.values() {
            for net in &lock(&peer.config).allowed_ips {
                afresh.insert(*net, peer.clone());
            }
        }
        for ip in &probes {
            assert_eq!(
                state.route(*ip).map(|p| p.key),
                afresh.lookup(*ip).map(|p| p.key),
                "{ip} after round {round}"
            );
        }
    }
}

/// A peer changed in place keeps its session index for an endpoint or AllowedIPs
/// change; a PSK or keepalive change gives it a new one (the old stays until the new
/// session's handshake); removing it frees its indices.
#[test]
fn a_peer_keeps_its_session_unless_its_psk_or_keepalive_changes() {
    let mut state = State::default();
    state.upsert(key(1), with(&["10.0.1.0/24"]), None);
    let index = lock(&state.peers[&key(1)].noise).index;
    let found = |state: &State, i: u32| state.by_receiver(i << 8).map(|p| p.key);
    assert_eq!(found(&state, index), Some(key(1)));
    let moved = "192.0.2.7:51820".parse().ok();
    state.upsert(key(1), with(&["10.0.9.0/24"]), moved);
    assert_eq!(lock(&state.peers[&key(1)].noise).index, index);
    assert_eq!(state.peers[&key(1)].endpoint(), moved);
    let psk = PeerConfig {
        psk: Some([7; 32]),
        ..with(&["10.0.9.0/24"])
    };
    state.upsert(key(1), psk, None);
    let fresh = lock(&state.peers[&key(1)].noise).index;
    assert_ne!(fresh, index);
    assert_eq!(found(&state, fresh), Some(key(1)));
    assert_eq!(
        state.peers[&key(1)].endpoint(),
        moved,
        "kept without a new one"
    );
    state.remove(&key(1));
    assert_eq!(found(&state, fresh), None);
    assert!(state.peers.is_empty());
}

/// A node with `secret` and one peer, `peer`.
fn node(secret: &StaticSecret, peer: &StaticSecret) -> State {
    let mut state = State::default();
    state.set_private_key(Some(secret.clone()));
    let key = PublicKey::from(peer).to_bytes();
    state.upsert(key, with(&["10.0.0.0/24"]), None);
    state
}

/// Runs one packet through `to`'s `Tunn` for its peer: what it answers, if anything.
fn deliver(to: &State, packet: &[u8]) -> Option<Vec<u8>> {
    use crate::userspace::wg::TunnResult;
    let peer = to.peers.values().next()?.clone();
    let mut noise = lock(&peer.noise);
    let tunn = to.session(&mut noise, &peer)?;
    let mut out = vec![0u8; 2048];
    match tunn.decapsulate(None, packet, &mut out) {
        TunnResult::WriteToNetwork(b) => Some(b.to_vec()),
        _ => None,
    }
}

/// A rotation's new private key keeps the session the node has, in both directions,
/// until a session under the new key is there, and the new key handshakes with a peer
/// that knows it (kernel WireGuard keeps receiving on its sessions too).
#[test]
fn a_new_private_key_keeps_the_session_it_had_until_the_new_one_is_made() {
    use crate::userspace::wg::TunnResult;
    let secret = |n: u8| StaticSecret::from([n; 32]);
    let (a_old, a_new, b) = (secret(1), secret(2), secret(3));
    let mut a = node(&a_old, &b);
    let b_state = node(&b, &a_old);
    let peer_b = a.peers.values().next().cloned().unwrap();
    let mut buf = vec![0u8; 2048];
    // A handshake between a (old key) and b, and a first packet that confirms it.
    let init = {
        let mut noise = lock(&peer_b.noise);
        let tunn = a.session(&mut noise, &peer_b).unwrap();
        match tunn.format_handshake_initiation(&mut buf, false) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            _ => panic!("no initiation"),
        }
    };
    let response = deliver(&b_state, &init).expect("b answers the initiation");
    let keepalive = deliver(&a, &response).expect("a confirms the session");
    assert!(deliver(&b_state, &keepalive).is_none());
    let old_index = lock(&peer_b.noise).index;

    a.set_private_key(Some(a_new.clone()));
    // The session made under the old key still carries traffic: its index still finds
    // b, and what a sends goes out on it, and b takes it.
    assert!(Arc::ptr_eq(a.by_receiver(old_index << 8).unwrap(), &peer_b));
    let ip_packet = {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[3] = 40;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        p
    };
    let sent = {
        let mut noise = lock(&peer_b.noise);
        let tunn = a.sending(&mut noise, &peer_b).unwrap();
        match tunn.encapsulate(&ip_packet, &mut buf) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            _ => panic!("the session it had does not send"),
        }
    };
    {
        let peer_a = b_state.peers.values().next().cloned().unwrap();
        let mut noise = lock(&peer_a.noise);
        let tunn = b_state.session(&mut noise, &peer_a).unwrap();
        let mut out = vec![0u8; 2048];
        assert!(matches!(
            tunn.decapsulate(None, &sent, &mut out),
            TunnResult::WriteToTunnelV4(..)
        ));
    }
    // The new key's handshake: a peer that knows only the old key cannot answer it;
    // b with a's next key staged can.
    let init = {
        let mut noise = lock(&peer_b.noise);
        assert_ne!(noise.index, old_index);
        let tunn = a.session(&mut noise, &peer_b).unwrap();
        match tunn.format_handshake_initiation(&mut buf, false) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            _ => panic!("no initiation under the new key"),
        }
    };
    assert!(deliver(&b_state, &init).is_none());
    let b_staged = node(&b, &a_new);
    assert!(deliver(&b_staged, &init).is_some());
}

/// The transfer counts `wg show` reports never go back: a PSK change's new `Tunn`
/// starts at zero, and the peer's counts still hold what the one before carried,
/// before and after it retires.
#[test]
fn a_psk_change_keeps_the_peers_transfer_counts() {
    use crate::userspace::wg::TunnResult;
    let secret = |n: u8| StaticSecret::from([n; 32]);
    let (a_key, b_key) = (secret(1), secret(2));
    let mut a = node(&a_key, &b_key);
    let mut b = node(&b_key, &a_key);
    let peer_b = a.peers.values().next().cloned().unwrap();
    let peer_a = b.peers.values().next().cloned().unwrap();
    let mut buf = vec![0u8; 2048];
    let initiation = |state: &State, peer: &Arc<Peer>, buf: &mut [u8]| {
        let mut noise = lock(&peer.noise);
        let tunn = state.session(&mut noise, peer).unwrap();
        match tunn.format_handshake_initiation(buf, false) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            _ => panic!("no initiation"),
        }
    };
    let handshake = |a: &State, b: &State, buf: &mut [u8]| {
        let response = deliver(b, &initiation(a, &peer_b, buf)).expect("b answers");
        let confirm = deliver(a, &response).expect("a confirms");
        assert!(deliver(b, &confirm).is_none());
    };
    // `from` sends a pod packet to its peer `via` on the session in use; the other side,
    // whose peer is `to`, takes it.
    let send = |from: &State, via: &Arc<Peer>, to: &Arc<Peer>, buf: &mut [u8]| {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[3] = 40;
        let sent = {
            let mut noise = lock(&via.noise);
            match from.sending(&mut noise, via).unwrap().encapsulate(&p, buf) {
                TunnResult::WriteToNetwork(p) => p.to_vec(),
                _ => panic!("no packet sent"),
            }
        };
        let mut noise = lock(&to.noise);
        let mut out = vec![0u8; 2048];
        let receiver = u32::from_le_bytes([sent[4], sent[5], sent[6], sent[7]]);
        assert!(matches!(
            noise
                .for_receiver(receiver)
                .unwrap()
                .decapsulate(None, &sent, &mut out),
            TunnResult::WriteToTunnelV4(..)
        ));
    };
    handshake(&a, &b, &mut buf);
    send(&a, &peer_b, &peer_a, &mut buf);
    send(&b, &peer_a, &peer_b, &mut buf);
    let counts = |state: &State| {
        let (_, tx, rx) = lock(&state.peers.values().next().unwrap().noise).stats();
        (tx, rx)
    };
    let before = counts(&a);
    assert!(before.0 > 0 && before.1 > 0, "{before:?}");

    let psk = PeerConfig {
        psk: Some([7; 32]),
        ..with(&["10.0.0.0/24"])
    };
    a.upsert(PublicKey::from(&b_key).to_bytes(), psk.clone(), None);
    b.upsert(PublicKey::from(&a_key).to_bytes(), psk, None);
    assert_eq!(
        counts(&a),
        before,
        "the new Tunn starts at zero; the peer does not"
    );
    handshake(&a, &b, &mut buf);
    send(&a, &peer_b, &peer_a, &mut buf);
    send(&b, &peer_a, &peer_b, &mut buf);
    lock(&peer_b.noise).retire();
    assert!(
        lock(&peer_b.noise).retiring.is_none(),
        "b sent on the new session"
    );
    let after = counts(&a);
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "{before:?} then {after:?}"
    );
}

/// What a `Receiver` under test sent and delivered.
#[derive(Default)]
struct Captured {
    sent: Vec<Vec<u8>>,
    delivered: usize,
}

impl super::super::rx::Outputs for &mut Captured {
    fn send(&mut self, _: super::super::udp::Endpoint, datagram: &[u8]) {
        self.sent.push(datagram.to_vec());
    }
    fn deliver(&mut self, _: &[u8]) {
        self.delivered += 1;
    }
}

/// One datagram through `state`'s receiving side: what it answered, and how many packets
/// reached the TUN device.
fn receive(state: &State, datagram: &[u8]) -> Captured {
    let mut captured = Captured::default();
    let from: std::net::SocketAddr = "192.0.2.1:51820".parse().unwrap();
    let mut rx = super::super::rx::Receiver::new(&mut captured, false);
    rx.batch(state, &mut datagram.to_vec(), 0, (from, None));
    drop(rx);
    captured
}

/// A PSK (or key) change that comes just after the device answered an initiation keeps
/// the session that answer made: the initiator sends on it as soon as it has the
/// response, and its first packets still arrive. The new `Tunn` then handshakes at once,
/// not only when traffic asks (in the VM, a pair whose PSKs both changed this way had no
/// session and no handshake until its pods sent something).
#[test]
fn a_change_just_after_answering_keeps_the_answered_session_and_handshakes_at_once() {
    use crate::userspace::wg::TunnResult;
    let secret = |n: u8| StaticSecret::from([n; 32]);
    let (a_key, b_key) = (secret(1), secret(2));
    let a = node(&a_key, &b_key);
    let mut b = node(&b_key, &a_key);
    let peer_b = a.peers.values().next().cloned().unwrap();
    let peer_a = b.peers.values().next().cloned().unwrap();
    let mut buf = vec![0u8; 2048];
    let init = {
        let mut noise = lock(&peer_b.noise);
        match a
            .session(&mut noise, &peer_b)
            .unwrap()
            .format_handshake_initiation(&mut buf, false)
        {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            _ => panic!("no initiation"),
        }
    };
    let answered = receive(&b, &init);
    assert_eq!(answered.sent.len(), 1, "b answers the initiation");
    let keepalive = deliver(&a, &answered.sent[0]).expect("a takes the response");

    // b's PSK changes before a's first packet on the new session has arrived.
    let psk = PeerConfig {
        psk: Some([7; 32]),
        ..with(&["10.0.0.0/24"])
    };
    b.upsert(PublicKey::from(&a_key).to_bytes(), psk, None);
    b.commit();
    assert!(
        lock(&peer_a.noise).initiate,
        "the new Tunn is due to handshake at once"
    );
    assert!(receive(&b, &keepalive).sent.is_empty());
    let mut pkt = vec![0u8; 40];
    pkt[0] = 0x45;
    pkt[3] = 40;
    pkt[12..16].copy_from_slice(&[10, 0, 0, 1]);
    let data = {
        let mut noise = lock(&peer_b.noise);
        match a
            .sending(&mut noise, &peer_b)
            .unwrap()
            .encapsulate(&pkt, &mut buf)
        {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            _ => panic!("a does not send on its new session"),
        }
    };
    assert_eq!(
        receive(&b, &data).delivered,
        1,
        "a's packet on the answered session reaches b's pods"
    );
}
