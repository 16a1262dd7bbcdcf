//! Forged clear packets from the underlay: a host on the underlay (the lab's external
//! host) sends pings with a pod address as source to a node, and counters in the pods
//! show whether any arrived. Used on every encrypting backend (`guard`, and `ipsec` in
//! the VM).

use std::net::Ipv4Addr;
use std::time::Duration;

use super::{in_ns, Lab};

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

/// In a lab of at least two nodes whose pods all reach each other: pings forged from the
/// underlay with node 2's pod address to node 1's pod, and with node 1's own pod address
/// to node 2's pod, reach no pod; the real pods' pings, through the tunnel, are counted.
pub fn assert_forged_pod_sources_reach_no_pod(lab: &Lab) {
    let (n1, n2) = (&lab.nodes[0], &lab.nodes[1]);
    let rp = in_ns(&n1.ns, "sysctl -n net.ipv4.conf.all.rp_filter").unwrap_or_default();
    eprintln!("node 1's rp_filter (all): {}", rp.trim());

    // Another node's pod, forged, to a local pod.
    let (victim, impersonated) = (&n1.pods[0], &n2.pods[0]);
    count_arrivals(&victim.ns, impersonated.ip);
    forge(lab, impersonated.ip, victim.ip, n1.ip);
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
    forge(lab, impersonated.ip, victim.ip, n1.ip);
    assert_eq!(
        arrivals(&victim.ns),
        0,
        "a forged packet from node 1's own pod went through the tunnel to node 2's pod"
    );
    assert!(lab.ping(&impersonated.ns, victim.ip, Duration::from_secs(5)));
    assert!(arrivals(&victim.ns) > 0, "the real pod's pings are counted");
    eprintln!(
        "forged pod sources from the underlay: none reached a pod (rp_filter {})",
        rp.trim()
    );
}
