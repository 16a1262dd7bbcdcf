//! Reconcilers: read what the kernel has, diff it against `DesiredState` for the objects weft
//! owns, apply only the delta. The only code in this crate that does I/O. In steady state a
//! pass makes zero writes. One failed write does not stop the others: it is reported, and the
//! next pass tries again.

mod dataplane;
mod dataplane_ipsec;
#[cfg(test)]
mod dataplane_tests;
mod dataplane_wg;
#[cfg(test)]
mod fake;
pub mod guard;
mod ipip;
mod ipsec_link;
pub mod monitor;
mod netlink;
mod nft;
pub(crate) mod nl_request;
mod port_taken;
#[cfg(test)]
mod reconcile_tests;
mod route_cache;
mod routing;
mod rtnl;
mod rtnl_vxlan;
mod seal;
mod underlay;
mod vxlan;
pub mod wireguard;
pub mod xfrm;

use std::collections::BTreeMap;

pub use dataplane::{Dataplane, DataplaneReport};
pub use dataplane_ipsec::IpsecPlane;
pub use netlink::{
    IpipInfo, NeighbourEntry, Netlink, ObservedLink, ObservedRoute, RouteWrite, VxlanInfo,
    VxlanNetlink, XfrmInfo, RTPROT_WEFT,
};
pub use nft::{
    expected_rules, listed_rules, reconcile_nft, tables_as_planned, Nft, NftCli, NftReport,
    TABLES as NFT_TABLES,
};
pub use port_taken::holder as udp_port_holder;
pub use route_cache::{OwnDeletions, RouteCache};
pub use routing::{diff_link, diff_routes, RoutingChange};
pub use rtnl::RtNetlink;
pub use seal::seal;
pub use underlay::Underlay;
pub use vxlan::reconcile_vxlan;

use crate::model::{DesiredState, Family};

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// A netlink request: the operation names the object.
    #[error("{op}: {source}")]
    Netlink {
        op: String,
        #[source]
        source: std::io::Error,
    },
    /// Anything else the data plane does that is not netlink: starting or talking to a
    /// process (`nft`, the userspace device), a UAPI socket, a file.
    #[error("{op}: {source}")]
    Io {
        op: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{op}: {detail}")]
    Nft { op: String, detail: String },
}

/// What one pass did: the changes applied, and those that failed with why.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub applied: Vec<RoutingChange>,
    pub failed: Vec<(RoutingChange, ApplyError)>,
}

async fn write<N: Netlink>(
    nl: &mut N,
    links: &BTreeMap<String, ObservedLink>,
    change: &RoutingChange,
    mtu_of: &BTreeMap<String, u32>,
) -> Result<(), ApplyError> {
    let link = |d: &String| links.get(d).cloned();
    match change {
        RoutingChange::Link { device, up, .. } => match (link(device), mtu_of.get(device)) {
            (Some(l), Some(mtu)) => nl.set_link(&l, *mtu, *up).await,
            _ => Ok(()),
        },
        RoutingChange::AddAddress { device, addr } => match link(device) {
            Some(l) => nl.add_address(&l, *addr).await,
            None => Ok(()),
        },
        RoutingChange::RemoveAddress { device, addr } => match link(device) {
            Some(l) => nl.del_address(&l, *addr).await,
            None => Ok(()),
        },
        RoutingChange::AddRoute(r) | RoutingChange::ReplaceRoute { to: r, .. } => {
            nl.put_route(r).await
        }
        RoutingChange::AddBlackhole(dst) => nl.put_blackhole(*dst).await,
        RoutingChange::RemoveRoute(r) => nl.del_route(r).await,
    }
}

/// Brings the links (MTU, up, addresses) and routes of `desired` into the kernel. Devices
/// themselves are created by the device reconciler; a device that does not exist yet is
/// skipped here, with its routes.
pub async fn reconcile_routing<N: Netlink>(
    nl: &mut N,
    desired: &DesiredState,
) -> Result<ApplyReport, ApplyError> {
    reconcile_routing_with(nl, desired, &mut RouteCache::default(), None).await
}

/// `reconcile_routing`, diffing the routes against `cache` where it holds them (else
/// listing them into it); `own` hears of each route deletion before it is made.
pub(crate) async fn reconcile_routing_with<N: Netlink>(
    nl: &mut N,
    desired: &DesiredState,
    cache: &mut RouteCache,
    own: Option<&OwnDeletions>,
) -> Result<ApplyReport, ApplyError> {
    let mut links = BTreeMap::new();
    let mut absent = Vec::new();
    let mut mtu_of = BTreeMap::new();
    let mut changes = Vec::new();
    let owned = desired
        .tunnels
        .iter()
        .map(|t| (&t.device, t.mtu, &t.addresses))
        .chain(
            desired
                .vxlan
                .iter()
                .map(|v| (&v.device, v.mtu, &v.addresses)),
        )
        .chain(
            desired
                .ipip
                .iter()
                .map(|i| (&i.device, i.mtu, &i.addresses)),
        )
        .chain(
            desired
                .ipsec
                .iter()
                .map(|i| (&i.device, i.mtu, &i.addresses)),
        );
    for (device, mtu, addresses) in owned {
        let Some(link) = nl.link(device).await? else {
            // Its routes went with it.
            cache.forget();
            absent.push(device.clone());
            continue;
        };
        let have = nl.addresses(&link).await?;
        changes.extend(diff_link(&link, mtu, addresses, &have));
        mtu_of.insert(device.clone(), mtu);
        links.insert(device.clone(), link);
    }
    // Routes may also leave by a device weft does not own (host-gw, DirectRouting: the
    // external interface); it is only looked up.
    // Each device is looked up once, found or not: on a first start every route names a
    // tunnel device not made yet, and a lookup per route was 10,000 netlink requests.
    let mut indexes: BTreeMap<String, Option<u32>> = links
        .iter()
        .map(|(n, l)| (n.clone(), Some(l.index)))
        .chain(absent.into_iter().map(|n| (n, None)))
        .collect();
    for r in &desired.routes {
        if !indexes.contains_key(&r.device) {
            let index = nl.link(&r.device).await?.map(|l| l.index);
            indexes.insert(r.device.clone(), index);
        }
    }
    let index_of = |d: &str| indexes.get(d).copied().flatten();
    // A device found down (or not as planned) may have lost its routes without a report
    // (the kernel flushes a downed device's routes silently): list them.
    if changes
        .iter()
        .any(|c| matches!(c, RoutingChange::Link { .. }))
    {
        cache.forget();
    }
    if cache.get(Family::Ipv4).is_none() {
        let v4 = RouteCache::ours(nl.routes(Family::Ipv4).await?);
        let v6 = RouteCache::ours(nl.routes(Family::Ipv6).await?);
        cache.listed(v4, v6);
    }
    for family in [Family::Ipv4, Family::Ipv6] {
        let Some(ours) = cache.get(family) else {
            continue;
        };
        let wanted = desired
            .routes
            .iter()
            .filter(|r| Family::of(&r.dst) == family);
        let holes = desired
            .fail_closed
            .iter()
            .filter(|n| Family::of(n) == family)
            .copied();
        changes.extend(routing::diff_our_routes(wanted, holes, &index_of, ours));
    }
    // Fail closed: the blackholes go in before anything that could move traffic.
    changes.sort_by_key(|c| !matches!(c, RoutingChange::AddBlackhole(_)));
    let mut report = ApplyReport::default();
    let mut record = |change: RoutingChange, result: Result<(), ApplyError>| match result {
        Ok(()) => {
            cache.wrote(&change);
            report.applied.push(change);
        }
        Err(e) => {
            // What the kernel holds now is unknown: the next pass lists it.
            cache.forget();
            report.failed.push((change, e));
        }
    };
    let mut changes = changes.into_iter().peekable();
    while let Some(change) = changes.next() {
        if route_write(&change).is_some() {
            // A run of route writes (each to its own destination) goes out together.
            let mut run = vec![change];
            while let Some(next) = changes.next_if(|c| route_write(c).is_some()) {
                run.push(next);
            }
            let routes: Vec<&RouteWrite> = run.iter().filter_map(route_write).collect();
            let results = nl.put_routes(&routes).await;
            for (change, result) in run.into_iter().zip(results) {
                record(change, result);
            }
            continue;
        }
        if let (Some(own), RoutingChange::RemoveRoute(r)) = (own, &change) {
            own.announce(r.dst);
        }
        let result = write(nl, &links, &change, &mtu_of).await;
        record(change, result);
    }
    Ok(report)
}

/// The route a change adds or replaces.
fn route_write(change: &RoutingChange) -> Option<&RouteWrite> {
    match change {
        RoutingChange::AddRoute(r) | RoutingChange::ReplaceRoute { to: r, .. } => Some(r),
        _ => None,
    }
}
