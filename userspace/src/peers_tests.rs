//! The peer table's tests: session indices, AllowedIPs, in-place changes and the sessions
//! and counts a change keeps.

use super::*;

/// Every session index a peer's tunnel holds finds the peer, and a removed peer's are
/// given back.
#[test]
fn a_peers_session_indices_find_it_until_it_is_removed() {
    use crate::wg::TunnResult;
    let secret = StaticSecret::from([1; 32]);
    let peer = StaticSecret::from([2; 32]);
    let state = &mut node(&secret, &peer);
    let p = state.peers.values().next().cloned().unwrap();
    let mut buf = vec![0u8; 256];
    let mut indices = Vec::new();
    for _ in 0..3 {
        let mut noise = lock(&p.noise);
        let tunn = state.session(&mut noise, &p).unwrap();
        match tunn.format_handshake_initiation(Instant::now(), &mut buf, true) {
            TunnResult::WriteToNetwork(m) => {
                indices.push(u32::from_le_bytes([m[4], m[5], m[6], m[7]]))
            }
            _ => panic!("no initiation"),
        }
    }
    // Only the last attempt is pending (a retry supersedes the one before); the others
    // were given back.
    assert!(indices[..2].iter().all(|i| state.by_receiver(*i).is_none()));
    assert!(Arc::ptr_eq(state.by_receiver(indices[2]).unwrap(), &p));
    state.remove(&PublicKey::from(&peer).to_bytes());
    assert!(indices.iter().all(|i| state.by_receiver(*i).is_none()));
    assert!(state.indices.is_empty(), "nothing held after the removal");
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

/// A node with `secret` and one peer, `peer`.
fn node(secret: &StaticSecret, peer: &StaticSecret) -> State {
    let mut state = State::default();
    state.set_private_key(Some(secret.clone()));
    let key = PublicKey::from(peer).to_bytes();
    state.upsert(key, with(&["10.0.0.0/24"]), None);
    state.commit();
    state
}

fn secret(n: u8) -> StaticSecret {
    StaticSecret::from([n; 32])
}

/// Runs one message through `to`'s tunnel for its only peer (MACs unchecked): what it
/// answers, if anything.
fn deliver(to: &State, packet: &[u8]) -> Option<Vec<u8>> {
    use crate::wg::TunnResult;
    let peer = to.peers.values().next()?.clone();
    let mut noise = lock(&peer.noise);
    let tunn = to.session(&mut noise, &peer)?;
    let mut out = vec![0u8; 2048];
    match tunn.decapsulate(packet, Instant::now(), &mut out) {
        TunnResult::WriteToNetwork(b) => Some(b.to_vec()),
        _ => None,
    }
}

/// An initiation from `state`'s tunnel to its only peer.
fn initiation(state: &State) -> Vec<u8> {
    use crate::wg::TunnResult;
    let peer = state.peers.values().next().cloned().unwrap();
    let mut noise = lock(&peer.noise);
    let mut buf = vec![0u8; 256];
    match state
        .session(&mut noise, &peer)
        .unwrap()
        .format_handshake_initiation(Instant::now(), &mut buf, true)
    {
        TunnResult::WriteToNetwork(p) => p.to_vec(),
        _ => panic!("no initiation"),
    }
}

/// A pod packet from `from` to its only peer, sealed on the session in use.
fn pod_packet(from: &State) -> Vec<u8> {
    use crate::wg::TunnResult;
    let peer = from.peers.values().next().cloned().unwrap();
    let mut p = vec![0u8; 40];
    p[0] = 0x45;
    p[3] = 40;
    p[12..16].copy_from_slice(&[10, 0, 0, 1]);
    p[16..20].copy_from_slice(&[10, 0, 0, 2]);
    let mut buf = vec![0u8; 2048];
    let mut noise = lock(&peer.noise);
    match from
        .session(&mut noise, &peer)
        .unwrap()
        .encapsulate(&p, Instant::now(), &mut buf)
    {
        TunnResult::WriteToNetwork(m) if m[0] == 4 => m.to_vec(),
        _ => panic!("no data message"),
    }
}

/// A full handshake initiated by `a`, confirmed by a's keepalive: the datagrams.
fn handshake(a: &State, b: &State) -> (Vec<u8>, Vec<u8>) {
    let init = initiation(a);
    let response = deliver(b, &init).expect("b answers");
    let confirm = deliver(a, &response).expect("a confirms");
    assert!(deliver(b, &confirm).is_none());
    (init, response)
}

/// A rotation's new private key keeps the session the node has, in both directions,
/// until a session under the new key is there, and the new key handshakes with a peer
/// that knows it (kernel WireGuard keeps receiving on its sessions too).
#[test]
fn a_new_private_key_keeps_the_session_it_had_until_the_new_one_is_made() {
    let (a_old, a_new, b) = (secret(1), secret(2), secret(3));
    let mut a = node(&a_old, &b);
    let b_state = node(&b, &a_old);
    handshake(&a, &b_state);
    a.set_private_key(Some(a_new.clone()));
    assert!(lock(&a.peers.values().next().unwrap().noise).initiate);
    // The session made under the old key still carries traffic both ways.
    assert!(deliver(&b_state, &pod_packet(&a)).is_none());
    let from_b = pod_packet(&b_state);
    let peer_b = a.peers.values().next().cloned().unwrap();
    assert!(a
        .by_receiver(u32::from_le_bytes([
            from_b[4], from_b[5], from_b[6], from_b[7]
        ]))
        .is_some_and(|p| Arc::ptr_eq(p, &peer_b)));
    // The new key's handshake: a peer that knows only the old key cannot answer it; b
    // with a's next key staged can.
    let init = initiation(&a);
    assert!(deliver(&b_state, &init).is_none());
    let b_staged = node(&b, &a_new);
    assert!(deliver(&b_staged, &init).is_some());
}

/// A PSK, keepalive or private key change, or a removal and return, keeps what the peer
/// must keep: the newest initiation timestamp (a recorded initiation is refused after
/// every one of them), the session in use, and the transfer counts. A PSK change applies
/// to the next handshake, which is due at once.
#[test]
fn every_change_keeps_the_replay_memory_the_session_and_the_counts() {
    let (a_key, b_key) = (secret(1), secret(2));
    let a = node(&a_key, &b_key);
    let mut b = node(&b_key, &a_key);
    let a_pub = PublicKey::from(&a_key).to_bytes();
    let (recorded, _) = handshake(&a, &b);
    assert!(deliver(&b, &pod_packet(&a)).is_none());
    let counts = |state: &State| {
        let (_, tx, rx) = lock(&state.peers.values().next().unwrap().noise).stats(Instant::now());
        (tx, rx)
    };
    let before = counts(&b);
    assert!(before.1 > 0, "{before:?}");
    let changes: [(&str, PeerConfig); 3] = [
        (
            "keepalive",
            PeerConfig {
                keepalive: 25,
                ..with(&["10.0.0.0/24"])
            },
        ),
        (
            "psk",
            PeerConfig {
                keepalive: 25,
                psk: Some([7; 32]),
                ..with(&["10.0.0.0/24"])
            },
        ),
        (
            "allowed-ips",
            PeerConfig {
                keepalive: 25,
                psk: Some([7; 32]),
                ..with(&["10.0.0.0/16"])
            },
        ),
    ];
    for (what, config) in changes {
        b.upsert(a_pub, config, None);
        b.commit();
        assert_eq!(
            deliver(&b, &recorded),
            None,
            "{what}: the recorded initiation is refused"
        );
        assert!(
            deliver(&b, &pod_packet(&a)).is_none(),
            "{what}: the session in use still opens"
        );
        assert!(counts(&b).1 > before.1, "{what}: counts go on");
    }
    assert!(
        lock(&b.peers[&a_pub].noise).initiate,
        "a PSK change handshakes at once"
    );
    b.set_private_key(Some(secret(9)));
    b.set_private_key(Some(b_key.clone()));
    assert_eq!(deliver(&b, &recorded), None, "key change: refused");
    // Removed and added again (the liveness watcher's re-handshake): refused too.
    let config = lock(&b.peers[&a_pub].config).clone();
    b.remove(&a_pub);
    b.upsert(a_pub, config, None);
    b.commit();
    assert_eq!(deliver(&b, &recorded), None, "remove and add: refused");
    // While a fresh initiation from the peer is answered.
    std::thread::sleep(std::time::Duration::from_millis(25));
    assert!(
        deliver(&b, &initiation(&a)).is_some(),
        "a new initiation is answered"
    );
}

/// An answered initiation's session waits in `next`: the session in use keeps carrying
/// traffic both ways until the peer's first data message on the new one confirms it, so
/// an initiation that is never followed by data (a replay, or a peer that lost the
/// response) cuts nothing.
#[test]
fn an_answered_session_is_used_only_once_the_peer_confirms_it() {
    let (a_key, b_key) = (secret(1), secret(2));
    let a = node(&a_key, &b_key);
    let b = node(&b_key, &a_key);
    handshake(&a, &b);
    let first = pod_packet(&b);
    // a initiates again; b answers, but the response is lost.
    std::thread::sleep(std::time::Duration::from_millis(25));
    assert!(deliver(&b, &initiation(&a)).is_some());
    let still = pod_packet(&b);
    assert_eq!(
        first[4..8],
        still[4..8],
        "b still sends on the confirmed session"
    );
    assert!(deliver(&a, &still).is_none(), "and a opens it");
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

/// A PSK change that comes just after the device answered an initiation keeps the
/// session that answer made: the initiator sends on it as soon as it has the response,
/// and its first packets still arrive. The tunnel then handshakes at once, not only when
/// traffic asks (in the VM, a pair whose PSKs both changed this way had no session and no
/// handshake until its pods sent something).
#[test]
fn a_change_just_after_answering_keeps_the_answered_session_and_handshakes_at_once() {
    let (a_key, b_key) = (secret(1), secret(2));
    let a = node(&a_key, &b_key);
    let mut b = node(&b_key, &a_key);
    let peer_a = b.peers.values().next().cloned().unwrap();
    let answered = receive(&b, &initiation(&a));
    assert_eq!(answered.sent.len(), 1, "b answers the initiation");
    let keepalive = deliver(&a, &answered.sent[0]).expect("a takes the response");
    let psk = PeerConfig {
        psk: Some([7; 32]),
        ..with(&["10.0.0.0/24"])
    };
    b.upsert(PublicKey::from(&a_key).to_bytes(), psk, None);
    b.commit();
    assert!(lock(&peer_a.noise).initiate, "due to handshake at once");
    assert!(receive(&b, &keepalive).sent.is_empty());
    assert_eq!(
        receive(&b, &pod_packet(&a)).delivered,
        1,
        "a's packet on the answered session reaches b's pods"
    );
}

/// Timestamps a device before this one saved are taken at start: an initiation not newer
/// than the saved one is refused, and the peer's next one is answered at once (no 20 ms
/// gap is owed to a timestamp consumed by another process).
#[test]
fn saved_timestamps_refuse_old_initiations_and_let_a_new_one_in_at_once() {
    let (a_key, b_key) = (secret(1), secret(2));
    let a = node(&a_key, &b_key);
    let old = initiation(&a);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let b_before = node(&b_key, &a_key);
    assert!(deliver(&b_before, &old).is_some());
    let saved = b_before.timestamps().into_iter().collect();
    let mut b = node(&b_key, &a_key);
    b.remember_saved(saved, Instant::now());
    assert!(deliver(&b, &old).is_none(), "the recorded one is refused");
    assert!(
        deliver(&b, &initiation(&a)).is_some(),
        "a new one is answered at once"
    );
}
