//! flannel's other ways to carry IPv6, each in a lab with every pod pair tried and the
//! underlay watched for clear pod packets: WireGuard `Mode: auto` (both families on
//! `flannel-wg`, over IPv4), `Mode: ipv6` (both families on `flannel-wg`, over IPv6), and an
//! IPv6-only cluster (`EnableIPv4: false`) on wireguard and vxlan.

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{in_ns, Lab, LabConfig};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Node 1's `flannel-wg` peers' endpoints.
fn endpoints(lab: &Lab, device: &str) -> Vec<String> {
    let text = lab
        .on_node(0, &format!("wg show {device} endpoints"))
        .unwrap();
    let mut out: Vec<String> = text
        .lines()
        .filter_map(|l| l.split('\t').nth(1).map(str::to_string))
        .collect();
    out.sort();
    out
}

fn links(lab: &Lab) -> String {
    in_ns(&lab.nodes[0].ns, "ip -o link show").unwrap()
}

/// A dual-stack wireguard lab in `mode`: all pairs of both families, nothing in clear, one
/// device (`flannel-wg`) whose peers are at `want` endpoints.
fn one_device(mode: &str, want: [&str; 2]) {
    let cfg = LabConfig::wireguard(3, WEFT)
        .dual_stack()
        .wireguard_mode(mode);
    let lab = Lab::start(cfg).unwrap();
    let watch = ClearWatch::start(&lab).unwrap();
    assert_eq!(lab.assert_all_pairs(), 48);
    watch.finish().unwrap();
    assert!(!links(&lab).contains("flannel-wg-v6"), "{}", links(&lab));
    assert_eq!(endpoints(&lab, "flannel-wg"), want);
}

#[test]
fn mode_auto_carries_both_families_on_one_device_over_ipv4() {
    one_device("auto", ["198.51.100.2:51820", "198.51.100.3:51820"]);
}

#[test]
fn mode_ipv6_carries_both_families_on_one_device_over_ipv6() {
    one_device("ipv6", ["[fd77::2]:51820", "[fd77::3]:51820"]);
}

#[test]
fn an_ipv6_only_cluster_meshes_on_wireguard() {
    let lab = Lab::start(LabConfig::wireguard(3, WEFT).ipv6_only()).unwrap();
    let watch = ClearWatch::start(&lab).unwrap();
    assert_eq!(lab.assert_all_pairs(), 24, "every pod pair over IPv6");
    watch.finish().unwrap();
    // Only the IPv6 device and subnet: no flannel-wg, no FLANNEL_SUBNET.
    assert!(!links(&lab).contains("flannel-wg:"), "{}", links(&lab));
    let env = std::fs::read_to_string(lab.nodes[0].subnet_env()).unwrap();
    assert!(
        !env.contains("FLANNEL_SUBNET=") && env.contains("FLANNEL_IPV6_SUBNET="),
        "{env}"
    );
    let value = lab
        .etcd()
        .etcdctl(&[
            "get",
            "--prefix",
            "/coreos.com/network/subnets/",
            "--keys-only",
        ])
        .unwrap();
    assert!(
        value
            .lines()
            .filter(|l| !l.is_empty())
            .all(|k| k.starts_with("/coreos.com/network/subnets/fd00:10:244:") && !k.contains('&')),
        "{value}"
    );
}

#[test]
fn an_ipv6_only_cluster_meshes_on_vxlan() {
    let lab = Lab::start(LabConfig::backend(3, WEFT, "vxlan", false).ipv6_only()).unwrap();
    assert_eq!(lab.assert_all_pairs(), 24, "every pod pair over IPv6");
    assert!(!links(&lab).contains("flannel.1:"), "{}", links(&lab));
}
