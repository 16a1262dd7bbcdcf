//! Dual stack in the plans: wireguard's `separate` mode builds a device per family and
//! its single-device modes choose each peer's endpoint family; host-gw routes each family
//! via the peer's address of that family; vxlan gives IPv6 a device of its own over the
//! IPv6 underlay.

use std::net::{IpAddr, Ipv6Addr};

use serde_json::json;

use super::tests::{ip, key, lease as wg_lease, run_as};
use super::unencrypted_tests::{lease, mac, run, run_on, vx};
use super::*;
use crate::model::{format_mac, Lease, VxlanSpec};

fn dual(node: &str, n: u8) -> Lease {
    let mut l = wg_lease(node, &format!("10.244.{n}.0/24"), ip(n), n);
    l.subnet_v6 = Some(format!("fd00:10:244:{n}::/64").parse().unwrap());
    l.public_ipv6 = Some(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(n)));
    l.backend_v6_data = Some(wireguard_backend_data(&key(n), 51821));
    l
}

const DUAL: &str = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:10:244::/48", "Backend": {"Type": "wireguard"}}"#;

fn run_dual(config: &str, peers: Vec<Lease>) -> DesiredState {
    run_as(dual("node-a", 1), config, peers, true).unwrap()
}

#[test]
fn dual_stack_separate_mode_builds_two_devices() {
    let state = run_dual(DUAL, vec![dual("node-b", 2)]);
    let devs: Vec<_> = state
        .tunnels
        .iter()
        .map(|t| {
            (
                t.device.as_str(),
                t.listen_port,
                t.peers[0].endpoint.to_string(),
            )
        })
        .collect();
    assert_eq!(
        devs,
        [
            ("flannel-wg", 51820, "198.51.100.2:51820".into()),
            ("flannel-wg-v6", 51821, "[2001:db8::2]:51821".into())
        ]
    );
    assert_eq!(
        state.tunnels[1].addresses,
        vec!["fd00:10:244:1::/128".parse::<IpNet>().unwrap()]
    );
    assert_eq!(state.routes.len(), 4);
    assert_eq!(
        state.masquerade.iter().map(|m| m.table).collect::<Vec<_>>(),
        ["flannel-ipv4", "flannel-ipv6"]
    );
    assert!(state
        .subnet_env
        .render()
        .contains("FLANNEL_IPV6_SUBNET=fd00:10:244:1::1/64\n"));
}

#[test]
fn single_device_modes_choose_the_endpoint_family() {
    for (mode, endpoint) in [
        ("ipv4", "198.51.100.2:51820"),
        ("ipv6", "[2001:db8::2]:51820"),
        ("auto", "198.51.100.2:51820"),
    ] {
        let conf = DUAL.replace(
            r#""Type": "wireguard""#,
            &format!(r#""Type": "wireguard", "Mode": "{mode}""#),
        );
        let state = run_dual(&conf, vec![dual("node-b", 2)]);
        assert_eq!(state.tunnels.len(), 1, "{mode}");
        let p = &state.tunnels[0].peers[0];
        assert_eq!(p.endpoint.to_string(), endpoint, "{mode}");
        assert_eq!(p.allowed_ips.len(), 2, "{mode}");
    }
    let mut v6_only = dual("node-b", 2);
    v6_only.public_ip = None;
    let conf = DUAL.replace(
        r#""Type": "wireguard""#,
        r#""Type": "wireguard", "Mode": "auto""#,
    );
    assert_eq!(
        run_dual(&conf, vec![v6_only]).tunnels[0].peers[0]
            .endpoint
            .to_string(),
        "[2001:db8::2]:51820"
    );
}

/// A dual-stack host-gw lease: node `n` at 198.51.100.`n` and fd77::`n`.
fn dual_gw(n: u8) -> Lease {
    let mut l = lease(
        &format!("node-{n}"),
        &format!("10.244.{n}.0/24"),
        [198, 51, 100, n],
        "host-gw",
        json!(null),
    );
    l.subnet_v6 = Some(format!("fd00:0:0:{n}::/64").parse().unwrap());
    l.public_ipv6 = Some(format!("fd77::{n}").parse().unwrap());
    l.backend_data = None;
    l
}

#[test]
fn host_gw_routes_each_family_via_the_peers_address_of_that_family() {
    let conf = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00::/56", "Backend": {"Type": "host-gw"}}"#;
    let mut no_v6 = dual_gw(3);
    no_v6.public_ipv6 = None;
    let mut off_link = dual_gw(4);
    off_link.public_ipv6 = Some("fd99::4".parse().unwrap());
    let state = run_on(
        conf,
        dual_gw(1),
        vec![dual_gw(2), no_v6, off_link],
        &["198.51.100.0/24", "fd77::/64"],
    )
    .unwrap();
    let routes: Vec<String> = state
        .routes
        .iter()
        .map(|r| format!("{} via {}", r.dst, r.via.unwrap()))
        .collect();
    assert_eq!(
        routes,
        [
            "10.244.2.0/24 via 198.51.100.2",
            "10.244.3.0/24 via 198.51.100.3",
            "10.244.4.0/24 via 198.51.100.4",
            "fd00:0:0:2::/64 via fd77::2",
        ]
    );
    let reasons: Vec<String> = state.left_out.iter().map(ToString::to_string).collect();
    assert_eq!(
        reasons,
        [
            "node node-3 left out: it publishes no IPv6 public IP to reach it on",
            "node node-4 left out: host-gw needs all nodes on one L2 segment; it is at fd99::4, behind a router: use vxlan with DirectRouting",
        ]
    );
    assert_eq!(
        state.subnet_env.ipv6_subnet,
        Some("fd00:0:0:1::1/64".parse().unwrap())
    );
}

/// A dual-stack vxlan lease: node `n` at 198.51.100.`n` and fd77::`n`, VTEP MACs `n`
/// (IPv4) and `0x80 + n` (IPv6).
fn dual_vx(n: u8) -> Lease {
    let mut l = vx(
        &format!("node-{n}"),
        &format!("10.244.{n}.0/24"),
        [198, 51, 100, n],
        n,
    );
    l.subnet_v6 = Some(format!("fd00:0:0:{n}::/64").parse().unwrap());
    l.public_ipv6 = Some(format!("fd77::{n}").parse().unwrap());
    l.backend_v6_data = Some(vxlan_backend_data(1, &mac(0x80 + n)));
    l
}

const VXLAN_DUAL: &str = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00::/56", "Backend": {"Type": "vxlan"}}"#;

#[test]
fn vxlan_gives_ipv6_its_own_device_over_the_ipv6_underlay() {
    let mut bad_v6 = dual_vx(3);
    bad_v6.backend_v6_data = Some(json!({"VNI": 1}));
    let state = run(VXLAN_DUAL, dual_vx(1), vec![dual_vx(2), bad_v6]).unwrap();
    let [v4, v6] = &state.vxlan[..] else {
        panic!("two devices: {:?}", state.vxlan);
    };
    assert_eq!(
        (v4.device.as_str(), v6.device.as_str()),
        ("flannel.1", "flannel-v6.1")
    );
    assert_eq!(v6.local, "fd77::1".parse::<IpAddr>().unwrap());
    assert_eq!(v6.mac, mac(0x81));
    assert_eq!((v4.mtu, v6.mtu), (1450, 1430));
    assert_eq!(v6.addresses, ["fd00:0:0:1::/128".parse().unwrap()]);
    let peer = |v: &VxlanSpec| {
        v.peers
            .iter()
            .map(|p| {
                format!(
                    "{} {} {} {}",
                    p.node,
                    p.gateway,
                    format_mac(&p.mac),
                    p.public_ip
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(peer(v6), ["node-2 fd00:0:0:2:: 0a:00:00:00:00:82 fd77::2"]);
    assert_eq!(peer(v4).len(), 2, "node-3's IPv4 half is fine");
    let routes: Vec<String> = state
        .routes
        .iter()
        .filter(|r| r.dst.addr().is_ipv6())
        .map(|r| {
            format!(
                "{} via {} dev {} onlink {}",
                r.dst,
                r.via.unwrap(),
                r.device,
                r.onlink
            )
        })
        .collect();
    assert_eq!(
        routes,
        ["fd00:0:0:2::/64 via fd00:0:0:2:: dev flannel-v6.1 onlink true"]
    );
    let reasons: Vec<String> = state.left_out.iter().map(ToString::to_string).collect();
    assert_eq!(
        reasons,
        ["node node-3 left out: its backend-v6-data is unusable: it has no VtepMAC"]
    );
    // The pods' MTU fits the IPv6 device.
    assert_eq!(state.subnet_env.mtu, 1430);
    // Without this node's IPv6 address the plan says what to give.
    let mut me = dual_vx(1);
    me.public_ipv6 = None;
    let err = run(VXLAN_DUAL, me, vec![]).unwrap_err().to_string();
    assert!(
        err.contains("no global IPv6 address") && err.contains("--public-ipv6"),
        "{err}"
    );
}
