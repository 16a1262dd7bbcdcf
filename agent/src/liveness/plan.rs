//! The plan as the watcher holds it: the loop's, shared, with a copy of a device only
//! where the registry publishes a peer's endpoint otherwise (one kept from roaming).

use std::net::SocketAddr;
use std::sync::Arc;

use weft_backends::model::{DesiredState, PeerSpec, TunnelSpec};
use weft_backends::plan::PatchedNode;
use weft_crypto::PublicKey;

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
    pub(super) state: Arc<DesiredState>,
    /// Per tunnel of `state`: its copy with the published endpoints, where they differ.
    pub(super) published: Vec<Option<TunnelSpec>>,
    /// A key rotation is in its switch window: peers' entries move outside the passes
    /// (the key-switch watcher), so drift is not looked for.
    pub switching: bool,
    /// The underlay addresses whose path MTU was measured: they answer (`Book::answering`).
    pub answering: std::collections::HashSet<std::net::IpAddr>,
}

impl Plan {
    /// Plan `state` as the watcher holds it, `published` its devices' copies (`published`).
    pub(super) fn new(
        generation: u64,
        own: PublicKey,
        state: &Arc<DesiredState>,
        published: Vec<Option<TunnelSpec>>,
    ) -> Plan {
        Plan {
            generation,
            own,
            state: state.clone(),
            published,
            switching: state.key_watch.is_some(),
            answering: state
                .paths
                .iter()
                .filter(|p| p.path_mtu.is_some())
                .map(|p| p.address)
                .collect(),
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
    pub(super) fn is_of(&self, state: &Arc<DesiredState>, own: PublicKey) -> bool {
        self.own == own
            && self.switching == state.key_watch.is_some()
            && (Arc::ptr_eq(&self.state, state) || is_published(self.tunnels(), state))
    }
}

/// `published(state)` for `state` patched from `held`'s plan, looking at its re-planned
/// `nodes` alone; `None` when their peers are as held. A device whose every peer had the
/// registry's endpoint keeps none of its own unless a re-planned peer differs; one held
/// as its own copy is made again.
pub(super) fn patched_published(
    held: &Plan,
    state: &DesiredState,
    nodes: &[PatchedNode],
) -> Option<Vec<Option<TunnelSpec>>> {
    let endpoints = Published::of(state);
    fn find<'p>(peers: &'p [PeerSpec], key: &PublicKey) -> Option<&'p PeerSpec> {
        peers.iter().find(|p| p.public_key == *key)
    }
    let unchanged = nodes.iter().all(|n| {
        n.before == n.after
            && n.after.iter().all(|(d, key)| {
                let have = held.tunnels().nth(*d).and_then(|t| find(&t.peers, key));
                let want = state.tunnels.get(*d).and_then(|t| {
                    let p = find(&t.peers, key)?;
                    Some((endpoints.endpoint(&t.device, p), p))
                });
                matches!((have, want), (Some(h), Some((e, w))) if same_peer(h, w, e))
            })
    });
    if unchanged {
        return None;
    }
    let published = state.tunnels.iter().enumerate().map(|(d, tunnel)| {
        let was_shared = held.published.get(d).is_some_and(Option::is_none);
        let differs = !was_shared
            || nodes.iter().flat_map(|n| &n.after).any(|(at, key)| {
                *at == d
                    && tunnel.peers.iter().any(|p| {
                        p.public_key == *key && endpoints.endpoint(&tunnel.device, p) != p.endpoint
                    })
            });
        differs
            .then(|| published_copy(tunnel, &endpoints))
            .flatten()
    });
    Some(published.collect())
}

/// Per tunnel of the plan, its copy with each peer's endpoint as the registry publishes
/// it, where one differs. The plan keeps an endpoint the device learned by roaming (or
/// that was set by hand: the agent cannot tell them apart) while its session is fresh; a
/// pair dead on such an endpoint is repaired onto the published one, which is also what
/// its cause names.
pub(super) fn published(state: &DesiredState) -> Vec<Option<TunnelSpec>> {
    let endpoints = Published::of(state);
    state
        .tunnels
        .iter()
        .map(|tunnel| published_copy(tunnel, &endpoints))
        .collect()
}

/// `tunnel` with its peers' endpoints as the registry publishes them, if one differs.
fn published_copy(tunnel: &TunnelSpec, endpoints: &Published<'_>) -> Option<TunnelSpec> {
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
pub(super) fn is_published<'a>(
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
                && (have.peers.iter().zip(&want.peers))
                    .all(|(h, w)| same_peer(h, w, endpoints.endpoint(&want.device, w)))
        })
}

/// Whether `have` is planned peer `want` with the registry's endpoint `published`.
fn same_peer(have: &PeerSpec, want: &PeerSpec, published: SocketAddr) -> bool {
    // Every field named: one added later is compared too.
    let PeerSpec {
        node,
        public_key,
        endpoint: _,
        allowed_ips,
        keepalive,
        psk,
        via,
    } = want;
    have.endpoint == published
        && have.node == *node
        && have.public_key == *public_key
        && have.allowed_ips == *allowed_ips
        && have.keepalive == *keepalive
        && have.psk == *psk
        && have.via == *via
}
