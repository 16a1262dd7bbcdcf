//! The whole data plane of one node in one reconcile: WireGuard devices and peers, links,
//! addresses and routes, and the nftables rule set. Ordered to fail closed: the blackhole
//! routes go in before anything else, and routes into a device only after its peers are
//! configured.

use weft_crypto::PrivateKey;

use super::wireguard::devices::WgImpl;
use super::wireguard::process::UserspaceProcess;
use super::wireguard::seen::Seen;
use super::wireguard::WgDevices;
use super::xfrm::{Xfrm, XfrmSocket};
use super::{
    reconcile_nft, reconcile_routing_with, reconcile_vxlan, ApplyError, Nft, NftCli, RtNetlink,
    VxlanNetlink,
};
use crate::model::{DesiredState, PeerSpec};
use crate::netconf::Implementation;
use crate::plan::{PlanStamp, WG_DEVICE};

/// What a pass reads afresh rather than taking as last read.
#[derive(Clone, Copy)]
struct Reads {
    /// Every WireGuard device (otherwise: as last read, plus this agent's changes since).
    devices: bool,
    /// Every route (otherwise: weft's as last listed, plus this agent's writes since,
    /// unless the kernel reported a deletion: `RouteCache`).
    routes: bool,
    /// weft's nftables tables (otherwise: as last listed, unless the plan changed them).
    tables: bool,
}

impl Reads {
    const ALL: Reads = Reads {
        devices: true,
        routes: true,
        tables: true,
    };
    const DEVICES: Reads = Reads {
        devices: true,
        routes: true,
        tables: false,
    };
    const NONE: Reads = Reads {
        devices: false,
        routes: false,
        tables: false,
    };
}

/// What one reconcile did: one line per change, one per failure.
#[derive(Debug, Default)]
pub struct DataplaneReport {
    pub changes: Vec<String>,
    pub errors: Vec<String>,
    /// Milliseconds spent per part of the pass: routing, wireguard, vxlan, nftables.
    pub timings: Vec<(&'static str, f64)>,
    /// The WireGuard peers whose endpoint this pass set (added peers among them).
    pub endpoints_set: Vec<crate::model::DevicePeer>,
    /// ipsec: states installed once under this node's epoch and gone since; the agent
    /// must bump the epoch (`Dataplane::bump_esp_epoch`) and publish it.
    pub esp_lost: Vec<String>,
}

fn lap(report: &mut DataplaneReport, part: &'static str, since: &mut std::time::Instant) {
    report
        .timings
        .push((part, since.elapsed().as_secs_f64() * 1e3));
    *since = std::time::Instant::now();
}

/// Generic over its kernel interfaces: links, routes and vxlan entries (`N`), nftables
/// (`F`), WireGuard devices (`W`) and XFRM (`X`). A node runs the real ones (the defaults,
/// opened by `connect`); the reconcile tests run in-memory ones.
pub struct Dataplane<N = RtNetlink, F = NftCli, W = WgImpl, X = XfrmSocket> {
    pub(super) nl: N,
    pub(super) nft: F,
    /// The ipsec backend's XFRM socket and epoch book; `None` for the other backends.
    pub(super) ipsec: Option<super::dataplane_ipsec::IpsecPlane<X>>,
    /// The guard last found in place (`None`: not known to be in place).
    guard_seen: Option<Vec<crate::model::GuardSpec>>,
    /// `None` for the unencrypted backends: no WireGuard implementation is probed.
    pub(super) wg: Option<W>,
    /// Each device as last read, with this agent's changes since applied, and the plan it
    /// holds: see `Seen`.
    pub(super) wg_seen: Seen,
    /// The rule set last found in place; an incremental pass leaves nftables alone when
    /// the plan's is the same (the check on an nftables event and every full pass still look).
    nft_seen: Option<Vec<crate::model::MasqueradeTable>>,
    /// Devices read afresh by `observe` for the pass about to run: a full pass uses that
    /// read instead of reading them again.
    pub(super) fresh: std::collections::HashSet<String>,
    /// weft's routes as last listed, with this agent's writes since.
    pub(super) routes: super::RouteCache,
    /// The route deletions this agent makes, for the deletion monitor to tell from others'.
    own_deletions: super::OwnDeletions,
}

impl Dataplane {
    /// Opens the kernel connections and, for the wireguard backend (`wanted` is set),
    /// picks the WireGuard implementation (see `WgImpl::choose`); returns the data plane
    /// and why that implementation runs. `userspace` runs userspace devices should they be
    /// needed. Must run inside a tokio runtime.
    pub async fn connect(
        wanted: Option<Implementation>,
        userspace: UserspaceProcess,
    ) -> Result<(Self, String), ApplyError> {
        let mut nl = RtNetlink::connect()?;
        let (wg, why) = match wanted {
            Some(wanted) => {
                let (wg, why) = WgImpl::choose(wanted, &mut nl, WG_DEVICE, userspace).await?;
                (Some(wg), why)
            }
            None => (
                None,
                "no WireGuard: the backend does not encrypt".to_string(),
            ),
        };
        Ok((Dataplane::new(nl, NftCli::default(), wg), why))
    }

    /// Picks a WireGuard implementation now, if none was picked at start: for a node whose
    /// backend does not use WireGuard and takes it up during a backend change
    /// (`plan::mixed::to_take_up`). Returns why that one runs, or `None` if one already
    /// did.
    pub async fn take_up_wireguard(
        &mut self,
        wanted: Implementation,
    ) -> Result<Option<String>, ApplyError> {
        if self.wg.is_some() {
            return Ok(None);
        }
        let (wg, why) =
            WgImpl::choose(wanted, &mut self.nl, WG_DEVICE, UserspaceProcess::default()).await?;
        self.wg = Some(wg);
        Ok(Some(why))
    }

    /// A second, independent handle on this node's WireGuard devices (its own socket), for
    /// a task that must not wait for the control loop: the key-switch watcher. `None`
    /// without WireGuard.
    pub fn another_wg_handle(&self) -> Option<Result<WgImpl, ApplyError>> {
        self.wg.as_ref().map(WgImpl::another)
    }

    /// The external interface: the link holding `ip` (see `RtNetlink::underlay_of`).
    pub async fn underlay_of(
        &mut self,
        ip: std::net::IpAddr,
    ) -> Result<Option<super::Underlay>, ApplyError> {
        self.nl.underlay_of(ip).await
    }
}

impl<N: VxlanNetlink, F: Nft, W: WgDevices<Nl = N>, X: Xfrm> Dataplane<N, F, W, X> {
    /// A data plane over these kernel interfaces; `wg` is `None` for the unencrypted
    /// backends.
    #[cfg(test)]
    pub(crate) fn kernel(&mut self) -> (&mut N, &mut F, Option<&mut W>) {
        (&mut self.nl, &mut self.nft, self.wg.as_mut())
    }

    pub fn new(nl: N, nft: F, wg: Option<W>) -> Self {
        Dataplane {
            nl,
            nft,
            ipsec: None,
            guard_seen: None,
            wg,
            wg_seen: Default::default(),
            nft_seen: None,
            fresh: Default::default(),
            routes: Default::default(),
            own_deletions: Default::default(),
        }
    }

    /// The kernel reported a deletion: the next pass lists every route afresh.
    pub fn forget_routes(&mut self) {
        self.routes.forget();
    }

    /// The route deletions this data plane makes (for `monitor::deletions`, which then
    /// does not report them as someone else's).
    pub fn own_deletions(&self) -> super::OwnDeletions {
        self.own_deletions.clone()
    }

    /// `kernel`, `userspace`, or `none` for the unencrypted backends.
    pub fn implementation(&self) -> &'static str {
        self.wg.as_ref().map_or("none", W::name)
    }

    /// Writes made so far, all kinds together.
    pub fn writes(&self) -> u64 {
        self.nl.writes() + self.nft.writes() + self.wireguard_writes() + self.xfrm_writes()
    }

    /// Writes to WireGuard devices alone: for the kernel, generic netlink messages.
    pub fn wireguard_writes(&self) -> u64 {
        self.wg.as_ref().map_or(0, W::writes)
    }

    async fn routing(
        &mut self,
        state: &DesiredState,
        report: &mut DataplaneReport,
    ) -> Result<(), ApplyError> {
        let own = Some(&self.own_deletions);
        let routing = reconcile_routing_with(&mut self.nl, state, &mut self.routes, own).await?;
        report
            .changes
            .extend(routing.applied.iter().map(ToString::to_string));
        report
            .errors
            .extend(super::port_taken::routing_errors(state, &routing.failed));
        Ok(())
    }

    /// The periodic check: the nftables tables (with `tables`: the agent lists them when
    /// nf_tables reports a change, and at least once a minute) and, for ipsec, the states
    /// and policies with their counters, which needs the key.
    pub async fn reconcile_nft(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        tables: bool,
    ) -> Result<DataplaneReport, ApplyError> {
        let mut report = DataplaneReport::default();
        if tables {
            self.nft.new_round();
            let nft = reconcile_nft(&mut self.nft, &state.masquerade).await?;
            report.changes = nft.applied;
            report.errors = nft.failed.iter().map(ToString::to_string).collect();
            // The guard is looked at only where it belongs (or was last found): other
            // backends' nodes pay no `nft list` for it.
            let guarded = !state.guard.is_empty();
            let _ = self.guard(state, guarded, &mut report).await;
        }
        if state.ipsec.is_some() {
            self.ipsec_pass(state, key, false, &mut report).await;
        }
        Ok(report)
    }

    /// Brings the node's data plane in line with `state`, reading everything from the
    /// kernel and the devices. Reads that fail abort the pass (the next one retries); a
    /// failed write is reported and the rest goes ahead. `stamp` says which plan `state`
    /// is (`PlanStamp::default()`: a plan of no planner's).
    pub async fn reconcile(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        stamp: &PlanStamp<'_>,
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, Reads::ALL, stamp).await
    }

    /// As `reconcile`, but the nftables tables are taken as last listed unless the plan
    /// changed them: for a full pass while nf_tables' events say nothing changed since the
    /// tables were last listed. Listing them costs an `nft` run for the tables there are and
    /// one for each of weft's among them, seconds on a starved CPU, and the control loop
    /// waits for them.
    pub async fn reconcile_trusting_tables(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        stamp: &PlanStamp<'_>,
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, Reads::DEVICES, stamp).await
    }

    /// As `reconcile`, for a pass woken by a registry change or a deletion: WireGuard
    /// devices are diffed against their state as last read plus this agent's own changes
    /// since (a deleted device is recreated and read afresh), and so are weft's routes
    /// (unless `forget_routes` was called: the kernel reported a deletion; a device found
    /// down, made or removed lists them too), an unchanged rule set is not re-read, and
    /// stale vxlan devices are not looked for. Links, addresses and the vxlan entries are
    /// read as always. A device that holds the plan `state` was patched from is compared
    /// on the re-planned nodes' peers alone.
    pub async fn reconcile_incremental(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        stamp: &PlanStamp<'_>,
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, Reads::NONE, stamp).await
    }

    async fn pass(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        reads: Reads,
        stamp: &PlanStamp<'_>,
    ) -> Result<DataplaneReport, ApplyError> {
        let full = reads.devices;
        let mut report = DataplaneReport::default();
        self.nft.new_round();
        let mut t = std::time::Instant::now();
        // Before any route: a pass whose guard is not in place installs none (fail closed).
        // A plan without a guard (an unencrypted backend) only removes stale guard tables,
        // after everything else.
        let guarded = !state.guard.is_empty();
        if guarded && !self.guard(state, reads.tables, &mut report).await {
            return Ok(report);
        }
        if reads.routes {
            self.routes.forget();
        }
        // ESP states and policies before the routes: a pair moving onto ipsec (a backend
        // change) is carried from the moment its route moves into the XFRM interface,
        // which is made here if it is missing, before any route into it.
        if self.ipsec_pass(state, key, full, &mut report).await {
            // A device made this pass: the routes that died with an old one are listed.
            self.routes.forget();
        }
        lap(&mut report, "ipsec", &mut t);
        self.routing(state, &mut report).await?;
        lap(&mut report, "routing", &mut t);
        let mut started = false;
        let mut added: Vec<PeerSpec> = Vec::new();
        for (index, tunnel) in state.tunnels.iter().enumerate() {
            let planned = (stamp, index);
            let (created, new_peers) = self.tunnel(tunnel, planned, key, full, &mut report).await?;
            started |= created;
            added.extend(new_peers);
        }
        self.remove_unplanned_devices(state, &mut report).await?;
        lap(&mut report, "wireguard", &mut t);
        match reconcile_vxlan(&mut self.nl, &state.vxlan, full, &mut report.changes).await {
            Ok(created) => started |= created,
            Err(e) => report.errors.push(e.to_string()),
        }
        let ipip = state.ipip.as_ref();
        match super::ipip::reconcile_ipip(&mut self.nl, ipip, full, &mut report.changes).await {
            Ok(created) => started |= created,
            Err(e) => report.errors.push(e.to_string()),
        }
        if started {
            // A device made this pass has new routes only the kernel knows of.
            self.routes.forget();
            self.routing(state, &mut report).await?;
        }
        lap(&mut report, "vxlan", &mut t);
        if let Some(wg) = self.wg.as_mut() {
            report.errors.extend(wg.start_handshakes(&added));
        }
        if !guarded {
            self.guard(state, reads.tables, &mut report).await;
        }
        if !reads.tables && self.nft_seen.as_ref() == Some(&state.masquerade) {
            return Ok(report);
        }
        let nft = reconcile_nft(&mut self.nft, &state.masquerade).await?;
        lap(&mut report, "nftables", &mut t);
        self.nft_seen = nft.failed.is_empty().then(|| state.masquerade.clone());
        report.changes.extend(nft.applied);
        report
            .errors
            .extend(nft.failed.iter().map(ToString::to_string));
        Ok(report)
    }

    /// The guard tables (`apply::guard`): listed when `list` says so and whenever the
    /// plan's guard changes. Returns whether the planned guard is in place.
    async fn guard(
        &mut self,
        state: &DesiredState,
        list: bool,
        report: &mut DataplaneReport,
    ) -> bool {
        if !list && self.guard_seen.as_ref() == Some(&state.guard) {
            return true;
        }
        match super::guard::reconcile_guard(&mut self.nft, &state.guard, list).await {
            Ok(changes) => {
                report.changes.extend(changes);
                self.guard_seen = Some(state.guard.clone());
                true
            }
            Err(e) => {
                report.errors.push(format!(
                    "the guard against forged clear packets is not in place, so no route is installed: {e}"
                ));
                self.guard_seen = None;
                state.guard.is_empty()
            }
        }
    }
}
