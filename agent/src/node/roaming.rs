//! What the loop remembers of its WireGuard peers between passes, for the plan's
//! `Observed`: the endpoint each peer was planned with, and when this agent last set it.
//! Joined with what the device holds now, it is all the planner needs to decide whether a
//! peer keeps an endpoint learned by roaming (`weft_backends::plan::roaming`).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::SystemTime;

use weft_backends::model::{DesiredState, PeerObserved};
use weft_crypto::PublicKey;

#[derive(Default)]
pub(super) struct Roaming {
    planned: HashMap<PublicKey, SocketAddr>,
    set_at: HashMap<PublicKey, SystemTime>,
}

impl Roaming {
    /// The device's peers with this memory, as the plan takes them.
    pub(super) fn observed(
        &self,
        mut device: BTreeMap<PublicKey, PeerObserved>,
    ) -> BTreeMap<PublicKey, PeerObserved> {
        for (key, peer) in device.iter_mut() {
            peer.planned_before = self.planned.get(key).copied();
            peer.endpoint_set = self.set_at.get(key).copied();
        }
        device
    }

    /// Remembers a pass: the endpoints `state` planned, the peers whose endpoint the data
    /// plane set (`set`), and the peers seen for the first time.
    pub(super) fn passed(&mut self, state: &DesiredState, set: &[PublicKey], now: SystemTime) {
        self.planned.extend(&state.planned_endpoints);
        for key in set {
            self.set_at.insert(*key, now);
        }
        for key in state.planned_endpoints.keys() {
            self.set_at.entry(*key).or_insert(now);
        }
    }
}
