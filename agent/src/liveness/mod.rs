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
mod plan;
pub mod probe;
mod roams;
mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, watch as tokio_watch};
use weft_backends::apply::wireguard::drift::{drift, Drift};
use weft_backends::model::DesiredState;
use weft_backends::plan::PlanStamp;
use weft_crypto::PublicKey;

use crate::observe::metrics::Metrics;

pub use plan::Plan;
use plan::{is_published, patched_published, published};
pub use watch::spawn;

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

/// What the watcher tells the loop of a pair's path (`node::paths`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathEvent {
    /// The pair (by node) was found dead on its path.
    Dead(String),
    /// The relayed pair's device roamed to another endpoint than the plan's.
    Roamed(String),
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
    /// The planner's generation of the plan held (`PlanStamp::generation`).
    planned: Option<u64>,
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

    /// Hands the watcher the plan a pass just applied, `stamp` its planner's account of
    /// it: a plan patched from the one held is new, and only its re-planned nodes' peers
    /// are looked at (at 10,000 peers, comparing every one with the last plan, and looking
    /// each up among the registry's endpoints, was a tenth of a patched pass).
    pub fn follow(&mut self, state: &Arc<DesiredState>, own: PublicKey, stamp: &PlanStamp<'_>) {
        let held = self.plan.borrow().clone();
        let held = held
            .as_deref()
            .filter(|p| p.own == own && p.switching == state.key_watch.is_some());
        let patched = stamp
            .patched
            .filter(|(from, nodes)| self.planned.is_some_and(|h| h == *from) && !nodes.is_empty());
        let published = match (held, patched) {
            (Some(held), _) if Arc::ptr_eq(&held.state, state) => None,
            (Some(held), Some((_, nodes))) => patched_published(held, state, nodes),
            (Some(held), None) if is_published(held.tunnels(), state) => None,
            _ => Some(published(state)),
        };
        self.planned = stamp.generation;
        let Some(published) = published else {
            return; // the device, once this pass is done, is what the same plan wants
        };
        self.generation += 1;
        let plan = Plan::new(self.generation, own, state, published);
        self.plan.send_replace(Some(Arc::new(plan)));
    }
}

#[cfg(test)]
mod tests {
    use weft_backends::apply::wireguard::{WgDevice, WgPeer};
    use weft_crypto::PrivateKey;

    use std::net::SocketAddr;

    use weft_backends::model::{PeerSpec, TunnelSpec};
    use weft_backends::plan::PatchedNode;

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
            via: Default::default(),
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
        let plan = Plan::new(1, own, &state, published(&state));
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
        let plan = Plan::new(1, key(1), &state, published(&state));
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

    fn handle(
        plan: tokio_watch::Sender<Option<Arc<Plan>>>,
        events: mpsc::Receiver<Event>,
    ) -> Handle {
        Handle {
            plan,
            events,
            generation: 0,
            planned: None,
            applying: Default::default(),
        }
    }

    /// The planner's stamp of plan `generation`, patched from the one before on `nodes`.
    fn patched(generation: u64, nodes: &[PatchedNode]) -> PlanStamp<'_> {
        PlanStamp {
            generation: Some(generation),
            patched: Some((generation - 1, nodes)),
        }
    }

    #[test]
    fn a_patched_plan_is_handed_over_from_its_changed_nodes_as_a_whole_one_would_be() {
        let (own, b, c) = (key(1), key(2), key(3));
        let (tx, rx) = tokio_watch::channel(None);
        let mut handle = handle(tx, mpsc::channel(1).1);
        let held = || rx.borrow().clone().unwrap();
        let one = Arc::new(state(vec![peer(b, "node-b", "198.51.100.2:51820")]));
        let full = PlanStamp {
            generation: Some(1),
            patched: None,
        };
        handle.follow(&one, own, &full);
        assert_eq!(
            (held().generation, held().published.clone()),
            (1, vec![None])
        );
        // Node c joins on an endpoint kept from roaming: its device is held as a copy.
        let mut two = (*one).clone();
        two.tunnels[0]
            .peers
            .push(peer(c, "node-c", "198.51.100.3:40000"));
        let published: SocketAddr = "198.51.100.3:51820".parse().unwrap();
        two.planned_endpoints
            .insert(("flannel-wg".into(), c), published);
        let two = Arc::new(two);
        let joined = [PatchedNode {
            node: "node-c".into(),
            before: vec![],
            after: vec![(0, c)],
        }];
        handle.follow(&two, own, &patched(2, &joined));
        assert_eq!(held().generation, 2);
        assert_eq!(held().published, super::published(&two));
        assert!(held().published[0].is_some());
        // Node c's lease changes, its peer does not: the same plan for the watcher.
        let three = Arc::new((*two).clone());
        let renewed = [PatchedNode {
            node: "node-c".into(),
            before: vec![(0, c)],
            after: vec![(0, c)],
        }];
        handle.follow(&three, own, &patched(3, &renewed));
        assert_eq!(held().generation, 2);
        // Back on its published endpoint, to the watcher the same plan.
        let mut four = (*three).clone();
        four.tunnels[0].peers[1].endpoint = published;
        handle.follow(&Arc::new(four.clone()), own, &patched(4, &renewed));
        assert_eq!(held().generation, 2);
        // Its subnet changes there: a new plan, and no device held as a copy.
        four.tunnels[0].peers[1].allowed_ips = vec!["10.244.3.0/24".parse().unwrap()];
        let four = Arc::new(four);
        handle.follow(&four, own, &patched(5, &renewed));
        assert_eq!(
            (held().generation, held().published.clone()),
            (3, vec![None])
        );
        // Node b changes too, but the plan is patched from one the watcher never held:
        // compared in full, and found the same.
        handle.follow(&Arc::new((*four).clone()), own, &patched(9, &joined));
        assert!(Arc::ptr_eq(&held().state, &four));
        assert_eq!(held().generation, 3);
    }

    #[test]
    fn a_full_pass_finds_drift_only_from_the_plan_it_applied_last() {
        let (own, b) = (key(1), key(2));
        let (plan, _) = tokio_watch::channel(None);
        let (_, events) = mpsc::channel(1);
        let mut handle = handle(plan, events);
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
        handle.follow(&applied, own, &PlanStamp::default());
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
        handle.follow(&switching, own, &PlanStamp::default());
        assert!(handle
            .drift(&switching, own, "flannel-wg", &device(vec![]))
            .is_empty());
    }
}
