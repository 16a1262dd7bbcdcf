//! The unencrypted backends' share of the plan. vxlan: the device `flannel.<VNI>`, per
//! peer a neighbour and an FDB entry and an on-link route via the peer subnet's network
//! address, or with `DirectRouting` a plain route via the public IP of a peer on this
//! node's segment. host-gw: one route per peer subnet via the peer's public IP, for peers
//! on this node's segment; the others are left out with the reason. Both families: IPv6
//! subnets via the peers' IPv6 addresses (host-gw, DirectRouting) or over the IPv6 vxlan
//! device `flannel-v6.<VNI>`.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{json, Value};

use super::peers::{Candidate, Screened};
use super::{subnet_env, LocalSubnets, PlanError, PlanInput};
use crate::model::{
    format_mac, parse_mac, BackendDataError, DesiredState, Family, LeaveReason, LeftOut, RouteRole,
    RouteSpec, VxlanPeer, VxlanSpec,
};
use crate::netconf::VxlanConf;

/// vxlan's encapsulation overhead (docs/architecture.md).
pub(super) const VXLAN_OVERHEAD: u32 = 50;
/// Over an IPv6 underlay: 20 bytes more of outer header.
pub(super) const VXLAN_OVERHEAD_V6: u32 = 70;

/// `flannel.<VNI>`.
pub fn vxlan_device(vni: u32) -> String {
    format!("flannel.{vni}")
}

/// `flannel-v6.<VNI>`: the IPv6 vxlan device.
pub fn vxlan_device_v6(vni: u32) -> String {
    format!("flannel-v6.{vni}")
}

/// `backend-data` of the vxlan backend: `{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}`.
pub fn vxlan_backend_data(vni: u32, mac: &[u8; 6]) -> Value {
    json!({ "VNI": vni, "VtepMAC": format_mac(mac) })
}

/// Decodes a node's published vxlan data to its VTEP MAC; the error says what is wrong.
/// flannel before 0.10 published no `VNI`; it is not needed to reach the peer.
pub fn vxlan_mac(value: Option<&Value>) -> Result<[u8; 6], BackendDataError> {
    let Some(value) = value else {
        return Err(BackendDataError::Missing);
    };
    let Some(obj) = value.as_object() else {
        return Err(BackendDataError::NotAnObject {
            example: r#"{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#,
            got: value.to_string(),
        });
    };
    match obj.get("VtepMAC") {
        Some(published @ Value::String(s)) => {
            let mac = parse_mac(s).ok_or_else(|| {
                BackendDataError::bad("VtepMAC", published, "is not a MAC address")
            })?;
            if mac[0] & 1 == 1 || mac == [0; 6] {
                return Err(BackendDataError::bad(
                    "VtepMAC",
                    published,
                    "is not a unicast address",
                ));
            }
            Ok(mac)
        }
        Some(other) => Err(BackendDataError::WrongType {
            field: "VtepMAC",
            got: other.to_string(),
            expected: "a string",
        }),
        None => Err(BackendDataError::NoField("VtepMAC")),
    }
}

fn onlink(input: &PlanInput<'_>, ip: IpAddr) -> bool {
    input
        .options
        .underlay_networks
        .iter()
        .any(|n| n.contains(&ip))
}

fn leave(node: &str, reason: LeaveReason) -> LeftOut {
    LeftOut {
        node: node.to_string(),
        reason,
    }
}

fn underlay_device(input: &PlanInput<'_>, backend: &'static str) -> Result<String, PlanError> {
    input
        .options
        .underlay_device
        .clone()
        .ok_or(PlanError::NoUnderlay { backend })
}

fn direct_route(c: &Candidate<'_>, subnet: IpNet, ip: IpAddr, device: &str) -> RouteSpec {
    RouteSpec {
        dst: subnet,
        device: device.to_string(),
        via: Some(ip),
        onlink: false,
        role: RouteRole::Direct(c.lease.node.clone()),
        mtu: None,
    }
}

/// A candidate's subnet and public IP of one family (`v6`), or why it cannot be a peer.
fn reach(c: &Candidate<'_>, v6: bool) -> Result<Option<(IpNet, IpAddr)>, LeaveReason> {
    let (subnet, ip, family) = if v6 {
        (c.v6, c.lease.public_ipv6.map(IpAddr::V6), Family::Ipv6)
    } else {
        (c.v4, c.lease.public_ip.map(IpAddr::V4), Family::Ipv4)
    };
    let Some(subnet) = subnet else {
        return Ok(None);
    };
    let ip = ip.ok_or(LeaveReason::NoPublicIp { family })?;
    Ok(Some((subnet, ip)))
}

pub(crate) fn host_gw(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    screened: Screened<'_>,
) -> Result<DesiredState, PlanError> {
    let device = underlay_device(input, "host-gw")?;
    let Screened {
        candidates,
        mut left_out,
    } = screened;
    let mut state = DesiredState::default();
    // Each family on its own: an IPv6 subnet via the peer's IPv6 address.
    let families = [false, true].map(|v6| candidates.iter().map(move |c| (c, v6)));
    for (c, v6) in families.into_iter().flatten() {
        match reach(c, v6) {
            Ok(Some((subnet, ip))) if onlink(input, ip) => {
                state.routes.push(direct_route(c, subnet, ip, &device))
            }
            Ok(Some((_, ip))) => left_out.push(leave(&c.lease.node, LeaveReason::NotOnLink { ip })),
            Ok(None) => {}
            Err(reason) => left_out.push(leave(&c.lease.node, reason)),
        }
    }
    state.left_out = left_out;
    state.subnet_env = subnet_env(
        input.config,
        ours,
        input.options.underlay_mtu,
        input.options.ip_masq,
    );
    Ok(state)
}

/// A candidate's subnet and address of one family (`v6`) for a tunnel to it; `None` when
/// it has none of that family, is left out (pushed onto `left_out`), or, with `direct`
/// (`DirectRouting`), is on this node's segment and gets a plain route (pushed onto
/// `routes`) instead.
pub(super) fn tunnel_target(
    input: &PlanInput<'_>,
    c: &Candidate<'_>,
    v6: bool,
    direct: bool,
    routes: &mut Vec<RouteSpec>,
    left_out: &mut Vec<LeftOut>,
) -> Option<(IpNet, IpAddr)> {
    let (subnet, ip) = match reach(c, v6) {
        Ok(Some(r)) => r,
        Ok(None) => return None,
        Err(reason) => {
            left_out.push(leave(&c.lease.node, reason));
            return None;
        }
    };
    if direct && onlink(input, ip) {
        if let Some(dev) = &input.options.underlay_device {
            routes.push(direct_route(c, subnet, ip, dev));
            return None;
        }
    }
    Some((subnet, ip))
}

/// A peer left out for its `backend-data` (`backend-v6-data` when `v6`).
fn bad_data(node: &str, v6: bool, detail: BackendDataError) -> LeftOut {
    let field = if v6 {
        "backend-v6-data"
    } else {
        "backend-data"
    };
    leave(node, LeaveReason::BadBackendData { field, detail })
}

/// Records `node`'s claim on `mac`. One MAC, two nodes: the FDB cannot tell them apart, so
/// the MAC stays with whoever claimed it first (this node, then the peers oldest first, the
/// order they are planned in), and a later claim is refused: the reason is returned.
fn claim_mac(
    macs: &mut BTreeMap<[u8; 6], String>,
    mac: [u8; 6],
    node: &str,
) -> Option<BackendDataError> {
    match macs.get(&mac) {
        Some(other) => Some(BackendDataError::Duplicate {
            field: "VtepMAC",
            value: format_mac(&mac),
            by: format!("node {other}, which keeps it"),
        }),
        None => {
            macs.insert(mac, node.to_string());
            None
        }
    }
}

/// The vxlan plan: `flannel.<VNI>` for the IPv4 subnets and, with IPv6 enabled,
/// `flannel-v6.<VNI>` for the IPv6 ones (as flannel does: the node's IPv6 address as the
/// tunnel's source, the VTEP MAC from `backend-v6-data`).
pub(crate) fn vxlan(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    conf: &VxlanConf,
    screened: Screened<'_>,
) -> Result<DesiredState, PlanError> {
    let Screened {
        candidates,
        mut left_out,
    } = screened;
    let mut state = DesiredState::default();
    for (v6, own) in [(false, ours.v4), (true, ours.v6)] {
        let Some(own) = own else {
            continue;
        };
        let family = FamilyPlan {
            v6,
            own,
            candidates: &candidates,
        };
        let spec = vxlan_device_plan(input, conf, &family, &mut state.routes, &mut left_out)?;
        state.vxlan.push(spec);
    }
    // One MTU for the pods of both families: the smaller device's.
    let mtu = state
        .vxlan
        .iter()
        .map(|v| v.mtu)
        .min()
        .unwrap_or(input.options.underlay_mtu);
    state.left_out = left_out;
    state.subnet_env = subnet_env(input.config, ours, mtu, input.options.ip_masq);
    Ok(state)
}

/// One family's share of the vxlan plan.
struct FamilyPlan<'a, 'b> {
    v6: bool,
    /// This node's subnet of that family.
    own: IpNet,
    candidates: &'a [Candidate<'b>],
}

/// One family's vxlan device, its peers, and their routes (pushed onto `routes`).
fn vxlan_device_plan(
    input: &PlanInput<'_>,
    conf: &VxlanConf,
    family: &FamilyPlan<'_, '_>,
    routes: &mut Vec<RouteSpec>,
    left_out: &mut Vec<LeftOut>,
) -> Result<VxlanSpec, PlanError> {
    let v6 = family.v6;
    let local_data = if v6 {
        input.local.backend_v6_data.as_ref()
    } else {
        input.local.backend_data.as_ref()
    };
    let own_mac = vxlan_mac(local_data).map_err(|detail| PlanError::LocalBackendData {
        node: input.local.node.clone(),
        detail,
    })?;
    let local = if v6 {
        input.local.public_ipv6.map(IpAddr::V6)
    } else {
        input.local.public_ip.map(IpAddr::V4)
    }
    .ok_or_else(|| PlanError::LocalNoPublicIp {
        node: input.local.node.clone(),
        family: if v6 { "global IPv6" } else { "IPv4" },
        flag: if v6 { "v6" } else { "" },
    })?;
    let device = if v6 {
        vxlan_device_v6(conf.vni)
    } else {
        vxlan_device(conf.vni)
    };
    let underlay = input.options.underlay_device.clone();
    let overhead = if v6 {
        VXLAN_OVERHEAD_V6
    } else {
        VXLAN_OVERHEAD
    };
    let mtu = conf
        .mtu
        .unwrap_or(input.options.underlay_mtu)
        .saturating_sub(overhead);
    let mut peers: Vec<VxlanPeer> = Vec::new();
    let mut macs: BTreeMap<[u8; 6], String> = BTreeMap::new();
    macs.insert(own_mac, input.local.node.clone());
    for c in family.candidates {
        let Some((subnet, ip)) = tunnel_target(input, c, v6, conf.direct_routing, routes, left_out)
        else {
            continue;
        };
        let data = if v6 {
            c.lease.backend_v6_data.as_ref()
        } else {
            c.lease.backend_data.as_ref()
        };
        let node = &c.lease.node;
        let mac = match vxlan_mac(data) {
            Ok(mac) => mac,
            Err(detail) => {
                left_out.push(bad_data(node, v6, detail));
                continue;
            }
        };
        if let Some(detail) = claim_mac(&mut macs, mac, node) {
            left_out.push(bad_data(node, v6, detail));
            continue;
        }
        peers.push(VxlanPeer {
            node: node.clone(),
            gateway: subnet.network(),
            mac,
            public_ip: ip,
        });
        routes.push(RouteSpec {
            dst: subnet,
            device: device.clone(),
            via: Some(subnet.network()),
            onlink: true,
            role: RouteRole::Peer(node.clone()),
            mtu: None,
        });
    }
    peers.sort_by(|a, b| a.node.cmp(&b.node));
    let host = if v6 { 128 } else { 32 };
    let own = family.own;
    Ok(VxlanSpec {
        device,
        vni: conf.vni,
        port: conf.port,
        gbp: conf.gbp,
        learning: conf.learning,
        mac: own_mac,
        local,
        underlay_device: underlay,
        mtu,
        addresses: vec![IpNet::new(own.network(), host).unwrap_or(own)],
        peers,
    })
}
