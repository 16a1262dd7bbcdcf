//! Pair paths across zones, from the loop's side: what the liveness watcher found dead,
//! kept as the plan's input (`Observed::paths`, see `weft_backends::plan::relay`), and the
//! re-handshake of each pair whose path the plan moved (onto a relay, off it, or to
//! another gateway): WireGuard would keep sealing on its sessions to the new endpoint,
//! which a relay that never saw the pair's handshake cannot route, and start over only
//! after 15 s; removed and added in one device change, the pair handshakes over its new
//! path at its first packet (a relayed pair has a keepalive, so at once).

use std::collections::BTreeMap;
use std::time::SystemTime;

use tracing::{info, warn};
use weft_backends::apply::wireguard::diff::{DeviceChange, PeerChange};
use weft_backends::apply::wireguard::{devices::WgImpl, WgDevices};
use weft_backends::model::{DesiredState, PathHistory, PeerSpec, Via};
use weft_crypto::PrivateKey;

/// How long after a pair moved to a new path a dead verdict is not held against that
/// path: the pair's two ends find the old path dead a few seconds apart, and through a
/// gateway of the other end's zone the pair answers only once that end has moved too. A
/// pair still dead after the watcher's repair steps (its back-off, later) is told again.
pub(crate) const MOVE_GRACE: std::time::Duration = std::time::Duration::from_secs(6);

/// The pairs' path failures, by peer node.
#[derive(Default)]
pub(crate) struct PathMemory {
    pub(crate) history: BTreeMap<String, PathHistory>,
    /// When each pair last moved to another path.
    moved_at: BTreeMap<String, SystemTime>,
}

impl PathMemory {
    /// The pair with `node` was found dead (by the watcher) on the path `last` planned for
    /// it: that path is remembered as failed. Whether the plan's input changed: only a
    /// relayed pair, or a direct pair across zones, has another path to take.
    pub(crate) fn dead(
        &mut self,
        node: &str,
        last: Option<&DesiredState>,
        cross_zone: bool,
        now: SystemTime,
    ) -> bool {
        let Some(peer) = last.and_then(|s| {
            s.tunnels
                .iter()
                .flat_map(|t| &t.peers)
                .find(|p| p.node == node)
        }) else {
            return false;
        };
        if self
            .moved_at
            .get(node)
            .is_some_and(|at| now.duration_since(*at).unwrap_or_default() < MOVE_GRACE)
        {
            return false;
        }
        let history = self.history.entry(node.to_string()).or_default();
        match &peer.via {
            Via::Gateway(g) => {
                warn!(node, gateway = %g, "pair dead through its gateway: moving it to another");
                history.gateways_failed.insert(g.clone(), now);
                true
            }
            Via::Direct if cross_zone => {
                info!(
                    node,
                    failures = history.direct_failures + 1,
                    "pair across zones dead on its direct path: a gateway carries it if one can"
                );
                history.direct_failed = Some(now);
                history.direct_failures += 1;
                true
            }
            _ => false,
        }
    }

    /// Forgets the nodes no longer in the view.
    pub(crate) fn retain(&mut self, alive: impl Fn(&str) -> bool) {
        self.history.retain(|n, _| alive(n));
        self.moved_at.retain(|n, _| alive(n));
    }

    /// The pairs in `moved` moved to another path at `now`.
    pub(crate) fn moved(&mut self, moved: &[(String, PeerSpec)], now: SystemTime) {
        for (_, peer) in moved {
            self.moved_at.insert(peer.node.clone(), now);
        }
    }
}

/// The peers whose path `after` moves from `before`'s, per device; not those whose device
/// holds the new endpoint already (`held`: it followed the gateway its peer chose).
pub(crate) fn moved(
    before: &DesiredState,
    after: &DesiredState,
    held: &BTreeMap<weft_crypto::PublicKey, std::net::SocketAddr>,
) -> Vec<(String, PeerSpec)> {
    let mut out = Vec::new();
    for t in &after.tunnels {
        let Some(old) = before.tunnels.iter().find(|o| o.device == t.device) else {
            continue;
        };
        let was: BTreeMap<_, &Via> = old.peers.iter().map(|p| (p.public_key, &p.via)).collect();
        for p in &t.peers {
            let gw = |v: &Via| v.gateway().map(str::to_string);
            let moved = was.get(&p.public_key).is_some_and(|v| gw(v) != gw(&p.via));
            if moved && held.get(&p.public_key) != Some(&p.endpoint) {
                out.push((t.device.clone(), p.clone()));
            }
        }
    }
    out
}

/// Removes and adds each moved pair in one change per device.
pub(crate) async fn rehandshake(wg: &mut WgImpl, moved: &[(String, PeerSpec)]) {
    let mut by_device: BTreeMap<&str, Vec<PeerChange>> = BTreeMap::new();
    for (device, peer) in moved {
        info!(node = %peer.node, device = %device, endpoint = %peer.endpoint, via = ?peer.via, "pair moved to another path: handshaking over it");
        by_device.entry(device).or_default().extend([
            PeerChange::Remove {
                key: peer.public_key,
            },
            PeerChange::Add(peer.clone()),
        ]);
    }
    // The change does not set the device's key, so no key is sent.
    let unused = PrivateKey::from_bytes([0; 32]);
    for (device, peers) in by_device {
        let change = DeviceChange {
            set_private_key: false,
            listen_port: None,
            peers,
        };
        if let Err(e) = wg.apply(device, &change, &unused).await {
            warn!(device, error = %e, "re-handshaking pairs that moved path");
        }
    }
}
