//! Table tests for the vxlan and host-gw plans: routes per peer and their kind, the vxlan
//! neighbour/FDB entries, and each kind of bad peer left out with its reason while the
//! good ones stay.

use std::net::{IpAddr, Ipv4Addr};
use std::time::SystemTime;

use serde_json::json;

use super::*;
use crate::model::{ClusterView, Lease, LeaveReason, RouteRole};
use crate::netconf::parse;

const MAC_A: [u8; 6] = [0x0a, 0, 0, 0, 0, 1];

pub(super) fn mac(n: u8) -> [u8; 6] {
    [0x0a, 0, 0, 0, 0, n]
}

pub(super) fn lease(
    node: &str,
    subnet: &str,
    ip: [u8; 4],
    backend: &str,
    data: serde_json::Value,
) -> Lease {
    Lease {
        node: node.into(),
        subnet: Some(subnet.parse().unwrap()),
        subnet_v6: None,
        public_ip: Some(Ipv4Addr::from(ip)),
        public_ipv6: None,
        backend_type: backend.into(),
        backend_data: Some(data),
        backend_v6_data: None,
        expires: None,
        reach: Default::default(),
        next_key: None,
        created: None,
        key_proof: None,
        ml_kem_key: None,
        also: Default::default(),
    }
}

pub(super) fn vx(node: &str, subnet: &str, ip: [u8; 4], n: u8) -> Lease {
    lease(node, subnet, ip, "vxlan", vxlan_backend_data(1, &mac(n)))
}

pub(super) fn run(conf: &str, me: Lease, peers: Vec<Lease>) -> Result<DesiredState, PlanError> {
    run_on(conf, me, peers, &["198.51.100.0/24"])
}

/// As `run`, with the external interface on `networks`.
pub(super) fn run_on(
    conf: &str,
    me: Lease,
    peers: Vec<Lease>,
    networks: &[&str],
) -> Result<DesiredState, PlanError> {
    run_on_at(conf, me, peers, networks, SystemTime::UNIX_EPOCH)
}

/// As `run_on`, planned at `now`.
pub(super) fn run_on_at(
    conf: &str,
    me: Lease,
    peers: Vec<Lease>,
    networks: &[&str],
    now: SystemTime,
) -> Result<DesiredState, PlanError> {
    run_observed_at(conf, me, peers, networks, now, &Default::default())
}

/// As `run_on_at`, with what the devices reported.
pub(super) fn run_observed_at(
    conf: &str,
    me: Lease,
    peers: Vec<Lease>,
    networks: &[&str],
    now: SystemTime,
    observed: &crate::model::Observed,
) -> Result<DesiredState, PlanError> {
    run_secrets_at(
        conf,
        me,
        peers,
        networks,
        now,
        observed,
        &Default::default(),
    )
}

/// As `run_observed_at`, with each pair's post-quantum PSK.
pub(super) fn run_secrets_at(
    conf: &str,
    me: Lease,
    peers: Vec<Lease>,
    networks: &[&str],
    now: SystemTime,
    observed: &crate::model::Observed,
    pair_psks: &std::collections::BTreeMap<weft_crypto::PublicKey, crate::model::PairSecret>,
) -> Result<DesiredState, PlanError> {
    let config = parse(conf).unwrap();
    let mut view = ClusterView::default();
    view.insert(me.clone());
    for p in peers {
        view.insert(p);
    }
    let options = PlanOptions {
        ip_masq: false,
        underlay_mtu: 1500,
        underlay_device: Some("eth0".into()),
        underlay_networks: networks.iter().map(|n| n.parse().unwrap()).collect(),
    };
    plan(&PlanInput {
        path_mtus: &Default::default(),
        pair_psks,
        observed,
        local: &me,
        view: &view,
        config: &config,
        options: &options,
        now,
    })
}

const VXLAN: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}"#;
const DIRECT: &str =
    r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "DirectRouting": true}}"#;
const HOST_GW: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "host-gw"}}"#;

fn me_vx() -> Lease {
    lease(
        "node-a",
        "10.244.1.0/24",
        [198, 51, 100, 1],
        "vxlan",
        vxlan_backend_data(1, &MAC_A),
    )
}

fn routes(state: &DesiredState) -> Vec<(String, String, Option<IpAddr>, bool)> {
    state
        .routes
        .iter()
        .map(|r| (r.dst.to_string(), r.device.clone(), r.via, r.onlink))
        .collect()
}

#[test]
fn vxlan_peers_get_neighbour_fdb_and_an_onlink_route() {
    let b = vx("node-b", "10.244.2.0/24", [198, 51, 100, 2], 2);
    let c = vx("node-c", "10.244.3.0/24", [203, 0, 113, 3], 3);
    let state = run(VXLAN, me_vx(), vec![c, b]).unwrap();
    let v = state.vxlan.first().unwrap();
    assert_eq!(
        (v.device.as_str(), v.vni, v.mtu, v.mac),
        ("flannel.1", 1, 1450, MAC_A)
    );
    assert_eq!(v.addresses, vec!["10.244.1.0/32".parse::<IpNet>().unwrap()]);
    assert_eq!(v.underlay_device.as_deref(), Some("eth0"));
    assert!(
        state.guard.is_empty(),
        "pod traffic is clear on the underlay: no guard"
    );
    let peers: Vec<_> = v
        .peers
        .iter()
        .map(|p| {
            (
                p.node.as_str(),
                p.gateway.to_string(),
                p.mac,
                p.public_ip.to_string(),
            )
        })
        .collect();
    assert_eq!(
        peers,
        vec![
            ("node-b", "10.244.2.0".into(), mac(2), "198.51.100.2".into()),
            ("node-c", "10.244.3.0".into(), mac(3), "203.0.113.3".into()),
        ]
    );
    let r = routes(&state);
    assert!(r.contains(&(
        "10.244.2.0/24".into(),
        "flannel.1".into(),
        Some("10.244.2.0".parse().unwrap()),
        true
    )));
    assert!(r.contains(&(
        "10.244.3.0/24".into(),
        "flannel.1".into(),
        Some("10.244.3.0".parse().unwrap()),
        true
    )));
    assert!(
        state.fail_closed.is_empty(),
        "vxlan does not encrypt: nothing to fail closed"
    );
    assert_eq!(state.subnet_env.mtu, 1450);
    assert_eq!(
        state.subnet_env.render(),
        "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=false\n"
    );
}

#[test]
fn direct_routing_goes_straight_to_onlink_peers_only() {
    let b = vx("node-b", "10.244.2.0/24", [198, 51, 100, 2], 2);
    let c = vx("node-c", "10.244.3.0/24", [203, 0, 113, 3], 3);
    let state = run(DIRECT, me_vx(), vec![b, c]).unwrap();
    let r = routes(&state);
    assert!(r.contains(&(
        "10.244.2.0/24".into(),
        "eth0".into(),
        Some("198.51.100.2".parse().unwrap()),
        false
    )));
    assert!(r.contains(&(
        "10.244.3.0/24".into(),
        "flannel.1".into(),
        Some("10.244.3.0".parse().unwrap()),
        true
    )));
    let roles: Vec<_> = state.routes.iter().map(|r| r.role.clone()).collect();
    assert!(roles.contains(&RouteRole::Direct("node-b".into())));
    assert!(roles.contains(&RouteRole::Peer("node-c".into())));
    let v = state.vxlan[0].clone();
    assert_eq!(v.peers.len(), 1, "only the routed peer needs vxlan entries");
    assert_eq!(v.peers[0].node, "node-c");
}

#[test]
fn bad_vxlan_peers_are_left_out_with_the_reason_and_the_rest_stays() {
    let good = vx("node-b", "10.244.2.0/24", [198, 51, 100, 2], 2);
    let bad_mac = lease(
        "node-x",
        "10.244.9.0/24",
        [198, 51, 100, 9],
        "vxlan",
        json!({"VNI": 1, "VtepMAC": "zz"}),
    );
    let multicast = lease(
        "node-m",
        "10.244.8.0/24",
        [198, 51, 100, 8],
        "vxlan",
        json!({"VtepMAC": "01:00:5e:00:00:01"}),
    );
    let dup1 = vx("node-d", "10.244.4.0/24", [198, 51, 100, 4], 7);
    let dup2 = vx("node-e", "10.244.5.0/24", [198, 51, 100, 5], 7);
    let wg = lease(
        "node-w",
        "10.244.6.0/24",
        [198, 51, 100, 6],
        "wireguard",
        json!(null),
    );
    let state = run(
        VXLAN,
        me_vx(),
        vec![good, bad_mac, multicast, dup1, dup2, wg],
    )
    .unwrap();
    let v = state.vxlan.first().unwrap();
    // node-d and node-e publish one MAC; with no creation order known, the first by name
    // keeps it.
    assert_eq!(
        v.peers.iter().map(|p| p.node.as_str()).collect::<Vec<_>>(),
        vec!["node-b", "node-d"]
    );
    let why = |n: &str| {
        state
            .left_out
            .iter()
            .find(|l| l.node == n)
            .map(|l| l.reason.to_string())
            .unwrap_or_else(|| panic!("{n} not left out: {:?}", state.left_out))
    };
    assert!(why("node-x").contains("VtepMAC \"zz\" is not a MAC address"));
    assert!(why("node-m").contains("not a unicast address"));
    assert_eq!(
        why("node-e"),
        "its backend-data is unusable: VtepMAC 0a:00:00:00:00:07 is also published by node node-d, which keeps it"
    );
    assert!(why("node-w").contains("all nodes must use one backend"));
    assert_eq!(state.left_out.len(), 4, "{:?}", state.left_out);
    assert_eq!(state.routes.len(), 2, "{:?}", state.routes);
}

#[test]
fn a_vtep_mac_claimed_twice_stays_with_the_older_entry() {
    let incumbent = |created: Option<i64>| {
        let mut l = vx("node-z", "10.244.4.0/24", [198, 51, 100, 4], 7);
        l.created = created;
        l
    };
    let newcomer = |created: Option<i64>| {
        let mut l = vx("node-c", "10.244.5.0/24", [198, 51, 100, 5], 7);
        l.created = created;
        l
    };
    // The incumbent sorts after the newcomer by name: only the creation order decides.
    for (z, c) in [(Some(3), Some(9)), (Some(3), None), (Some(5), Some(5))] {
        let state = run(VXLAN, me_vx(), vec![incumbent(z), newcomer(c)]).unwrap();
        let kept: Vec<_> = state.vxlan[0]
            .peers
            .iter()
            .map(|p| p.node.as_str())
            .collect();
        let out: Vec<_> = state.left_out.iter().map(|l| l.node.as_str()).collect();
        if z == c {
            // A tie goes to the first name, on every node alike.
            assert_eq!((kept, out), (vec!["node-c"], vec!["node-z"]));
        } else {
            assert_eq!((kept, out), (vec!["node-z"], vec!["node-c"]), "{z:?} {c:?}");
        }
    }
    // A peer that publishes this node's own MAC is left out; this node keeps it.
    let mine = lease(
        "node-c",
        "10.244.5.0/24",
        [198, 51, 100, 5],
        "vxlan",
        vxlan_backend_data(1, &MAC_A),
    );
    let state = run(VXLAN, me_vx(), vec![mine]).unwrap();
    assert!(state.vxlan.first().unwrap().peers.is_empty());
    assert!(state.left_out[0]
        .reason
        .to_string()
        .contains("node node-a, which keeps it"));
}

#[test]
fn this_nodes_own_bad_vtep_mac_fails_the_plan_naming_the_node() {
    let me = lease(
        "node-a",
        "10.244.1.0/24",
        [198, 51, 100, 1],
        "vxlan",
        json!({"VNI": 1}),
    );
    let err = run(VXLAN, me, vec![]).unwrap_err().to_string();
    assert!(err.contains("node-a") && err.contains("VtepMAC"), "{err}");
}

#[test]
fn host_gw_routes_onlink_peers_and_names_the_routed_one() {
    let me = lease(
        "node-a",
        "10.244.1.0/24",
        [198, 51, 100, 1],
        "host-gw",
        json!(null),
    );
    let b = lease(
        "node-b",
        "10.244.2.0/24",
        [198, 51, 100, 2],
        "host-gw",
        json!(null),
    );
    let x = lease(
        "node-x",
        "10.244.3.0/24",
        [203, 0, 113, 5],
        "host-gw",
        json!(null),
    );
    let state = run(HOST_GW, me, vec![b, x]).unwrap();
    assert_eq!(
        routes(&state),
        vec![(
            "10.244.2.0/24".into(),
            "eth0".into(),
            Some("198.51.100.2".parse().unwrap()),
            false
        )]
    );
    assert!(state.vxlan.is_empty() && state.tunnels.is_empty());
    assert_eq!(state.subnet_env.mtu, 1500);
    assert_eq!(state.left_out.len(), 1);
    assert_eq!(
        state.left_out[0].to_string(),
        "node node-x left out: host-gw needs all nodes on one L2 segment; it is at 203.0.113.5, behind a router: use vxlan with DirectRouting"
    );
    assert!(matches!(
        state.left_out[0].reason,
        LeaveReason::NotOnLink { .. }
    ));
}
