//! The cookie checker against boringtun as the other side: its messages' mac1 verifies,
//! our cookie reply is taken by it (and by our own handshake), and its next message's
//! mac2 verifies only from the address and port the cookie was made for, and only while
//! the secret lives.

use std::net::SocketAddr;
use std::time::Instant;

use boringtun::noise::{Tunn, TunnResult};
use x25519_dalek::StaticSecret;

use super::super::handshake::Handshake;
use super::*;

fn key(n: u8) -> StaticSecret {
    StaticSecret::from([n; 32])
}

fn written(r: TunnResult<'_>) -> Vec<u8> {
    match r {
        TunnResult::WriteToNetwork(b) => b.to_vec(),
        other => panic!("expected a datagram, got {other:?}"),
    }
}

#[test]
fn a_cookie_binds_the_source_address_and_port_and_boringtun_takes_ours() {
    let ours = PublicKey::from(&key(1));
    let checker = Checker::new(&ours);
    let mut peer = Tunn::new(key(2), ours, None, None, 5, None);
    let mut buf = vec![0u8; 2048];
    let init = written(peer.format_handshake_initiation(&mut buf, false));
    let now = Instant::now();
    let from: SocketAddr = "198.51.100.2:51820".parse().unwrap();
    assert_eq!(checker.check(&init, from, now), Macs::Mac1);
    for at in [0, 20, 120, 131] {
        let mut bad = init.clone();
        bad[at] ^= 1;
        assert_eq!(checker.check(&bad, from, now), Macs::Invalid, "byte {at}");
    }
    let reply = checker.reply(&init, from, now).unwrap();
    assert!(matches!(
        peer.decapsulate(Some(from.ip()), &reply, &mut buf),
        TunnResult::Done
    ));
    let again = written(peer.format_handshake_initiation(&mut buf, true));
    assert_eq!(checker.check(&again, from, now), Macs::Mac2);
    let other_port: SocketAddr = "198.51.100.2:51821".parse().unwrap();
    assert_eq!(
        checker.check(&again, other_port, now),
        Macs::Mac1,
        "the cookie is bound to the source port too"
    );
    let other_host: SocketAddr = "198.51.100.3:51820".parse().unwrap();
    assert_eq!(checker.check(&again, other_host, now), Macs::Mac1);
    assert_eq!(
        checker.check(&again, from, now + SECRET_LIFE),
        Macs::Mac1,
        "a new secret after two minutes"
    );
}

#[test]
fn our_handshake_takes_our_cookie_reply_and_its_next_mac2_verifies() {
    let (a, b) = (key(1), key(2));
    let checker = Checker::new(&PublicKey::from(&b));
    let mut hs = Handshake::new(a, PublicKey::from(&b), None);
    let now = Instant::now();
    let from: SocketAddr = "[2001:db8::1]:4000".parse().unwrap();
    let mut init = [0u8; 148];
    hs.initiate(7, now, &mut init).unwrap();
    let reply = checker.reply(&init, from, now).unwrap();
    let mut forged = reply;
    forged[40] ^= 1;
    assert!(hs.take_cookie(&forged, now).is_err());
    hs.take_cookie(&reply, now).unwrap();
    hs.initiate(8, now, &mut init).unwrap();
    assert_eq!(checker.check(&init, from, now), Macs::Mac2);
}
