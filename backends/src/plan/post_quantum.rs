//! Post-quantum pairs (`Backend.PostQuantum`): the peers this node runs rounds with, from
//! the plan's peers and the ML-KEM keys they publish, and the PSK each WireGuard peer gets
//! from a completed round. Pure: the rounds themselves are the agent's.

use std::collections::BTreeMap;
use std::net::IpAddr;

use weft_crypto::pq::EncapsKey;
use weft_crypto::{PresharedKey, PublicKey};

use super::PlanInput;
use crate::model::{DesiredState, PeerSpec, PqKey, PqPeer};
use crate::netconf::{Backend, NetConf, WireguardConf};

/// Whether the config asks for post-quantum rounds.
pub fn enabled(config: &NetConf) -> bool {
    match &config.backend {
        Backend::Wireguard(w) => w.post_quantum,
        Backend::Ipsec(i) => i.post_quantum,
        _ => false,
    }
}

/// The PSK of the WireGuard peer with `key`: the pair's post-quantum PSK combined with the
/// cluster's, or the cluster's alone while the pair is classical.
pub(super) fn peer_psk(
    input: &PlanInput<'_>,
    wg: &WireguardConf,
    key: &PublicKey,
) -> Option<PresharedKey> {
    match input.pair_psks.get(key).filter(|_| wg.post_quantum) {
        Some(pair) => Some(weft_crypto::pq::combine(&pair.psk, wg.psk.as_ref())),
        None => wg.psk.clone(),
    }
}

/// Notes in `state` every planned peer's part in post-quantum rounds.
pub(super) fn add(state: &mut DesiredState, input: &PlanInput<'_>) {
    if !enabled(input.config) {
        return;
    }
    // Peers by node, with the key in use and the address the rounds go to: a WireGuard
    // peer's tunnel address (of a peer with AllowedIPs, not a next key staged beside it;
    // IPv4 first); an ipsec peer's public IP. An ipsec pair's tunnel is keyed with the
    // secret itself, so two nodes holding different secrets (one lost its saved state)
    // could not carry a round through it to mend that; between the public IPs, outside
    // the policies, the next round always arrives.
    // The underlay address: the registry's endpoint (not one learned by roaming).
    let mut peers_of: BTreeMap<&str, PqParts> = BTreeMap::new();
    let wireguard = state.tunnels.iter().flat_map(|t| {
        t.peers
            .iter()
            .filter_map(|p| Some((p.node.as_str(), wg_part(state, &t.device, p)?)))
    });
    let ipsec = state.ipsec.iter().flat_map(|s| &s.peers).map(|p| {
        let remote = std::net::IpAddr::V4(p.remote);
        (p.node.as_str(), (p.public_key, remote, remote))
    });
    for (node, part) in wireguard.chain(ipsec) {
        merge(peers_of.entry(node).or_insert(part), part);
    }
    state.post_quantum = peers_of
        .into_iter()
        .map(|(node, parts)| pq_peer(input, node, parts))
        .collect();
}

/// A peer's part in post-quantum rounds: its key in use, the address the rounds go to,
/// its underlay address.
pub(super) type PqParts = (PublicKey, IpAddr, IpAddr);

/// What WireGuard entry `p` of `device` gives its node's rounds: none for a next key
/// staged beside the current one (no AllowedIPs).
pub(super) fn wg_part(state: &DesiredState, device: &str, p: &PeerSpec) -> Option<PqParts> {
    let net = p.allowed_ips.iter().min_by_key(|n| n.addr().is_ipv6())?;
    let endpoint = (state.planned_endpoints)
        .get(&(device.into(), p.public_key))
        .unwrap_or(&p.endpoint);
    Some((p.public_key, net.network(), endpoint.ip()))
}

/// A node's parts, the first entry's, with an IPv4 address where a later entry has one.
pub(super) fn merge(parts: &mut PqParts, later: PqParts) {
    if later.1.is_ipv4() && parts.1.is_ipv6() {
        parts.1 = later.1;
    }
}

/// The post-quantum peer `node` is, with the ML-KEM key it publishes.
pub(super) fn pq_peer(input: &PlanInput<'_>, node: &str, parts: PqParts) -> PqPeer {
    let (public_key, address, underlay) = parts;
    let ek = match input
        .view
        .leases
        .get(node)
        .and_then(|l| l.ml_kem_key.as_deref())
    {
        None => PqKey::None,
        Some(text) => match EncapsKey::from_base64(text) {
            Ok(ek) => PqKey::Published(ek),
            Err(e) => PqKey::Bad(format!("its ML-KEM key does not decode: {e}")),
        },
    };
    PqPeer {
        node: node.to_string(),
        public_key,
        address,
        underlay,
        ek,
    }
}
