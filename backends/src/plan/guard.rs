//! The guard of an encrypting backend, planned: per address family, which pod-network
//! sources a node accepts from where. A packet from another node's pod must come out of a
//! tunnel device (where it was decrypted and checked against that peer's AllowedIPs or
//! inbound policy); a packet from this node's own pods never arrives on the underlay.
//! Without it, a forged clear packet on the underlay with a pod's source address is
//! routed like a real one: to a local pod, or into the tunnel as if this node's pod had
//! sent it (the usual loose rp_filter lets both through).

use crate::model::{DesiredState, Family, GuardSpec, RouteRole};

use super::{LocalSubnets, PlanInput};

/// Adds the guard for every network the plan fails closed on (the encrypting backends').
pub(super) fn add(state: &mut DesiredState, input: &PlanInput<'_>, ours: &LocalSubnets) {
    let mut tunnels: Vec<String> = state.tunnels.iter().map(|t| t.device.clone()).collect();
    tunnels.extend(state.ipsec.iter().map(|s| s.device.clone()));
    let in_clear: std::collections::BTreeSet<&str> = state
        .pair_backends
        .iter()
        .filter(|p| p.why_clear.is_some())
        .map(|p| p.node.as_str())
        .collect();
    let clear: Vec<(String, ipnet::IpNet)> = state
        .routes
        .iter()
        .filter(|r| match &r.role {
            RouteRole::Peer(node) | RouteRole::Direct(node) => in_clear.contains(node.as_str()),
            _ => false,
        })
        .map(|r| (r.device.clone(), r.dst))
        .chain(state.clear_draining.iter().cloned())
        .collect();
    state.guard = state
        .fail_closed
        .iter()
        .map(|network| {
            let family = Family::of(network);
            GuardSpec {
                family,
                network: *network,
                own: if family == Family::Ipv6 {
                    ours.v6
                } else {
                    ours.v4
                },
                tunnels: tunnels.clone(),
                clear: clear
                    .iter()
                    .filter(|(_, net)| Family::of(net) == family)
                    .cloned()
                    .collect(),
                underlay: input.options.underlay_device.clone(),
            }
        })
        .collect();
}
