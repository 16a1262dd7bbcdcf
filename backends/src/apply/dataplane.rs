//! The whole data plane of one node in one reconcile: WireGuard devices and peers, links,
//! addresses and routes, and the nftables rule set. Ordered to fail closed: the blackhole
//! routes go in before anything else, and routes into a device only after its peers are
//! configured.

use weft_crypto::PrivateKey;

use super::wireguard::devices::WgImpl;
use super::wireguard::diff::apply_to;
use super::wireguard::pass::{applied, device_change};
use super::wireguard::process::UserspaceProcess;
use super::wireguard::WgDevices;
use super::xfrm::{Xfrm, XfrmSocket};
use super::{
    reconcile_nft, reconcile_routing_with, reconcile_vxlan, ApplyError, Nft, NftCli, RtNetlink,
    VxlanNetlink,
};
use crate::model::{DesiredState, PeerObserved, PeerSpec, TunnelSpec};
use crate::netconf::Implementation;
use crate::plan::{WG_DEVICE, WG_DEVICE_V6};

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
    wg: Option<W>,
    /// Each device as last read, with this agent's changes since applied: an incremental
    /// pass diffs against it instead of dumping thousands of peers again.
    wg_seen: std::collections::HashMap<String, super::wireguard::WgDevice>,
    /// The rule set last found in place; an incremental pass leaves nftables alone when
    /// the plan's is the same (the check on an nftables event and every full pass still look).
    nft_seen: Option<Vec<crate::model::MasqueradeTable>>,
    /// Devices read afresh by `observe` for the pass about to run: a full pass uses that
    /// read instead of reading them again.
    fresh: std::collections::HashSet<String>,
    /// weft's routes as last listed, with this agent's writes since.
    routes: super::RouteCache,
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

    /// The peers of this node's WireGuard devices, for the plan (`Observed`: endpoint and
    /// last handshake; the agent adds its memory): read afresh when `full` (the full pass
    /// that follows uses this read), else as last read plus this agent's changes since. A
    /// device that does not exist has no peers.
    pub async fn observe(
        &mut self,
        full: bool,
    ) -> Result<std::collections::BTreeMap<crate::model::DevicePeer, PeerObserved>, ApplyError>
    {
        self.fresh.clear();
        let mut peers = std::collections::BTreeMap::new();
        let Some(wg) = self.wg.as_mut() else {
            return Ok(peers);
        };
        for name in [WG_DEVICE, WG_DEVICE_V6] {
            if full {
                if self.nl.link(name).await?.is_none() {
                    self.wg_seen.remove(name);
                    continue;
                }
                let device = wg.get(name).await?;
                self.wg_seen.insert(name.to_string(), device);
                self.fresh.insert(name.to_string());
            }
            if let Some(device) = self.wg_seen.get(name) {
                peers.extend(device.peers.iter().map(|(k, p)| {
                    let seen = PeerObserved {
                        endpoint: p.endpoint,
                        last_handshake: p.last_handshake,
                        planned_before: None,
                        endpoint_set: None,
                    };
                    ((name.to_string(), *k), seen)
                }));
            }
        }
        Ok(peers)
    }

    /// Every peer of this node's WireGuard devices as last read (the latest full pass or
    /// `observe(true)`), with this agent's changes since: for statistics that must not
    /// cost a device read each time they are asked for.
    pub fn last_read_peers(
        &self,
    ) -> impl Iterator<Item = (&weft_crypto::PublicKey, &super::wireguard::WgPeer)> {
        self.wg_seen.values().flat_map(|d| d.peers.iter())
    }

    /// WireGuard device `name` as `observe` read it afresh for the pass about to run (none
    /// for an incremental pass, or a device that is not there).
    pub fn fresh_device(&self, name: &str) -> Option<&super::wireguard::WgDevice> {
        self.fresh
            .contains(name)
            .then(|| self.wg_seen.get(name))
            .flatten()
    }

    /// Removes WireGuard device `name` (a userspace device's process with it), for the next
    /// pass to make again: the liveness watcher found it at fault. The blackhole routes stay,
    /// so pod traffic is dropped, never sent in clear, until the device is back. False if
    /// there was no such device.
    pub async fn remove_wg_device(&mut self, name: &str) -> Result<bool, ApplyError> {
        if self.wg.is_none() {
            return Ok(false);
        }
        let Some(link) = self.nl.link(name).await? else {
            return Ok(false);
        };
        W::remove(&mut self.nl, &link).await?;
        self.wg_seen.remove(name);
        self.routes.forget();
        Ok(true)
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
    /// failed write is reported and the rest goes ahead.
    pub async fn reconcile(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, Reads::ALL).await
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
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, Reads::DEVICES).await
    }

    /// As `reconcile`, for a pass woken by a registry change or a deletion: WireGuard
    /// devices are diffed against their state as last read plus this agent's own changes
    /// since (a deleted device is recreated and read afresh), and so are weft's routes
    /// (unless `forget_routes` was called: the kernel reported a deletion; a device found
    /// down, made or removed lists them too), an unchanged rule set is not re-read, and
    /// stale vxlan devices are not looked for. Links, addresses and the vxlan entries are
    /// read as always.
    pub async fn reconcile_incremental(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, Reads::NONE).await
    }

    async fn pass(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        reads: Reads,
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
        self.routing(state, &mut report).await?;
        lap(&mut report, "routing", &mut t);
        let mut started = false;
        let mut added: Vec<PeerSpec> = Vec::new();
        for tunnel in &state.tunnels {
            let (created, new_peers) = self.tunnel(tunnel, key, full, &mut report).await?;
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
        started |= self.ipsec_pass(state, key, full, &mut report).await;
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

    /// One WireGuard device brought in line with its spec. Returns whether the device was
    /// created, and the peers that should get a handshake started at once.
    async fn tunnel(
        &mut self,
        t: &TunnelSpec,
        key: &PrivateKey,
        full: bool,
        report: &mut DataplaneReport,
    ) -> Result<(bool, Vec<PeerSpec>), ApplyError> {
        let Some(wg) = self.wg.as_mut() else {
            report.errors.push(format!(
                "{}: planned, but this agent runs no WireGuard implementation",
                t.device
            ));
            return Ok((false, Vec::new()));
        };
        let created = wg.ensure(&mut self.nl, &t.device).await?;
        if created {
            report.changes.push(format!(
                "created {} WireGuard device {}",
                wg.name(),
                t.device
            ));
        }
        // Taken out, not copied (thousands of peers), and put back below; an error in
        // between leaves it out, so the next pass reads the device.
        let observed = match self.wg_seen.remove(&t.device) {
            Some(seen) if (!full || self.fresh.contains(&t.device)) && !created => seen,
            _ => wg.get(&t.device).await?,
        };
        let change = device_change(t, key, &observed, report);
        if change.is_empty() {
            self.wg_seen.insert(t.device.clone(), observed);
            return Ok((created, Vec::new()));
        }
        match wg.apply(&t.device, &change, key).await {
            Ok(()) => {
                let mut now = observed;
                apply_to(&mut now, &change, &key.public_key());
                self.wg_seen.insert(t.device.clone(), now);
                Ok((created, applied(t, &change, report)))
            }
            Err(e) => {
                // What the device holds now is unknown: the next pass reads it.
                self.wg_seen.remove(&t.device);
                report.errors.push(
                    if change.listen_port.is_some() && super::port_taken::in_use(&e) {
                        super::port_taken::message(&t.device, t.listen_port, "ListenPort")
                    } else {
                        e.to_string()
                    },
                );
                Ok((created, Vec::new()))
            }
        }
    }

    /// WireGuard devices weft owns that the plan no longer has (a backend or mode change).
    async fn remove_unplanned_devices(
        &mut self,
        state: &DesiredState,
        report: &mut DataplaneReport,
    ) -> Result<(), ApplyError> {
        for name in [WG_DEVICE, WG_DEVICE_V6] {
            if state.tunnels.iter().any(|t| t.device == name) {
                continue;
            }
            self.wg_seen.remove(name);
            if let Some(link) = self.nl.link(name).await? {
                // Its routes go with it.
                self.routes.forget();
                match W::remove(&mut self.nl, &link).await {
                    Ok(()) => report
                        .changes
                        .push(format!("removed WireGuard device {name}: not in the plan")),
                    Err(e) => report.errors.push(e.to_string()),
                }
            }
        }
        Ok(())
    }
}
