//! `/metrics` (Prometheus / OpenMetrics text, prometheus-client), on the health port.
//!
//! Kept by the control loop: reconcile passes, their errors and a duration histogram;
//! registry events (nodes joined, changed, left); each peer's key generation (1 for the
//! first key seen, +1 at every change); the registry's warnings (changes to the
//! annotations that steer this node's traffic, foreign writes to its etcd lease written
//! back). Built at each scrape from the agent's snapshot and
//! the device as read then: per peer the last handshake's age, received and sent bytes and
//! an info series with its endpoint and key, and the peers left out of the plan with their
//! reason.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use weft_backends::plan::PatchedNode;
use weft_crypto::PublicKey;

use crate::observe::snapshot::Snapshot;
use crate::registry::Alerts;

type Labels = Vec<(&'static str, String)>;

#[derive(Clone)]
pub struct Metrics {
    passes: Counter,
    pass_errors: Counter,
    pass_seconds: Histogram,
    /// Node → (its current key, generation).
    keys: Arc<Mutex<HashMap<String, (weft_crypto::PublicKey, u64)>>>,
    /// Repairs of WireGuard pairs, by cause and step (`crate::liveness`).
    pair_repairs: Family<Labels, Counter>,
    /// Leaked pod addresses the agent released, by container (`cni::release`).
    pub addresses_released: Counter,
    /// What the registry warned about; it counts into these.
    pub alerts: Alerts,
}

/// `node`'s key in a plan: a new one is its next generation.
fn note_key(keys: &mut HashMap<String, (PublicKey, u64)>, node: &str, key: &PublicKey) {
    match keys.get_mut(node) {
        Some(entry) if entry.0 != *key => *entry = (*key, entry.1 + 1),
        Some(_) => {}
        None => {
            keys.insert(node.to_string(), (*key, 1));
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            passes: Counter::default(),
            pass_errors: Counter::default(),
            // 1 ms … ~16 s.
            pass_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            keys: Arc::default(),
            pair_repairs: Family::default(),
            addresses_released: Counter::default(),
            alerts: Alerts::default(),
        }
    }
}

impl Metrics {
    pub fn pass(&self, seconds: f64, failed: bool) {
        self.passes.inc();
        self.pass_seconds.observe(seconds);
        if failed {
            self.pass_errors.inc();
        }
    }

    /// A repair of a pair (or of its device) for `cause`, by `step`.
    pub fn pair_repaired(&self, cause: &str, step: &str) {
        self.pair_repairs
            .get_or_create(&vec![
                ("cause", cause.to_string()),
                ("step", step.to_string()),
            ])
            .inc();
    }

    /// Notes each planned peer's key; a new key for a known node is a new generation.
    /// Nodes no longer planned are forgotten (a node that comes back starts again at 1):
    /// under churn, remembering every node ever seen grows without bound.
    pub fn peer_keys(&self, peers: &[(&str, &weft_crypto::PublicKey)]) {
        let Ok(mut keys) = self.keys.lock() else {
            return;
        };
        let planned: std::collections::HashSet<&str> = peers.iter().map(|(n, _)| *n).collect();
        keys.retain(|node, _| planned.contains(node.as_str()));
        for (node, key) in peers {
            note_key(&mut keys, node, key);
        }
    }

    /// As `peer_keys`, for a plan the planner patched: only the nodes it re-planned can
    /// have another key or none (every other peer is as it was).
    pub fn patched_keys(&self, nodes: &[PatchedNode]) {
        let Ok(mut keys) = self.keys.lock() else {
            return;
        };
        for n in nodes {
            if n.after.is_empty() {
                keys.remove(&n.node);
            }
            for (_, key) in &n.after {
                note_key(&mut keys, &n.node, key);
            }
        }
    }

    fn generation(&self, node: &str) -> Option<u64> {
        self.keys.lock().ok()?.get(node).map(|(_, g)| *g)
    }

    /// The registry's warnings.
    fn register_alerts(&self, registry: &mut Registry) {
        registry.register(
            "steering_annotation_changes",
            "Changes to public-ip-overwrite or node-public-ip on this node's own Node",
            self.alerts.steering_changes.clone(),
        );
        registry.register(
            "leases_defended",
            "Foreign writes to this node's etcd lease, written back",
            self.alerts.leases_defended.clone(),
        );
    }

    /// The exposition for `snapshot`, with the device read now.
    pub async fn render(&self, snapshot: &Snapshot) -> String {
        let mut registry = Registry::with_prefix("weft");
        self.register_passes(&mut registry);
        self.register_alerts(&mut registry);
        register_plan(&mut registry, snapshot);
        super::relay_metrics::register(&mut registry, snapshot);
        self.register_peers(&mut registry, snapshot);
        self.register_liveness(&mut registry, snapshot);
        register_post_quantum(&mut registry, snapshot, std::time::SystemTime::now());
        register_paths(&mut registry, snapshot);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }

    /// The reconcile passes and registry events.
    fn register_passes(&self, registry: &mut Registry) {
        registry.register(
            "reconcile_passes",
            "Reconcile passes run",
            self.passes.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Reconcile passes with at least one error",
            self.pass_errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of reconcile passes",
            self.pass_seconds.clone(),
        );
        registry.register(
            "pod_address_leaks_released",
            "Leaked pod addresses the agent released, by container: attachments whose container is gone (its network namespace gone, or of an earlier boot), through the delegate's DEL, and host-local reservations no attachment held",
            self.addresses_released.clone(),
        );
        registry.register(
            "registry_events",
            "Nodes that joined, changed or left, as the registry reported them",
            self.alerts.events.clone(),
        );
    }

    /// One series set per peer of the plan: identity, handshake age, bytes, ESP
    /// counters, key generation.
    fn register_peers(&self, registry: &mut Registry, snapshot: &Snapshot) {
        let info: Family<Labels, Gauge> = Family::default();
        let age: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>> = Family::default();
        let rx: Family<Labels, Counter> = Family::default();
        let tx: Family<Labels, Counter> = Family::default();
        let generation: Family<Labels, Gauge> = Family::default();
        let replay: Family<Labels, Counter> = Family::default();
        let integrity: Family<Labels, Counter> = Family::default();
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        for p in &snapshot.peers {
            let node = vec![("node", p.node.clone())];
            let key = p.public_key.clone().unwrap_or_default();
            info.get_or_create(&vec![
                ("node", p.node.clone()),
                ("endpoint", p.endpoint.clone().unwrap_or_default()),
                ("public_key", key.clone()),
            ])
            .set(1);
            if let Some(g) = self.generation(&p.node) {
                generation.get_or_create(&node).set(g as i64);
            }
            // The counters as the last full pass read them (every resync period): a scrape
            // never reads the device.
            let on_device = key
                .parse::<PublicKey>()
                .ok()
                .and_then(|k| snapshot.counters.get(&k).copied());
            if let Some(w) = on_device {
                if let Some(t) = w.last_handshake.filter(|t| !t.is_zero()) {
                    age.get_or_create(&node)
                        .set(now.saturating_sub(t).as_secs_f64());
                }
                rx.get_or_create(&node).inc_by(w.rx_bytes);
                tx.get_or_create(&node).inc_by(w.tx_bytes);
                if let Some(n) = w.esp_replay_failed {
                    replay.get_or_create(&node).inc_by(n);
                }
                if let Some(n) = w.esp_integrity_failed {
                    integrity.get_or_create(&node).inc_by(n);
                }
            }
        }
        registry.register(
            "peer_info",
            "One series per peer: its endpoint and public key",
            info,
        );
        registry.register(
            "peer_last_handshake_age_seconds",
            "Seconds since the peer's last WireGuard handshake",
            age,
        );
        registry.register("peer_receive_bytes", "Bytes received from the peer", rx);
        registry.register("peer_transmit_bytes", "Bytes sent to the peer", tx);
        register_esp(registry, replay, integrity);
        registry.register(
            "peer_key_generation",
            "How many keys the peer has had since this agent started (1 = its first)",
            generation,
        );
    }
}

impl Metrics {
    /// Each WireGuard pair's liveness (1 unless dead) and the repairs made.
    fn register_liveness(&self, registry: &mut Registry, snapshot: &Snapshot) {
        let alive: Family<Labels, Gauge> = Family::default();
        for p in &snapshot.liveness {
            alive
                .get_or_create(&vec![
                    ("node", p.node.clone()),
                    ("device", p.device.clone()),
                ])
                .set(i64::from(p.state != "dead"));
        }
        registry.register(
            "peer_alive",
            "0 while the pair is dead: traffic sent and nothing authenticated came back, a probe included",
            alive,
        );
        registry.register(
            "peer_repairs",
            "Repairs of dead pairs and of drifted or faulty devices, by cause and step",
            self.pair_repairs.clone(),
        );
    }
}

/// With `PostQuantum`: each pair's protection (1 once a round completed) and the age of
/// its secret.
fn register_post_quantum(registry: &mut Registry, snapshot: &Snapshot, now: std::time::SystemTime) {
    if snapshot.post_quantum.is_empty() {
        return;
    }
    let protected: Family<Labels, Gauge> = Family::default();
    let age: Family<Labels, Gauge> = Family::default();
    for p in &snapshot.post_quantum {
        let labels = vec![("node", p.node.clone())];
        protected
            .get_or_create(&labels)
            .set(i64::from(p.round_ms.is_some()));
        if let Some(ms) = p.round_ms {
            let at = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(ms);
            let secs = now.duration_since(at).unwrap_or_default().as_secs();
            age.get_or_create(&labels)
                .set(i64::try_from(secs).unwrap_or(i64::MAX));
        }
    }
    registry.register(
        "peer_post_quantum",
        "1 while the pair's PSK comes from a completed ML-KEM-768 round; 0 while it is classical",
        protected,
    );
    registry.register(
        "peer_post_quantum_secret_age_seconds",
        "How long ago the round of the pair's PSK in force began",
        age,
    );
}

/// The plan: peers left out (by reason) and the peers in it.
fn register_plan(registry: &mut Registry, snapshot: &Snapshot) {
    let left_out: Family<Labels, Gauge> = Family::default();
    for l in &snapshot.left_out {
        left_out
            .get_or_create(&vec![
                ("node", l.node.clone()),
                ("reason", l.reason.clone()),
            ])
            .set(1);
    }
    registry.register(
        "peers_left_out",
        "Peers left out of the plan, by reason",
        left_out,
    );
    let planned: Gauge = Gauge::default();
    // Nodes, not device peers: a dual-stack node is a peer of two devices.
    let nodes: std::collections::BTreeSet<&str> =
        snapshot.peers.iter().map(|p| p.node.as_str()).collect();
    planned.set(nodes.len() as i64);
    registry.register("peers", "Peers in the plan", planned);
    let by_backend: Family<Labels, Gauge> = Family::default();
    for (backend, n) in &snapshot.backends.peers {
        by_backend
            .get_or_create(&vec![("backend", backend.clone())])
            .set(i64::try_from(*n).unwrap_or(i64::MAX));
    }
    registry.register(
        "peers_by_backend",
        "Peers whose pair runs on each backend (more than one while the cluster changes backend)",
        by_backend,
    );
    let clear: Family<Labels, Gauge> = Family::default();
    for c in &snapshot.backends.clear {
        clear
            .get_or_create(&vec![("node", c.node.clone()), ("why", c.why.clone())])
            .set(1);
    }
    registry.register(
        "pairs_in_clear",
        "Pairs in clear while the cluster changes backend (their peer publishes no encrypting backend), by node and why",
        clear,
    );
}

/// Each peer path's measured MTU, the MTU its routes carry, and when it was measured.
fn register_paths(registry: &mut Registry, snapshot: &Snapshot) {
    let mtu: Family<Labels, Gauge> = Family::default();
    let route: Family<Labels, Gauge> = Family::default();
    let at: Family<Labels, Gauge> = Family::default();
    for p in &snapshot.paths {
        let labels = vec![("node", p.node.clone()), ("address", p.address.to_string())];
        if let Some(m) = p.path_mtu {
            mtu.get_or_create(&labels).set(i64::from(m));
        }
        if let Some(m) = p.route_mtu {
            route.get_or_create(&labels).set(i64::from(m));
        }
        if let Some(ms) = p.measured_ms {
            at.get_or_create(&labels)
                .set(i64::try_from(ms / 1000).unwrap_or(i64::MAX));
        }
    }
    registry.register(
        "peer_path_mtu_bytes",
        "The MTU of the underlay path to the peer, as last measured",
        mtu,
    );
    registry.register(
        "peer_route_mtu_bytes",
        "The MTU the peer's routes carry (only where the path is narrower than the pod MTU)",
        route,
    );
    registry.register(
        "peer_path_mtu_measured_timestamp_seconds",
        "When the peer's path MTU was last measured (Unix time)",
        at,
    );
}

/// The ipsec peers' inbound-state counters.
fn register_esp(
    registry: &mut Registry,
    replay: Family<Labels, Counter>,
    integrity: Family<Labels, Counter>,
) {
    registry.register(
        "peer_esp_replay_dropped",
        "ipsec: packets from the peer its inbound ESP state dropped as replays",
        replay,
    );
    registry.register(
        "peer_esp_integrity_failed",
        "ipsec: packets from the peer that failed the ESP integrity check",
        integrity,
    );
}

#[cfg(test)]
mod tests {
    use super::Metrics;

    fn owned(peers: &[(&str, &str)]) -> Vec<(String, weft_crypto::PublicKey)> {
        peers
            .iter()
            .map(|(n, k)| {
                let seed = [k.as_bytes()[1]; 32];
                let key = weft_crypto::PrivateKey::from_bytes(seed).public_key();
                (n.to_string(), key)
            })
            .collect()
    }

    fn refs(peers: &[(String, weft_crypto::PublicKey)]) -> Vec<(&str, &weft_crypto::PublicKey)> {
        peers.iter().map(|(n, k)| (n.as_str(), k)).collect()
    }

    #[test]
    fn key_generations_count_changes_and_forget_nodes_that_left() {
        let m = Metrics::default();
        m.peer_keys(&refs(&owned(&[("a", "k1"), ("b", "k2")])));
        m.peer_keys(&refs(&owned(&[("a", "k3"), ("b", "k2")])));
        assert_eq!(m.generation("a"), Some(2));
        assert_eq!(m.generation("b"), Some(1));
        // b leaves: forgotten, so churn does not grow the map.
        m.peer_keys(&refs(&owned(&[("a", "k3")])));
        assert_eq!(m.generation("b"), None);
        assert_eq!(m.keys.lock().map(|k| k.len()).ok(), Some(1));
        // b comes back: a first key again.
        m.peer_keys(&refs(&owned(&[("a", "k3"), ("b", "k4")])));
        assert_eq!(m.generation("b"), Some(1));
        assert_eq!(m.generation("a"), Some(2));
    }

    /// A patched plan's nodes alone count as the whole plan's peers do.
    #[test]
    fn patched_nodes_count_as_the_whole_plan() {
        let node = |name: &str, key: Option<&str>| weft_backends::plan::PatchedNode {
            node: name.into(),
            before: vec![],
            after: key.map_or(vec![], |k| vec![(0, owned(&[(name, k)])[0].1)]),
        };
        let (whole, patched) = (Metrics::default(), Metrics::default());
        whole.peer_keys(&refs(&owned(&[("a", "k1"), ("b", "k2")])));
        patched.peer_keys(&refs(&owned(&[("a", "k1"), ("b", "k2")])));
        let steps = [
            (vec![("a", "k3"), ("b", "k2")], vec![node("a", Some("k3"))]),
            (vec![("a", "k3")], vec![node("b", None)]),
            (vec![("a", "k3"), ("b", "k4")], vec![node("b", Some("k4"))]),
            (vec![("a", "k5"), ("b", "k4")], vec![node("a", Some("k5"))]),
        ];
        for (plan, nodes) in steps {
            whole.peer_keys(&refs(&owned(&plan)));
            patched.patched_keys(&nodes);
            for name in ["a", "b"] {
                assert_eq!(whole.generation(name), patched.generation(name), "{name}");
            }
        }
        assert_eq!(patched.generation("a"), Some(3));
        assert_eq!(patched.generation("b"), Some(1));
    }
}
