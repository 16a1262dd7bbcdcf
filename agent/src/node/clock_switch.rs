//! A peer's next key taken over by this node's clock, with no handshake on it seen: one
//! packet into the tunnel towards the peer (an ICMP echo to its tunnel address, the
//! liveness probe) makes the device start that key's handshake at once.
//!
//! The rotating node starts one handshake with each peer when it switches. A peer whose
//! control loop was busy then (a full pass takes seconds under the VM's emulation) had not
//! staged the key yet and dropped it; WireGuard retries only after 5 s, while the peer, on
//! the clock, has left the old key's session: the pair carried nothing until a packet
//! happened to go the other way. Seen in the VM: a hole of 2 s at 100 pps.

use std::collections::BTreeSet;

use tracing::{info, warn};
use weft_backends::model::DesiredState;
use weft_backends::plan::liveness::probe_target;
use weft_crypto::PublicKey;

use crate::liveness::probe::Prober;

#[derive(Default)]
pub(super) struct ClockSwitches {
    prober: Prober,
    /// The keys already sent a packet, while the plan still switches them on the clock.
    nudged: BTreeSet<PublicKey>,
}

impl ClockSwitches {
    /// After a pass that programmed `state`: one packet to each newly clock-switched peer.
    pub(super) fn programmed(&mut self, state: &DesiredState) {
        self.nudged.retain(|k| state.switched_on_clock.contains(k));
        let peers = state.tunnels.iter().flat_map(|t| &t.peers);
        for peer in peers.filter(|p| state.switched_on_clock.contains(&p.public_key)) {
            if !self.nudged.insert(peer.public_key) {
                continue;
            }
            let Some(to) = probe_target(peer) else {
                continue;
            };
            match self.prober.send(to) {
                Ok(()) => info!(
                    node = %peer.node,
                    %to,
                    "a peer's next key taken over by the clock: one packet into the tunnel starts its handshake"
                ),
                Err(e) => {
                    warn!(node = %peer.node, error = %e, "starting the handshake with a peer's next key")
                }
            }
        }
    }
}
