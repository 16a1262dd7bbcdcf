//! The second segment (`br1`, 203.0.113.0/24) and what joins it to the first: one router,
//! or — with `LabConfig::narrow` — two routers joined by a narrower link (a site-to-site
//! VPN, a provider network at 1400), optionally dropping the ICMP "fragmentation needed" /
//! "packet too big" they would send (as security groups that block ICMP do). Every node's
//! own interface stays at 1500: only the path between the segments is narrow. In a
//! dual-stack lab the second segment has an IPv6 prefix of its own (`SECOND_SEGMENT_V6`),
//! routed the same way.

use super::config::{EXT_IP, ROUTER_IP, ROUTER_IP2};
use super::fabric::{attach_to, in_ns, Namespaces};

/// The second segment's IPv6 prefix, and the routers' IPv6 addresses on each segment.
pub const SECOND_SEGMENT_V6: &str = "fd78::/64";
pub const ROUTER_IP6: &str = "fd77::fe";
pub const ROUTER_IP6_2: &str = "fd78::fe";

/// Node `i`'s (1-based) IPv6 underlay address on the second segment, with its prefix.
pub fn routed_ipv6(i: usize) -> String {
    format!("fd78::{i:x}/64")
}

/// The narrow link between the two routers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Narrow {
    pub mtu: u32,
    /// The routers drop the ICMP errors that would tell a sender the path's MTU.
    pub drop_icmp: bool,
}

/// The router on the first segment's side (the only one without `Narrow`).
pub fn router_ns(tag: &str) -> String {
    format!("{tag}-rt")
}

/// The router on the second segment's side (`Narrow` only).
pub fn far_router_ns(tag: &str) -> String {
    format!("{tag}-rtb")
}

/// Builds `br1` and the router(s).
pub(super) fn build(
    tag: &str,
    fabric: &str,
    namespaces: &mut Namespaces,
    narrow: Option<Narrow>,
    ipv6: bool,
) -> anyhow::Result<()> {
    in_ns(fabric, "ip link add br1 type bridge && ip link set br1 up")?;
    let rt = router_ns(tag);
    namespaces.add(&rt)?;
    attach_to(fabric, "br0", &rt, "rt", "eth0", ROUTER_IP)?;
    in_ns(
        &rt,
        &format!("sysctl -qw net.ipv4.ip_forward=1 && ip route add default via {EXT_IP}"),
    )?;
    if ipv6 {
        in_ns(
            &rt,
            &format!(
                "sysctl -qw net.ipv6.conf.all.forwarding=1 && ip -6 addr add {ROUTER_IP6}/64 dev eth0 nodad"
            ),
        )?;
    }
    for name in ["ext", "etcd"] {
        in_ns(
            &format!("{tag}-{name}"),
            &format!("ip route add 203.0.113.0/24 via {ROUTER_IP}"),
        )?;
    }
    let Some(narrow) = narrow else {
        attach_to(fabric, "br1", &rt, "rt2", "eth1", ROUTER_IP2)?;
        if ipv6 {
            in_ns(
                &rt,
                &format!("ip -6 addr add {ROUTER_IP6_2}/64 dev eth1 nodad"),
            )?;
        }
        return Ok(());
    };
    let far = far_router_ns(tag);
    namespaces.add(&far)?;
    attach_to(fabric, "br1", &far, "rt2", "eth1", ROUTER_IP2)?;
    in_ns(
        &rt,
        &format!(
            "ip link add site type veth peer name site netns {far} \
             && ip link set site mtu {mtu} up && ip addr add 10.255.255.1/30 dev site \
             && ip route add 203.0.113.0/24 via 10.255.255.2",
            mtu = narrow.mtu
        ),
    )?;
    in_ns(
        &far,
        &format!(
            "sysctl -qw net.ipv4.ip_forward=1 \
             && ip link set site mtu {mtu} up && ip addr add 10.255.255.2/30 dev site \
             && ip route add default via 10.255.255.1",
            mtu = narrow.mtu
        ),
    )?;
    if ipv6 {
        in_ns(
            &rt,
            &format!(
                "ip -6 addr add fd79::1/64 dev site nodad \
                 && ip -6 route add {SECOND_SEGMENT_V6} via fd79::2"
            ),
        )?;
        in_ns(
            &far,
            &format!(
                "sysctl -qw net.ipv6.conf.all.forwarding=1 \
                 && ip -6 addr add fd79::2/64 dev site nodad \
                 && ip -6 addr add {ROUTER_IP6_2}/64 dev eth1 nodad \
                 && ip -6 route add default via fd79::1"
            ),
        )?;
    }
    for ns in [&rt, &far] {
        clamp_mss(ns)?;
        if narrow.drop_icmp {
            drop_icmp_errors(ns)?;
        }
    }
    Ok(())
}

/// Clamps the MSS of TCP connections crossing the narrow link to its MTU, as site-to-site
/// gateways do: the agents' own TCP (etcd) crosses it too, and with ICMP dropped a
/// connection that never learns the path's MTU stalls on its first full-sized segment
/// (node 3 then missed a node's lease for good in one run). Tunnel traffic is UDP: this
/// changes nothing the path MTU tests prove.
fn clamp_mss(ns: &str) -> anyhow::Result<()> {
    in_ns(
        ns,
        "nft add table inet lab_mss \
         && nft add chain inet lab_mss clamp '{ type filter hook forward priority mangle; }' \
         && nft add rule inet lab_mss clamp 'tcp flags & (syn | rst) == syn tcp option maxseg size set rt mtu'",
    )?;
    Ok(())
}

/// Drops the ICMP errors a router sends for a packet too big for the next link.
fn drop_icmp_errors(ns: &str) -> anyhow::Result<()> {
    in_ns(
        ns,
        "nft add table inet lab_icmp \
         && nft add chain inet lab_icmp icmpout '{ type filter hook output priority 0; }' \
         && nft add rule inet lab_icmp icmpout icmp type destination-unreachable icmp code frag-needed drop \
         && nft add rule inet lab_icmp icmpout icmpv6 type packet-too-big drop",
    )?;
    Ok(())
}

/// Sets the narrow link's MTU (both ends) while the lab runs: a path that narrows or
/// widens again.
pub fn set_narrow_mtu(tag: &str, mtu: u32) -> anyhow::Result<()> {
    for ns in [router_ns(tag), far_router_ns(tag)] {
        in_ns(&ns, &format!("ip link set site mtu {mtu}"))?;
    }
    Ok(())
}

/// Counts, from now on, the IP fragments the near router forwards across the narrow link.
pub fn count_fragments(tag: &str) -> anyhow::Result<()> {
    in_ns(
        &router_ns(tag),
        "nft add table ip lab_frag \
         && nft add chain ip lab_frag fragcount '{ type filter hook forward priority 0; }' \
         && nft add rule ip lab_frag fragcount 'ip frag-off & 0x3fff != 0' counter \
         && nft add table ip6 lab_frag \
         && nft add chain ip6 lab_frag fragcount '{ type filter hook forward priority 0; }' \
         && nft add rule ip6 lab_frag fragcount 'exthdr frag exists' counter",
    )?;
    Ok(())
}

/// The fragments counted since `count_fragments` (IPv4 and IPv6).
pub fn fragments(tag: &str) -> anyhow::Result<u64> {
    let mut total = 0;
    for family in ["ip", "ip6"] {
        let out = in_ns(
            &router_ns(tag),
            &format!("nft list table {family} lab_frag"),
        )?;
        let packets: Option<u64> = out
            .split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok());
        total += packets.ok_or_else(|| anyhow::anyhow!("no fragment counter in: {out}"))?;
    }
    Ok(total)
}
