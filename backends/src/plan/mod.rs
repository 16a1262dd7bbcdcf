//! `plan()`: `(local lease, ClusterView, NetConf, options, now) -> DesiredState`.
//!
//! Pure: no I/O, no clock of its own, no randomness. Every decision about peers lives here:
//! which peers, which endpoint, which AllowedIPs, which routes, the MTU, and which peers are
//! left out and why. A bad peer is left out with a reason naming it; it never disturbs the
//! rest of the plan. Only a problem with this node's own lease fails the plan.

mod guard;
mod incremental;
pub use incremental::{PatchedNode, PlanKind, PlanStamp, Planner};
mod ipip;
pub mod ipsec;
mod ipsec_data;
mod ipsec_pq;
pub use ipsec_pq::SETTLE as IPSEC_PQ_SETTLE;
pub mod liveness;
mod masquerade;
pub mod mixed;
pub mod path_mtu;
mod peers;
pub mod post_quantum;
pub mod relay;
pub mod roaming;
mod unencrypted;
mod wg_rotation;
mod wireguard;

use std::time::SystemTime;

use ipnet::IpNet;

use crate::model::{BackendDataError, DesiredState, Family, Lease, SubnetEnv};
use crate::netconf::{Backend, NetConf};

pub use unencrypted::{vxlan_backend_data, vxlan_device, vxlan_device_v6, vxlan_mac};
pub use wireguard::{
    backend_data as wireguard_backend_data, WireguardData, DEVICE as WG_DEVICE,
    DEVICE_V6 as WG_DEVICE_V6,
};

/// Node-local facts the plan needs besides the config: resolved by the agent, passed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanOptions {
    /// `--ip-masq`: install the masquerade rule set.
    pub ip_masq: bool,
    /// MTU of the external interface, used when the config sets no `MTU`.
    pub underlay_mtu: u32,
    /// The external interface (vxlan runs over it; host-gw routes go out of it).
    pub underlay_device: Option<String>,
    /// The networks directly connected on the external interface: a peer whose public
    /// IP lies in one is on-link (host-gw, vxlan `DirectRouting`).
    pub underlay_networks: Vec<IpNet>,
}

pub struct PlanInput<'a> {
    pub local: &'a Lease,
    pub view: &'a crate::model::ClusterView,
    pub config: &'a NetConf,
    pub options: &'a PlanOptions,
    /// What this node's devices reported (announced keys in use).
    pub observed: &'a crate::model::Observed,
    pub now: SystemTime,
    /// The path MTU measured to each peer's underlay address (the agent's prober).
    pub path_mtus: &'a std::collections::BTreeMap<std::net::IpAddr, u32>,
    /// With `PostQuantum`: the PSK of each pair's last completed post-quantum round, by
    /// the peer's X25519 key (pairs of this node's current key only). A pair not in it is
    /// classical.
    pub pair_psks: &'a std::collections::BTreeMap<weft_crypto::PublicKey, crate::model::PairSecret>,
}

/// A problem with this node's own lease or setup: nothing can be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "this node ({node}) holds no {family:?} subnet, but the family is enabled in net-conf.json"
    )]
    LocalNoSubnet { node: String, family: Family },
    #[error("this node's ({node}) subnet {subnet} lies outside the pod network {network}; fix the node's podCIDR or the config's Network")]
    LocalSubnetOutside {
        node: String,
        subnet: IpNet,
        network: IpNet,
    },
    #[error("this node's ({node}) published backend data is unusable: {detail}")]
    LocalBackendData {
        node: String,
        detail: BackendDataError,
    },
    #[error("this node ({node}) publishes no {family} address for the vxlan tunnel's source; give --public-ip{flag} or an interface with one")]
    LocalNoPublicIp {
        node: String,
        family: &'static str,
        /// `v6` for the IPv6 flag.
        flag: &'static str,
    },
    #[error("the {backend} backend needs the external interface, which is unknown; give --public-ip or --iface")]
    NoUnderlay { backend: &'static str },
}

/// This node's subnets, checked against the config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalSubnets {
    pub v4: Option<IpNet>,
    pub v6: Option<IpNet>,
}

impl LocalSubnets {
    fn of(local: &Lease, config: &NetConf) -> Result<Self, PlanError> {
        let pick = |subnet: Option<IpNet>, family: Family| -> Result<Option<IpNet>, PlanError> {
            let Some(net) = config.network(family == Family::Ipv6) else {
                return Ok(None);
            };
            let subnet = subnet.ok_or_else(|| PlanError::LocalNoSubnet {
                node: local.node.clone(),
                family,
            })?;
            if !net.network.contains(&subnet) {
                return Err(PlanError::LocalSubnetOutside {
                    node: local.node.clone(),
                    subnet,
                    network: net.network,
                });
            }
            Ok(Some(subnet))
        };
        Ok(LocalSubnets {
            v4: pick(local.subnet, Family::Ipv4)?,
            v6: pick(local.subnet_v6, Family::Ipv6)?,
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.v4.iter().chain(self.v6.iter()).copied()
    }
}

/// Plans this node's data plane. See the module doc.
pub fn plan(input: &PlanInput<'_>) -> Result<DesiredState, PlanError> {
    plan_noting(input, None)
}

/// `plan`, noting in `claims` what every node claims (the incremental planner's index).
pub(crate) fn plan_noting(
    input: &PlanInput<'_>,
    mut claims: Option<&mut incremental::Claims>,
) -> Result<DesiredState, PlanError> {
    let ours = LocalSubnets::of(input.local, input.config)?;
    let mut state = if mixed::involved(input) {
        mixed::plan(input, &ours)?
    } else {
        let kind = input.config.backend.kind();
        let screened = peers::screen(input, &ours, kind, claims.as_deref_mut());
        backend_plan(input, &ours, screened, claims)?
    };
    guard::add(&mut state, input, &ours);
    path_mtu::apply(&mut state, input);
    post_quantum::add(&mut state, input);
    if input.options.ip_masq {
        state.masquerade = masquerade::tables(input.config, &ours);
    }
    state.left_out.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(state)
}

/// The config's backend's plan for the screened peers.
fn backend_plan(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    screened: peers::Screened<'_>,
    claims: Option<&mut incremental::Claims>,
) -> Result<DesiredState, PlanError> {
    match &input.config.backend {
        Backend::Wireguard(wg) => wireguard::plan(input, ours, wg, screened, claims),
        Backend::Vxlan(conf) => unencrypted::vxlan(input, ours, conf, screened),
        Backend::HostGw => unencrypted::host_gw(input, ours, screened),
        Backend::Ipip(conf) => ipip::plan(input, ours, conf, screened),
        Backend::Ipsec(conf) => ipsec::plan(input, ours, conf, screened),
    }
}

/// subnet.env for this node: the gateway address is the subnet's first host.
pub(crate) fn subnet_env(
    config: &NetConf,
    ours: &LocalSubnets,
    mtu: u32,
    ipmasq: bool,
) -> SubnetEnv {
    let gateway = |s: IpNet| {
        let first = crate::model::net::to_u128(s.network()) + 1;
        IpNet::new(
            crate::model::net::from_u128(s.addr(), first),
            s.prefix_len(),
        )
        .unwrap_or(s)
    };
    SubnetEnv {
        network: config.ipv4.map(|n| n.network),
        subnet: ours.v4.map(gateway),
        ipv6_network: config.ipv6.map(|n| n.network),
        ipv6_subnet: ours.v6.map(gateway),
        mtu,
        ipmasq,
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod claims_tests;
#[cfg(test)]
mod dual_stack_tests;
#[cfg(test)]
mod incremental_tests;
#[cfg(test)]
mod ipip_tests;
#[cfg(test)]
mod ipsec_pq_tests;
#[cfg(test)]
mod ipsec_tests;
#[cfg(test)]
mod mixed_tests;
#[cfg(test)]
mod post_quantum_tests;
#[cfg(test)]
mod switchover_tests;
#[cfg(test)]
mod unencrypted_tests;
