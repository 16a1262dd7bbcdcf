//! The relay's table between two real WireGuard cores (weft's own, one per end): a pair
//! handshakes and carries data through it both ways, each datagram going where the
//! pair's other end is, and nothing else gets through.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use x25519_dalek::{PublicKey, StaticSecret};

use super::table::{Drop, Member, Table};
use crate::wg::index::Indices;
use crate::wg::{TunnResult, Tunnel};

fn key(n: u8) -> StaticSecret {
    StaticSecret::from([n; 32])
}

fn public(n: u8) -> [u8; 32] {
    *PublicKey::from(&key(n)).as_bytes()
}

/// Node `me`'s tunnel to node `peer`, with a keepalive so it initiates at once.
fn tunnel(me: u8, peer: u8, now: Instant) -> Tunnel {
    Tunnel::new(
        key(me),
        PublicKey::from(&key(peer)),
        None,
        None,
        Arc::new(Indices::default()),
        now,
    )
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// a (private, another zone: reached through its NAT at `A`), b (this gateway's zone, at
/// `B`), c (this zone, at `C`).
const A: &str = "198.51.100.253:40001";
const B: &str = "192.0.2.130:51820";
const C: &str = "192.0.2.131:51820";

fn members() -> Vec<Member> {
    vec![
        Member {
            node: "a".into(),
            key: public(1),
            home: None,
        },
        Member {
            node: "b".into(),
            key: public(2),
            home: Some(addr(B)),
        },
        Member {
            node: "c".into(),
            key: public(3),
            home: Some(addr(C)),
        },
    ]
}

fn packet(len: usize, tag: u8) -> Vec<u8> {
    let mut p = vec![tag; len];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    p[12..16].copy_from_slice(&[10, 244, 1, 2]);
    p[16..20].copy_from_slice(&[10, 244, 2, 2]);
    p
}

fn datagram(r: TunnResult<'_>) -> Vec<u8> {
    match r {
        TunnResult::WriteToNetwork(d) => d.to_vec(),
        other => panic!("expected a datagram, got {other:?}"),
    }
}

/// a and b handshake through the relay (a initiates); returns both tunnels.
fn handshake(t: &mut Table, now: Instant) -> (Tunnel, Tunnel) {
    let (mut a, mut b) = (tunnel(1, 2, now), tunnel(2, 1, now));
    let mut buf = vec![0u8; 2048];
    let init = datagram(a.encapsulate(&packet(100, 1), now, &mut buf));
    assert_eq!(
        t.route(addr(A), &init, now),
        Ok(addr(B)),
        "the initiation goes to b"
    );
    let resp = datagram(b.decapsulate(&init, now, &mut buf));
    assert_eq!(
        t.route(addr(B), &resp, now),
        Ok(addr(A)),
        "the response goes back to a"
    );
    // a confirms the session (a keepalive), then its queued packet follows.
    let keepalive = datagram(a.decapsulate(&resp, now, &mut buf));
    assert_eq!(t.route(addr(A), &keepalive, now), Ok(addr(B)));
    assert!(matches!(
        b.decapsulate(&keepalive, now, &mut buf),
        TunnResult::Done
    ));
    let data = datagram(a.decapsulate(&[], now, &mut buf));
    assert_eq!(t.route(addr(A), &data, now), Ok(addr(B)));
    assert!(matches!(
        b.decapsulate(&data, now, &mut buf),
        TunnResult::WriteToTunnelV4(..)
    ));
    (a, b)
}

#[test]
fn a_pair_handshakes_and_carries_data_both_ways_through_the_relay() {
    let now = Instant::now();
    let mut t = Table::new(now);
    t.set_members(&members());
    let (mut a, mut b) = handshake(&mut t, now);
    let mut buf = vec![0u8; 2048];
    for n in 0..3u8 {
        let d = datagram(b.encapsulate(&packet(200, n), now, &mut buf));
        assert_eq!(t.route(addr(B), &d, now), Ok(addr(A)));
        assert!(matches!(
            a.decapsulate(&d, now, &mut buf),
            TunnResult::WriteToTunnelV4(..)
        ));
    }
    let pairs = t.pair_bytes();
    let names: Vec<(&str, &str)> = pairs.iter().map(|p| (&*p.from, &*p.to)).collect();
    assert_eq!(names, [("a", "b"), ("b", "a")], "{pairs:?}");
    assert!(pairs.iter().all(|p| p.bytes > 0));
}

#[test]
fn the_initiator_is_learned_so_the_other_end_can_initiate_too() {
    let now = Instant::now();
    let mut t = Table::new(now);
    t.set_members(&members());
    let _ = handshake(&mut t, now);
    // b now initiates (its own rekey): a's address was learned from the first response.
    let mut b2 = tunnel(2, 1, now);
    let mut buf = vec![0u8; 2048];
    let init = datagram(b2.encapsulate(&packet(100, 9), now, &mut buf));
    assert_eq!(t.route(addr(B), &init, now), Ok(addr(A)));
    // Before any handshake, a is known nowhere: c's initiation to it has no way.
    let mut fresh = Table::new(now);
    fresh.set_members(&members());
    let mut c = tunnel(3, 1, now);
    let init = datagram(c.encapsulate(&packet(100, 9), now, &mut buf));
    assert_eq!(
        fresh.route(addr(C), &init, now),
        Err(Drop::UnknownResponder)
    );
}

#[test]
fn what_has_no_route_is_dropped_and_nothing_is_sent_back_where_it_came_from() {
    let now = Instant::now();
    let mut t = Table::new(now);
    t.set_members(&members());
    let (_a, mut b) = handshake(&mut t, now);
    let mut buf = vec![0u8; 2048];
    let d = datagram(b.encapsulate(&packet(200, 1), now, &mut buf));
    // The right index from another source.
    assert_eq!(t.route(addr(C), &d, now), Err(Drop::NoRoute));
    // An index nobody holds.
    let mut other = d.clone();
    other[4..8].copy_from_slice(&0xdead_beefu32.to_le_bytes());
    assert_eq!(t.route(addr(B), &other, now), Err(Drop::NoRoute));
    // Not WireGuard: a wrong type, bad reserved bytes, a short message.
    let mut reserved = d.clone();
    reserved[1] = 1;
    for bad in [vec![9u8; 64], reserved, d[..20].to_vec()] {
        assert_eq!(t.route(addr(B), &bad, now), Err(Drop::NotWireguard));
    }
    // An initiation for a key that is no member.
    let mut stranger = tunnel(1, 7, now);
    let init = datagram(stranger.encapsulate(&packet(100, 1), now, &mut buf));
    assert_eq!(t.route(addr(A), &init, now), Err(Drop::UnknownResponder));
    // b initiating to itself through the relay: its own address is never the way.
    let mut self_init = tunnel(9, 2, now);
    let init = datagram(self_init.encapsulate(&packet(100, 1), now, &mut buf));
    assert_eq!(t.route(addr(B), &init, now), Err(Drop::UnknownResponder));
}

#[test]
fn routes_expire_and_an_unanswered_initiation_goes_sooner() {
    let now = Instant::now();
    let mut t = Table::new(now);
    t.set_members(&members());
    let (_a, mut b) = handshake(&mut t, now);
    let mut lone = tunnel(1, 3, now);
    let mut buf = vec![0u8; 2048];
    let init = datagram(lone.encapsulate(&packet(100, 1), now, &mut buf));
    assert_eq!(t.route(addr(A), &init, now), Ok(addr(C)));
    assert_eq!(
        t.routes(),
        3,
        "two for the pair, one waiting for c's response"
    );
    let later = now + super::table::PENDING_LIFE + Duration::from_secs(1);
    t.expire(later);
    assert_eq!(t.routes(), 2, "the unanswered initiation's route is gone");
    // Data keeps a route alive; silence past ROUTE_LIFE ends it.
    let d = datagram(b.encapsulate(&packet(200, 1), now, &mut buf));
    assert_eq!(t.route(addr(B), &d, later), Ok(addr(A)));
    t.expire(later + super::table::ROUTE_LIFE + Duration::from_secs(1));
    assert_eq!(t.routes(), 0);
    assert_eq!(t.route(addr(B), &d, later), Err(Drop::NoRoute));
    // What the pair carried is still counted.
    assert_eq!(t.pair_bytes().len(), 2);
}

#[test]
fn a_restarted_relay_carries_the_pair_on_from_its_saved_routes() {
    let now = Instant::now();
    let mut t = Table::new(now);
    t.set_members(&members());
    let (mut a, mut b) = handshake(&mut t, now);
    let text = super::persist::render(&t, now);
    let later = now + Duration::from_secs(5);
    let mut back = Table::new(later);
    let (routes, learned) = super::persist::parse(&text, later);
    assert_eq!((routes.len(), learned.len()), (2, 1), "{text}");
    back.restore(routes, learned, later);
    back.set_members(&members());
    let mut buf = vec![0u8; 2048];
    let d = datagram(b.encapsulate(&packet(200, 1), later, &mut buf));
    assert_eq!(back.route(addr(B), &d, later), Ok(addr(A)));
    assert!(matches!(
        a.decapsulate(&d, later, &mut buf),
        TunnResult::WriteToTunnelV4(..)
    ));
    // The learned address came back too: b may initiate to a.
    let mut b2 = tunnel(2, 1, later);
    let init = datagram(b2.encapsulate(&packet(100, 9), later, &mut buf));
    assert_eq!(back.route(addr(B), &init, later), Ok(addr(A)));
    // A torn or foreign line is skipped.
    let (r, m) = super::persist::parse("r 1 2\nm zz 1.2.3.4:5 9\nhello\n", later);
    assert!(r.is_empty() && m.is_empty());
}

#[test]
fn a_flood_of_handshake_messages_from_one_source_is_limited_and_starves_no_one_else() {
    let now = Instant::now();
    let mut t = Table::new(now);
    t.set_members(&members());
    let mut a = tunnel(1, 2, now);
    let mut buf = vec![0u8; 2048];
    let init = datagram(a.encapsulate(&packet(100, 1), now, &mut buf));
    let passed = (0..5000)
        .filter(|_| t.route(addr(A), &init, now).is_ok())
        .count();
    assert_eq!(
        passed, 100,
        "the burst, then nothing within the same instant"
    );
    // Another source is not held back by the first one's flood, which spent nothing of
    // the total past its own burst.
    let mut other = tunnel(3, 2, now);
    let init2 = datagram(other.encapsulate(&packet(100, 1), now, &mut buf));
    assert_eq!(
        t.route(addr("198.51.100.253:40002"), &init2, now),
        Ok(addr(B))
    );
    // A second later, 50 more.
    let later = now + Duration::from_secs(1);
    let passed = (0..100)
        .filter(|_| t.route(addr(A), &init, later).is_ok())
        .count();
    assert_eq!(passed, 50, "refilled at its rate");
}

#[test]
fn a_forged_message_takes_no_live_route_over() {
    let now = Instant::now();
    let mut t = Table::new(now);
    t.set_members(&members());
    let (_a, mut b) = handshake(&mut t, now);
    let mut buf = vec![0u8; 2048];
    // b's data to a names a's index: an initiation forged with that index, "from" a
    // stranger, for b, would make the route b -> a point at the stranger.
    let d = datagram(b.encapsulate(&packet(200, 1), now, &mut buf));
    let a_index = u32::from_le_bytes(d[4..8].try_into().unwrap());
    let mut forged = vec![0u8; 148];
    forged[0] = 1;
    forged[4..8].copy_from_slice(&a_index.to_le_bytes());
    crate::wg::cookie::write_mac1(&public(2), &mut forged);
    let stranger = addr("203.0.113.66:1234");
    assert_eq!(t.route(stranger, &forged, now), Err(Drop::Taken));
    assert_eq!(
        t.route(addr(B), &d, now),
        Ok(addr(A)),
        "b's data still goes to a"
    );
    // A response forged for the confirmed route (its mac1 is anyone's to compute) is
    // refused: only an initiation still waiting is answered.
    let mut resp = vec![0u8; 92];
    resp[0] = 2;
    resp[4..8].copy_from_slice(&7u32.to_le_bytes());
    resp[8..12].copy_from_slice(&a_index.to_le_bytes());
    crate::wg::cookie::write_mac1(&public(1), &mut resp);
    assert_eq!(t.route(addr(B), &resp, now), Err(Drop::NoRoute));
}

#[test]
fn saved_lifetimes_lose_the_time_the_relay_was_down_and_bad_ones_are_bounded() {
    let now = Instant::now();
    let written = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let key = "01".repeat(32);
    let text = format!(
        "t {}\nr 5 192.0.2.130:51820 198.51.100.253:40001 150000 1 - - 0\nr 6 192.0.2.130:51820 198.51.100.253:40001 99999999999999999 1 - - 0\nm {key} 198.51.100.253:40001 18446744073709551615\n",
        written - 100_000
    );
    let (routes, learned) = super::persist::parse(&text, now);
    let lefts: Vec<u64> = routes.iter().map(|(.., l)| l.as_secs()).collect();
    // 150 s saved 100 s ago: about 50 left; a huge one is bounded by ROUTE_LIFE first.
    assert!((49..=50).contains(&lefts[0]), "{lefts:?}");
    assert!((99..=100).contains(&lefts[1]), "{lefts:?}");
    assert!(learned[0].2 <= super::table::LEARNED_LIFE);
    // Written longer ago than anything lives: nothing comes back.
    let stale = format!(
        "t {}\nr 5 192.0.2.130:51820 198.51.100.253:40001 150000 1 - - 0\n",
        written - 300_000
    );
    assert!(super::persist::parse(&stale, now).0.is_empty());
}
