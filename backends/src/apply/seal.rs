//! Fail closed from the agent's first moment. An agent starting with an encrypting backend
//! may find routes another backend left (a node switched from host-gw or vxlan: routes to
//! the peers' subnets over the underlay or `flannel.1`) and no blackhole yet. Until its
//! first pass, pod packets would follow those routes in clear. `seal` runs as soon as the
//! config is known, before the lease and the devices: it puts the pod networks' fail-closed
//! blackholes in, and removes weft's routes inside them that do not enter a tunnel device.
//! Peer traffic is then dropped, not sent in clear, until the tunnels carry it. A restart
//! that finds its own tunnel routes and blackholes writes nothing.

use ipnet::IpNet;

use super::netlink::{Netlink, RTPROT_WEFT};
use super::ApplyError;
use crate::model::Family;

/// Seals `networks` (the pod networks) for the tunnel devices `tunnels`; returns one line
/// per change made.
pub async fn seal<N: Netlink>(
    nl: &mut N,
    networks: &[IpNet],
    tunnels: &[&str],
) -> Result<Vec<String>, ApplyError> {
    let mut tunnel_indexes = Vec::new();
    for name in tunnels {
        if let Some(link) = nl.link(name).await? {
            tunnel_indexes.push(link.index);
        }
    }
    let mut changes = Vec::new();
    for family in [Family::Ipv4, Family::Ipv6] {
        let mine: Vec<&IpNet> = networks
            .iter()
            .filter(|n| Family::of(n) == family)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let routes = nl.routes(family).await?;
        for net in mine {
            let sealed = routes
                .iter()
                .any(|r| r.blackhole && r.dst == *net && r.protocol == RTPROT_WEFT);
            if !sealed {
                nl.put_blackhole(*net).await?;
                changes.push(format!("blackhole {net} put in before the first pass"));
            }
            let stale = routes.iter().filter(|r| {
                r.protocol == RTPROT_WEFT
                    && !r.blackhole
                    && net.contains(&r.dst)
                    && !r.oif.is_some_and(|i| tunnel_indexes.contains(&i))
            });
            for route in stale {
                nl.del_route(route).await?;
                changes.push(format!(
                    "route {} (not into a tunnel) removed before the first pass",
                    route.dst
                ));
            }
        }
    }
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::fake::FakeNetlink;
    use crate::apply::netlink::ObservedRoute;
    use crate::model::FAIL_CLOSED_METRIC;

    fn route(dst: &str, oif: u32, blackhole: bool, protocol: u8) -> ObservedRoute {
        ObservedRoute {
            dst: dst.parse().unwrap(),
            oif: (!blackhole).then_some(oif),
            gateway: None,
            protocol,
            blackhole,
            metric: if blackhole { FAIL_CLOSED_METRIC } else { 0 },
            mtu: None,
        }
    }

    fn put(nl: &mut FakeNetlink, r: ObservedRoute) {
        nl.routes.insert((r.dst, r.metric), r);
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn another_backends_routes_go_and_the_blackhole_comes_before_the_first_pass() {
        let mut nl = FakeNetlink::default();
        let eth = nl.add_link("eth0", "veth");
        let wg = nl.add_link("flannel-wg", "wireguard");
        // host-gw's routes to two peers, the operator's route, a route outside.
        put(&mut nl, route("10.244.2.0/24", eth, false, RTPROT_WEFT));
        put(&mut nl, route("10.244.3.0/24", wg, false, RTPROT_WEFT));
        put(&mut nl, route("10.244.9.0/24", eth, false, 4));
        put(&mut nl, route("192.168.0.0/16", eth, false, RTPROT_WEFT));
        let net: IpNet = "10.244.0.0/16".parse().unwrap();
        let changes = block_on(seal(&mut nl, &[net], &["flannel-wg"])).unwrap();
        assert_eq!(changes.len(), 2, "{changes:?}");
        let dsts: Vec<String> = nl.routes.values().map(|r| r.dst.to_string()).collect();
        assert_eq!(
            dsts,
            [
                "10.244.0.0/16",
                "10.244.3.0/24",
                "10.244.9.0/24",
                "192.168.0.0/16"
            ]
        );
        assert!(nl.routes.values().any(|r| r.blackhole && r.dst == net));
        // Sealed: the next start writes nothing.
        let writes = nl.writes();
        assert!(block_on(seal(&mut nl, &[net], &["flannel-wg"]))
            .unwrap()
            .is_empty());
        assert_eq!(nl.writes(), writes);
    }
}
