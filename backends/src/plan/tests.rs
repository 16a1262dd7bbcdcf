//! Table tests for `plan`: the good mesh in full, then one case per kind of bad peer, each
//! asserting the recorded reason and that the good peer's plan is untouched.

use std::net::Ipv4Addr;
use std::time::{Duration, SystemTime};

use serde_json::json;
use weft_crypto::PrivateKey;

use super::*;
use crate::model::{ClusterView, Lease, RouteRole};
use crate::netconf::parse;

pub(super) const NOW: Duration = Duration::from_secs(1_800_000_000);

pub(super) fn key(seed: u8) -> weft_crypto::PublicKey {
    PrivateKey::from_bytes([seed; 32]).public_key()
}

pub(super) fn lease(node: &str, subnet: &str, ip: Ipv4Addr, key_seed: u8) -> Lease {
    Lease {
        node: node.into(),
        subnet: Some(subnet.parse().unwrap()),
        subnet_v6: None,
        public_ip: Some(ip),
        public_ipv6: None,
        backend_type: "wireguard".into(),
        backend_data: Some(wireguard_backend_data(&key(key_seed), 51820)),
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

pub(super) fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 51, 100, last)
}

pub(super) fn local() -> Lease {
    lease("node-a", "10.244.1.0/24", ip(1), 1)
}

pub(super) fn good_peer() -> Lease {
    lease("node-b", "10.244.2.0/24", ip(2), 2)
}

pub(super) fn run(
    config: &str,
    peers: Vec<Lease>,
    ip_masq: bool,
) -> Result<DesiredState, PlanError> {
    run_as(local(), config, peers, ip_masq)
}

pub(super) fn run_as(
    me: Lease,
    config: &str,
    peers: Vec<Lease>,
    ip_masq: bool,
) -> Result<DesiredState, PlanError> {
    run_observing(me, config, peers, ip_masq, &Default::default())
}

/// `run_as`, with what the devices reported.
pub(super) fn run_observing(
    me: Lease,
    config: &str,
    peers: Vec<Lease>,
    ip_masq: bool,
    observed: &crate::model::Observed,
) -> Result<DesiredState, PlanError> {
    run_with_psks(me, config, peers, ip_masq, observed, &Default::default())
}

/// `run_observing`, with the pairs' post-quantum PSKs.
pub(super) fn run_with_psks(
    me: Lease,
    config: &str,
    peers: Vec<Lease>,
    ip_masq: bool,
    observed: &crate::model::Observed,
    pair_psks: &std::collections::BTreeMap<weft_crypto::PublicKey, crate::model::PairSecret>,
) -> Result<DesiredState, PlanError> {
    let config = parse(config).unwrap();
    let mut view = ClusterView::default();
    view.insert(me.clone());
    for p in peers {
        view.insert(p);
    }
    let options = PlanOptions {
        ip_masq,
        underlay_mtu: 1500,
        underlay_device: None,
        underlay_networks: vec![],
    };
    plan(&PlanInput {
        path_mtus: &Default::default(),
        pair_psks,
        observed,
        local: &me,
        view: &view,
        config: &config,
        options: &options,
        now: SystemTime::UNIX_EPOCH + NOW,
    })
}

pub(super) const CONF: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;

#[test]
fn a_peer_in_our_zone_is_reached_on_its_internal_address() {
    let zoned = |mut l: Lease, zone: Option<&str>, internal: Option<&str>| {
        l.reach.zone = zone.map(str::to_string);
        l.reach.internal_ip = internal.map(|i| i.parse().unwrap());
        l
    };
    let near = zoned(good_peer(), Some("zone-a"), Some("192.0.2.2"));
    let far = zoned(
        lease("node-c", "10.244.3.0/24", ip(3), 3),
        Some("zone-b"),
        Some("192.0.2.3"),
    );
    let unzoned = zoned(
        lease("node-d", "10.244.4.0/24", ip(4), 4),
        None,
        Some("192.0.2.4"),
    );
    let endpoints = |me: Lease| -> Vec<String> {
        let state = run_as(
            me,
            CONF,
            vec![near.clone(), far.clone(), unzoned.clone()],
            false,
        )
        .unwrap();
        state.tunnels[0]
            .peers
            .iter()
            .map(|p| p.endpoint.to_string())
            .collect()
    };
    assert_eq!(
        endpoints(zoned(local(), Some("zone-a"), None)),
        [
            "192.0.2.2:51820",
            "198.51.100.3:51820",
            "198.51.100.4:51820"
        ]
    );
    assert_eq!(
        endpoints(zoned(local(), Some("zone-b"), None)),
        [
            "198.51.100.2:51820",
            "192.0.2.3:51820",
            "198.51.100.4:51820"
        ]
    );
    // No zone of our own: every peer on its published address.
    assert_eq!(
        endpoints(local()),
        [
            "198.51.100.2:51820",
            "198.51.100.3:51820",
            "198.51.100.4:51820"
        ]
    );
}

#[test]
fn persistent_keepalive_is_applied_to_every_peer() {
    let conf = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "PersistentKeepaliveInterval": 25}}"#;
    let state = run(
        conf,
        vec![good_peer(), lease("node-c", "10.244.3.0/24", ip(3), 3)],
        false,
    )
    .unwrap();
    assert!(state.tunnels[0].peers.iter().all(|p| p.keepalive == 25));
}

#[test]
fn three_nodes_full_plan() {
    let c = lease("node-c", "10.244.3.0/24", ip(3), 3);
    let state = run(CONF, vec![c, good_peer()], true).unwrap();
    assert_eq!(state.tunnels.len(), 1);
    let t = &state.tunnels[0];
    assert_eq!(
        (t.device.as_str(), t.listen_port, t.mtu),
        ("flannel-wg", 51820, 1420)
    );
    assert_eq!(t.addresses, vec!["10.244.1.0/32".parse::<IpNet>().unwrap()]);
    let peers: Vec<_> = t
        .peers
        .iter()
        .map(|p| {
            (
                p.node.as_str(),
                p.public_key,
                p.endpoint.to_string(),
                p.allowed_ips.clone(),
            )
        })
        .collect();
    assert_eq!(
        peers,
        vec![
            (
                "node-b",
                key(2),
                "198.51.100.2:51820".into(),
                vec!["10.244.2.0/24".parse().unwrap()]
            ),
            (
                "node-c",
                key(3),
                "198.51.100.3:51820".into(),
                vec!["10.244.3.0/24".parse().unwrap()]
            ),
        ]
    );
    let routes: Vec<_> = state
        .routes
        .iter()
        .map(|r| (r.dst.to_string(), r.device.as_str(), r.role.clone()))
        .collect();
    assert_eq!(
        routes,
        vec![
            ("10.244.0.0/16".into(), "flannel-wg", RouteRole::Covering),
            (
                "10.244.2.0/24".into(),
                "flannel-wg",
                RouteRole::Peer("node-b".into())
            ),
            (
                "10.244.3.0/24".into(),
                "flannel-wg",
                RouteRole::Peer("node-c".into())
            ),
        ]
    );
    assert_eq!(
        state.subnet_env.render(),
        "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1420\nFLANNEL_IPMASQ=true\n"
    );
    assert_eq!(state.masquerade.len(), 1);
    assert_eq!(
        state.masquerade[0].lines(),
        vec![
            "postrouting: meta mark & 0x4000 == 0x4000 return",
            "postrouting: ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
            "postrouting: ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return",
            "postrouting: ip saddr != 10.244.0.0/16 ip daddr 10.244.1.0/24 return",
            "postrouting: ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random",
            "postrouting: ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random",
            "forward: ip saddr 10.244.0.0/16 accept",
            "forward: ip daddr 10.244.0.0/16 accept",
        ]
    );
    assert!(state.left_out.is_empty());
    assert_eq!(
        state.fail_closed,
        vec!["10.244.0.0/16".parse::<IpNet>().unwrap()],
        "wireguard fails closed"
    );
    // Pure: the same input gives the same plan.
    let again = run(
        CONF,
        vec![lease("node-c", "10.244.3.0/24", ip(3), 3), good_peer()],
        true,
    )
    .unwrap();
    assert_eq!(again, state);
}

/// node-x, otherwise good, with one thing broken.
fn broken(f: impl FnOnce(&mut Lease)) -> Lease {
    let mut l = lease("node-x", "10.244.9.0/24", ip(9), 9);
    f(&mut l);
    l
}

#[test]
fn bad_peers_are_left_out_with_a_reason_and_the_rest_is_unaffected() {
    let left_out = |why: &str| format!("node node-x left out: {why}");
    let cases: Vec<(&str, Lease, String)> = vec![
        ("undecodable key", broken(|l| l.backend_data = Some(json!({"PublicKey": "bm90IGEga2V5", "Port": 51820}))),
         left_out("its backend-data is unusable: PublicKey \"bm90IGEga2V5\": decodes to 9 bytes, but a WireGuard key is exactly 32 bytes (44 base64 characters)")),
        ("missing backend-data", broken(|l| l.backend_data = None), left_out("its backend-data is unusable: it is missing")),
        ("bad port", broken(|l| l.backend_data = Some(json!({"PublicKey": key(9).to_base64(), "Port": 0}))),
         left_out("its backend-data is unusable: Port 0 is not a UDP port (1–65535)")),
        ("no public IP", broken(|l| l.public_ip = None), left_out("it publishes no IPv4 public IP to reach it on")),
        ("subnet outside network", broken(|l| l.subnet = Some("10.99.9.0/24".parse().unwrap())),
         left_out("its subnet 10.99.9.0/24 lies outside the pod network 10.244.0.0/16")),
        ("overlaps our subnet", broken(|l| l.subnet = Some("10.244.1.0/25".parse().unwrap())),
         left_out("its subnet 10.244.1.0/25 overlaps this node's subnet 10.244.1.0/24")),
        ("our own key", broken(|l| l.backend_data = Some(wireguard_backend_data(&key(1), 51820))),
         left_out(&format!("it publishes this node's own public key {}", key(1)))),
        ("wrong backend", broken(|l| l.backend_type = "vxlan".into()),
         left_out("it runs backend \"vxlan\", this node runs wireguard; all nodes must use one backend")),
        ("expired", broken(|l| l.expires = Some(SystemTime::UNIX_EPOCH + NOW - Duration::from_secs(1))), left_out("its lease has expired")),
        ("no subnet", broken(|l| l.subnet = None), left_out("it holds no subnet of an enabled family")),
    ];

    for (name, bad, want) in cases {
        let peers = vec![bad, good_peer()];
        let state = run(CONF, peers, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        let reasons: Vec<_> = state.left_out.iter().map(ToString::to_string).collect();
        assert_eq!(reasons, vec![want.to_string()], "{name}");
        let t = &state.tunnels[0];
        assert_eq!(
            t.peers.iter().map(|p| p.node.as_str()).collect::<Vec<_>>(),
            ["node-b"],
            "{name}"
        );
        assert!(
            state
                .routes
                .iter()
                .any(|r| r.role == RouteRole::Peer("node-b".into())),
            "{name}"
        );
        assert!(
            !state
                .routes
                .iter()
                .any(|r| r.role == RouteRole::Peer("node-x".into())),
            "{name}"
        );
        assert!(
            state.routes.iter().any(|r| r.role == RouteRole::Covering),
            "{name}: fail-closed route missing"
        );
    }
}

#[test]
fn peer_without_usable_key_still_has_its_traffic_captured_by_the_covering_route() {
    let mut bad = good_peer();
    bad.backend_data = Some(json!("garbage"));
    let state = run(CONF, vec![bad], false).unwrap();
    assert!(state.tunnels[0].peers.is_empty());
    let covering: Vec<_> = state
        .routes
        .iter()
        .filter(|r| {
            r.dst
                .contains(&"10.244.2.7".parse::<std::net::IpAddr>().unwrap())
        })
        .collect();
    assert_eq!(covering.len(), 1);
    assert_eq!(
        (covering[0].device.as_str(), &covering[0].role),
        ("flannel-wg", &RouteRole::Covering)
    );
}

#[test]
fn psk_keepalive_port_and_mtu_from_config() {
    let conf = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "ListenPort": 51999, "MTU": 9000,
        "PSK": "FpCyhws9cxwWoV4xELtfJvjJN+zQVRPISllRWgeopVE=", "PersistentKeepaliveInterval": 25}}"#;
    let mut flannel_peer = good_peer();
    flannel_peer.backend_data = Some(json!({ "PublicKey": key(2).to_base64() })); // flannel omits Port
    let state = run(conf, vec![flannel_peer], false).unwrap();
    let t = &state.tunnels[0];
    assert_eq!((t.listen_port, t.mtu), (51999, 8920));
    let p = &t.peers[0];
    assert_eq!(
        (
            p.endpoint.to_string().as_str(),
            p.keepalive,
            p.psk.is_some()
        ),
        ("198.51.100.2:51999", 25, true)
    );
    assert!(state.masquerade.is_empty(), "no --ip-masq, no rules");
    assert_eq!(state.subnet_env.mtu, 8920);
}

#[test]
fn problems_with_our_own_lease_fail_the_plan() {
    let config = parse(CONF).unwrap();
    let options = PlanOptions {
        ip_masq: false,
        underlay_mtu: 1500,
        underlay_device: None,
        underlay_networks: vec![],
    };
    let view = ClusterView::default();
    let mut me = local();
    me.subnet = Some("10.9.0.0/24".parse().unwrap());
    let err = plan(&PlanInput {
        path_mtus: &Default::default(),
        pair_psks: &Default::default(),
        observed: &Default::default(),
        local: &me,
        view: &view,
        config: &config,
        options: &options,
        now: SystemTime::UNIX_EPOCH,
    })
    .unwrap_err();
    assert_eq!(err.to_string(), "this node's (node-a) subnet 10.9.0.0/24 lies outside the pod network 10.244.0.0/16; fix the node's podCIDR or the config's Network");
    let mut me = local();
    me.backend_data = None;
    let err = plan(&PlanInput {
        path_mtus: &Default::default(),
        pair_psks: &Default::default(),
        observed: &Default::default(),
        local: &me,
        view: &view,
        config: &config,
        options: &options,
        now: SystemTime::UNIX_EPOCH,
    })
    .unwrap_err();
    assert!(matches!(err, PlanError::LocalBackendData { .. }), "{err}");
}

/// An encrypting backend guards its pod network against forged clear packets: other
/// nodes' pods only out of the tunnel, this node's own never off the underlay (the
/// unencrypted backends, which carry pod traffic in clear, get none: `unencrypted_tests`).
#[test]
fn wireguard_plans_a_guard() {
    let state = run(CONF, vec![good_peer()], false).unwrap();
    assert_eq!(
        state.guard,
        [crate::model::GuardSpec {
            family: crate::model::Family::Ipv4,
            network: "10.244.0.0/16".parse().unwrap(),
            own: Some("10.244.1.0/24".parse().unwrap()),
            tunnels: vec!["flannel-wg".into()],
            underlay: None,
            clear: vec![],
        }]
    );
}
