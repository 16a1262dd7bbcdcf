//! A cluster changing backend node by node (`plan::mixed`): each pair's backend from
//! both ends' published sets, the same from either end; the merged plan (devices, routes,
//! guard) of a node that speaks two backends; clear pairs refused by `RefuseClear`.

use serde_json::Value;

use super::mixed::{pair_backend, to_take_up};
use super::unencrypted_tests::{lease, mac, run, run_observed_at};
use super::*;
use crate::model::{Lease, LeaveReason, RouteRole};
use crate::netconf::BackendKind::{self, HostGw, Ipsec, Vxlan, Wireguard};

const WG: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;
const WG_STRICT: &str =
    r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "RefuseClear": true}}"#;
const IPSEC: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec"}}"#;
const VXLAN: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}"#;

fn key(n: u8) -> weft_crypto::PublicKey {
    weft_crypto::PrivateKey::from_bytes([n; 32]).public_key()
}

fn data(kind: BackendKind, n: u8) -> Value {
    match kind {
        Wireguard => wireguard_backend_data(&key(n), 51820),
        Vxlan => vxlan_backend_data(1, &mac(n)),
        Ipsec => super::ipsec::backend_data(&key(n), &super::ipsec_tests::epoch(1)),
        _ => Value::Null,
    }
}

/// Node `n` (`node-<n>`, 10.244.<n>.0/24, 198.51.100.<n>) running `primary`, also
/// speaking `also`.
fn node(n: u8, primary: BackendKind, also: &[BackendKind]) -> Lease {
    let mut l = lease(
        &format!("node-{n}"),
        &format!("10.244.{n}.0/24"),
        [198, 51, 100, n],
        primary.as_str(),
        data(primary, n),
    );
    l.also = also
        .iter()
        .map(|k| (k.as_str().to_string(), data(*k, n)))
        .collect();
    l
}

#[test]
fn each_pair_takes_what_both_ends_speak_the_same_from_either_end() {
    type Case<'a> = (
        (BackendKind, &'a [BackendKind]),
        (BackendKind, &'a [BackendKind]),
        Result<BackendKind, &'a str>,
    );
    let cases: &[Case] = &[
        // One backend everywhere.
        ((Wireguard, &[]), (Wireguard, &[]), Ok(Wireguard)),
        ((Vxlan, &[]), (Vxlan, &[]), Ok(Vxlan)),
        // vxlan -> wireguard: a moved node keeps vxlan for the nodes still on it.
        ((Wireguard, &[Vxlan]), (Vxlan, &[]), Ok(Vxlan)),
        ((Wireguard, &[Vxlan]), (Wireguard, &[Vxlan]), Ok(Wireguard)),
        ((Wireguard, &[Vxlan]), (Wireguard, &[]), Ok(Wireguard)),
        ((Wireguard, &[HostGw]), (HostGw, &[]), Ok(HostGw)),
        // wireguard -> vxlan: encrypted while both ends can, in clear once one cannot.
        ((Vxlan, &[Wireguard]), (Wireguard, &[]), Ok(Wireguard)),
        ((Vxlan, &[Wireguard]), (Vxlan, &[Wireguard]), Ok(Wireguard)),
        ((Vxlan, &[Wireguard]), (Vxlan, &[]), Ok(Vxlan)),
        // wireguard <-> ipsec: never clear, never down while one end keeps the other's.
        ((Ipsec, &[Wireguard]), (Wireguard, &[]), Ok(Wireguard)),
        // Both configs on ipsec: on ESP at once, before WireGuard is retired.
        ((Ipsec, &[Wireguard]), (Ipsec, &[Wireguard]), Ok(Ipsec)),
        ((Ipsec, &[Wireguard]), (Ipsec, &[]), Ok(Ipsec)),
        ((Wireguard, &[Ipsec]), (Wireguard, &[]), Ok(Wireguard)),
        (
            (Ipsec, &[]),
            (Wireguard, &[Vxlan]),
            Err("no common encryption"),
        ),
        // Nothing in common at all.
        ((Wireguard, &[]), (Vxlan, &[]), Err("wrong backend")),
        ((HostGw, &[]), (Vxlan, &[]), Err("wrong backend")),
    ];
    for ((a, a_also), (b, b_also), want) in cases {
        let (la, lb) = (node(1, *a, a_also), node(2, *b, b_also));
        for (me, peer) in [(&la, &lb), (&lb, &la)] {
            let got = pair_backend(me.backend_type.parse().unwrap(), &me.also, peer, false);
            let got = got.map_err(|r| match r {
                LeaveReason::NoCommonEncryption { .. } => "no common encryption",
                LeaveReason::WrongBackend { .. } => "wrong backend",
                other => panic!("unexpected reason {other}"),
            });
            assert_eq!(&got, want, "{} seen from {}", peer.node, me.node);
        }
    }
}

#[test]
fn a_node_moved_to_wireguard_keeps_vxlan_pairs_and_guards_them_by_device() {
    let me = node(1, Wireguard, &[Vxlan]);
    let old = node(2, Vxlan, &[]);
    let moved = node(3, Wireguard, &[Vxlan]);
    let state = run(WG, me, vec![old, moved]).unwrap();
    // Both devices, each with its peer.
    let wg: Vec<&str> = state.tunnels[0]
        .peers
        .iter()
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(wg, ["node-3"]);
    let vx: Vec<&str> = state.vxlan[0]
        .peers
        .iter()
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(vx, ["node-2"]);
    assert_eq!(state.vxlan[0].mac, mac(1), "the VTEP MAC peers hold");
    let route = |node: &str| {
        state
            .routes
            .iter()
            .find(|r| r.role == RouteRole::Peer(node.into()))
            .map(|r| (r.dst.to_string(), r.device.clone()))
    };
    assert_eq!(
        route("node-2"),
        Some(("10.244.2.0/24".into(), "flannel.1".into()))
    );
    assert_eq!(
        route("node-3"),
        Some(("10.244.3.0/24".into(), "flannel-wg".into()))
    );
    // Fail closed stays: the pod network is blackholed, the guard in place, and a clear
    // pair's pods are taken from its own device alone.
    assert_eq!(
        state.fail_closed,
        ["10.244.0.0/16".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(
        state.guard[0].clear,
        [("flannel.1".to_string(), "10.244.2.0/24".parse().unwrap())]
    );
    assert_eq!(state.guard[0].tunnels, ["flannel-wg"]);
    // Each pair's backend, and why the clear one is clear.
    let pairs: Vec<(&str, BackendKind, bool)> = state
        .pair_backends
        .iter()
        .map(|p| (p.node.as_str(), p.backend, p.why_clear.is_some()))
        .collect();
    assert_eq!(
        pairs,
        [("node-2", Vxlan, true), ("node-3", Wireguard, false)]
    );
    assert_eq!(
        state.subnet_env.mtu, 1420,
        "the config's backend sets the pods' MTU"
    );
}

#[test]
fn refuse_clear_leaves_clear_pairs_down_and_names_them() {
    let me = node(1, Wireguard, &[Vxlan]);
    let state = run(
        WG_STRICT,
        me,
        vec![node(2, Vxlan, &[]), node(3, Wireguard, &[])],
    )
    .unwrap();
    assert!(state
        .routes
        .iter()
        .all(|r| r.role != RouteRole::Peer("node-2".into())));
    assert!(state.vxlan.iter().all(|v| v.peers.is_empty()));
    assert!(state.guard[0].clear.is_empty());
    let left: Vec<(&str, bool)> = state
        .left_out
        .iter()
        .map(|l| {
            (
                l.node.as_str(),
                matches!(l.reason, LeaveReason::ClearRefused { .. }),
            )
        })
        .collect();
    assert_eq!(left, [("node-2", true)]);
}

#[test]
fn on_the_way_back_pairs_stay_encrypted_until_the_peer_stops_publishing_a_key() {
    let me = node(1, Vxlan, &[Wireguard]);
    let state = run(
        VXLAN,
        me,
        vec![
            node(2, Wireguard, &[]),
            node(3, Vxlan, &[Wireguard]),
            node(4, Vxlan, &[]),
        ],
    )
    .unwrap();
    let wg: Vec<&str> = state.tunnels[0]
        .peers
        .iter()
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(wg, ["node-2", "node-3"]);
    let vx: Vec<&str> = state.vxlan[0]
        .peers
        .iter()
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(vx, ["node-4"]);
    assert!(!state.guard.is_empty(), "kept WireGuard fails closed");
}

#[test]
fn one_backend_everywhere_plans_as_before() {
    let me = node(1, Wireguard, &[]);
    let state = run(WG, me, vec![node(2, Wireguard, &[])]).unwrap();
    assert!(state.pair_backends.is_empty());
    assert!(state.vxlan.is_empty());
}

#[test]
fn a_node_on_a_backend_nobody_keeps_takes_up_the_peers_and_nobody_else_does() {
    type Case<'a> = (
        (BackendKind, &'a [BackendKind]),
        BackendKind,
        bool,
        Option<BackendKind>,
    );
    let cases: &[Case] = &[
        // ipsec -> wireguard: the nodes still on ipsec meet the moved ones on WireGuard.
        ((Ipsec, &[]), Wireguard, false, Some(Wireguard)),
        ((Ipsec, &[]), Wireguard, true, Some(Wireguard)),
        // ipsec -> vxlan or host-gw: in clear, since the peer encrypts no more, unless
        // this node refuses clear pairs.
        ((Ipsec, &[]), Vxlan, false, Some(Vxlan)),
        ((Ipsec, &[]), Vxlan, true, None),
        ((Ipsec, &[]), HostGw, false, Some(HostGw)),
        // Already in common, or the same backend: nothing to take up.
        ((Ipsec, &[Wireguard]), Wireguard, false, None),
        ((Ipsec, &[]), Ipsec, false, None),
        // A node on a backend peers keep takes up nothing: the peer keeps (or takes up)
        // this node's.
        ((Wireguard, &[]), Ipsec, false, None),
        ((Vxlan, &[]), Ipsec, false, None),
        ((Wireguard, &[]), Vxlan, false, None),
        // ipip is not kept either.
        ((BackendKind::Ipip, &[]), Wireguard, false, Some(Wireguard)),
    ];
    for ((ours, also), theirs, refuse, want) in cases {
        let me = node(1, *ours, also);
        let peer = node(2, *theirs, &[]);
        assert_eq!(
            to_take_up(*ours, &me.also, &peer, *refuse),
            *want,
            "{ours:?} {also:?} meeting {theirs:?} (refusing clear: {refuse})"
        );
    }
}

#[test]
fn an_ipsec_node_that_took_up_wireguard_runs_each_pair_on_its_own_device() {
    let me = node(1, Ipsec, &[Wireguard]);
    let state = run(
        IPSEC,
        me,
        vec![
            node(2, Wireguard, &[]),
            node(3, Ipsec, &[]),
            node(4, Ipsec, &[Wireguard]),
        ],
    )
    .unwrap();
    let wg: Vec<&str> = state.tunnels[0]
        .peers
        .iter()
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(
        wg,
        ["node-2"],
        "only the pair whose configs differ is on WireGuard"
    );
    let esp: Vec<&str> = state
        .ipsec
        .iter()
        .flat_map(|s| &s.peers)
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(
        esp,
        ["node-3", "node-4"],
        "pairs of two ipsec configs stay on ESP"
    );
    let route = |node: &str| {
        state
            .routes
            .iter()
            .find(|r| r.role == RouteRole::Peer(node.into()))
            .map(|r| r.device.clone())
    };
    assert_eq!(route("node-2").as_deref(), Some("flannel-wg"));
    assert_eq!(route("node-4").as_deref(), Some("flannel-ipsec"));
    assert!(state.guard[0].clear.is_empty(), "nothing in clear");
    let mut tunnels = state.guard[0].tunnels.clone();
    tunnels.sort();
    assert_eq!(tunnels, ["flannel-ipsec", "flannel-wg"]);
    assert!(state.pair_backends.iter().all(|p| p.why_clear.is_none()));
}

#[test]
fn a_backend_retired_a_moment_ago_keeps_its_device_but_carries_no_pair() {
    // Back to vxlan: this node retired WireGuard (its device drains), the peer still
    // publishes it. The pair follows what this node publishes, as the peer does.
    let me = node(1, Vxlan, &[Wireguard]);
    let peer = node(2, Vxlan, &[Wireguard]);
    let observed = crate::model::Observed {
        draining: ["wireguard".to_string()].into(),
        ..Default::default()
    };
    let state = run_observed_at(
        VXLAN,
        me.clone(),
        vec![peer.clone()],
        &["198.51.100.0/24"],
        std::time::SystemTime::UNIX_EPOCH,
        &observed,
    )
    .unwrap();
    let pairs: Vec<(&str, BackendKind)> = state
        .pair_backends
        .iter()
        .map(|p| (p.node.as_str(), p.backend))
        .collect();
    assert_eq!(pairs, [("node-2", Vxlan)]);
    assert_eq!(state.tunnels.len(), 1, "the draining device stays");
    assert!(state.tunnels[0].peers.is_empty());
    // Not draining: the pair stays encrypted while both publish WireGuard.
    let state = run(VXLAN, me, vec![peer]).unwrap();
    assert_eq!(state.pair_backends[0].backend, Wireguard);
}
