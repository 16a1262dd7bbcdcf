//! Per-peer path MTU: the MTU of each peer's route, from the path MTU the agent measured
//! to the peer's underlay address (`PlanInput::path_mtus`), less what the backend wraps
//! around a packet. A route gets an MTU only when that is narrower than the pod MTU: a pod
//! sending more to that peer hears "fragmentation needed" from its own node at once, TCP
//! picks the segment size that fits, and nothing is fragmented on the underlay. Every
//! peer's underlay address is listed in `DesiredState::paths`, which is what the agent
//! measures.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use super::PlanInput;
use crate::model::{DesiredState, Family, PeerPath, RouteRole, RouteSpec};
use crate::netconf::Backend;

/// WireGuard's data message: type, receiver index and counter (16), the tag (16).
const WG_MESSAGE: u32 = 32;
/// The outer IP and UDP headers.
const UDP_V4: u32 = 20 + 8;
const UDP_V6: u32 = 40 + 8;
/// The smallest MTU a route is given, per family of its pod addresses: IPv6's minimum link
/// MTU (a narrower path is then fragmented on the underlay), and IPv4's minimum datagram.
pub const MIN_ROUTE_MTU_V6: u32 = 1280;
pub const MIN_ROUTE_MTU_V4: u32 = 576;

/// What the backend wraps around a pod packet sent to `address` over a route of `role`,
/// and the multiple the inner size is padded to (WireGuard pads to 16).
fn encapsulation(backend: &Backend, role: &RouteRole, address: IpAddr) -> (u32, u32) {
    let v6 = address.is_ipv6();
    let outer_ip = if v6 { 40 } else { 20 };
    if matches!(role, RouteRole::Direct(_)) {
        return (0, 1);
    }
    match backend {
        Backend::Wireguard(_) => (if v6 { UDP_V6 } else { UDP_V4 } + WG_MESSAGE, 16),
        Backend::Vxlan(_) if v6 => (super::unencrypted::VXLAN_OVERHEAD_V6, 1),
        Backend::Vxlan(_) => (super::unencrypted::VXLAN_OVERHEAD, 1),
        Backend::HostGw => (0, 1),
        Backend::Ipip(_) => (super::ipip::IPIP_OVERHEAD, 1),
        Backend::Ipsec(conf) => {
            let encap = if conf.udp_encap {
                super::ipsec::UDP_ENCAP_OVERHEAD
            } else {
                0
            };
            // ESP_OVERHEAD counts an IPv4 outer header.
            (super::ipsec::ESP_OVERHEAD + encap + outer_ip - 20, 4)
        }
    }
}

/// Each tunnel peer's underlay address, by device and node (the first peer of a node on a
/// device, as the plan lists them).
fn tunnel_addresses(state: &DesiredState) -> HashMap<(&str, &str), IpAddr> {
    let mut addresses = HashMap::new();
    for tunnel in &state.tunnels {
        for peer in &tunnel.peers {
            addresses
                .entry((tunnel.device.as_str(), peer.node.as_str()))
                .or_insert(peer.endpoint.ip());
        }
    }
    addresses
}

/// The underlay address `node`'s traffic to `route_family` pod addresses, routed into
/// `device`, goes to: the endpoint of the node's peer on that tunnel device (in WireGuard's
/// `separate` mode, IPv6 pod traffic goes over IPv6 to another endpoint), else the address
/// the node publishes for that family.
fn address_of(
    tunnels: &HashMap<(&str, &str), IpAddr>,
    input: &PlanInput<'_>,
    node: &str,
    device: &str,
    family: Family,
) -> Option<IpAddr> {
    if let Some(address) = tunnels.get(&(device, node)) {
        return Some(*address);
    }
    let lease = input.view.leases.get(node)?;
    match family {
        Family::Ipv4 => lease.public_ip.map(IpAddr::V4),
        Family::Ipv6 => lease
            .public_ipv6
            .map(IpAddr::V6)
            .or(lease.public_ip.map(IpAddr::V4)),
    }
}

/// Lists every peer's path and gives each peer route the MTU its measured path allows.
/// Linear in the number of routes: a pass at 10,000 nodes plans 10,000 routes.
pub(super) fn apply(state: &mut DesiredState, input: &PlanInput<'_>) {
    let pod_mtu = state.subnet_env.mtu;
    let mut routes = std::mem::take(&mut state.routes);
    // At most one path a route: sized once, not grown by doubling at 10,000 peers.
    let mut paths: Vec<PeerPath> = Vec::with_capacity(routes.len());
    let mut listed: HashSet<(String, IpAddr)> = HashSet::with_capacity(routes.len());
    let tunnels = tunnel_addresses(state);
    for route in &mut routes {
        let (RouteRole::Peer(node) | RouteRole::Direct(node)) = &route.role else {
            continue;
        };
        let Some(address) =
            address_of(&tunnels, input, node, &route.device, Family::of(&route.dst))
        else {
            continue;
        };
        let path = route_path(input, pod_mtu, route, node, address);
        route.mtu = path.route_mtu;
        if listed.insert((node.clone(), address)) {
            paths.push(path);
        }
    }
    drop(tunnels);
    state.routes = routes;
    paths.sort_by(|a, b| (&a.node, a.address).cmp(&(&b.node, b.address)));
    state.paths = paths;
}

/// The path of `route`, to `node`'s pods over the underlay `address`, with the MTU the
/// route gets (`route_mtu`).
fn route_path(
    input: &PlanInput<'_>,
    pod_mtu: u32,
    route: &RouteSpec,
    node: &str,
    address: IpAddr,
) -> PeerPath {
    let (overhead, pad) = encapsulation(&input.config.backend, &route.role, address);
    let limit = match route.role {
        RouteRole::Direct(_) => input.options.underlay_mtu,
        _ => pod_mtu,
    };
    let path_mtu = input.path_mtus.get(&address).copied();
    let floor = match Family::of(&route.dst) {
        Family::Ipv4 => MIN_ROUTE_MTU_V4,
        Family::Ipv6 => MIN_ROUTE_MTU_V6,
    };
    // A path that carries the pod MTU whole leaves the route alone (padding stops at
    // the device's MTU); a narrower one gets what fits, down to the padding multiple so
    // padding never makes a packet too large for it.
    let route_mtu = path_mtu
        .map(|p| p.saturating_sub(overhead))
        .filter(|inner| *inner < limit)
        .map(|inner| (inner / pad * pad).max(floor));
    PeerPath {
        node: node.to_string(),
        address,
        overhead,
        path_mtu,
        route_mtu,
    }
}

/// `apply` for one WireGuard entry's routes (`routes`, into a device where the entry's
/// endpoint is `endpoint`): sets their MTUs and adds the node's paths to `paths`, one per
/// address, the first route's (the caller sorts them by address).
pub(super) fn entry_routes(
    input: &PlanInput<'_>,
    pod_mtu: u32,
    node: &str,
    routes: &mut [RouteSpec],
    endpoint: IpAddr,
    paths: &mut Vec<PeerPath>,
) {
    for route in routes {
        let path = route_path(input, pod_mtu, route, node, endpoint);
        route.mtu = path.route_mtu;
        if !paths.iter().any(|p| p.address == endpoint) {
            paths.push(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::SystemTime;

    use super::super::tests::{good_peer, ip, lease, local, NOW};
    use super::super::{plan, PlanInput, PlanOptions};
    use crate::model::{ClusterView, DesiredState};

    fn plan_with(config: &str, mtus: &[(u8, u32)]) -> DesiredState {
        let config = crate::netconf::parse(config).unwrap();
        let mut view = ClusterView::default();
        let kind = config.backend.kind();
        for mut l in [
            local(),
            good_peer(),
            lease("node-c", "10.244.3.0/24", ip(3), 3),
        ] {
            l.backend_type = kind.to_string();
            view.insert(l);
        }
        let path_mtus: BTreeMap<_, _> = mtus.iter().map(|(n, m)| (ip(*n).into(), *m)).collect();
        let options = PlanOptions {
            ip_masq: false,
            underlay_mtu: 1500,
            underlay_device: Some("eth0".into()),
            underlay_networks: vec!["198.51.100.0/24".parse().unwrap()],
        };
        plan(&PlanInput {
            path_mtus: &path_mtus,
            pair_psks: &Default::default(),
            observed: &Default::default(),
            local: view.leases.get("node-a").unwrap(),
            view: &view,
            config: &config,
            options: &options,
            now: SystemTime::UNIX_EPOCH + NOW,
        })
        .unwrap()
    }

    fn mtu_to(state: &DesiredState, subnet: &str) -> Option<u32> {
        let dst = subnet.parse().unwrap();
        state
            .routes
            .iter()
            .find(|r| r.dst == dst)
            .and_then(|r| r.mtu)
    }

    #[test]
    fn a_narrow_paths_routes_carry_its_mtu_less_the_encapsulation() {
        let wg = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;
        let state = plan_with(wg, &[(2, 1500), (3, 1400)]);
        // 1400 less 60 (IPv4, UDP, WireGuard), down to a multiple of 16.
        assert_eq!(mtu_to(&state, "10.244.3.0/24"), Some(1328));
        assert_eq!(
            mtu_to(&state, "10.244.2.0/24"),
            None,
            "a wide path keeps the pod MTU"
        );
        // 1480 less 60 is exactly the pod MTU (1420): it fits whole, padding included.
        let exact = plan_with(wg, &[(2, 1480)]);
        assert_eq!(
            mtu_to(&exact, "10.244.2.0/24"),
            None,
            "a path carrying the pod MTU"
        );
        let one_less = plan_with(wg, &[(2, 1479)]);
        assert_eq!(mtu_to(&one_less, "10.244.2.0/24"), Some(1408), "down to 16");
        assert_eq!(state.paths.len(), 2);
        assert_eq!(state.paths[1].path_mtu, Some(1400));
        assert_eq!(state.paths[1].route_mtu, Some(1328));
        assert_eq!(state.paths[1].overhead, 60);
        let unmeasured = plan_with(wg, &[]);
        assert!(unmeasured.routes.iter().all(|r| r.mtu.is_none()));
        assert_eq!(
            unmeasured.paths.len(),
            2,
            "every peer is listed to be measured"
        );
        let tiny = plan_with(wg, &[(3, 300)]);
        assert_eq!(
            mtu_to(&tiny, "10.244.3.0/24"),
            Some(576),
            "never below IPv4's minimum"
        );
    }

    #[test]
    fn each_backend_takes_its_own_encapsulation_off() {
        for (backend, want) in [
            (r#"{"Type": "host-gw"}"#, Some(1400)),
            (r#"{"Type": "ipip"}"#, Some(1380)),
        ] {
            let config = format!(r#"{{"Network": "10.244.0.0/16", "Backend": {backend}}}"#);
            let state = plan_with(&config, &[(3, 1400)]);
            assert_eq!(mtu_to(&state, "10.244.3.0/24"), want, "{backend}");
        }
    }

    #[test]
    fn ipsec_and_vxlan_take_their_headers_off_per_family() {
        use super::encapsulation;
        use crate::model::RouteRole;
        let peer = RouteRole::Peer("node-b".into());
        let (v4, v6) = (ip(2).into(), "2001:db8::2".parse().unwrap());
        let backend = |conf: &str| {
            crate::netconf::parse(&format!(
                r#"{{"Network": "10.244.0.0/16", "Backend": {conf}}}"#
            ))
            .unwrap()
            .backend
        };
        let ipsec = backend(r#"{"Type": "ipsec"}"#);
        let encap = backend(r#"{"Type": "ipsec", "UDPEncap": true}"#);
        let vxlan = backend(r#"{"Type": "vxlan"}"#);
        assert_eq!(encapsulation(&ipsec, &peer, v4), (60, 4));
        assert_eq!(encapsulation(&ipsec, &peer, v6), (80, 4));
        assert_eq!(encapsulation(&encap, &peer, v4), (68, 4));
        assert_eq!(encapsulation(&vxlan, &peer, v4), (50, 1));
        assert_eq!(encapsulation(&vxlan, &peer, v6), (70, 1));
        let direct = RouteRole::Direct("node-b".into());
        assert_eq!(
            encapsulation(&vxlan, &direct, v4),
            (0, 1),
            "DirectRouting: no tunnel"
        );
    }
}
