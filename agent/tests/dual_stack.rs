//! The dual-stack lab: every node has an IPv4 and an IPv6 underlay address, every pod an
//! address of each family. On wireguard (flannel's default `Mode: separate`) every pod
//! pair reaches each other over both families, IPv6 through `flannel-wg-v6` between the
//! nodes' IPv6 addresses, nothing in clear; the leases are flannel's dual-stack ones. A
//! deleted `flannel-wg-v6` and the IPv6 masquerade table come back, and an agent killed
//! and restarted loses no IPv6 traffic.

use std::time::Duration;

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{in_ns, Lab, LabConfig};
use weft_lab::traffic::Probe;
use weft_lab::wait::{until, until_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn lab() -> Lab {
    Lab::start(LabConfig::wireguard(3, WEFT).dual_stack()).unwrap()
}

#[test]
fn wireguard_carries_both_families_between_all_pairs() {
    let lab = lab();
    let pairs = lab.assert_all_pairs();
    assert_eq!(pairs, 3 * 2 * 2 * 2 * 2, "every pod pair, both families");
    let watch = ClearWatch::start(&lab).unwrap();
    for (i, node) in lab.nodes.iter().enumerate() {
        // The lease: `10.244.X.0-24&fd00:10:244:Y::-64`, with the node's IPv6 address.
        let key = lab.lease_key(i).unwrap();
        assert!(key.contains("&fd00:10:244:"), "{key}");
        let value = lab.published_lease(i).expect("the node's lease");
        assert_eq!(value["PublicIPv6"], format!("fd77::{}", i + 1), "{value}");
        // IPv6 peers on flannel-wg-v6, reached at their IPv6 addresses.
        let peers = lab.on_node(i, "wg show flannel-wg-v6 endpoints").unwrap();
        let endpoints: Vec<&str> = peers.lines().filter_map(|l| l.split('\t').nth(1)).collect();
        assert_eq!(endpoints.len(), 2, "{peers}");
        assert!(
            endpoints
                .iter()
                .all(|e| e.starts_with("[fd77::") && e.ends_with("]:51821")),
            "{peers}"
        );
        // Fail closed for IPv6 too: the pod network's blackhole under the device routes.
        let routes = in_ns(&node.ns, "ip -6 route show type blackhole").unwrap();
        assert!(routes.contains("blackhole fd00:10:244::/56"), "{routes}");
    }
    // `weft status`: each peer once per device, with that family's subnet, both up.
    let status = lab.on_node(0, &format!("{WEFT} status")).unwrap();
    let rows: Vec<&str> = status.lines().filter(|l| l.ends_with(" up")).collect();
    assert_eq!(rows.len(), 4, "{status}");
    assert_eq!(
        rows.iter().filter(|r| r.contains("/64 ")).count(),
        2,
        "{status}"
    );
    let watched = watch.finish().unwrap();
    eprintln!("dual-stack watch: {watched:?}");
}

#[test]
fn the_ipv6_device_and_table_heal_and_a_restart_loses_no_ipv6_traffic() {
    let mut lab = lab();
    let node = &lab.nodes[0];
    let (a, b) = (&node.pods[0], &lab.nodes[1].pods[0]);
    let b6 = b.ip6.unwrap();
    let watch = ClearWatch::start(&lab).unwrap();
    in_ns(&node.ns, "ip link del flannel-wg-v6").unwrap();
    let back = until_or(
        "flannel-wg-v6 back with both peers and its routes",
        Duration::from_secs(2),
        || {
            lab.on_node(0, "wg show flannel-wg-v6 peers")
                .is_ok_and(|p| p.lines().count() == 2)
                && in_ns(&node.ns, "ip -6 route show proto 87 dev flannel-wg-v6")
                    .is_ok_and(|r| r.lines().count() == 3)
        },
        || {
            let peers = lab.on_node(0, "wg show flannel-wg-v6").unwrap_or_default();
            let routes = in_ns(&node.ns, "ip -6 route show table all").unwrap_or_default();
            format!("{peers}\n{routes}\n{}", lab.logs())
        },
    );
    let traffic = until(
        "IPv6 pod traffic through the recreated device",
        Duration::from_secs(5),
        || in_ns(&a.ns, &format!("ping -c 1 -W 1 -q {b6}")).is_ok(),
    );
    eprintln!("flannel-wg-v6 deleted -> back {back:?}; IPv6 traffic {traffic:?} after that");
    // The watch goes on while every pair, both families, is tried through the new device.
    lab.assert_all_pairs();
    let watched = watch.finish().unwrap();
    eprintln!("device deleted and recreated: {watched:?}, nothing in clear");

    in_ns(&node.ns, "nft delete table ip6 flannel-ipv6").unwrap();
    let table = until(
        "the IPv6 masquerade table back after deletion",
        Duration::from_secs(5),
        || {
            in_ns(&node.ns, "nft list table ip6 flannel-ipv6")
                .is_ok_and(|t| t.contains("masquerade fully-random"))
        },
    );
    eprintln!("ip6 flannel-ipv6 back {table:?} after deletion");

    // SIGKILL and restart node 2's agent under a 100 pps IPv6 ping and TCP stream.
    let (a_ns, b_ns) = (a.ns.clone(), b.ns.clone());
    let probe = Probe::start(&a_ns, &b_ns, b6).unwrap();
    lab.kill_and_restart(1).unwrap();
    let d = probe.finish().unwrap();
    eprintln!("SIGKILL + restart over IPv6: {d}");
    assert_eq!(d.pings_lost, 0, "{d}");
    assert!(d.stream_error.is_none(), "{d}");
    lab.assert_all_pairs();
}

#[test]
fn host_gw_routes_both_families_between_all_pairs() {
    let lab = Lab::start(LabConfig::backend(3, WEFT, "host-gw", false).dual_stack()).unwrap();
    let pairs = lab.assert_all_pairs();
    assert_eq!(pairs, 48, "every pod pair, both families");
    for (i, node) in lab.nodes.iter().enumerate() {
        // One IPv6 route per peer, via that peer's IPv6 underlay address.
        let routes = in_ns(&node.ns, "ip -6 route show proto 87").unwrap();
        let via: Vec<&str> = routes
            .lines()
            .filter_map(|l| l.split(" via ").nth(1)?.split_whitespace().next())
            .collect();
        let mut want: Vec<String> = (1..=3)
            .filter(|n| *n != i + 1)
            .map(|n| format!("fd77::{n}"))
            .collect();
        want.sort();
        let mut got: Vec<String> = via.iter().map(|s| s.to_string()).collect();
        got.sort();
        assert_eq!(got, want, "{routes}");
    }
}

#[test]
fn vxlan_carries_ipv6_over_its_own_device_and_heals_it() {
    let lab = Lab::start(LabConfig::backend(3, WEFT, "vxlan", false).dual_stack()).unwrap();
    assert_eq!(lab.assert_all_pairs(), 48, "every pod pair, both families");
    let node = &lab.nodes[0];
    // flannel-v6.1 over the IPv6 underlay, one FDB entry per peer at its IPv6 address.
    let link = in_ns(&node.ns, "ip -d link show flannel-v6.1").unwrap();
    assert!(link.contains("local fd77::1"), "{link}");
    let fdb = in_ns(&node.ns, "bridge fdb show dev flannel-v6.1").unwrap();
    for peer in ["fd77::2", "fd77::3"] {
        assert!(fdb.contains(&format!("dst {peer} ")), "{fdb}");
    }
    // The doctor checks both devices' entries against what the peers published.
    let (said, doctor) = lab.doctor_says(
        0,
        &[
            "PASS",
            "vxlan entries",
            "flannel.1, flannel-v6.1",
            "of 4 peers",
        ],
    );
    assert!(said, "{doctor}");
    // Deleted, it comes back with its neighbours and FDB entries, and IPv6 flows again.
    in_ns(&node.ns, "ip link del flannel-v6.1").unwrap();
    let back = until_or(
        "flannel-v6.1 back with its entries",
        Duration::from_secs(5),
        || {
            in_ns(&node.ns, "bridge fdb show dev flannel-v6.1")
                .is_ok_and(|f| f.matches(" dst fd77::").count() == 2)
                && in_ns(&node.ns, "ip -6 neigh show dev flannel-v6.1 nud permanent")
                    .is_ok_and(|n| n.lines().count() == 2)
        },
        || lab.logs(),
    );
    eprintln!("flannel-v6.1 deleted -> back with its entries in {back:?}");
    assert_eq!(lab.assert_all_pairs(), 48);
}

#[test]
fn vxlan_direct_routing_routes_ipv6_straight_to_onlink_peers() {
    let lab = Lab::start(LabConfig::backend(3, WEFT, "vxlan", true).dual_stack()).unwrap();
    assert_eq!(lab.assert_all_pairs(), 48, "every pod pair, both families");
    let routes = in_ns(&lab.nodes[0].ns, "ip -6 route show proto 87").unwrap();
    for peer in ["fd77::2", "fd77::3"] {
        assert!(
            routes
                .lines()
                .any(|l| l.contains(&format!("via {peer} dev eth0"))),
            "{routes}"
        );
    }
}

#[test]
fn a_dual_stack_kube_cluster_meshes_both_families() {
    let lab = Lab::start(LabConfig::kube(3, WEFT).dual_stack()).unwrap();
    let watch = ClearWatch::start(&lab).unwrap();
    assert_eq!(lab.assert_all_pairs(), 48, "every pod pair, both families");
    watch.finish().unwrap();
    // flannel's annotations for the IPv6 half on every Node.
    let api = lab.kube.as_ref().unwrap();
    for n in 1..=3 {
        let node = api.node(&format!("n{n}")).unwrap();
        let notes = &node["metadata"]["annotations"];
        assert_eq!(
            notes["flannel.alpha.coreos.com/public-ipv6"],
            format!("fd77::{n}"),
            "{notes}"
        );
        let v6: serde_json::Value = serde_json::from_str(
            notes["flannel.alpha.coreos.com/backend-v6-data"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(v6["Port"], 51821, "{notes}");
    }
}
