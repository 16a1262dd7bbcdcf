//! The whole data plane of one node in one reconcile: WireGuard devices and peers, links,
//! addresses and routes, and the nftables rule set. Ordered to fail closed: the blackhole
//! routes go in before anything else, and routes into a device only after its peers are
//! configured.

use weft_crypto::PrivateKey;

use super::wireguard::devices::WgImpl;
use super::wireguard::diff::{apply_to, diff_device, DeviceChange, PeerChange};
use super::wireguard::process::{remove_device, UserspaceProcess};
use super::wireguard::{WgDevice, WgDevices};
use super::{
    reconcile_nft, reconcile_routing, reconcile_vxlan, ApplyError, Netlink, Nft, NftCli, RtNetlink,
};
use crate::model::{DesiredState, PeerSpec, TunnelSpec};
use crate::netconf::Implementation;
use crate::plan::{WG_DEVICE, WG_DEVICE_V6};

/// What one reconcile did: one line per change, one per failure.
#[derive(Debug, Default)]
pub struct DataplaneReport {
    pub changes: Vec<String>,
    pub errors: Vec<String>,
    /// Milliseconds spent per part of the pass: routing, wireguard, vxlan, nftables.
    pub timings: Vec<(&'static str, f64)>,
    /// The WireGuard peers whose endpoint this pass set (added peers among them).
    pub endpoints_set: Vec<weft_crypto::PublicKey>,
}

fn lap(report: &mut DataplaneReport, part: &'static str, since: &mut std::time::Instant) {
    report
        .timings
        .push((part, since.elapsed().as_secs_f64() * 1e3));
    *since = std::time::Instant::now();
}

pub struct Dataplane {
    nl: RtNetlink,
    nft: NftCli,
    /// `None` for the unencrypted backends: no WireGuard implementation is probed.
    wg: Option<WgImpl>,
    /// Each device as last read, with this agent's changes since applied: an incremental
    /// pass diffs against it instead of dumping thousands of peers again.
    wg_seen: std::collections::HashMap<String, super::wireguard::WgDevice>,
    /// The rule set last found in place; an incremental pass leaves nftables alone when
    /// the plan's is the same (the 2 s check and every full pass still look).
    nft_seen: Option<Vec<crate::model::MasqueradeTable>>,
    /// Devices read afresh by `observe` for the pass about to run: a full pass uses that
    /// read instead of reading them again.
    fresh: std::collections::HashSet<String>,
}

/// A peer just added to a device gets one empty datagram into the tunnel, to its device
/// address (its subnet's network address), so the device handshakes now. This matters
/// after a device (re)starts: its peers still hold sessions with the device that is gone,
/// keep encrypting with keys nobody has, and would wait for WireGuard's rekey timers (15 s
/// or more) before handshaking again. Every peer of a fresh device is an added peer. Runs
/// after the routing pass, so the peer's route exists.
fn prime_handshakes(added: &[PeerSpec], report: &mut DataplaneReport) {
    if added.is_empty() {
        return;
    }
    let Ok(v4) = std::net::UdpSocket::bind("0.0.0.0:0") else {
        return;
    };
    let v6 = std::net::UdpSocket::bind("[::]:0").ok();
    for peer in added {
        for net in &peer.allowed_ips {
            let target = std::net::SocketAddr::new(net.network(), DISCARD_PORT);
            let sent = match target {
                std::net::SocketAddr::V4(_) => v4.send_to(&[], target),
                std::net::SocketAddr::V6(_) => {
                    v6.as_ref().map_or(Ok(0), |s| s.send_to(&[], target))
                }
            };
            if let Err(e) = sent {
                report.errors.push(format!(
                    "priming a handshake with {} via {target}: {e}",
                    peer.node
                ));
            }
        }
    }
}

/// The discard port: the datagram only exists to start a handshake.
const DISCARD_PORT: u16 = 9;

/// What device `t` needs, against `observed`; notes in `report` the peers whose endpoint
/// it sets.
fn device_change(
    t: &TunnelSpec,
    key: &PrivateKey,
    observed: &WgDevice,
    report: &mut DataplaneReport,
) -> DeviceChange {
    let mut change = diff_device(t, &key.public_key(), observed);
    for c in &change.peers {
        match c {
            PeerChange::Add(p) => report.endpoints_set.push(p.public_key),
            PeerChange::Update { spec, fields } if fields.endpoint.is_some() => {
                report.endpoints_set.push(spec.public_key)
            }
            _ => {}
        }
    }
    if change.set_private_key && !observed.peers.is_empty() {
        // A new key ends every session: the peers are re-added with it, so each starts a
        // fresh handshake instead of carrying state made for the old key.
        change.peers = observed
            .peers
            .keys()
            .map(|k| PeerChange::Remove { key: *k })
            .chain(t.peers.iter().cloned().map(PeerChange::Add))
            .collect();
    }
    change
}

/// Reports an applied `change` to device `t`; returns the peers that get a handshake
/// started at once: added peers, peers whose AllowedIPs or PSK changed (a rotated peer's
/// key taking over: a userspace device re-adds such a peer, losing its session), and after
/// a new private key every peer (it ends every session).
fn applied(t: &TunnelSpec, change: &DeviceChange, report: &mut DataplaneReport) -> Vec<PeerSpec> {
    if change.set_private_key {
        report
            .changes
            .push(format!("{}: private key set", t.device));
    }
    if let Some(port) = change.listen_port {
        report
            .changes
            .push(format!("{}: listen port {port}", t.device));
    }
    report
        .changes
        .extend(change.peers.iter().map(|p| format!("{}: {p}", t.device)));
    let mut handshake: Vec<PeerSpec> = change
        .peers
        .iter()
        .filter_map(|c| match c {
            PeerChange::Add(p) => Some(p.clone()),
            PeerChange::Update { spec, fields }
                if fields.allowed_ips.is_some() || fields.psk.is_some() =>
            {
                Some(spec.clone())
            }
            _ => None,
        })
        .collect();
    if change.set_private_key {
        handshake.extend(
            t.peers
                .iter()
                .filter(|p| !p.allowed_ips.is_empty())
                .cloned(),
        );
    }
    handshake
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
        let dataplane = Dataplane {
            nl,
            nft: NftCli::default(),
            wg,
            wg_seen: Default::default(),
            nft_seen: None,
            fresh: Default::default(),
        };
        Ok((dataplane, why))
    }

    /// The last handshake of every peer on WireGuard device `device` (read now), for the
    /// key-rotation switch: a peer's announced key that has handshaken is in use.
    pub async fn handshakes(
        &mut self,
        device: &str,
    ) -> Result<std::collections::HashMap<weft_crypto::PublicKey, std::time::Duration>, ApplyError>
    {
        let Some(wg) = self.wg.as_mut() else {
            return Ok(Default::default());
        };
        let observed = wg.get(device).await?;
        Ok(observed
            .peers
            .into_iter()
            .filter_map(|(k, p)| Some((k, p.last_handshake.filter(|t| !t.is_zero())?)))
            .collect())
    }

    /// The peers of this node's WireGuard devices, for the plan (`Observed`): read afresh
    /// when `full` (the full pass that follows uses this read), else as last read plus
    /// this agent's changes since. A device that does not exist has no peers.
    pub async fn observe(
        &mut self,
        full: bool,
    ) -> Result<
        std::collections::BTreeMap<weft_crypto::PublicKey, super::wireguard::WgPeer>,
        ApplyError,
    > {
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
                peers.extend(device.peers.iter().map(|(k, p)| (*k, p.clone())));
            }
        }
        Ok(peers)
    }

    /// The external interface: the link holding `ip` (see `RtNetlink::underlay_of`).
    pub async fn underlay_of(
        &mut self,
        ip: std::net::IpAddr,
    ) -> Result<Option<super::Underlay>, ApplyError> {
        self.nl.underlay_of(ip).await
    }

    /// `kernel`, `userspace`, or `none` for the unencrypted backends.
    pub fn implementation(&self) -> &'static str {
        self.wg.as_ref().map_or("none", WgImpl::name)
    }

    /// Writes made so far, all kinds together.
    pub fn writes(&self) -> u64 {
        self.nl.writes() + self.nft.writes() + self.wireguard_writes()
    }

    /// Writes to WireGuard devices alone: for the kernel, generic netlink messages.
    pub fn wireguard_writes(&self) -> u64 {
        self.wg.as_ref().map_or(0, WgImpl::writes)
    }

    async fn routing(
        &mut self,
        state: &DesiredState,
        report: &mut DataplaneReport,
    ) -> Result<(), ApplyError> {
        let routing = reconcile_routing(&mut self.nl, state).await?;
        report
            .changes
            .extend(routing.applied.iter().map(ToString::to_string));
        report
            .errors
            .extend(routing.failed.iter().map(|(c, e)| format!("{c}: {e}")));
        Ok(())
    }

    /// Only the nftables part (a cheap, frequent check: table deletions raise no netlink
    /// event).
    pub async fn reconcile_nft(
        &mut self,
        state: &DesiredState,
    ) -> Result<DataplaneReport, ApplyError> {
        let nft = reconcile_nft(&mut self.nft, &state.masquerade).await?;
        Ok(DataplaneReport {
            changes: nft.applied,
            errors: nft.failed.iter().map(ToString::to_string).collect(),
            ..DataplaneReport::default()
        })
    }

    /// Brings the node's data plane in line with `state`, reading everything from the
    /// kernel and the devices. Reads that fail abort the pass (the next one retries); a
    /// failed write is reported and the rest goes ahead.
    pub async fn reconcile(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, true).await
    }

    /// As `reconcile`, for a pass woken by a registry change or a deletion: WireGuard
    /// devices are diffed against their state as last read plus this agent's own changes
    /// since (a deleted device is recreated and read afresh), an unchanged rule set is not
    /// re-read, and stale vxlan devices are not looked for. Links, addresses, routes and
    /// the vxlan entries are read as always.
    pub async fn reconcile_incremental(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
    ) -> Result<DataplaneReport, ApplyError> {
        self.pass(state, key, false).await
    }

    async fn pass(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        full: bool,
    ) -> Result<DataplaneReport, ApplyError> {
        let mut report = DataplaneReport::default();
        let mut t = std::time::Instant::now();
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
        match reconcile_vxlan(
            &mut self.nl,
            state.vxlan.as_ref(),
            full,
            &mut report.changes,
        )
        .await
        {
            Ok(created) => started |= created,
            Err(e) => report.errors.push(e.to_string()),
        }
        if started {
            self.routing(state, &mut report).await?;
        }
        lap(&mut report, "vxlan", &mut t);
        prime_handshakes(&added, &mut report);
        if !full && self.nft_seen.as_ref() == Some(&state.masquerade) {
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
        let observed = match self.wg_seen.get(&t.device) {
            Some(seen) if (!full || self.fresh.contains(&t.device)) && !created => seen.clone(),
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
                report.errors.push(e.to_string());
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
                match remove_device(&mut self.nl, &link).await {
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
