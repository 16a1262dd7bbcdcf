//! The handshake against boringtun's, message for message: each side initiates, the
//! other answers, and data sealed by one opens on the other.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;

use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Tunn, TunnResult};
use x25519_dalek::{PublicKey, StaticSecret};

use super::*;

const FROM: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));

fn key(n: u8) -> StaticSecret {
    StaticSecret::from([n; 32])
}

/// boringtun's tunnel for `ours` to `peer` (its index 77).
fn theirs(ours: u8, peer: u8, psk: Option<[u8; 32]>) -> Tunn {
    let peer = PublicKey::from(&key(peer));
    Tunn::new(key(ours), peer, psk, None, 77, None)
}

fn written(r: TunnResult<'_>) -> Vec<u8> {
    match r {
        TunnResult::WriteToNetwork(b) => b.to_vec(),
        other => panic!("expected a datagram, got {other:?}"),
    }
}

/// An IPv4 packet of `len` bytes from 10.0.0.1.
fn ip_packet(len: usize) -> Vec<u8> {
    let mut p = vec![0u8; len];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    p[12..16].copy_from_slice(&[10, 0, 0, 1]);
    p[16..20].copy_from_slice(&[10, 0, 0, 2]);
    p
}

/// Data both ways between `session` and boringtun's `tunn`, whose session it shares.
fn carries(session: &Session, tunn: &mut Tunn) {
    let mut buf = vec![0u8; 2048];
    let pkt = ip_packet(120);
    let mut msg = vec![0u8; pkt.len() + 32];
    let n = session.seal(&pkt, &mut msg).unwrap();
    match tunn.decapsulate(Some(FROM), &msg[..n], &mut buf) {
        TunnResult::WriteToTunnelV4(p, _) => assert_eq!(p, &pkt[..]),
        other => panic!("boringtun did not open ours: {other:?}"),
    }
    let sealed = written(tunn.encapsulate(&pkt, &mut buf));
    let mut out = vec![0u8; 2048];
    let n = session.open(&sealed, &mut out).unwrap();
    assert_eq!(&out[..n], &pkt[..]);
}

#[test]
fn our_initiation_completes_with_boringtun_and_carries_data() {
    let mut ours = Handshake::new(key(1), PublicKey::from(&key(2)), None);
    let mut tunn = theirs(2, 1, None);
    let mut init = [0u8; INIT_LEN];
    ours.initiate(0x1234_5601, Instant::now(), &mut init)
        .unwrap();
    let mut buf = vec![0u8; 2048];
    let response = written(tunn.decapsulate(Some(FROM), &init, &mut buf));
    let session = ours.complete(&response, Instant::now()).unwrap();
    assert_eq!(session.local, 0x1234_5601);
    assert!(ours.in_flight().is_none(), "the attempt is over");
    // boringtun sends on it once it has our first message (the keepalive).
    let mut keepalive = [0u8; 32];
    session.seal(&[], &mut keepalive).unwrap();
    assert!(matches!(
        tunn.decapsulate(Some(FROM), &keepalive, &mut buf),
        TunnResult::Done
    ));
    carries(&session, &mut tunn);
    assert_eq!(
        ours.complete(&response, Instant::now()).err(),
        Some(HandshakeError::Unexpected),
        "a response is taken once"
    );
}

#[test]
fn boringtuns_initiation_is_answered_and_the_session_carries_data() {
    let psk = Some([9u8; 32]);
    let mut ours = Handshake::new(key(1), PublicKey::from(&key(2)), psk);
    let mut tunn = theirs(2, 1, psk);
    let mut buf = vec![0u8; 2048];
    let init = written(tunn.format_handshake_initiation(&mut buf, false));
    assert_eq!(
        initiator_of(&key(1), &PublicKey::from(&key(1)), &init),
        Some(*PublicKey::from(&key(2)).as_bytes())
    );
    let mut response = [0u8; RESPONSE_LEN];
    let (session, n) = ours
        .respond(&init, Instant::now(), || Some(0x42_07), &mut response)
        .unwrap();
    assert_eq!(n, RESPONSE_LEN);
    let keepalive = written(tunn.decapsulate(Some(FROM), &response, &mut buf));
    let mut out = [0u8; 64];
    assert_eq!(session.open(&keepalive, &mut out), Ok(0));
    carries(&session, &mut tunn);
    // The same initiation again is a replay.
    assert_eq!(
        ours.respond(&init, Instant::now(), || Some(0x42_08), &mut response)
            .err(),
        Some(HandshakeError::Replayed)
    );
}

#[test]
fn wrong_keys_and_psks_and_altered_messages_are_refused() {
    let mut buf = vec![0u8; 2048];
    // An initiation from a key that is not the peer's.
    let mut ours = Handshake::new(key(1), PublicKey::from(&key(2)), None);
    let init = written(theirs(3, 1, None).format_handshake_initiation(&mut buf, false));
    let mut out = [0u8; RESPONSE_LEN];
    assert_eq!(
        ours.respond(&init, Instant::now(), || Some(1), &mut out)
            .err(),
        Some(HandshakeError::WrongKey)
    );
    // An initiation to another key.
    let init = written(theirs(2, 4, None).format_handshake_initiation(&mut buf, false));
    assert_eq!(
        ours.respond(&init, Instant::now(), || Some(1), &mut out)
            .err(),
        Some(HandshakeError::Forged)
    );
    // A PSK only one side has: the response does not verify.
    let mut ours = Handshake::new(key(1), PublicKey::from(&key(2)), Some([5; 32]));
    let mut init = [0u8; INIT_LEN];
    ours.initiate(7, Instant::now(), &mut init).unwrap();
    let response = written(theirs(2, 1, None).decapsulate(Some(FROM), &init, &mut buf));
    assert_eq!(
        ours.complete(&response, Instant::now()).err(),
        Some(HandshakeError::Forged)
    );
    // Any changed byte of an initiation is refused.
    let mut ours = Handshake::new(key(1), PublicKey::from(&key(2)), None);
    let init = written(theirs(2, 1, None).format_handshake_initiation(&mut buf, false));
    for at in 8..116 {
        let mut bad = init.clone();
        bad[at] ^= 0x20;
        assert!(
            ours.respond(&bad, Instant::now(), || Some(1), &mut out)
                .is_err(),
            "byte {at}"
        );
    }
    assert!(
        ours.respond(&init, Instant::now(), || Some(1), &mut out)
            .is_ok(),
        "the untouched one is taken"
    );
}

#[test]
fn a_cookie_from_a_loaded_peer_is_taken_and_its_mac2_passes_the_load_check() {
    let peer_public = PublicKey::from(&key(2));
    // A limiter already at its limit: every handshake message needs a valid mac2.
    let limiter = Arc::new(RateLimiter::new(&peer_public, 0));
    let mut ours = Handshake::new(key(1), peer_public, None);
    let mut init = [0u8; INIT_LEN];
    ours.initiate(7, Instant::now(), &mut init).unwrap();
    let mut reply = [0u8; COOKIE_LEN];
    let cookie = match limiter.verify_packet(Some(FROM), &init, &mut reply) {
        Err(TunnResult::WriteToNetwork(c)) => c.to_vec(),
        other => panic!("expected a cookie reply, got {other:?}"),
    };
    let mut forged = cookie.clone();
    forged[40] ^= 1;
    assert_eq!(
        ours.take_cookie(&forged, Instant::now()).err(),
        Some(HandshakeError::Forged)
    );
    ours.take_cookie(&cookie, Instant::now()).unwrap();
    assert_eq!(
        ours.take_cookie(&cookie, Instant::now()).err(),
        Some(HandshakeError::Unexpected),
        "one cookie per message sent"
    );
    ours.initiate(8, Instant::now(), &mut init).unwrap();
    assert!(
        limiter.verify_packet(Some(FROM), &init, &mut reply).is_ok(),
        "mac2 made with the cookie is accepted under load"
    );
    // From another source address the cookie does not hold.
    let elsewhere = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 9));
    assert!(limiter
        .verify_packet(Some(elsewhere), &init, &mut reply)
        .is_err());
}

#[test]
fn an_initiation_with_a_low_order_ephemeral_is_refused() {
    let mut ours = Handshake::new(key(1), PublicKey::from(&key(2)), None);
    let mut buf = vec![0u8; 2048];
    let mut init = written(theirs(2, 1, None).format_handshake_initiation(&mut buf, false));
    init[8..40].copy_from_slice(&[0u8; 32]);
    let mut out = [0u8; RESPONSE_LEN];
    assert_eq!(
        ours.respond(&init, Instant::now(), || Some(1), &mut out)
            .err(),
        Some(HandshakeError::Forged)
    );
    assert_eq!(
        initiator_of(&key(1), &PublicKey::from(&key(1)), &init),
        None
    );
}
