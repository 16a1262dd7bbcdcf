//! Test fixtures shared by the planner's and the appliers' unit tests.

use weft_crypto::{PrivateKey, PublicKey};

use super::{PeerSpec, TunnelSpec};

/// A public key made from one repeated byte.
pub fn key(seed: u8) -> PublicKey {
    PrivateKey::from_bytes([seed; 32]).public_key()
}

/// `flannel-wg` on port 51820, MTU 1420, with `peers`.
pub fn tunnel(peers: Vec<PeerSpec>) -> TunnelSpec {
    TunnelSpec {
        device: "flannel-wg".into(),
        listen_port: 51820,
        mtu: 1420,
        addresses: vec![],
        peers,
    }
}
