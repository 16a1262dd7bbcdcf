//! The planner across passes. `plan()` is a pure function of everything it reads, and at
//! 10,000 nodes one run of it costs tens of milliseconds: re-run for every registry event,
//! each event costs what the whole cluster costs. `Planner` keeps the last plan with what
//! it was made from. When a pass finds that only some nodes changed (their leases, or what
//! the device reports of their peers) and nothing else the plan reads, it re-plans those
//! nodes alone and carries the rest of the plan over. Anything else is planned in full:
//! the first pass, another config or own lease, measured paths or post-quantum PSKs that
//! changed, a backend other than wireguard, a rotating node among the changed ones, a
//! changed node contending for a subnet or a key, or a moment the plan turns on having
//! come (a lease expiring, a peer's key switching by the clock, a session going stale).
//! Either way the result is the full plan's: `incremental_tests` checks it after random
//! sequences of changes.

mod claims;
mod patch;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

pub(crate) use claims::Claims;
use claims::{KeyIndex, SubnetIndex};
use weft_crypto::PublicKey;

use super::roaming::SESSION_FRESH;
use super::{PlanError, PlanInput, PlanOptions};
use crate::model::{
    ClusterView, DesiredState, DevicePeer, Lease, Observed, PairSecret, PeerObserved,
};
use crate::netconf::NetConf;

/// More changed nodes than this in one pass are planned in full (patching each costs a
/// few searches and moves; past this, one full plan costs less).
const MOST_PATCHED: usize = 64;

/// How a pass was planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanKind {
    /// In full, and why.
    Full(&'static str),
    /// Only this many changed nodes re-planned; the rest carried over.
    Patched(usize),
}

/// A node a patched pass re-planned, with its tunnel peers (the tunnel's index in the
/// plan, the peer's key) before and after: what the pass changed in the plan's peers, for
/// the reports that would otherwise compare every peer of two plans. A patched plan has
/// the tunnels of the one before, in the same order, so an index names one device in both.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PatchedNode {
    pub node: String,
    pub before: Vec<(usize, PublicKey)>,
    pub after: Vec<(usize, PublicKey)>,
}

/// Which plan a pass applies, for a consumer that keeps what it applied last: the plan's
/// generation (its number among one planner's plans; `None` for a plan made elsewhere)
/// and, for a plan patched from the one before it, that one's generation and the nodes
/// re-planned. Every peer of a patched plan outside those nodes is as in the plan before.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlanStamp<'a> {
    pub generation: Option<u64>,
    pub patched: Option<(u64, &'a [PatchedNode])>,
}

/// Plans one node across passes. See the module doc.
#[derive(Default)]
pub struct Planner {
    memo: Option<Memo>,
    /// The nodes the last pass re-planned, if it was patched.
    patched: Vec<PatchedNode>,
    /// Plans made so far: the last one's generation.
    generation: u64,
    /// Whether the last plan was patched (from generation `generation - 1`).
    was_patched: bool,
}

/// The last plan and what it was made from.
struct Memo {
    view: Arc<ClusterView>,
    local: Lease,
    config: NetConf,
    options: PlanOptions,
    observed: Observed,
    path_mtus: BTreeMap<IpAddr, u32>,
    pair_psks: BTreeMap<PublicKey, PairSecret>,
    planned_at: SystemTime,
    /// The first moment from which the clock alone may change the plan.
    horizon: Option<SystemTime>,
    state: Arc<DesiredState>,
    /// Every candidate's subnets, per family (IPv4, IPv6).
    subnets: [SubnetIndex; 2],
    /// Every entry's key, per tunnel device (the plan's order).
    keys: Vec<KeyIndex>,
}

impl Planner {
    /// The plan for `input`, whose view is `view`; and how it was made. `full` plans in
    /// full whatever changed (the periodic resync: it re-plans everything, so a change the
    /// events missed is still planned).
    pub fn plan(
        &mut self,
        input: &PlanInput<'_>,
        view: &Arc<ClusterView>,
        full: bool,
    ) -> Result<(Arc<DesiredState>, PlanKind), PlanError> {
        debug_assert!(std::ptr::eq(input.view, &**view));
        let why = match self.memo.as_mut() {
            None => "first pass",
            Some(_) if full => "resync",
            Some(memo) => match patch::patch(memo, input, view) {
                Ok(nodes) => {
                    let kind = PlanKind::Patched(nodes.len());
                    self.patched = nodes;
                    self.generation += 1;
                    self.was_patched = true;
                    return Ok((memo.state.clone(), kind));
                }
                Err(why) => why,
            },
        };
        self.memo = None;
        self.patched.clear();
        self.was_patched = false;
        let mut claims = Claims::default();
        let state = Arc::new(super::plan_noting(input, Some(&mut claims))?);
        self.memo = Some(Memo::of(input, view, state.clone(), claims));
        self.generation += 1;
        Ok((state, PlanKind::Full(why)))
    }

    /// The last plan's stamp (see `PlanStamp`).
    pub fn stamp(&self) -> PlanStamp<'_> {
        PlanStamp {
            generation: Some(self.generation),
            patched: self
                .was_patched
                .then(|| (self.generation - 1, self.patched.as_slice())),
        }
    }

    /// The nodes the last `plan` re-planned when it was `Patched` (each changed node, in
    /// name order, with its tunnel peers before and after; every other peer is as it
    /// was); empty after a full plan.
    pub fn patched(&self) -> &[PatchedNode] {
        &self.patched
    }
}

impl Memo {
    fn of(
        input: &PlanInput<'_>,
        view: &Arc<ClusterView>,
        state: Arc<DesiredState>,
        claims: Claims,
    ) -> Memo {
        let mut subnets: [SubnetIndex; 2] = Default::default();
        for (node, v4, v6) in &claims.subnets {
            for (family, net) in [(0, v4), (1, v6)] {
                if let Some(net) = net {
                    subnets[family].insert(node, *net);
                }
            }
        }
        let keys = claims
            .keys
            .iter()
            .map(|entries| {
                let mut index = KeyIndex::default();
                for (key, node) in entries {
                    index.insert(*key, node);
                }
                index
            })
            .collect();
        let mut memo = Memo {
            view: view.clone(),
            local: input.local.clone(),
            config: input.config.clone(),
            options: input.options.clone(),
            observed: input.observed.clone(),
            path_mtus: input.path_mtus.clone(),
            pair_psks: input.pair_psks.clone(),
            planned_at: input.now,
            horizon: state.next_switch,
            state,
            subnets,
            keys,
        };
        for lease in input.view.leases.values() {
            memo.expires_at(lease, input.now);
        }
        for have in input.observed.peers.values() {
            memo.roams_until(have, input.now);
        }
        memo
    }

    fn soonest(&mut self, moment: SystemTime, now: SystemTime) {
        if moment > now {
            self.horizon = Some(self.horizon.map_or(moment, |h| h.min(moment)));
        }
    }

    /// A lease leaves the plan when it expires.
    fn expires_at(&mut self, lease: &Lease, now: SystemTime) {
        if let Some(t) = lease.expires {
            self.soonest(t, now);
        }
    }

    /// Whether a peer keeps its roamed endpoint turns on its session's age and on when
    /// its endpoint was set (`roaming::keeps_roamed`).
    fn roams_until(&mut self, have: &PeerObserved, now: SystemTime) {
        if let Some(t) = have.last_handshake.filter(|t| !t.is_zero()) {
            self.soonest(SystemTime::UNIX_EPOCH + t + SESSION_FRESH, now);
        }
        if let Some(t) = have.endpoint_set {
            self.soonest(t + SESSION_FRESH, now);
        }
    }

    /// Why the last plan cannot be carried over to `input` at all, if it cannot: what it
    /// read besides the leases and the device's peers changed, or a moment came.
    fn stale(&self, input: &PlanInput<'_>) -> Option<&'static str> {
        use crate::netconf::Backend;
        let stale = [
            (
                !matches!(input.config.backend, Backend::Wireguard(_)),
                "backend",
            ),
            (self.config != *input.config, "config"),
            // A cluster changing backend: each pair's backend turns on both ends' leases.
            (super::mixed::involved(input), "backends mixed"),
            (self.local != *input.local, "own lease"),
            (self.options != *input.options, "options"),
            (self.path_mtus != *input.path_mtus, "path MTUs"),
            (self.pair_psks != *input.pair_psks, "pair PSKs"),
            (
                self.observed.next_keys_in_use != input.observed.next_keys_in_use
                    || self.observed.next_keys_seen != input.observed.next_keys_seen
                    || self.observed.esp_heard != input.observed.esp_heard,
                "announced keys seen",
            ),
            (self.observed.paths != input.observed.paths, "pair paths"),
            (input.now < self.planned_at, "clock went back"),
            (
                self.horizon.is_some_and(|h| input.now >= h),
                "a moment came",
            ),
        ];
        stale.into_iter().find(|(is, _)| *is).map(|(_, why)| why)
    }

    /// The nodes whose entries may differ from the last plan: leases changed, or what the
    /// device reports of their peers (with the reports that changed).
    fn changed_nodes(
        &self,
        input: &PlanInput<'_>,
        view: &ClusterView,
        devices: &[&str],
    ) -> (BTreeSet<String>, Vec<DevicePeer>) {
        let mut nodes: BTreeSet<String> = self
            .view
            .diff(view)
            .into_iter()
            .map(|c| match c {
                crate::model::ViewChange::Added(n)
                | crate::model::ViewChange::Changed(n)
                | crate::model::ViewChange::Removed(n) => n,
            })
            .collect();
        let reports = changed_reports(&self.observed.peers, &input.observed.peers);
        for (device, key) in &reports {
            if let Some(d) = devices.iter().position(|name| *name == device.as_str()) {
                if let Some(index) = self.keys.get(d) {
                    nodes.extend(index.claimants(key).iter().cloned());
                }
            }
        }
        (nodes, reports)
    }
}

/// The device peers whose reports differ between `old` and `new` (added, changed or
/// gone): one merge of the two sorted maps.
fn changed_reports(
    old: &BTreeMap<DevicePeer, PeerObserved>,
    new: &BTreeMap<DevicePeer, PeerObserved>,
) -> Vec<DevicePeer> {
    use crate::model::sorted::{walk, Side};
    let mut changed = Vec::new();
    walk(old, new, |side| match side {
        Side::Gone(key, _) | Side::New(key, _) => changed.push(*key),
        Side::Both(key, was, is) => {
            if was != is {
                changed.push(*key);
            }
        }
    });
    changed
}
