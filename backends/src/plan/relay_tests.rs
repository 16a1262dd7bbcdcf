//! Path choice, table-tested: the two-site shape (a1 gateway, a2 private in site A; b1, b3
//! gateways-or-public and b2 private in site B) from each node's side, the liveness
//! watcher's findings, and what the full plan makes of it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, SystemTime};

use super::super::tests::{key, lease, run_observing, CONF, NOW};
use super::*;
use crate::model::{ClusterView, Lease, Observed, PathHistory, Via};

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + NOW
}

/// A node of `zone`: `public` its published address, `internal` its own when another
/// (1:1 NAT), a gateway with `gateway`.
fn node(
    name: &str,
    n: u8,
    zone: &str,
    public: [u8; 4],
    internal: Option<[u8; 4]>,
    gateway: bool,
) -> Lease {
    let mut l = lease(name, &format!("10.244.{n}.0/24"), Ipv4Addr::from(public), n);
    l.reach.zone = Some(zone.into());
    l.reach.internal_ip = internal.map(|i| IpAddr::V4(Ipv4Addr::from(i)));
    l.reach.gateway = gateway.then_some(51824);
    l
}

fn sites() -> ClusterView {
    let mut v = ClusterView::default();
    for l in [
        node(
            "a1",
            1,
            "site-a",
            [198, 51, 100, 11],
            Some([192, 0, 2, 11]),
            true,
        ),
        node("a2", 2, "site-a", [192, 0, 2, 12], None, false),
        node(
            "b1",
            3,
            "site-b",
            [198, 51, 100, 21],
            Some([192, 0, 2, 141]),
            true,
        ),
        node("b2", 4, "site-b", [192, 0, 2, 142], None, false),
        node(
            "b3",
            5,
            "site-b",
            [198, 51, 100, 23],
            Some([192, 0, 2, 143]),
            false,
        ),
    ] {
        v.insert(l);
    }
    v
}

fn path(
    view: &ClusterView,
    from: &str,
    to: &str,
    history: Option<&PathHistory>,
    answers: bool,
) -> Path {
    path_on(view, from, to, history, answers, None)
}

fn path_on(
    view: &ClusterView,
    from: &str,
    to: &str,
    history: Option<&PathHistory>,
    answers: bool,
    current: Option<SocketAddr>,
) -> Path {
    let (l, p) = (view.get(from).unwrap(), view.get(to).unwrap());
    let direct = SocketAddr::new(IpAddr::V4(p.public_ip.unwrap()), 51820);
    let facts = Facts {
        history,
        direct,
        direct_answers: answers,
        current,
        roamed: false,
        now: now(),
    };
    choose(l, p, view, facts)
}

fn gateway(p: &Path) -> Option<(&str, SocketAddr)> {
    match p {
        Path::Relay { gateway, endpoint } => Some((gateway, *endpoint)),
        _ => None,
    }
}

#[test]
fn only_two_private_nodes_of_two_zones_are_relayed() {
    let v = sites();
    let direct = [
        ("a1", "a2"),
        ("a2", "a1"),
        ("b2", "b3"), // same zone
        ("a2", "b1"),
        ("b1", "a2"),
        ("a1", "b2"), // a gateway at one end
        ("a2", "b3"),
        ("b3", "a2"), // b3 is not private
    ];
    for (from, to) in direct {
        assert_eq!(
            path(&v, from, to, None, false),
            Path::Direct,
            "{from} -> {to}"
        );
    }
    let (ga, ea) = gateway(&path(&v, "a2", "b2", None, false))
        .map(|(g, e)| (g.to_string(), e))
        .unwrap();
    let (gb, eb) = gateway(&path(&v, "b2", "a2", None, false))
        .map(|(g, e)| (g.to_string(), e))
        .unwrap();
    assert_eq!(ga, gb, "both ends choose the same gateway");
    // Its own zone's gateway on the internal address, the other zone's on the public one.
    let g = v.get(&ga).unwrap();
    let (inside, outside) = if ga == "a1" { (ea, eb) } else { (eb, ea) };
    assert_eq!(inside.ip(), g.reach.internal_ip.unwrap());
    assert_eq!(outside.ip(), IpAddr::V4(g.public_ip.unwrap()));
    assert_eq!((inside.port(), outside.port()), (51824, 51824));
    // A direct path that answers probes is taken even between two private nodes.
    assert_eq!(path(&v, "a2", "b2", None, true), Path::Direct);
}

#[test]
fn no_gateway_in_either_zone_is_named() {
    let mut v = sites();
    for g in ["a1", "b1"] {
        let mut l = v.get(g).unwrap().clone();
        l.reach.gateway = None;
        v.insert(l);
    }
    match path(&v, "a2", "b2", None, false) {
        Path::NoPath { why } => assert!(why.contains("neither zone has a gateway"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_dead_gateway_is_skipped_and_a_dead_direct_path_relays_until_it_answers_again() {
    let v = sites();
    let first = gateway(&path(&v, "a2", "b2", None, false))
        .unwrap()
        .0
        .to_string();
    let mut h = PathHistory::default();
    h.gateways_failed
        .insert(first.clone(), now() - Duration::from_secs(3));
    let second = gateway(&path(&v, "a2", "b2", Some(&h), false))
        .unwrap()
        .0
        .to_string();
    assert_ne!(first, second);
    // Both dead: the one that failed longest ago.
    h.gateways_failed
        .insert(second.clone(), now() - Duration::from_secs(1));
    assert_eq!(
        gateway(&path(&v, "a2", "b2", Some(&h), false)).unwrap().0,
        first
    );
    // Past the hold, the first is back in line.
    h.gateways_failed
        .insert(first.clone(), now() - GATEWAY_HOLD);
    assert_eq!(
        gateway(&path(&v, "a2", "b2", Some(&h), false)).unwrap().0,
        first
    );

    // a2 -> b3 is direct until the watcher finds it dead; then relayed, even if the
    // direct path answers probes, for the hold; then direct again only if it answers.
    let dead = PathHistory {
        direct_failed: Some(now() - Duration::from_secs(1)),
        direct_failures: 1,
        ..Default::default()
    };
    assert!(gateway(&path(&v, "a2", "b3", Some(&dead), true)).is_some());
    let held = PathHistory {
        direct_failed: Some(now() - DIRECT_HOLD),
        ..dead.clone()
    };
    assert_eq!(path(&v, "a2", "b3", Some(&held), true), Path::Direct);
    assert!(gateway(&path(&v, "a2", "b3", Some(&held), false)).is_some());
    // The hold doubles with each failure in a row.
    let again = PathHistory {
        direct_failures: 3,
        ..held
    };
    assert!(gateway(&path(&v, "a2", "b3", Some(&again), true)).is_some());
    assert_eq!(direct_hold(3), DIRECT_HOLD * 4);
    assert_eq!(direct_hold(40), DIRECT_HOLD_MAX);
}

#[test]
fn the_plan_relays_with_a_keepalive_and_says_through_whom() {
    let v = sites();
    let me = v.get("a2").unwrap().clone();
    let peers: Vec<Lease> = v
        .leases
        .values()
        .filter(|l| l.node != "a2")
        .map(|l| (**l).clone())
        .collect();
    let state = run_observing(me, CONF, peers, false, &Observed::default()).unwrap();
    let b2 = state.tunnels[0]
        .peers
        .iter()
        .find(|p| p.node == "b2")
        .unwrap();
    assert!(
        matches!(&b2.via, Via::Gateway(g) if g == "a1" || g == "b1"),
        "{:?}",
        b2.via
    );
    assert_eq!(
        b2.keepalive, RELAYED_KEEPALIVE,
        "no keepalive configured: the relay's own"
    );
    assert_eq!(b2.endpoint.port(), 51824);
    let b3 = state.tunnels[0]
        .peers
        .iter()
        .find(|p| p.node == "b3")
        .unwrap();
    assert_eq!((b3.via.clone(), b3.keepalive), (Via::Direct, 0));
}

#[test]
fn a_gateway_relays_for_every_node_and_reaches_its_own_zone_at_home() {
    let v = sites();
    let members = relay_members(v.get("b1").unwrap(), &v, 51820);
    let home: Vec<(&str, Option<SocketAddr>)> =
        members.iter().map(|m| (m.node.as_str(), m.home)).collect();
    assert_eq!(
        home,
        [
            ("a1", None),
            ("a2", None),
            ("b2", Some("192.0.2.142:51820".parse().unwrap())),
            ("b3", Some("192.0.2.143:51820".parse().unwrap())),
        ]
    );
    assert_eq!(members[0].key, key(1));
    assert!(
        relay_members(v.get("b2").unwrap(), &v, 51820).is_empty(),
        "not a gateway"
    );
}

#[test]
fn a_pair_stays_on_its_gateway_and_follows_the_one_the_peer_chose() {
    let v = sites();
    let first = gateway(&path(&v, "a2", "b2", None, false))
        .unwrap()
        .0
        .to_string();
    let other = if first == "a1" { "b1" } else { "a1" };
    // The device holds the other gateway's relay (the peer's handshake came through it):
    // this end follows, rather than send through the first.
    let on_other = gateway(&path(&v, "b2", "a2", None, false))
        .map(|_| {
            let g = v.get(other).unwrap();
            let ip = match g.reach.zone == v.get("a2").unwrap().reach.zone {
                true => g.reach.internal_ip.unwrap(),
                false => IpAddr::V4(g.public_ip.unwrap()),
            };
            SocketAddr::new(ip, 51824)
        })
        .unwrap();
    assert_eq!(
        gateway(&path_on(&v, "a2", "b2", None, false, Some(on_other)))
            .unwrap()
            .0,
        other
    );
    // Unless that one was found dead for the pair.
    let mut h = PathHistory::default();
    h.gateways_failed
        .insert(other.to_string(), now() - Duration::from_secs(1));
    assert_eq!(
        gateway(&path_on(&v, "a2", "b2", Some(&h), false, Some(on_other)))
            .unwrap()
            .0,
        first
    );
}

#[test]
fn a_direct_address_another_node_of_this_zone_has_too_proves_nothing() {
    let mut v = sites();
    // b2's private address is also a2's neighbour's (another VPC's range overlaps).
    let mut twin = node("a3", 6, "site-a", [192, 0, 2, 142], None, false);
    twin.backend_data = Some(crate::plan::wireguard_backend_data(&key(6), 51820));
    v.insert(twin);
    assert!(
        gateway(&path(&v, "a2", "b2", None, true)).is_some(),
        "its answer is a3's"
    );
}

#[test]
fn a_peer_whose_handshake_came_straight_from_its_address_is_followed_direct() {
    let v = sites();
    let b2 = v.get("b2").unwrap();
    let direct = SocketAddr::new(IpAddr::V4(b2.public_ip.unwrap()), 51820);
    let facts = |roamed, current| Facts {
        history: None,
        direct,
        direct_answers: false,
        current,
        roamed,
        now: now(),
    };
    let a2 = v.get("a2").unwrap();
    assert_eq!(choose(a2, b2, &v, facts(true, Some(direct))), Path::Direct);
    // Not when this node set it, nor from another address (a NAT's port), nor a relay.
    assert!(gateway(&choose(a2, b2, &v, facts(false, Some(direct)))).is_some());
    let natted = SocketAddr::new("198.51.100.242".parse().unwrap(), 40000);
    assert!(gateway(&choose(a2, b2, &v, facts(true, Some(natted)))).is_some());
}
