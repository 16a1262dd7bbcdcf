//! WireGuard's timers (whitepaper §6), each with time moved by the test: two of our own
//! tunnels, every call given the `now` the test chooses, so minutes pass in microseconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use x25519_dalek::{PublicKey, StaticSecret};

use super::super::cookie::Checker;
use super::super::index::Indices;
use super::super::timers::*;
use super::*;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn tunnel(me: u8, peer: u8, keepalive: Option<u16>, t0: Instant) -> Tunnel {
    Tunnel::new(
        StaticSecret::from([me; 32]),
        PublicKey::from(&StaticSecret::from([peer; 32])),
        None,
        keepalive,
        Arc::new(Indices::default()),
        t0,
    )
}

fn ip_packet() -> Vec<u8> {
    let mut p = vec![0u8; 60];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&60u16.to_be_bytes());
    p[12..16].copy_from_slice(&[10, 0, 0, 1]);
    p
}

/// The message type of what a call wrote, if it wrote one.
fn kind(r: TunnResult<'_>) -> Option<u8> {
    match r {
        TunnResult::WriteToNetwork(b) => b.first().copied(),
        _ => None,
    }
}

fn bytes(r: TunnResult<'_>) -> Vec<u8> {
    match r {
        TunnResult::WriteToNetwork(b) => b.to_vec(),
        other => panic!("expected a datagram, got {other:?}"),
    }
}

/// `a` initiates at `now`; `b` answers; `a` confirms. Both then have a session in use.
fn handshake(a: &mut Tunnel, b: &mut Tunnel, now: Instant) {
    let mut buf = vec![0u8; 2048];
    let init = bytes(a.format_handshake_initiation(now, &mut buf, true));
    let response = bytes(b.decapsulate(&init, now, &mut buf));
    let keepalive = bytes(a.decapsulate(&response, now, &mut buf));
    assert!(matches!(
        b.decapsulate(&keepalive, now, &mut buf),
        TunnResult::Done
    ));
    assert!(a.established() && b.established());
}

/// A packet from `from` at `now`: whether `to` opened it.
fn send(from: &mut Tunnel, to: &mut Tunnel, now: Instant) -> bool {
    let mut buf = vec![0u8; 2048];
    let mut out = vec![0u8; 2048];
    match from.encapsulate(&ip_packet(), now, &mut buf) {
        TunnResult::WriteToNetwork(m) if m[0] == 4 => {
            matches!(
                to.decapsulate(m, now, &mut out),
                TunnResult::WriteToTunnelV4(..)
            )
        }
        _ => false,
    }
}

/// What the timers write at `now`.
fn tick(t: &mut Tunnel, now: Instant) -> Option<u8> {
    let mut buf = vec![0u8; 2048];
    kind(t.update_timers(now, &mut buf))
}

#[test]
fn the_initiator_rekeys_after_rekey_after_time_and_the_responder_does_not() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut a, &mut b, t0);
    assert!(send(&mut a, &mut b, t0 + secs(1)));
    assert!(send(&mut b, &mut a, t0 + secs(1)));
    let at = t0 + REKEY_AFTER_TIME - secs(1);
    assert!(send(&mut a, &mut b, at));
    assert_eq!(tick(&mut a, at), None, "not yet");
    let at = t0 + REKEY_AFTER_TIME + secs(1);
    assert!(
        send(&mut b, &mut a, at),
        "the session still carries traffic"
    );
    assert!(send(&mut a, &mut b, at));
    assert_eq!(tick(&mut b, at), None, "the responder waits");
    assert_eq!(
        tick(&mut a, at),
        Some(1),
        "the initiator sends an initiation"
    );
}

#[test]
fn a_session_is_refused_after_reject_after_time_in_every_slot() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut a, &mut b, t0);
    // b rekeys at 100 s: a's old session becomes previous, and still opens for a while.
    handshake(&mut b, &mut a, t0 + secs(100));
    let mut buf = vec![0u8; 2048];
    let late = t0 + REJECT_AFTER_TIME;
    tick(&mut a, late);
    tick(&mut b, late);
    assert!(
        send(&mut a, &mut b, late),
        "the newer session carries traffic"
    );
    // The first session is gone from both sides: a message sealed on it is not opened.
    let (mut old_a, mut old_b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut old_a, &mut old_b, t0);
    let m = bytes(old_a.encapsulate(&ip_packet(), t0 + secs(1), &mut buf));
    tick(&mut old_b, late);
    assert!(matches!(
        old_b.decapsulate(&m, late, &mut buf),
        TunnResult::Err(TunnelError::NoSession)
    ));
    tick(&mut old_a, late);
    assert!(old_a.sending().is_none());
    assert_ne!(
        kind(old_a.encapsulate(&ip_packet(), late, &mut buf)),
        Some(4),
        "nothing is sealed on a session past REJECT_AFTER_TIME"
    );
}

#[test]
fn an_unanswered_handshake_is_retried_every_rekey_timeout_and_given_up_after_rekey_attempt_time() {
    let t0 = Instant::now();
    let mut a = tunnel(1, 2, None, t0);
    let mut buf = vec![0u8; 2048];
    assert_eq!(kind(a.encapsulate(&ip_packet(), t0, &mut buf)), Some(1));
    let mut retries = 0;
    let mut at = t0;
    while at < t0 + REKEY_ATTEMPT_TIME - secs(1) {
        at += Duration::from_millis(250);
        match tick(&mut a, at) {
            Some(1) => retries += 1,
            Some(other) => panic!("unexpected message type {other}"),
            None => {}
        }
    }
    assert_eq!(retries, 17, "one every 5 s");
    let mut out = vec![0u8; 2048];
    assert!(matches!(
        a.update_timers(t0 + REKEY_ATTEMPT_TIME, &mut out),
        TunnResult::Err(TunnelError::Expired)
    ));
    assert_eq!(
        tick(&mut a, t0 + REKEY_ATTEMPT_TIME + secs(10)),
        None,
        "no more"
    );
    // Traffic later asks for a new attempt, which starts afresh.
    assert_eq!(
        kind(a.encapsulate(&ip_packet(), t0 + secs(200), &mut buf)),
        Some(1)
    );
}

#[test]
fn a_keepalive_follows_received_data_after_keepalive_timeout_if_nothing_else_went_out() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut a, &mut b, t0);
    assert!(send(&mut b, &mut a, t0 + secs(1)));
    assert_eq!(tick(&mut a, t0 + secs(10)), None);
    assert_eq!(tick(&mut a, t0 + secs(11)), Some(4), "a keepalive");
    assert_eq!(tick(&mut a, t0 + secs(30)), None, "one only");
}

#[test]
fn data_sent_without_an_answer_starts_a_handshake_after_keepalive_and_rekey_timeouts() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut b, &mut a, t0);
    let mut buf = vec![0u8; 2048];
    assert_eq!(
        kind(a.encapsulate(&ip_packet(), t0 + secs(1), &mut buf)),
        Some(4)
    );
    assert_eq!(tick(&mut a, t0 + secs(15)), None);
    assert_eq!(
        tick(&mut a, t0 + secs(16)),
        Some(1),
        "15 s without an answer"
    );
}

#[test]
fn a_forged_cookie_reply_does_not_hold_back_the_handshake_of_a_dead_session() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut b, &mut a, t0);
    let mut buf = vec![0u8; 2048];
    // a's initiation was seen on the wire; anyone who knows b's public key can answer it
    // with a cookie reply.
    let init = bytes(a.format_handshake_initiation(t0, &mut buf, true));
    let forger = Checker::new(&PublicKey::from(&StaticSecret::from([2; 32])));
    let from = "198.51.100.9:1".parse().unwrap();
    assert_eq!(
        kind(a.encapsulate(&ip_packet(), t0 + secs(1), &mut buf)),
        Some(4)
    );
    // A fresh tunnel state: the initiation above is answered by b at once in real life;
    // here it is not, and the forged reply comes 14 s later.
    let reply = forger.reply(&init, from, t0).unwrap();
    assert!(matches!(
        a.decapsulate(&reply, t0 + secs(14), &mut buf),
        TunnResult::Done
    ));
    let due = (1..=10)
        .map(|s| t0 + secs(14 + s))
        .find_map(|at| tick(&mut a, at));
    assert_eq!(due, Some(1), "the retry is still due");
}

#[test]
fn a_persistent_keepalive_goes_out_at_once_and_then_every_interval() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, Some(25), t0), tunnel(2, 1, None, t0));
    handshake(&mut a, &mut b, t0);
    assert_eq!(tick(&mut a, t0), Some(4), "at once when set");
    assert_eq!(tick(&mut a, t0 + secs(24)), None);
    assert_eq!(tick(&mut a, t0 + secs(25)), Some(4));
    assert_eq!(tick(&mut b, t0 + secs(1)), None, "b has none");
    b.set_keepalive(5);
    assert_eq!(
        tick(&mut b, t0 + secs(2)),
        Some(4),
        "set later: one at once"
    );
}

/// Given up after REKEY_ATTEMPT_TIME, a peer with a persistent keepalive still tries:
/// each keepalive starts a new attempt (a node behind NAT keeps its mapping open).
#[test]
fn a_persistent_keepalive_goes_on_after_the_handshake_was_given_up() {
    let t0 = Instant::now();
    let mut a = tunnel(1, 2, Some(25), t0);
    let mut out = vec![0u8; 2048];
    assert_eq!(
        tick(&mut a, t0),
        Some(1),
        "the first keepalive needs a handshake"
    );
    let mut at = t0;
    while at < t0 + REKEY_ATTEMPT_TIME {
        at += Duration::from_millis(250);
        let _ = a.update_timers(at, &mut out);
    }
    let after = (1..=30).find_map(|s| tick(&mut a, at + secs(s)));
    assert_eq!(
        after,
        Some(1),
        "a new attempt within the keepalive interval"
    );
}

#[test]
fn every_session_and_queued_packet_goes_after_three_times_reject_after_time() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut a, &mut b, t0);
    let mut out = vec![0u8; 2048];
    let at = t0 + REJECT_AFTER_TIME * 3;
    assert!(matches!(
        a.update_timers(at, &mut out),
        TunnResult::Err(TunnelError::Expired)
    ));
    assert!(!a.established());
    assert!(matches!(
        a.update_timers(at + secs(1), &mut out),
        TunnResult::Err(TunnelError::Expired)
    ));
}

#[test]
fn a_session_past_rekey_after_messages_is_rekeyed_and_past_reject_after_messages_is_not_used() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut a, &mut b, t0);
    let session = a.sending().cloned().unwrap();
    session.set_sent(super::super::session::REKEY_AFTER_MESSAGES);
    assert_eq!(
        tick(&mut a, t0 + secs(1)),
        None,
        "REKEY_TIMEOUT after our last handshake message"
    );
    assert_eq!(
        tick(&mut a, t0 + REKEY_TIMEOUT),
        Some(1),
        "worn: a new handshake"
    );
    let (mut a, mut b) = (tunnel(1, 2, None, t0), tunnel(2, 1, None, t0));
    handshake(&mut a, &mut b, t0);
    a.sending()
        .cloned()
        .unwrap()
        .set_sent(super::super::session::REJECT_AFTER_MESSAGES);
    let mut buf = vec![0u8; 2048];
    assert_eq!(
        kind(a.encapsulate(&ip_packet(), t0 + secs(1), &mut buf)),
        None,
        "no data on a spent session (queued; a handshake went out under REKEY_TIMEOUT ago)"
    );
    assert!(a.sending().is_none());
    assert_eq!(
        kind(a.encapsulate(&ip_packet(), t0 + REKEY_TIMEOUT, &mut buf)),
        Some(1),
        "then a handshake"
    );
}

#[test]
fn without_a_session_one_keepalive_waits_at_most_and_a_lost_key_seals_nothing_more() {
    let t0 = Instant::now();
    let (mut a, mut b) = (tunnel(1, 2, Some(1), t0), tunnel(2, 1, None, t0));
    let mut buf = vec![0u8; 2048];
    for s in 0..10 {
        let _ = a.update_timers(t0 + secs(s), &mut buf);
    }
    // The initiation from the first keepalive, answered now: one queued keepalive goes.
    let init = bytes(a.format_handshake_initiation(t0 + secs(10), &mut buf, true));
    let response = bytes(b.decapsulate(&init, t0 + secs(10), &mut buf));
    let _ = bytes(a.decapsulate(&response, t0 + secs(10), &mut buf));
    let mut queued = 0;
    while let TunnResult::WriteToNetwork(_) = a.decapsulate(&[], t0 + secs(10), &mut buf) {
        queued += 1;
    }
    assert!(queued <= 1, "{queued} keepalives were queued");
    assert!(send(&mut a, &mut b, t0 + secs(11)));
    a.stop_sending();
    assert!(a.sending().is_none());
    assert_ne!(
        kind(a.encapsulate(&ip_packet(), t0 + secs(12), &mut buf)),
        Some(4)
    );
    assert!(
        send(&mut b, &mut a, t0 + secs(12)),
        "what the peer sends still opens"
    );
}
