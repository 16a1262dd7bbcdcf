//! A tunnel against boringtun's: handshakes either way through the public calls the
//! device makes, queued packets flushed after the handshake, data both ways.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;

use boringtun::noise::{Tunn, TunnResult as Theirs};
use x25519_dalek::{PublicKey, StaticSecret};

use super::*;

const FROM: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));

fn key(n: u8) -> StaticSecret {
    StaticSecret::from([n; 32])
}

fn ours() -> Tunnel {
    Tunnel::new(
        key(1),
        PublicKey::from(&key(2)),
        None,
        None,
        Arc::new(Indices::default()),
        Instant::now(),
    )
}

fn theirs() -> Tunn {
    Tunn::new(key(2), PublicKey::from(&key(1)), None, None, 5, None)
}

fn ip_packet(len: usize, tag: u8) -> Vec<u8> {
    let mut p = vec![tag; len];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    p[12..16].copy_from_slice(&[10, 0, 0, 1]);
    p[16..20].copy_from_slice(&[10, 0, 0, 2]);
    p
}

fn net(r: TunnResult<'_>) -> Vec<u8> {
    match r {
        TunnResult::WriteToNetwork(b) => b.to_vec(),
        other => panic!("expected a datagram, got {other:?}"),
    }
}

fn their_net(r: Theirs<'_>) -> Vec<u8> {
    match r {
        Theirs::WriteToNetwork(b) => b.to_vec(),
        other => panic!("expected a datagram, got {other:?}"),
    }
}

#[test]
fn traffic_before_a_session_handshakes_and_the_queue_goes_out_after_it() {
    let (mut a, mut b) = (ours(), theirs());
    let mut buf = vec![0u8; 2048];
    let mut bbuf = vec![0u8; 2048];
    let first = ip_packet(100, 1);
    let init = net(a.encapsulate(&first, Instant::now(), &mut buf));
    assert_eq!(init[0], 1, "an initiation");
    assert!(matches!(
        a.encapsulate(&ip_packet(60, 2), Instant::now(), &mut buf),
        TunnResult::Done
    ));
    assert!(a.time_since_last_handshake(Instant::now()).is_none());
    let response = their_net(b.decapsulate(Some(FROM), &init, &mut bbuf));
    let keepalive = net(a.decapsulate(&response, Instant::now(), &mut buf));
    assert!(a.time_since_last_handshake(Instant::now()).is_some());
    assert!(matches!(
        b.decapsulate(Some(FROM), &keepalive, &mut bbuf),
        Theirs::Done
    ));
    // The two queued packets, in order.
    for want in [ip_packet(100, 1), ip_packet(60, 2)] {
        let d = net(a.decapsulate(&[], Instant::now(), &mut buf));
        match b.decapsulate(Some(FROM), &d, &mut bbuf) {
            Theirs::WriteToTunnelV4(p, _) => assert_eq!(p, &want[..]),
            other => panic!("{other:?}"),
        }
    }
    assert!(matches!(
        a.decapsulate(&[], Instant::now(), &mut buf),
        TunnResult::Done
    ));
    // And back.
    let back = their_net(b.encapsulate(&ip_packet(80, 3), &mut bbuf));
    match a.decapsulate(&back, Instant::now(), &mut buf) {
        TunnResult::WriteToTunnelV4(p, src) => {
            assert_eq!(p, &ip_packet(80, 3)[..]);
            assert_eq!(src, Ipv4Addr::new(10, 0, 0, 1));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        a.decapsulate(&back, Instant::now(), &mut buf),
        TunnResult::Err(TunnelError::Data(OpenError::Replayed))
    ));
    let (_, tx, rx) = a.stats(Instant::now());
    assert_eq!((tx, rx), (160, 80));
}

#[test]
fn a_responder_sends_on_the_new_session_once_the_peer_has_used_it() {
    let (mut a, mut b) = (ours(), theirs());
    let mut buf = vec![0u8; 2048];
    let mut bbuf = vec![0u8; 2048];
    let init = their_net(b.format_handshake_initiation(&mut bbuf, false));
    let response = net(a.decapsulate(&init, Instant::now(), &mut buf));
    assert_eq!(response[0], 2);
    assert!(
        a.time_since_last_handshake(Instant::now()).is_none(),
        "not confirmed yet"
    );
    let keepalive = their_net(b.decapsulate(Some(FROM), &response, &mut bbuf));
    assert!(matches!(
        a.decapsulate(&keepalive, Instant::now(), &mut buf),
        TunnResult::Done
    ));
    let data = net(a.encapsulate(&ip_packet(200, 4), Instant::now(), &mut buf));
    assert_eq!(data[0], 4);
    assert!(matches!(
        b.decapsulate(Some(FROM), &data, &mut bbuf),
        Theirs::WriteToTunnelV4(..)
    ));
}

#[test]
fn a_forged_data_message_or_a_stranger_initiation_changes_nothing() {
    let (mut a, mut b) = (ours(), theirs());
    let mut buf = vec![0u8; 2048];
    let mut bbuf = vec![0u8; 2048];
    let init = net(a.format_handshake_initiation(Instant::now(), &mut buf, false));
    let response = their_net(b.decapsulate(Some(FROM), &init, &mut bbuf));
    let keepalive = net(a.decapsulate(&response, Instant::now(), &mut buf));
    assert!(matches!(
        b.decapsulate(Some(FROM), &keepalive, &mut bbuf),
        Theirs::Done
    ));
    let mut data = net(a.encapsulate(&ip_packet(100, 5), Instant::now(), &mut buf));
    data[40] ^= 1;
    assert!(matches!(
        b.decapsulate(Some(FROM), &data, &mut bbuf),
        Theirs::Err(_)
    ));
    let back = their_net(b.encapsulate(&ip_packet(100, 6), &mut bbuf));
    let mut bad = back.clone();
    bad[30] ^= 1;
    assert!(matches!(
        a.decapsulate(&bad, Instant::now(), &mut buf),
        TunnResult::Err(TunnelError::Data(OpenError::Forged))
    ));
    assert!(
        matches!(
            a.decapsulate(&back, Instant::now(), &mut buf),
            TunnResult::WriteToTunnelV4(..)
        ),
        "the forgery did not use up the counter"
    );
    // An initiation from a third key is not answered.
    let mut stranger = Tunn::new(key(3), PublicKey::from(&key(1)), None, None, 9, None);
    let init = their_net(stranger.format_handshake_initiation(&mut bbuf, false));
    assert!(matches!(
        a.decapsulate(&init, Instant::now(), &mut buf),
        TunnResult::Err(TunnelError::Handshake(HandshakeError::WrongKey))
    ));
    assert!(
        a.time_since_last_handshake(Instant::now()).is_some(),
        "the session stays"
    );
}

#[test]
fn a_decrypted_packet_shorter_than_an_ip_header_says_is_not_ip() {
    let mut p = ip_packet(40, 7);
    assert!(inner(&p).is_some());
    p[2..4].copy_from_slice(&19u16.to_be_bytes());
    assert_eq!(inner(&p), None, "an IPv4 total length under 20");
    p[2..4].copy_from_slice(&41u16.to_be_bytes());
    assert_eq!(inner(&p), None, "longer than what arrived");
}
