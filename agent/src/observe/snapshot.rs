//! What the agent knows about this node and its peers, as the operator's tools see it:
//! the agent keeps a `Snapshot` (updated after every pass) and serves it on its control
//! socket; `weft status` and `weft doctor` read it and add what the devices say
//! (handshakes, transfer), which they read themselves.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use weft_backends::apply::expected_rules;
use weft_backends::model::{format_mac, ClusterView, DesiredState, Lease, NextKey, RouteRole};

pub use crate::relay::{RelayInfo, RelayedPair};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub node: String,
    pub subnet: Option<IpNet>,
    pub backend: String,
    /// `kernel`, `userspace`, or `none` for the unencrypted backends.
    pub implementation: String,
    pub public_ip: Option<IpAddr>,
    /// This node's backend data as published (WireGuard key and port, or VTEP MAC).
    pub published: Option<Value>,
    /// The device the backend uses (`flannel-wg`, `flannel.1`; none for host-gw).
    pub device: Option<String>,
    /// The device's interface index when the last pass ended well: a device made again
    /// since (another index) is not configured yet. Not sent to the CLI.
    #[serde(skip)]
    pub device_index: Option<u32>,
    /// The underlay MTU the plan assumed.
    pub underlay_mtu: u32,
    pub ip_masq: bool,
    /// The nftables tables the plan wants, with their rules as `expected_rules` gives them.
    pub masquerade: Vec<NftTable>,
    /// The vxlan device's UDP port (vxlan backend).
    pub vxlan_port: Option<u16>,
    pub peers: Vec<PeerInfo>,
    pub left_out: Vec<LeftOutInfo>,
    /// Each peer's underlay path and its measured MTU (`pathmtu`).
    #[serde(default)]
    pub paths: Vec<PathInfo>,
    /// Every node in the registry with its published backend data (ours included), for
    /// `weft doctor`'s registry-versus-device checks.
    pub registry: BTreeMap<String, RegistryEntry>,
    /// The current key's generation (1 = the node's first key).
    pub key_generation: u64,
    /// A key rotation under way: the announced key and its switch moment.
    pub rotating: Option<NextKey>,
    pub passes: u64,
    pub pass_errors: u64,
    /// The errors of the last pass, if it had any.
    pub last_errors: Vec<String>,
    /// What the agent's checks found changed behind its back and put back (a deleted
    /// nftables table, say), oldest first: at most `REPAIRS_KEPT`.
    #[serde(default)]
    pub repairs: Vec<Repair>,
    /// Each WireGuard pair's liveness, as the liveness watcher last judged it.
    #[serde(default)]
    pub liveness: Vec<PairLiveness>,
    /// When it did, in milliseconds since the Unix epoch (0: never).
    #[serde(default)]
    pub liveness_at_ms: u64,
    /// With `PostQuantum`: each pair's post-quantum protection (`crate::pq`).
    #[serde(default)]
    pub post_quantum: Vec<PqPairInfo>,
    /// Each WireGuard peer's counters as the last full pass read them, for `/metrics`
    /// (which must not read the device per request). Not sent to the CLI.
    #[serde(skip)]
    pub counters: std::sync::Arc<BTreeMap<weft_crypto::PublicKey, PeerCounters>>,
    /// This node's relay, when it is a gateway: what it carries.
    #[serde(default)]
    pub relay: Option<RelayInfo>,
    /// The backends of this node's pairs (more than one while the cluster changes
    /// backend), the pairs in clear, and the old backends it still speaks.
    #[serde(default)]
    pub backends: BackendsInfo,
}

/// How this node's pairs are carried while the cluster may be changing backend.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BackendsInfo {
    /// Peers (nodes) per backend.
    pub peers: BTreeMap<String, usize>,
    /// The pairs in clear, and why each is.
    pub clear: Vec<ClearPairInfo>,
    /// The backends this node still speaks besides its config's (its old one, kept while
    /// a peer runs it).
    pub also: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClearPairInfo {
    pub node: String,
    pub why: String,
}

/// A peer's counters: a WireGuard peer's as read from the device, or an ipsec peer's
/// from its two ESP states.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PeerCounters {
    /// Time since the Unix epoch of the last handshake; `None` or zero: never.
    pub last_handshake: Option<std::time::Duration>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// ipsec: packets the inbound state dropped as replays, and as failing the
    /// integrity check.
    pub esp_replay_failed: Option<u64>,
    pub esp_integrity_failed: Option<u64>,
}

impl PeerCounters {
    /// A WireGuard peer's, as read from its device.
    pub fn wireguard(peer: &weft_backends::apply::wireguard::WgPeer) -> Self {
        PeerCounters {
            last_handshake: peer.last_handshake,
            rx_bytes: peer.rx_bytes,
            tx_bytes: peer.tx_bytes,
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub node: String,
    pub subnet: Option<IpNet>,
    /// Where this node sends the peer's traffic: the WireGuard endpoint, the vxlan VTEP
    /// address, or the host-gw next hop.
    pub endpoint: Option<String>,
    pub public_key: Option<String>,
    pub vtep_mac: Option<String>,
    /// The device it is a peer of (`flannel-wg`, `flannel-wg-v6`, `flannel.1`, …); `None`
    /// for a host-gw or DirectRouting route.
    #[serde(default)]
    pub device: Option<String>,
    /// ipsec: the SPIs of the state this node receives on and of the one it sends with.
    #[serde(default)]
    pub spi_in: Option<u32>,
    #[serde(default)]
    pub spi_out: Option<u32>,
    /// WireGuard across zones: `direct`, `via <gateway>`, or `no path: <why>`.
    #[serde(default)]
    pub path: Option<String>,
}

/// One WireGuard pair's liveness (see `crate::liveness`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairLiveness {
    pub node: String,
    pub device: String,
    /// `alive` (sent and answered), `idle` (nothing sent), `waiting` (sent, not answered
    /// yet: probed) or `dead`.
    pub state: String,
    /// Why it is dead, as `/metrics` counts it (`endpoint unanswered`, …).
    pub cause: Option<String>,
    /// The cause in words.
    pub detail: Option<String>,
    /// How long it has been dead.
    pub dead_secs: Option<u64>,
}

/// One pair's post-quantum protection (the post-quantum task keeps one per pair).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PqPairInfo {
    pub node: String,
    /// When the round of the PSK in force began (ms since the Unix epoch): the pair is
    /// protected; `None`: classical.
    pub round_ms: Option<u64>,
    /// Rounds completed since the agent started.
    pub rounds: u64,
    /// Why the pair is classical, when it is.
    pub classical_because: Option<String>,
    /// The last of the pair's messages that was refused, and why.
    pub last_refusal: Option<String>,
}

/// The rows of the post-quantum task's `status`, by node.
fn pq_rows(status: &BTreeMap<weft_crypto::PublicKey, crate::pq::PairStatus>) -> Vec<PqPairInfo> {
    let mut rows: Vec<PqPairInfo> = status.values().cloned().collect();
    rows.sort_by(|a, b| a.node.cmp(&b.node));
    rows
}

/// A change the agent's checks made to put back what something else had changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repair {
    pub what: String,
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
}

/// How many repairs the snapshot keeps.
pub const REPAIRS_KEPT: usize = 16;

impl Snapshot {
    /// Records the changes a check made, at `at_ms`.
    pub fn repaired(&mut self, changes: &[String], at_ms: u64) {
        self.repairs.extend(changes.iter().map(|what| Repair {
            what: what.clone(),
            at_ms,
        }));
        let excess = self.repairs.len().saturating_sub(REPAIRS_KEPT);
        self.repairs.drain(..excess);
    }
}

/// One peer's underlay path: its MTU as measured, and what weft did about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathInfo {
    pub node: String,
    pub address: IpAddr,
    /// The path's MTU as last measured; `None`: not measured yet, or not answered.
    pub path_mtu: Option<u32>,
    /// When it was last measured (milliseconds since the Unix epoch); `None`: never.
    pub measured_ms: Option<u64>,
    /// A measurement was made and the peer answered none of it.
    pub unanswered: bool,
    /// What the backend wraps around a pod packet on this path.
    pub overhead: u32,
    /// The MTU the peer's routes carry: the path is narrower than the pod MTU.
    pub route_mtu: Option<u32>,
}

/// The plan's paths with the prober's latest measurement of each.
pub fn path_rows(
    state: &DesiredState,
    measured: &BTreeMap<IpAddr, crate::pathmtu::Measurement>,
) -> Vec<PathInfo> {
    state
        .paths
        .iter()
        .map(|p| {
            let m = measured.get(&p.address);
            PathInfo {
                node: p.node.clone(),
                address: p.address,
                path_mtu: p.path_mtu,
                measured_ms: m.and_then(|m| {
                    let since =
                        m.at.duration_since(std::time::SystemTime::UNIX_EPOCH)
                            .ok()?;
                    u64::try_from(since.as_millis()).ok()
                }),
                unanswered: m.is_some_and(|m| m.mtu.is_none()),
                overhead: p.overhead,
                route_mtu: p.route_mtu,
            }
        })
        .collect()
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NftTable {
    /// `ip` or `ip6`.
    pub family: String,
    pub table: String,
    pub rules: Value,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeftOutInfo {
    pub node: String,
    pub reason: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RegistryEntry {
    pub subnet: Option<IpNet>,
    pub public_ip: Option<IpAddr>,
    pub backend_type: String,
    pub backend_data: Option<Value>,
    /// `backend-v6-data` (the IPv6 devices' data).
    #[serde(default)]
    pub backend_v6_data: Option<Value>,
}

/// The agent's current snapshot, shared between the control loop and the servers.
#[derive(Clone, Default)]
pub struct Shared(Arc<RwLock<Inner>>);

#[derive(Default)]
struct Inner {
    snapshot: Snapshot,
    /// The last plan and the view it came from, whose rows (`peers`, `registry`) are not
    /// written into `snapshot` yet: they are made when someone reads it, not once a pass.
    /// At 10,000 nodes they were a tenth of every pass.
    rows: Option<(Arc<ClusterView>, Arc<DesiredState>)>,
    /// The last plan's paths and the prober's measurements: the `paths` rows are made
    /// when the snapshot is read, with the measurements then.
    paths: Option<(Arc<DesiredState>, Measurements)>,
    /// The post-quantum manager's pairs: the `post_quantum` rows are made from them when
    /// the snapshot is read.
    pq: Option<PqStatus>,
    /// This node's relay, read when the snapshot is.
    relay: Option<Arc<weft_backends::userspace::relay::Relay>>,
}

/// The post-quantum manager's status of each pair (`pq::Handles::status`).
pub type PqStatus = Arc<std::sync::Mutex<BTreeMap<weft_crypto::PublicKey, crate::pq::PairStatus>>>;

/// The path MTU prober's latest measurement of each path (`pathmtu::Handle`).
pub type Measurements = Arc<std::sync::Mutex<BTreeMap<IpAddr, crate::pathmtu::Measurement>>>;

impl Inner {
    fn current(&mut self) -> &Snapshot {
        if let Some((view, state)) = self.rows.take() {
            from_plan_rows(&view, &state, &mut self.snapshot);
        }
        if let Some((state, measured)) = &self.paths {
            if let Ok(measured) = measured.lock() {
                self.snapshot.paths = path_rows(state, &measured);
            }
        }
        if let Some(status) = &self.pq {
            if let Ok(status) = status.lock() {
                self.snapshot.post_quantum = pq_rows(&status);
            }
        }
        self.snapshot.relay = self.relay.as_deref().map(crate::relay::info);
        &self.snapshot
    }
}

impl Snapshot {
    /// The WireGuard key this node publishes, decoded as its peers decode it.
    pub fn published_key(&self) -> Option<weft_crypto::PublicKey> {
        weft_backends::plan::WireguardData::decode(self.published.as_ref())
            .ok()
            .map(|d| d.public_key)
    }
}

impl Shared {
    pub fn get(&self) -> Snapshot {
        self.read(Snapshot::clone).unwrap_or_default()
    }

    /// What `f` reads from the snapshot, without copying all of it.
    pub fn read<T>(&self, f: impl FnOnce(&Snapshot) -> T) -> Option<T> {
        self.0.write().ok().map(|mut s| f(s.current()))
    }

    /// The relay this node runs, read each time the snapshot is (`None`: none).
    pub fn relay(&self, relay: Option<Arc<weft_backends::userspace::relay::Relay>>) {
        if let Ok(mut s) = self.0.write() {
            s.relay = relay;
        }
    }

    /// What `f` reads from the snapshot's own facts, leaving the rows derived from the plan
    /// (`peers`, `registry`, `paths`) unmade: `f` must not read them. For the control
    /// loop's own reads, which would otherwise make a row per node every pass.
    pub fn facts<T>(&self, f: impl FnOnce(&Snapshot) -> T) -> Option<T> {
        self.0.read().ok().map(|s| f(&s.snapshot))
    }

    /// Changes the snapshot; `f` must not read the plan's rows (`peers`, `registry`),
    /// which may not be written yet.
    pub fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        if let Ok(mut s) = self.0.write() {
            f(&mut s.snapshot);
        }
    }

    /// The parts of the snapshot `state` (planned for `me` from `view`) determines; its
    /// rows are written when the snapshot is next read.
    pub fn planned(&self, me: &Lease, view: &Arc<ClusterView>, state: &Arc<DesiredState>) {
        if let Ok(mut s) = self.0.write() {
            from_plan_but_rows(me, state, &mut s.snapshot);
            s.rows = Some((view.clone(), state.clone()));
        }
    }

    /// The post-quantum pairs' rows, made from `status` when the snapshot is read.
    pub fn post_quantum(&self, status: &PqStatus) {
        if let Ok(mut s) = self.0.write() {
            if !s.pq.as_ref().is_some_and(|had| Arc::ptr_eq(had, status)) {
                s.pq = Some(status.clone());
            }
        }
    }

    /// The paths of `state`, with what the prober measured of them when the snapshot is
    /// read (`paths`).
    pub fn paths(&self, state: &Arc<DesiredState>, measured: &Measurements) {
        if let Ok(mut s) = self.0.write() {
            s.paths = Some((state.clone(), measured.clone()));
        }
    }
}

/// A WireGuard pair's path in words.
pub fn path_words(via: &weft_backends::model::Via) -> String {
    match via {
        weft_backends::model::Via::Direct => "direct".into(),
        weft_backends::model::Via::Gateway(g) => format!("via {g}"),
        weft_backends::model::Via::NoPath(why) => format!("no path: {why}"),
    }
}

/// One row per peer of each device (WireGuard, vxlan, ipsec, ipip) and per node reached by a
/// plain route (host-gw, DirectRouting), sorted by node.
fn peer_rows(view: &ClusterView, state: &DesiredState) -> Vec<PeerInfo> {
    // A dual-stack node is a peer of each family's device: one row each, with that
    // family's subnet.
    let subnet_of = |node: &str, v6: bool| {
        let lease = view.get(node)?;
        if v6 {
            lease.subnet_v6
        } else {
            lease.subnet
        }
    };
    let mut peers = Vec::new();
    for t in &state.tunnels {
        for p in &t.peers {
            let v6 = p.allowed_ips.first().is_some_and(|n| n.addr().is_ipv6());
            peers.push(PeerInfo {
                node: p.node.clone(),
                subnet: subnet_of(&p.node, v6),
                endpoint: Some(p.endpoint.to_string()),
                public_key: Some(p.public_key.to_string()),
                vtep_mac: None,
                device: Some(t.device.clone()),
                path: Some(path_words(&p.via)),
                ..PeerInfo::default()
            });
        }
    }
    for v in &state.vxlan {
        for p in &v.peers {
            peers.push(PeerInfo {
                node: p.node.clone(),
                subnet: subnet_of(&p.node, p.gateway.is_ipv6()),
                endpoint: Some(p.public_ip.to_string()),
                public_key: None,
                vtep_mac: Some(format_mac(&p.mac)),
                device: Some(v.device.clone()),
                ..PeerInfo::default()
            });
        }
    }
    for s in state.ipsec.iter() {
        for p in &s.peers {
            peers.push(PeerInfo {
                node: p.node.clone(),
                subnet: Some(p.subnet),
                endpoint: Some(p.remote.to_string()),
                public_key: Some(p.public_key.to_string()),
                device: Some(s.device.clone()),
                spi_in: Some(p.spi_in()),
                spi_out: Some(p.outbound.spi),
                ..PeerInfo::default()
            });
        }
    }
    // Nodes reached by a route alone: a plain one (host-gw, DirectRouting), or one through
    // the ipip device, whose peers are its routes.
    let ipip = state.ipip.as_ref().map(|i| i.device.as_str());
    for r in &state.routes {
        let (node, device) = match &r.role {
            RouteRole::Direct(node) => (node, None),
            RouteRole::Peer(node) if Some(r.device.as_str()) == ipip => {
                (node, Some(r.device.clone()))
            }
            _ => continue,
        };
        if !peers.iter().any(|p| &p.node == node) {
            peers.push(PeerInfo {
                node: node.clone(),
                subnet: Some(r.dst),
                endpoint: r.via.map(|v| v.to_string()),
                device,
                ..PeerInfo::default()
            });
        }
    }
    peers.sort_by(|a, b| a.node.cmp(&b.node));
    peers
}

/// The rows of a snapshot a plan determines: a peer's, a registry entry's.
fn from_plan_rows(view: &ClusterView, state: &DesiredState, snapshot: &mut Snapshot) {
    snapshot.peers = peer_rows(view, state);
    snapshot.registry = view
        .leases
        .iter()
        .map(|(name, l)| {
            (
                name.to_string(),
                RegistryEntry {
                    subnet: l.subnet,
                    public_ip: l.public_ip.map(IpAddr::V4),
                    backend_type: l.backend_type.clone(),
                    backend_data: l.backend_data.clone(),
                    backend_v6_data: l.backend_v6_data.clone(),
                },
            )
        })
        .collect();
}

/// The parts of a snapshot a plan determines, but for its rows.
fn from_plan_but_rows(me: &Lease, state: &DesiredState, snapshot: &mut Snapshot) {
    snapshot.node = me.node.clone();
    snapshot.subnet = me.subnet;
    snapshot.backend = me.backend_type.clone();
    snapshot.public_ip = me.public_ip.map(IpAddr::V4);
    snapshot.published = me.backend_data.clone();
    snapshot.device = state
        .tunnels
        .first()
        .map(|t| t.device.clone())
        .or_else(|| state.vxlan.first().map(|v| v.device.clone()))
        .or_else(|| state.ipip.as_ref().map(|i| i.device.clone()))
        .or_else(|| state.ipsec.as_ref().map(|i| i.device.clone()));
    snapshot.ip_masq = !state.masquerade.is_empty();
    snapshot.masquerade = state
        .masquerade
        .iter()
        .map(|t| NftTable {
            family: t.family.nft().to_string(),
            table: t.table.to_string(),
            rules: expected_rules(t),
        })
        .collect();
    snapshot.vxlan_port = state
        .vxlan
        .first()
        .map(|v| if v.port == 0 { 8472 } else { v.port });
    snapshot.backends = backends_info(me, state);
    snapshot.left_out = state
        .left_out
        .iter()
        .map(|l| LeftOutInfo {
            node: l.node.clone(),
            reason: l.reason.to_string(),
        })
        .collect();
}

/// Peers per backend, the pairs in clear and the old backends `me` still speaks.
fn backends_info(me: &Lease, state: &DesiredState) -> BackendsInfo {
    let mut peers: BTreeMap<String, usize> = BTreeMap::new();
    let mut clear = Vec::new();
    if state.pair_backends.is_empty() {
        let nodes: std::collections::BTreeSet<&str> = state
            .routes
            .iter()
            .filter_map(|r| match &r.role {
                weft_backends::model::RouteRole::Peer(n)
                | weft_backends::model::RouteRole::Direct(n) => Some(n.as_str()),
                _ => None,
            })
            .collect();
        if !nodes.is_empty() {
            peers.insert(me.backend_type.clone(), nodes.len());
        }
    }
    for p in &state.pair_backends {
        *peers.entry(p.backend.as_str().to_string()).or_default() += 1;
        if let Some(why) = &p.why_clear {
            clear.push(ClearPairInfo {
                node: p.node.clone(),
                why: why.clone(),
            });
        }
    }
    BackendsInfo {
        peers,
        clear,
        also: me.also.keys().cloned().collect(),
    }
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
mod tests;
