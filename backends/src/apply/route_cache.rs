//! weft's own routes between reads. Listing every route costs a pass at 10,000 peers more
//! than the rest of its routing work together, and between a pass and the next only two
//! things change them: this agent's own writes, which the cache follows, and someone
//! else's deletions, which the kernel reports (`monitor::deletions`; the agent then drops
//! the cache). So a pass woken by the registry diffs the plan against the cache; a full
//! pass, a pass after a deletion or after a failed write, and one that made a device,
//! list the routes afresh. A route someone else *changed* in place, without deleting it,
//! is put back by the next full pass.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ipnet::IpNet;

use super::{ObservedRoute, RoutingChange, RTPROT_WEFT};
use crate::model::{Family, FAIL_CLOSED_METRIC};

/// weft's routes of one family, by destination and whether they are blackholes.
pub(crate) type OurRoutes = BTreeMap<(IpNet, bool), ObservedRoute>;

/// weft's routes as last listed, with this agent's writes since; empty when they must be
/// listed afresh.
#[derive(Debug, Default)]
pub struct RouteCache {
    families: Option<[OurRoutes; 2]>,
}

fn slot(family: Family) -> usize {
    match family {
        Family::Ipv4 => 0,
        Family::Ipv6 => 1,
    }
}

impl RouteCache {
    /// The next pass lists the routes afresh.
    pub fn forget(&mut self) {
        self.families = None;
    }

    /// weft's routes of `family`, if they are known without a read.
    pub(crate) fn get(&self, family: Family) -> Option<&OurRoutes> {
        self.families.as_ref().map(|f| &f[slot(family)])
    }

    /// What a listing of every route of `family` holds of weft's.
    pub(crate) fn ours(listed: Vec<ObservedRoute>) -> OurRoutes {
        listed
            .into_iter()
            .filter(|r| r.protocol == RTPROT_WEFT)
            .map(|r| ((r.dst, r.blackhole), r))
            .collect()
    }

    /// Keeps both families' listings.
    pub(crate) fn listed(&mut self, v4: OurRoutes, v6: OurRoutes) {
        self.families = Some([v4, v6]);
    }

    /// Follows a change this agent wrote.
    pub(crate) fn wrote(&mut self, change: &RoutingChange) {
        let Some(families) = self.families.as_mut() else {
            return;
        };
        match change {
            RoutingChange::AddRoute(r) | RoutingChange::ReplaceRoute { to: r, .. } => {
                families[slot(Family::of(&r.dst))].insert(
                    (r.dst, false),
                    ObservedRoute {
                        dst: r.dst,
                        oif: Some(r.oif),
                        gateway: r.gateway,
                        protocol: RTPROT_WEFT,
                        blackhole: false,
                        metric: 0,
                        mtu: r.mtu,
                    },
                );
            }
            RoutingChange::AddBlackhole(dst) => {
                families[slot(Family::of(dst))].insert(
                    (*dst, true),
                    ObservedRoute {
                        dst: *dst,
                        oif: None,
                        gateway: None,
                        protocol: RTPROT_WEFT,
                        blackhole: true,
                        metric: FAIL_CLOSED_METRIC,
                        mtu: None,
                    },
                );
            }
            RoutingChange::RemoveRoute(r) => {
                families[slot(Family::of(&r.dst))].remove(&(r.dst, r.blackhole));
            }
            RoutingChange::Link { .. }
            | RoutingChange::AddAddress { .. }
            | RoutingChange::RemoveAddress { .. } => {}
        }
    }
}

/// How long a deletion this agent announced waits for the kernel's report of it.
const OWN_DELETION_REPORTED: Duration = Duration::from_secs(5);

/// The routes this agent is deleting, shared with the deletion monitor: the kernel's
/// report of one of them is this agent's own work, not a reason to list every route again.
/// An announced deletion whose report never came is forgotten after a few seconds, so it
/// cannot hide a later deletion by someone else.
#[derive(Debug, Clone, Default)]
pub struct OwnDeletions(Arc<Mutex<HashMap<IpNet, Instant>>>);

impl OwnDeletions {
    /// This agent is about to delete its route to `dst`.
    pub(crate) fn announce(&self, dst: IpNet) {
        if let Ok(mut pending) = self.0.lock() {
            let now = Instant::now();
            pending.retain(|_, at| now.duration_since(*at) < OWN_DELETION_REPORTED);
            pending.insert(dst, now);
        }
    }

    /// Whether the reported deletion of weft's route to `dst` was this agent's own (it is
    /// taken off the list).
    pub(crate) fn reported(&self, dst: IpNet) -> bool {
        let Ok(mut pending) = self.0.lock() else {
            return false;
        };
        pending
            .remove(&dst)
            .is_some_and(|at| at.elapsed() < OWN_DELETION_REPORTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::RouteWrite;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn the_cache_follows_the_agents_writes_and_is_empty_once_forgotten() {
        let mut cache = RouteCache::default();
        let add = RoutingChange::AddRoute(RouteWrite {
            dst: net("10.244.2.0/24"),
            oif: 7,
            device: "flannel-wg".into(),
            gateway: None,
            onlink: false,
            mtu: Some(1380),
        });
        cache.wrote(&add);
        assert!(
            cache.get(Family::Ipv4).is_none(),
            "nothing listed: nothing known"
        );
        cache.listed(OurRoutes::new(), OurRoutes::new());
        cache.wrote(&add);
        cache.wrote(&RoutingChange::AddBlackhole(net("10.244.0.0/16")));
        let v4 = cache.get(Family::Ipv4).unwrap();
        assert_eq!(v4.len(), 2);
        let route = &v4[&(net("10.244.2.0/24"), false)];
        assert_eq!((route.oif, route.mtu), (Some(7), Some(1380)));
        let removed = route.clone();
        cache.wrote(&RoutingChange::RemoveRoute(removed));
        assert_eq!(cache.get(Family::Ipv4).unwrap().len(), 1);
        assert!(cache.get(Family::Ipv6).unwrap().is_empty());
        cache.forget();
        assert!(cache.get(Family::Ipv4).is_none());
    }

    #[test]
    fn an_announced_deletion_is_reported_once_as_the_agents_own() {
        let own = OwnDeletions::default();
        let dst = net("10.244.9.0/24");
        assert!(!own.reported(dst), "not announced: someone else's");
        own.announce(dst);
        assert!(own.reported(dst));
        assert!(!own.reported(dst), "a second report is someone else's");
    }
}
