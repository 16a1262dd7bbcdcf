//! The ipip backend's share of the plan, as flannel's: the device `flannel.ipip` (IPv4 in
//! IPv4, source this node's public IP, MTU underlay − 20) and one route per peer subnet via
//! the peer's public IP, on-link through the device; with `DirectRouting`, a peer on this
//! node's segment gets a plain route via its public IP instead. IPv4 only (the config
//! refuses IPv6 with ipip).

use ipnet::IpNet;

use super::peers::Screened;
use super::unencrypted::tunnel_target;
use super::{subnet_env, LocalSubnets, PlanError, PlanInput};
use crate::model::{DesiredState, IpipSpec, RouteRole, RouteSpec};
use crate::netconf::IpipConf;

/// flannel's ipip device.
pub const IPIP_DEVICE: &str = "flannel.ipip";
/// The outer IPv4 header.
pub(super) const IPIP_OVERHEAD: u32 = 20;

pub(crate) fn plan(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    conf: &IpipConf,
    screened: Screened<'_>,
) -> Result<DesiredState, PlanError> {
    let local = input
        .local
        .public_ip
        .ok_or_else(|| PlanError::LocalNoPublicIp {
            node: input.local.node.clone(),
            family: "IPv4",
            flag: "",
        })?;
    let underlay = input.options.underlay_device.clone();
    let mtu = conf
        .mtu
        .unwrap_or(input.options.underlay_mtu)
        .saturating_sub(IPIP_OVERHEAD);
    let Screened {
        candidates,
        mut left_out,
    } = screened;
    let mut state = DesiredState::default();
    for c in &candidates {
        let direct = conf.direct_routing;
        let routes = &mut state.routes;
        let Some((subnet, ip)) = tunnel_target(input, c, false, direct, routes, &mut left_out)
        else {
            continue;
        };
        state.routes.push(RouteSpec {
            dst: subnet,
            device: IPIP_DEVICE.to_string(),
            via: Some(ip),
            onlink: true,
            role: RouteRole::Peer(c.lease.node.clone()),
            mtu: None,
        });
    }
    let addresses = ours
        .v4
        .map(|s| IpNet::new(s.network(), 32).unwrap_or(s))
        .into_iter()
        .collect();
    state.ipip = Some(IpipSpec {
        device: IPIP_DEVICE.to_string(),
        local,
        underlay_device: underlay,
        mtu,
        addresses,
    });
    state.left_out = left_out;
    state.subnet_env = subnet_env(input.config, ours, mtu, input.options.ip_masq);
    Ok(state)
}
