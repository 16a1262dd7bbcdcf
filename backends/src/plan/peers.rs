//! Backend-independent screening of peers: expiry, backend type, subnets inside the
//! network, overlap with ours, one subnet per node. What survives goes to the backend.

use std::collections::BTreeMap;

use ipnet::IpNet;

use super::{LocalSubnets, PlanInput};
use crate::model::{Lease, LeaveReason, LeftOut};
use crate::netconf::BackendKind;

/// A peer whose lease passed the common checks, with its usable subnets.
pub(crate) struct Candidate<'a> {
    pub lease: &'a Lease,
    pub v4: Option<IpNet>,
    pub v6: Option<IpNet>,
}

pub(crate) struct Screened<'a> {
    pub candidates: Vec<Candidate<'a>>,
    pub left_out: Vec<LeftOut>,
}

fn leave(node: &str, reason: LeaveReason) -> LeftOut {
    LeftOut {
        node: node.to_string(),
        reason,
    }
}

pub(crate) fn screen<'a>(
    input: &PlanInput<'a>,
    ours: &LocalSubnets,
    kind: BackendKind,
) -> Screened<'a> {
    let mut left_out = Vec::new();
    let mut candidates = Vec::new();
    for lease in input.view.leases.values() {
        if lease.node == input.local.node {
            continue;
        }
        match check(input, ours, kind, lease) {
            Ok(c) => candidates.push(c),
            Err(reason) => left_out.push(leave(&lease.node, reason)),
        }
    }
    // A subnet claimed by two nodes: routing to either is a guess, so neither gets it.
    // Sorted by start address, each subnet is checked against the widest one seen so far:
    // O(n log n), for clusters of thousands of nodes.
    let mut clash: BTreeMap<String, LeaveReason> = BTreeMap::new();
    for v6 in [false, true] {
        let mut subnets: Vec<(u128, u128, IpNet, usize)> = candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let net = if v6 { c.v6 } else { c.v4 }?;
                let start = crate::model::net::to_u128(net.network());
                let end = crate::model::net::to_u128(net.broadcast());
                Some((start, end, net, i))
            })
            .collect();
        subnets.sort_by_key(|(start, end, _, _)| (*start, std::cmp::Reverse(*end)));
        let mut widest: Option<(u128, IpNet, usize)> = None;
        for (start, end, net, i) in subnets {
            match widest {
                Some((w_end, w_net, w)) if start <= w_end => {
                    let (a, b) = (&candidates[w], &candidates[i]);
                    clash
                        .entry(a.lease.node.clone())
                        .or_insert(LeaveReason::DuplicateSubnet {
                            subnet: w_net,
                            other: b.lease.node.clone(),
                        });
                    clash
                        .entry(b.lease.node.clone())
                        .or_insert(LeaveReason::DuplicateSubnet {
                            subnet: net,
                            other: a.lease.node.clone(),
                        });
                    if end > w_end {
                        widest = Some((end, net, i));
                    }
                }
                _ => widest = Some((end, net, i)),
            }
        }
    }
    candidates.retain(|c| match clash.remove(&c.lease.node) {
        Some(reason) => {
            left_out.push(leave(&c.lease.node, reason));
            false
        }
        None => true,
    });
    Screened {
        candidates,
        left_out,
    }
}

fn check<'a>(
    input: &PlanInput<'a>,
    ours: &LocalSubnets,
    kind: BackendKind,
    lease: &'a Lease,
) -> Result<Candidate<'a>, LeaveReason> {
    if lease.expires.is_some_and(|t| t <= input.now) {
        return Err(LeaveReason::Expired);
    }
    if lease.backend_type.parse::<BackendKind>().ok() != Some(kind) {
        return Err(LeaveReason::WrongBackend {
            theirs: lease.backend_type.clone(),
            ours: kind.as_str(),
        });
    }
    let usable = |subnet: Option<IpNet>, v6: bool| -> Result<Option<IpNet>, LeaveReason> {
        let (Some(subnet), Some(net)) = (subnet, input.config.network(v6)) else {
            return Ok(None);
        };
        if !net.network.contains(&subnet) {
            return Err(LeaveReason::SubnetOutsideNetwork {
                subnet,
                network: net.network,
            });
        }
        if let Some(mine) = ours
            .iter()
            .find(|o| o.contains(&subnet) || subnet.contains(o))
        {
            return Err(LeaveReason::OverlapsOurSubnet { subnet, ours: mine });
        }
        Ok(Some(subnet))
    };
    let v4 = usable(lease.subnet, false)?;
    let v6 = usable(lease.subnet_v6, true)?;
    if v4.is_none() && v6.is_none() {
        return Err(LeaveReason::NoSubnet);
    }
    Ok(Candidate { lease, v4, v6 })
}
