//! The keys that tag path MTU acks: this node's X25519 key and each peer's, from the plan
//! (`Targets`), and the pair key of each peer, derived once per peer and own key. Pure:
//! no I/O.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use tracing::debug;
use weft_crypto::pq::AuthKey;
use weft_crypto::{PrivateKey, PublicKey};

use super::wire::ACK_LABEL;

/// How a path is probed.
pub(super) enum Probing {
    /// No key for the peer (a backend without keys): untagged probes and acks.
    Untagged,
    /// Keyed probes naming `own`, whose acks must bear `pair`'s tag.
    Keyed { own: PublicKey, pair: Arc<AuthKey> },
    /// The peer has a key, and this node none or none that makes a pair key with it: the
    /// path is not probed (its routes keep what they have), never probed untagged.
    Unusable,
}

#[derive(Default)]
pub(super) struct Auth {
    own: Option<PrivateKey>,
    by_address: HashMap<IpAddr, PublicKey>,
    peers: HashSet<PublicKey>,
    /// Pair keys derived so far, by peer key (under `own`).
    derived: HashMap<PublicKey, Arc<AuthKey>>,
}

impl Auth {
    /// Takes the plan's keys: own `own`, the peers' `keys` by address. Pair keys derived
    /// before are kept for the peers still listed under the same own key.
    pub(super) fn update(&mut self, own: Option<&PrivateKey>, keys: &BTreeMap<IpAddr, PublicKey>) {
        if self.own.as_ref() != own {
            self.own = own.cloned();
            self.derived.clear();
        }
        self.by_address = keys.iter().map(|(a, k)| (*a, *k)).collect();
        self.peers = keys.values().copied().collect();
        let peers = &self.peers;
        self.derived.retain(|k, _| peers.contains(k));
    }

    /// The pair key shared with `peer`, if it is a peer of the plan's (a probe naming any
    /// other key gets no answer); one X25519 per peer, however many probes.
    pub(super) fn key_of_peer(&mut self, peer: &PublicKey) -> Option<Arc<AuthKey>> {
        if !self.peers.contains(peer) {
            return None;
        }
        if let Some(key) = self.derived.get(peer) {
            return Some(key.clone());
        }
        let own = self.own.as_ref()?;
        match AuthKey::for_purpose(own, peer, ACK_LABEL) {
            Ok(key) => {
                let key = Arc::new(key);
                self.derived.insert(*peer, key.clone());
                Some(key)
            }
            Err(e) => {
                debug!(peer = %peer, error = %e, "path MTU: no pair key with the peer");
                None
            }
        }
    }

    /// How to probe the path to `to`.
    pub(super) fn probing(&mut self, to: IpAddr) -> Probing {
        let Some(peer) = self.by_address.get(&to).copied() else {
            return Probing::Untagged;
        };
        let own = self.own.as_ref().map(PrivateKey::public_key);
        match (own, self.key_of_peer(&peer)) {
            (Some(own), Some(pair)) => Probing::Keyed { own, pair },
            _ => Probing::Unusable,
        }
    }
}
