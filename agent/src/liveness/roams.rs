//! Relayed pairs whose device roamed to another endpoint than the plan's: the peer's
//! handshake came through another gateway. The loop is told once per endpoint, and plans
//! again with the device read afresh, so this end follows the gateway the pair is on
//! (`weft_backends::plan::relay`).

use std::collections::HashMap;
use std::net::SocketAddr;

use tokio::sync::mpsc;
use tracing::debug;
use weft_backends::model::TunnelSpec;
use weft_backends::plan::liveness::PeerRead;
use weft_crypto::PublicKey;

use super::PathEvent;

/// Tells `events` of each relayed peer of `spec` whose read endpoint is not the planned
/// one, unless `told` already has it at that endpoint.
pub(super) fn tell(
    told: &mut HashMap<PublicKey, SocketAddr>,
    spec: &TunnelSpec,
    reads: &HashMap<PublicKey, PeerRead>,
    events: &mpsc::UnboundedSender<PathEvent>,
) {
    for peer in spec.peers.iter().filter(|p| p.via.gateway().is_some()) {
        let Some(at) = reads.get(&peer.public_key).and_then(|r| r.endpoint) else {
            continue;
        };
        if at == peer.endpoint {
            told.remove(&peer.public_key);
            continue;
        }
        if told.insert(peer.public_key, at) != Some(at) {
            debug!(node = %peer.node, endpoint = %at, planned = %peer.endpoint, "relayed pair roamed: planning again");
            let _ = events.send(PathEvent::Roamed(peer.node.clone()));
        }
    }
}
