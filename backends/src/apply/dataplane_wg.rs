//! The WireGuard part of a data plane pass: what the devices hold for the plan
//! (`observe`), each planned device brought in line with its spec, and devices the plan
//! no longer has removed.

use super::dataplane::{Dataplane, DataplaneReport};
use super::netlink::VxlanNetlink;
use super::nft::Nft;
use super::wireguard::diff::apply_to;
use super::wireguard::pass::{applied, device_change};
use super::wireguard::seen::changed_peers;
use super::wireguard::WgDevices;
use super::xfrm::Xfrm;
use super::ApplyError;
use crate::model::{DesiredState, PeerObserved, PeerSpec, TunnelSpec};
use crate::plan::{PlanStamp, WG_DEVICE, WG_DEVICE_V6};
use weft_crypto::PrivateKey;

impl<N: VxlanNetlink, F: Nft, W: WgDevices<Nl = N>, X: Xfrm> Dataplane<N, F, W, X> {
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
        let Some(wg) = self.wg.as_mut() else {
            return Ok(Default::default());
        };
        for name in [WG_DEVICE, WG_DEVICE_V6] {
            if full {
                if self.nl.link(name).await?.is_none() {
                    self.wg_seen.forget(name);
                    continue;
                }
                let device = wg.get(name).await?;
                self.wg_seen.read(name, device);
                self.fresh.insert(name.to_string());
            }
        }
        // Collected in key order (each device's peers are, and its name sorts before
        // the next's), so the map is built in one go rather than by a search per peer.
        let seen = &self.wg_seen;
        let peers = [WG_DEVICE, WG_DEVICE_V6]
            .into_iter()
            .filter_map(|name| Some((name, seen.get(name)?)))
            .flat_map(|(name, device)| {
                device.peers.iter().map(move |(k, p)| {
                    let seen = PeerObserved {
                        endpoint: p.endpoint,
                        last_handshake: p.last_handshake,
                        planned_before: None,
                        endpoint_set: None,
                    };
                    ((name.into(), *k), seen)
                })
            })
            .collect();
        Ok(peers)
    }

    /// Every peer of this node's WireGuard devices as last read (the latest full pass or
    /// `observe(true)`), with this agent's changes since: for statistics that must not
    /// cost a device read each time they are asked for.
    pub fn last_read_peers(
        &self,
    ) -> impl Iterator<Item = (&weft_crypto::PublicKey, &super::wireguard::WgPeer)> {
        self.wg_seen.peers()
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
        self.wg_seen.forget(name);
        self.routes.forget();
        Ok(true)
    }

    /// One WireGuard device brought in line with its spec, tunnel `index` of the plan
    /// `stamp` names. Returns whether the device was created, and the peers that should get
    /// a handshake started at once.
    pub(super) async fn tunnel(
        &mut self,
        t: &TunnelSpec,
        (stamp, index): (&PlanStamp<'_>, usize),
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
        let (observed, holds) = match self.wg_seen.take(&t.device) {
            Some(seen) if (!full || self.fresh.contains(&t.device)) && !created => seen,
            _ => (wg.get(&t.device).await?, None),
        };
        // A pass that read the device compares every peer: it may have changed behind us.
        let keys = (!full)
            .then(|| changed_peers(stamp, holds, index))
            .flatten();
        let change = device_change(t, key, &observed, keys.as_ref(), report);
        if change.is_empty() {
            self.wg_seen.put(&t.device, observed, stamp.generation);
            return Ok((created, Vec::new()));
        }
        match wg.apply(&t.device, &change, key).await {
            Ok(()) => {
                let mut now = observed;
                apply_to(&mut now, &change, &key.public_key());
                self.wg_seen.put(&t.device, now, stamp.generation);
                Ok((created, applied(t, &change, report)))
            }
            Err(e) => {
                // What the device holds now is unknown: the next pass reads it.
                self.wg_seen.forget(&t.device);
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
    pub(super) async fn remove_unplanned_devices(
        &mut self,
        state: &DesiredState,
        report: &mut DataplaneReport,
    ) -> Result<(), ApplyError> {
        for name in [WG_DEVICE, WG_DEVICE_V6] {
            if state.tunnels.iter().any(|t| t.device == name) {
                continue;
            }
            self.wg_seen.forget(name);
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
