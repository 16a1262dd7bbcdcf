//! Pure diff of links, addresses and routes: desired (from the plan) against observed (read
//! from the kernel this pass). Only weft's objects are considered: its devices, and routes
//! stamped `RTPROT_WEFT`.

use std::collections::HashSet;
use std::fmt;

use ipnet::IpNet;

use super::netlink::{ObservedLink, ObservedRoute, RouteWrite, RTPROT_WEFT};
use super::route_cache::OurRoutes;
use crate::model::RouteSpec;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoutingChange {
    Link {
        device: String,
        mtu: Option<(u32, u32)>,
        up: bool,
    },
    AddAddress {
        device: String,
        addr: IpNet,
    },
    RemoveAddress {
        device: String,
        addr: IpNet,
    },
    AddRoute(RouteWrite),
    AddBlackhole(IpNet),
    /// Same destination, other device or gateway: replaced in one write.
    ReplaceRoute {
        from: ObservedRoute,
        to: RouteWrite,
    },
    RemoveRoute(ObservedRoute),
}

impl fmt::Display for RoutingChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let via = |g: &Option<std::net::IpAddr>| g.map(|g| format!(" via {g}")).unwrap_or_default();
        let mtu = |m: &Option<u32>| m.map(|m| format!(" mtu {m}")).unwrap_or_default();
        match self {
            RoutingChange::Link { device, mtu, up } => {
                write!(f, "set link {device}")?;
                if let Some((from, to)) = mtu {
                    write!(f, " mtu {from} -> {to}")?;
                }
                if *up {
                    write!(f, " up")?;
                }
                Ok(())
            }
            RoutingChange::AddAddress { device, addr } => {
                write!(f, "add address {addr} dev {device}")
            }
            RoutingChange::RemoveAddress { device, addr } => {
                write!(f, "remove address {addr} dev {device}")
            }
            RoutingChange::AddRoute(r) => write!(
                f,
                "add route {}{} dev {}{}",
                r.dst,
                via(&r.gateway),
                r.device,
                mtu(&r.mtu)
            ),
            RoutingChange::ReplaceRoute { to, .. } => write!(
                f,
                "replace route {}{} dev {}{}",
                to.dst,
                via(&to.gateway),
                to.device,
                mtu(&to.mtu)
            ),
            RoutingChange::AddBlackhole(dst) => {
                write!(f, "add blackhole route {dst} (fail closed)")
            }
            RoutingChange::RemoveRoute(r) if r.blackhole => {
                write!(f, "remove blackhole route {}", r.dst)
            }
            RoutingChange::RemoveRoute(r) => write!(f, "remove route {}{}", r.dst, via(&r.gateway)),
        }
    }
}

/// Link properties and addresses of one weft device.
pub fn diff_link(
    link: &ObservedLink,
    mtu: u32,
    desired: &[IpNet],
    observed: &[IpNet],
) -> Vec<RoutingChange> {
    let mut out = Vec::new();
    if link.mtu != mtu || !link.up {
        out.push(RoutingChange::Link {
            device: link.name.clone(),
            mtu: (link.mtu != mtu).then_some((link.mtu, mtu)),
            up: !link.up,
        });
    }
    for addr in desired.iter().filter(|a| !observed.contains(a)) {
        out.push(RoutingChange::AddAddress {
            device: link.name.clone(),
            addr: *addr,
        });
    }
    for addr in observed.iter().filter(|a| !desired.contains(a)) {
        out.push(RoutingChange::RemoveAddress {
            device: link.name.clone(),
            addr: *addr,
        });
    }
    out
}

/// Routes: `desired` with their devices resolved to indexes (`index_of`; a route whose
/// device does not exist yet is skipped, the next pass adds it), and the `fail_closed`
/// blackholes. Only weft's routes (`RTPROT_WEFT`) are compared or removed.
pub fn diff_routes(
    desired: &[RouteSpec],
    fail_closed: &[IpNet],
    index_of: &dyn Fn(&str) -> Option<u32>,
    observed: &[ObservedRoute],
) -> Vec<RoutingChange> {
    let ours: OurRoutes = observed
        .iter()
        .filter(|r| r.protocol == RTPROT_WEFT)
        .map(|r| ((r.dst, r.blackhole), r.clone()))
        .collect();
    diff_our_routes(desired.iter(), fail_closed.iter().copied(), index_of, &ours)
}

/// `diff_routes` against weft's routes alone (`ours`, by destination and blackhole). A
/// route as planned costs two lookups and no allocation: at 10,000 peers every pass
/// compares 10,000 routes.
pub(crate) fn diff_our_routes<'a>(
    desired: impl Iterator<Item = &'a RouteSpec>,
    fail_closed: impl Iterator<Item = IpNet>,
    index_of: &dyn Fn(&str) -> Option<u32>,
    ours: &OurRoutes,
) -> Vec<RoutingChange> {
    let mut out = Vec::new();
    let mut wanted: HashSet<(IpNet, bool)> = HashSet::with_capacity(ours.len());
    for spec in desired {
        let Some(oif) = index_of(&spec.device) else {
            continue;
        };
        wanted.insert((spec.dst, false));
        let have = ours.get(&(spec.dst, false));
        if have.is_some_and(|h| h.oif == Some(oif) && h.gateway == spec.via && h.mtu == spec.mtu) {
            continue;
        }
        let write = RouteWrite {
            dst: spec.dst,
            oif,
            device: spec.device.clone(),
            gateway: spec.via,
            onlink: spec.onlink,
            mtu: spec.mtu,
        };
        out.push(match have {
            Some(have) => RoutingChange::ReplaceRoute {
                from: have.clone(),
                to: write,
            },
            None => RoutingChange::AddRoute(write),
        });
    }
    for dst in fail_closed {
        wanted.insert((dst, true));
        if !ours.contains_key(&(dst, true)) {
            out.push(RoutingChange::AddBlackhole(dst));
        }
    }
    for (key, route) in ours {
        if !wanted.contains(key) {
            out.push(RoutingChange::RemoveRoute(route.clone()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RouteRole, FAIL_CLOSED_METRIC};

    fn spec(dst: &str, dev: &str) -> RouteSpec {
        RouteSpec {
            dst: dst.parse().unwrap(),
            device: dev.into(),
            via: Default::default(),
            onlink: false,
            role: RouteRole::Covering,
            mtu: None,
        }
    }

    fn seen(dst: &str, oif: u32, protocol: u8) -> ObservedRoute {
        ObservedRoute {
            dst: dst.parse().unwrap(),
            oif: Some(oif),
            gateway: None,
            protocol,
            blackhole: false,
            metric: 0,
            mtu: None,
        }
    }

    fn lines(changes: Vec<RoutingChange>) -> Vec<String> {
        changes.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn routes_add_replace_remove_and_leave_foreign_ones() {
        let index = |d: &str| match d {
            "flannel-wg" => Some(7),
            "other" => Some(9),
            _ => None,
        };
        let net: IpNet = "10.244.0.0/16".parse().unwrap();
        let desired = [
            spec("10.244.0.0/16", "flannel-wg"),
            spec("10.244.2.0/24", "flannel-wg"),
            spec("10.244.3.0/24", "flannel-wg"),
            spec("10.244.4.0/24", "missing"),
        ];
        let observed = [
            seen("10.244.0.0/16", 7, RTPROT_WEFT), // as wanted
            seen("10.244.2.0/24", 9, RTPROT_WEFT), // wrong device
            seen("10.244.9.0/24", 7, RTPROT_WEFT), // stale
            seen("192.168.0.0/16", 9, 4),          // someone else's
            seen("10.244.3.0/24", 9, 3),           // someone else's, same dst: add replaces it
        ];
        assert_eq!(
            lines(diff_routes(&desired, &[net], &index, &observed)),
            [
                "replace route 10.244.2.0/24 dev flannel-wg",
                "add route 10.244.3.0/24 dev flannel-wg",
                "add blackhole route 10.244.0.0/16 (fail closed)",
                "remove route 10.244.9.0/24",
            ]
        );
        let hole = ObservedRoute {
            oif: None,
            blackhole: true,
            metric: FAIL_CLOSED_METRIC,
            ..seen("10.244.0.0/16", 0, RTPROT_WEFT)
        };
        let steady = [
            seen("10.244.0.0/16", 7, RTPROT_WEFT),
            seen("10.244.2.0/24", 7, RTPROT_WEFT),
            seen("10.244.3.0/24", 7, RTPROT_WEFT),
            hole,
        ];
        assert!(diff_routes(&desired, &[net], &index, &steady).is_empty());
        // No fail-closed network wanted (an unencrypted backend): the blackhole goes.
        assert_eq!(
            lines(diff_routes(&desired, &[], &index, &steady)),
            ["remove blackhole route 10.244.0.0/16"]
        );
    }

    #[test]
    fn link_mtu_up_and_addresses() {
        let link = ObservedLink {
            index: 7,
            name: "flannel-wg".into(),
            mtu: 1500,
            up: false,
            kind: Some("wireguard".into()),
            mac: Vec::new(),
            vxlan: None,
            ipip: None,
            xfrm: None,
        };
        let want: Vec<IpNet> = vec!["10.244.1.0/32".parse().unwrap()];
        let have: Vec<IpNet> = vec!["10.9.9.9/32".parse().unwrap()];
        assert_eq!(
            lines(diff_link(&link, 1420, &want, &have)),
            [
                "set link flannel-wg mtu 1500 -> 1420 up",
                "add address 10.244.1.0/32 dev flannel-wg",
                "remove address 10.9.9.9/32 dev flannel-wg",
            ]
        );
        let steady = ObservedLink {
            mtu: 1420,
            up: true,
            ..link
        };
        assert!(diff_link(&steady, 1420, &want, &want).is_empty());
    }
}
