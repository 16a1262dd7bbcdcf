//! The masquerade rule set of docs/architecture.md, one nftables table per enabled family.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::LocalSubnets;
use crate::model::{Family, ForwardRule, MasqueradeTable, Match, NatRule};
use crate::netconf::NetConf;

/// kube-proxy's masquerade mark: packets it will NAT itself.
pub const KUBE_PROXY_MARK: u32 = 0x4000;

pub(crate) fn tables(config: &NetConf, ours: &LocalSubnets) -> Vec<MasqueradeTable> {
    let mut out = Vec::new();
    if let (Some(net), Some(subnet)) = (config.ipv4, ours.v4) {
        let multicast = IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(224, 0, 0, 0), 4));
        out.push(table(
            Family::Ipv4,
            "flannel-ipv4",
            net.network,
            subnet,
            multicast,
        ));
    }
    if let (Some(net), Some(subnet)) = (config.ipv6, ours.v6) {
        let multicast = IpNet::V6(Ipv6Net::new_assert(
            Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0),
            8,
        ));
        out.push(table(
            Family::Ipv6,
            "flannel-ipv6",
            net.network,
            subnet,
            multicast,
        ));
    }
    out
}

fn table(
    family: Family,
    name: &'static str,
    network: IpNet,
    subnet: IpNet,
    multicast: IpNet,
) -> MasqueradeTable {
    MasqueradeTable {
        family,
        table: name,
        postrouting: vec![
            NatRule::ReturnIfMarked {
                mark: KUBE_PROXY_MARK,
            },
            NatRule::Return {
                src: Match::In(subnet),
                dst: Match::In(network),
            },
            NatRule::Return {
                src: Match::In(network),
                dst: Match::In(subnet),
            },
            NatRule::Return {
                src: Match::NotIn(network),
                dst: Match::In(subnet),
            },
            NatRule::Masquerade {
                src: Match::In(network),
                dst: Match::NotIn(multicast),
                fully_random: true,
            },
            NatRule::Masquerade {
                src: Match::NotIn(network),
                dst: Match::In(network),
                fully_random: true,
            },
        ],
        forward: vec![
            ForwardRule {
                src: Some(network),
                dst: None,
            },
            ForwardRule {
                src: None,
                dst: Some(network),
            },
        ],
    }
}
