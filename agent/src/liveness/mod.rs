//! The liveness watcher: a thread of its own that reads this node's WireGuard devices twice a
//! second (less often past 2,000 peers), beside the control loop, and keeps every pair alive
//! or says why not.
//! - Each pair's verdict (alive, idle, waiting for an answer, dead and why) comes from
//!   its counters (`weft_backends::plan::liveness`); a pair that sent and heard nothing
//!   back is probed through the tunnel, and one that still hears nothing is dead.
//! - A dead pair is repaired in steps, each logged with its cause: the peer re-applied as
//!   planned (the registry's endpoint among it), then re-handshaken if it has answered
//!   since the watch began; the device is re-created only when it is itself at fault (it
//!   does not answer, or every pair with traffic is dead). Then a doubling pause: never a
//!   loop.
//! - Drift (a key, AllowedIPs, a listen port changed behind the agent) is seen at the read
//!   after it and put back by a full pass of the loop at once, not at the next resync.
//!
//! The loop hands it each plan (`Handle::follow`) and takes its requests (`Event`); what it
//! finds goes into the snapshot (`weft status`, `weft doctor`) and `/metrics`.

mod crowd;
pub mod probe;
mod watch;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, watch as tokio_watch};
use weft_backends::apply::wireguard::drift::{drift, Drift};
use weft_backends::model::{DesiredState, PeerSpec, TunnelSpec};
use weft_crypto::PublicKey;

use crate::observe::metrics::Metrics;

pub use watch::spawn;

/// What the watcher judges against: the last plan's devices. The plan is shared with the
/// loop, not copied (at 10,000 peers a copy per pass was a copy of every peer's entry);
/// only a device with a peer whose endpoint the registry publishes differently (one kept
/// from roaming) is held as its own copy, with the published endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Counts the plans handed over: drift is drift only when two reads under the same
    /// plan show it (a pass under way changes the device before its plan arrives here).
    pub generation: u64,
    /// This node's public key, as the devices must carry it.
    pub own: PublicKey,
    state: Arc<DesiredState>,
    /// Per tunnel of `state`: its copy with the published endpoints, where they differ.
    published: Vec<Option<TunnelSpec>>,
    /// A key rotation is in its switch window: peers' entries move outside the passes
    /// (the key-switch watcher), so drift is not looked for.
    pub switching: bool,
}

impl Plan {
    fn new(generation: u64, own: PublicKey, state: &Arc<DesiredState>) -> Plan {
        Plan {
            generation,
            own,
            state: state.clone(),
            published: published(state),
            switching: state.key_watch.is_some(),
        }
    }

    /// The planned devices, each with its peers' endpoints as the registry publishes them.
    pub fn tunnels(&self) -> impl ExactSizeIterator<Item = &TunnelSpec> + '_ {
        self.state
            .tunnels
            .iter()
            .zip(&self.published)
            .map(|(planned, published)| published.as_ref().unwrap_or(planned))
    }

    /// Whether this is the plan `state` makes for a node of key `own`.
    fn is_of(&self, state: &Arc<DesiredState>, own: PublicKey) -> bool {
        self.own == own
            && self.switching == state.key_watch.is_some()
            && (Arc::ptr_eq(&self.state, state) || is_published(self.tunnels(), state))
    }
}

/// Says that `device` drifted from the plan (`found`), in the log and `/metrics`, as the
/// pass that puts it back; the differences in words.
pub fn tell_drift(metrics: &Metrics, device: &str, found: &[Drift]) -> Vec<String> {
    for d in found {
        metrics.pair_repaired(d.cause(), "pass");
    }
    let words: Vec<String> = found.iter().map(ToString::to_string).collect();
    tracing::warn!(device, drift = ?words, "the device differs from the plan: putting it back");
    words
}

/// What the watcher asks of the control loop.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// `device` differs from the plan (each difference in words): a full pass puts it back.
    Drift { device: String, found: Vec<String> },
    /// `device` is at fault: remove it, and the next pass makes it again.
    Recreate { device: String, cause: String },
}

/// The loop's end of the watcher.
pub struct Handle {
    plan: tokio_watch::Sender<Option<Arc<Plan>>>,
    pub events: mpsc::Receiver<Event>,
    generation: u64,
    /// Set while a pass changes the devices: a device busy taking a large change answers a
    /// read late, and is not at fault for it.
    applying: Arc<AtomicBool>,
}

/// Says the devices are being changed, until dropped.
pub struct Applying(Arc<AtomicBool>);

impl Drop for Applying {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Handle {
    /// For the time a pass changes the devices.
    pub fn applying(&self) -> Applying {
        self.applying.store(true, Ordering::Release);
        Applying(self.applying.clone())
    }

    /// How `device` (`name`, as a full pass just read it) differs from the plan the last
    /// pass applied, when the pass about to run plans it the same: what changed behind
    /// the agent, which the pass puts back. Empty during a key switch, whose watcher moves
    /// peers between passes.
    pub fn drift(
        &self,
        state: &Arc<DesiredState>,
        own: PublicKey,
        name: &str,
        device: &weft_backends::apply::wireguard::WgDevice,
    ) -> Vec<Drift> {
        let plan = self.plan.borrow();
        let Some(plan) = plan.as_ref().filter(|p| p.is_of(state, own)) else {
            return Vec::new();
        };
        if plan.switching {
            return Vec::new();
        }
        // Bound before `plan`'s borrow ends: the iterator borrows from it.
        let found = plan
            .tunnels()
            .find(|t| t.device == name)
            .map(|spec| drift(spec, &plan.own, device))
            .unwrap_or_default();
        found
    }

    /// Hands the watcher the plan a pass just applied.
    pub fn follow(&mut self, state: &Arc<DesiredState>, own: PublicKey) {
        let same = self
            .plan
            .borrow()
            .as_ref()
            .is_some_and(|p| p.is_of(state, own));
        if same {
            return; // the device, once this pass is done, is what the same plan wants
        }
        self.generation += 1;
        let plan = Plan::new(self.generation, own, state);
        self.plan.send_replace(Some(Arc::new(plan)));
    }
}

/// Per tunnel of the plan, its copy with each peer's endpoint as the registry publishes
/// it, where one differs. The plan keeps an endpoint the device learned by roaming (or
/// that was set by hand: the agent cannot tell them apart) while its session is fresh; a
/// pair dead on such an endpoint is repaired onto the published one, which is also what
/// its cause names.
fn published(state: &DesiredState) -> Vec<Option<TunnelSpec>> {
    let endpoints = Published::of(state);
    state
        .tunnels
        .iter()
        .map(|tunnel| {
            let differs = tunnel
                .peers
                .iter()
                .any(|p| endpoints.endpoint(&tunnel.device, p) != p.endpoint);
            differs.then(|| {
                let mut copy = tunnel.clone();
                for peer in &mut copy.peers {
                    peer.endpoint = endpoints.endpoint(&tunnel.device, peer);
                }
                copy
            })
        })
        .collect()
}

/// The registry's endpoints of the plan's peers.
struct Published<'a> {
    planned: &'a std::collections::BTreeMap<weft_backends::model::DevicePeer, SocketAddr>,
}

impl<'a> Published<'a> {
    fn of(state: &'a DesiredState) -> Self {
        Published {
            planned: &state.planned_endpoints,
        }
    }

    /// The registry's endpoint of `peer` on `device`, or the plan's where it names none.
    fn endpoint(&self, device: &str, peer: &PeerSpec) -> SocketAddr {
        let id = (device.into(), peer.public_key);
        self.planned.get(&id).copied().unwrap_or(peer.endpoint)
    }
}

/// Whether `tunnels` is what `published(state)` makes, without copying the plan: each
/// pass asks, and most passes leave the plan as it was.
fn is_published<'a>(
    tunnels: impl ExactSizeIterator<Item = &'a TunnelSpec>,
    state: &DesiredState,
) -> bool {
    let endpoints = Published::of(state);
    tunnels.len() == state.tunnels.len()
        && tunnels.zip(&state.tunnels).all(|(have, want)| {
            have.device == want.device
                && have.listen_port == want.listen_port
                && have.mtu == want.mtu
                && have.addresses == want.addresses
                && have.peers.len() == want.peers.len()
                && have.peers.iter().zip(&want.peers).all(|(h, w)| {
                    // Every field named: one added later is compared too.
                    let PeerSpec {
                        node,
                        public_key,
                        endpoint: _,
                        allowed_ips,
                        keepalive,
                        psk,
                    } = w;
                    h.endpoint == endpoints.endpoint(&want.device, w)
                        && h.node == *node
                        && h.public_key == *public_key
                        && h.allowed_ips == *allowed_ips
                        && h.keepalive == *keepalive
                        && h.psk == *psk
                })
        })
}

#[cfg(test)]
mod tests {
    use weft_backends::apply::wireguard::{WgDevice, WgPeer};
    use weft_crypto::PrivateKey;

    use super::*;

    fn key(seed: u8) -> PublicKey {
        PrivateKey::from_bytes([seed; 32]).public_key()
    }

    fn peer(key: PublicKey, node: &str, endpoint: &str) -> PeerSpec {
        PeerSpec {
            node: node.into(),
            public_key: key,
            endpoint: endpoint.parse().unwrap(),
            allowed_ips: vec!["10.244.2.0/24".parse().unwrap()],
            keepalive: 0,
            psk: None,
        }
    }

    fn state(peers: Vec<PeerSpec>) -> DesiredState {
        let mut state = DesiredState::default();
        state.tunnels.push(TunnelSpec {
            device: "flannel-wg".into(),
            listen_port: 51820,
            mtu: 1420,
            addresses: vec![],
            peers,
        });
        state
    }

    #[test]
    fn the_watcher_repairs_onto_the_registrys_endpoint_not_a_roamed_one() {
        let (own, key, other) = (key(1), key(2), key(3));
        // Node b's endpoint kept from roaming (or a `wg set` by hand); another peer the
        // registry's endpoints do not list.
        let mut state = state(vec![
            peer(key, "node-b", "198.51.100.2:51999"),
            peer(other, "node-b", "198.51.100.3:51820"),
        ]);
        state.planned_endpoints.insert(
            ("flannel-wg".into(), key),
            "198.51.100.2:51820".parse().unwrap(),
        );
        let state = Arc::new(state);
        let plan = Plan::new(1, own, &state);
        let endpoints: Vec<String> = plan
            .tunnels()
            .flat_map(|t| &t.peers)
            .map(|p| p.endpoint.to_string())
            .collect();
        assert_eq!(endpoints, ["198.51.100.2:51820", "198.51.100.3:51820"]);
        assert!(is_published(plan.tunnels(), &state));
        assert!(
            !is_published(state.tunnels.iter(), &state),
            "the roamed endpoint differs"
        );
        // The same plan, made again (another pass planning the same), is the same.
        assert!(plan.is_of(&Arc::new((*state).clone()), own));
    }

    #[test]
    fn a_plan_is_shared_and_copies_only_a_device_whose_endpoints_differ() {
        let state = Arc::new(state(vec![peer(key(2), "node-b", "198.51.100.2:51820")]));
        let plan = Plan::new(1, key(1), &state);
        assert_eq!(plan.published, [None]);
        assert!(std::ptr::eq(
            plan.tunnels().next().unwrap(),
            &state.tunnels[0]
        ));
        assert!(plan.is_of(&state, key(1)));
        let mut moved = (*state).clone();
        moved.tunnels[0].peers[0].endpoint = "198.51.100.9:51820".parse().unwrap();
        assert!(!plan.is_of(&Arc::new(moved), key(1)));
    }

    #[test]
    fn a_full_pass_finds_drift_only_from_the_plan_it_applied_last() {
        let (own, b) = (key(1), key(2));
        let (plan, _) = tokio_watch::channel(None);
        let (_, events) = mpsc::channel(1);
        let mut handle = Handle {
            plan,
            events,
            generation: 0,
            applying: Default::default(),
        };
        let applied = Arc::new(state(vec![peer(b, "node-b", "198.51.100.2:51820")]));
        let device = |peers: Vec<PublicKey>| WgDevice {
            public_key: Some(own),
            listen_port: 51820,
            peers: peers
                .into_iter()
                .map(|k| {
                    let ips = vec!["10.244.2.0/24".parse().unwrap()];
                    let p = WgPeer {
                        allowed_ips: ips,
                        ..WgPeer::default()
                    };
                    (k, p)
                })
                .collect(),
        };
        // Before any plan, nothing is drift.
        assert!(handle
            .drift(&applied, own, "flannel-wg", &device(vec![]))
            .is_empty());
        handle.follow(&applied, own);
        assert!(handle
            .drift(&applied, own, "flannel-wg", &device(vec![b]))
            .is_empty());
        // Node b's key replaced by hand: its peer is missing, a stranger is there.
        let replaced = handle.drift(&applied, own, "flannel-wg", &device(vec![key(9)]));
        assert_eq!(
            replaced,
            [
                Drift::MissingPeer {
                    node: "node-b".into(),
                    key: b
                },
                Drift::UnknownPeer { key: key(9) },
            ]
        );
        // A pass that plans otherwise (node b's new key) changes the device itself.
        let rotated = Arc::new(state(vec![peer(key(9), "node-b", "198.51.100.2:51820")]));
        assert!(handle
            .drift(&rotated, own, "flannel-wg", &device(vec![b]))
            .is_empty());
        // So does this node's own key switch, and a peer's key switch under way.
        assert!(handle
            .drift(&applied, key(7), "flannel-wg", &device(vec![]))
            .is_empty());
        let mut switching = (*applied).clone();
        switching.key_watch = Some(weft_backends::model::KeyWatch {
            from: std::time::SystemTime::UNIX_EPOCH,
            until: std::time::SystemTime::UNIX_EPOCH,
            moves: Vec::new(),
        });
        let switching = Arc::new(switching);
        handle.follow(&switching, own);
        assert!(handle
            .drift(&switching, own, "flannel-wg", &device(vec![]))
            .is_empty());
    }
}
