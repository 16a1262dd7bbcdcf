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

/// Screens every lease but ours; with `claims`, notes every candidate's subnets there
/// (before duplicates are left out: a claim that loses still takes part).
pub(crate) fn screen<'a>(
    input: &PlanInput<'a>,
    ours: &LocalSubnets,
    kind: BackendKind,
    claims: Option<&mut super::incremental::Claims>,
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
    if let Some(claims) = claims {
        claims.subnets = candidates
            .iter()
            .map(|c| (c.lease.node.clone(), c.v4, c.v6))
            .collect();
    }
    let mut clash: BTreeMap<String, LeaveReason> = BTreeMap::new();
    for v6 in [false, true] {
        subnet_clashes(&candidates, v6, &mut clash);
    }
    candidates.retain(|c| match clash.remove(&c.lease.node) {
        Some(reason) => {
            left_out.push(leave(&c.lease.node, reason));
            false
        }
        None => true,
    });
    // Every backend meets the peers oldest first, so the first claim on a key or a MAC
    // is the incumbent's.
    candidates.sort_by(|a, b| seniority(a.lease).cmp(&seniority(b.lease)));
    Screened {
        candidates,
        left_out,
    }
}

/// A lease's place in line: the entry the registry created first (unknown counts as
/// newest), then the node's name, so every node breaks ties the same way.
pub(crate) fn seniority(lease: &Lease) -> (i64, &str) {
    (lease.created.unwrap_or(i64::MAX), &lease.node)
}

/// Whether `lease` proves that its node holds the private key of `key` (a proof made for
/// its own name: copied from another node, it does not verify). Checked only where
/// entries contend for a key, so a plan verifies no signature in a cluster without
/// duplicates.
pub(crate) fn proves(lease: &Lease, key: &weft_crypto::PublicKey) -> bool {
    lease
        .key_proof
        .as_ref()
        .is_some_and(|p| weft_crypto::proof::verify(key, &lease.node, p))
}

/// The entry that keeps each public key more than one candidate publishes (`key_of`
/// reads a candidate's key, if it has one): one that proves holding it, before one that
/// does not, then the oldest (candidates come oldest first). Keys only one candidate
/// publishes are not in the map.
pub(crate) fn contested_keys<'a>(
    candidates: &[Candidate<'a>],
    key_of: impl Fn(&Candidate<'a>) -> Option<weft_crypto::PublicKey>,
) -> BTreeMap<weft_crypto::PublicKey, &'a str> {
    let mut claims: BTreeMap<weft_crypto::PublicKey, Vec<&'a Lease>> = BTreeMap::new();
    for c in candidates {
        if let Some(key) = key_of(c) {
            claims.entry(key).or_default().push(c.lease);
        }
    }
    claims
        .into_iter()
        .filter(|(_, leases)| leases.len() > 1)
        .filter_map(|(key, leases)| {
            let owner = leases.iter().find(|l| proves(l, &key)).or(leases.first())?;
            Some((key, owner.node.as_str()))
        })
        .collect()
}

/// Subnets of one family claimed twice. Every lease has this node's prefix length (see
/// `check`), so two subnets that overlap are equal: the incumbent keeps it and the
/// newcomer is left out. Where lengths can still differ (a family this node has no subnet
/// of), a subnet that covers another is the one left out. Sorted by start address, each
/// subnet is checked against the widest kept so far: O(n log n), for clusters of
/// thousands of nodes.
fn subnet_clashes(
    candidates: &[Candidate<'_>],
    v6: bool,
    clash: &mut BTreeMap<String, LeaveReason>,
) {
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
        let Some((w_end, w_net, w)) = widest.filter(|(w_end, _, _)| start <= *w_end) else {
            widest = Some((end, net, i));
            continue;
        };
        let (kept, lost) = if w_net == net {
            let (a, b) = (&candidates[w], &candidates[i]);
            if seniority(a.lease) <= seniority(b.lease) {
                (w, i)
            } else {
                (i, w)
            }
        } else {
            // Sorted widest first: `w_net` covers `net`.
            (i, w)
        };
        clash
            .entry(candidates[lost].lease.node.clone())
            .or_insert(LeaveReason::DuplicateSubnet {
                subnet: if lost == w { w_net } else { net },
                other: candidates[kept].lease.node.clone(),
            });
        if lost == w {
            widest = Some((end, net, i));
        } else {
            widest = Some((w_end, w_net, w));
        }
    }
}

/// The common checks of one lease: its usable subnets, or why it is left out.
pub(crate) fn check<'a>(
    input: &PlanInput<'_>,
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
        // Every node's subnet has one length (etcd: SubnetLen; Kubernetes: the podCIDR
        // mask): a wider one would cover other nodes' subnets.
        let own = if v6 { ours.v6 } else { ours.v4 };
        if let Some(own) = own.filter(|o| o.prefix_len() != subnet.prefix_len()) {
            return Err(LeaveReason::SubnetLength {
                subnet,
                expected: own.prefix_len(),
            });
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
