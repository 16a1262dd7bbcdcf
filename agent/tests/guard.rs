//! Forged clear packets from the underlay, in the lab (wireguard backend, userspace device,
//! the lab's own sysctls: nothing tightened for the test). A host on the underlay sends
//! pings to a node with a pod address as source, the way anyone on that network can:
//! - "from" node 2's pod to node 1's pod: without a guard node 1 routes it to its pod as
//!   if it had come through the tunnel;
//! - "from" node 1's own pod to node 2's pod: without a guard node 1 encrypts it and node
//!   2 receives it as if node 1's pod had sent it.
//!
//! A counter in the receiving pod's namespace shows whether any arrived; the same pod
//! address then pings for real, through the tunnel, and is counted: the guard drops the
//! forgeries and nothing else.

use std::net::Ipv4Addr;
use std::time::Duration;

use weft_lab::lab::{in_ns, Lab, LabConfig};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Counts, in namespace `ns`, the echo requests that arrive from `src` (from now on).
fn count_arrivals(ns: &str, src: Ipv4Addr) {
    in_ns(
        ns,
        &format!(
            "{{ nft delete table ip probe 2>/dev/null || true; }} && nft add table ip probe && nft add chain ip probe input '{{ type filter hook input priority 0; }}' && nft add rule ip probe input ip saddr {src} icmp type echo-request counter"
        ),
    )
    .unwrap();
}

fn arrivals(ns: &str) -> u64 {
    let listing = in_ns(ns, "nft list table ip probe").unwrap();
    listing
        .split("packets ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in {listing}"))
}

/// From the lab's external host on the underlay: three pings with source `src` to `dst`,
/// sent to `via` (a node's underlay address) as the next hop.
fn forge(lab: &Lab, src: Ipv4Addr, dst: Ipv4Addr, via: Ipv4Addr) {
    let ext = lab.ext();
    in_ns(
        &ext,
        &format!("ip addr add {src}/32 dev lo && ip route replace {dst}/32 via {via}"),
    )
    .unwrap();
    // No answer comes back (that is the point): the exit status says nothing.
    let _ = in_ns(&ext, &format!("ping -c 3 -i 0.2 -W 1 -q -I {src} {dst}"));
    in_ns(
        &ext,
        &format!("ip addr del {src}/32 dev lo && ip route del {dst}/32"),
    )
    .unwrap();
}

#[test]
fn forged_pod_sources_from_the_underlay_reach_no_pod() {
    let lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();
    lab.assert_all_pairs();
    let (n1, n2) = (&lab.nodes[0], &lab.nodes[1]);
    let rp = in_ns(
        &n1.ns,
        "sysctl -n net.ipv4.conf.all.rp_filter net.ipv4.conf.eth0.rp_filter",
    )
    .unwrap();
    eprintln!(
        "node 1's rp_filter (all, eth0): {}",
        rp.split_whitespace().collect::<Vec<_>>().join(", ")
    );

    // Another node's pod, forged, to a local pod.
    let (victim, impersonated) = (&n1.pods[0], &n2.pods[0]);
    count_arrivals(&victim.ns, impersonated.ip);
    forge(&lab, impersonated.ip, victim.ip, n1.ip);
    assert_eq!(
        arrivals(&victim.ns),
        0,
        "a forged packet from node 2's pod reached node 1's pod:\n{}",
        lab.logs()
    );
    assert!(lab.ping(&impersonated.ns, victim.ip, Duration::from_secs(5)));
    assert!(arrivals(&victim.ns) > 0, "the real pod's pings are counted");

    // This node's own pod, forged, into the tunnel.
    let (impersonated, victim) = (&n1.pods[1], &n2.pods[0]);
    count_arrivals(&victim.ns, impersonated.ip);
    forge(&lab, impersonated.ip, victim.ip, n1.ip);
    assert_eq!(
        arrivals(&victim.ns),
        0,
        "a forged packet from node 1's own pod went through the tunnel to node 2's pod"
    );
    assert!(lab.ping(&impersonated.ns, victim.ip, Duration::from_secs(5)));
    assert!(arrivals(&victim.ns) > 0, "the real pod's pings are counted");
}
