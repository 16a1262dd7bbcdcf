//! Two sites, each a private segment behind a cloud-style NAT gateway that maps every flow
//! to a random port (endpoint-dependent mapping: no hole punching), as managed NAT gateways
//! do; a node may have a 1:1 public address on its site's NAT (an elastic address). Nodes
//! run with `--zone site-a|site-b`; those with a public address advertise it
//! (`--public-ip`), the others their own private one, which the other site cannot reach.
//!
//! Site A is 192.0.2.0/25 on `br2` behind `<tag>-nata` (outside `NAT_A`), site B
//! 192.0.2.128/25 on `br3` behind `<tag>-natb` (outside `NAT_B`). Each node's address is
//! a /24, so the other site's private range looks on-link and is unreachable, as an
//! overlapping private range in another VPC is.

use std::net::Ipv4Addr;

use super::fabric::{attach_to, in_ns, Namespaces};
use super::EXT_IP;

pub const NAT_A: &str = "198.51.100.241";
pub const NAT_B: &str = "198.51.100.242";
const INSIDE: [&str; 2] = ["192.0.2.126", "192.0.2.254"];
const BRIDGE: [&str; 2] = ["br2", "br3"];
pub const ZONES: [&str; 2] = ["site-a", "site-b"];
/// The NATs' UDP mapping timeout (conntrack), short so that a test can outlast it.
pub const UDP_TIMEOUT_S: u32 = 10;

/// Where each node sits.
#[derive(Debug, Clone, Default)]
pub struct Sites {
    /// Per node (by index): its site (0 or 1) and its 1:1 public address, if any.
    pub placement: Vec<(usize, Option<Ipv4Addr>)>,
    /// Nodes (by index) started with `--gateway`.
    pub gateways: Vec<usize>,
}

impl Sites {
    /// The two-site shape, by node index: a2 (private) and a1 (gateway, public) in site A;
    /// b1 (gateway, public), b2 (private), b3 (public, not a gateway) in site B. In a
    /// mixed lab (kernel WireGuard on even indices) the relayed pair a2–b2 has a kernel
    /// end and a userspace end.
    pub fn two() -> Sites {
        Sites {
            placement: vec![
                (0, None),
                (0, Some(public(2))),
                (1, Some(public(3))),
                (1, None),
                (1, Some(public(5))),
            ],
            gateways: vec![1, 2],
        }
    }

    pub fn site(&self, i: usize) -> Option<usize> {
        self.placement.get(i).map(|(s, _)| *s)
    }

    pub fn public_of(&self, i: usize) -> Option<Ipv4Addr> {
        self.placement.get(i).and_then(|(_, p)| *p)
    }

    /// Node `i`'s private address (1-based `n`), its bridge and default route.
    pub(super) fn node(&self, i: usize, n: usize) -> Option<(Ipv4Addr, &'static str, String)> {
        let site = self.site(i)?;
        let ip = Ipv4Addr::new(192, 0, 2, (site * 128 + n) as u8);
        Some((
            ip,
            BRIDGE[site],
            format!("ip route add default via {}", INSIDE[site]),
        ))
    }

    /// The agent's flags for node `i` whose own address is `own`.
    pub(super) fn agent_args(&self, i: usize, own: Ipv4Addr) -> Option<String> {
        let site = self.site(i)?;
        let public = self.public_of(i).unwrap_or(own);
        let gateway = match self.gateways.contains(&i) {
            true => " --gateway",
            false => "",
        };
        Some(format!(
            "--public-ip={public} --zone={}{gateway}",
            ZONES[site]
        ))
    }
}

/// The 1:1 public address of node `n` (1-based).
pub fn public(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 51, 100, 100 + n)
}

pub fn nat_ns(tag: &str, site: usize) -> String {
    format!("{tag}-nat{}", ["a", "b"][site])
}

/// Builds both sites' bridges and NATs (the 1:1 mappings come with each node: `map`). The
/// conntrack timeouts are set once the NAT rules have loaded conntrack (a fresh kernel has
/// no such sysctl before).
pub(super) fn build(tag: &str, fabric: &str, namespaces: &mut Namespaces) -> anyhow::Result<()> {
    for site in 0..2 {
        in_ns(
            fabric,
            &format!(
                "ip link add {b} type bridge && ip link set {b} up",
                b = BRIDGE[site]
            ),
        )?;
        let nat = nat_ns(tag, site);
        namespaces.add(&nat)?;
        let outside = [NAT_A, NAT_B][site];
        attach_to(
            fabric,
            "br0",
            &nat,
            &format!("nat{}", ["a", "b"][site]),
            "eth0",
            outside,
        )?;
        attach_to(
            fabric,
            BRIDGE[site],
            &nat,
            &format!("nat{}i", ["a", "b"][site]),
            "eth1",
            INSIDE[site],
        )?;
        in_ns(
            &nat,
            &format!(
                "sysctl -qw net.ipv4.ip_forward=1 && ip route add default via {EXT_IP} \
                 && nft add table ip nat \
                 && nft add chain ip nat pre '{{ type nat hook prerouting priority -100; }}' \
                 && nft add chain ip nat post '{{ type nat hook postrouting priority 100; }}' \
                 && nft add rule ip nat post oifname eth0 masquerade random \
                 && sysctl -qw net.netfilter.nf_conntrack_udp_timeout={t} \
                 && sysctl -qw net.netfilter.nf_conntrack_udp_timeout_stream={t}",
                t = UDP_TIMEOUT_S
            ),
        )?;
    }
    Ok(())
}

/// Maps `public` 1:1 to `inside` on `site`'s NAT (an elastic address).
pub(super) fn map(
    tag: &str,
    site: usize,
    public: Ipv4Addr,
    inside: Ipv4Addr,
) -> anyhow::Result<()> {
    in_ns(
        &nat_ns(tag, site),
        &format!(
            "ip addr add {public}/32 dev eth0 \
             && nft insert rule ip nat post ip saddr {inside} oifname eth0 snat to {public} \
             && nft add rule ip nat pre ip daddr {public} dnat to {inside}"
        ),
    )?;
    Ok(())
}

/// Each site's private range.
const RANGE: [&str; 2] = ["192.0.2.0/25", "192.0.2.128/25"];

impl super::Lab {
    /// Peers the two sites (as a VPC peering that comes up): each site routes the other's
    /// private range through the NATs, unmasqueraded, so private nodes reach each other on
    /// their own addresses. A direct path that appears later.
    pub fn peer_sites(&self) -> anyhow::Result<()> {
        let Some(sites) = &self.cfg.sites else {
            anyhow::bail!("this lab has no sites");
        };
        for site in 0..2 {
            let (other, far) = (RANGE[1 - site], [NAT_B, NAT_A][site]);
            in_ns(
                &nat_ns(&self.tag, site),
                &format!(
                    "ip route add {other} via {far} \
                     && nft insert rule ip nat post ip daddr {other} accept"
                ),
            )?;
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if let Some(site) = sites.site(i) {
                in_ns(
                    &node.ns,
                    &format!("ip route add {} via {}", RANGE[1 - site], INSIDE[site]),
                )?;
            }
        }
        Ok(())
    }

    /// Cuts node `i` off the network (its link down) or puts it back.
    pub fn set_link(&self, i: usize, up: bool) -> anyhow::Result<()> {
        let state = if up { "up" } else { "down" };
        in_ns(&self.nodes[i].ns, &format!("ip link set eth0 {state}"))?;
        if up {
            let routes = self
                .cfg
                .sites
                .as_ref()
                .and_then(|s| s.node(i, i + 1))
                .map(|(_, _, r)| r);
            if let Some(r) = routes {
                let _ = in_ns(&self.nodes[i].ns, &r);
            }
        }
        Ok(())
    }
}
