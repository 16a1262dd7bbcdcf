//! ESP keys for the ipsec backend, one per direction per node pair, from the two nodes'
//! X25519 keys: HKDF-SHA256 over the X25519 shared secret, salted with the cluster PSK
//! (when set), with an info string binding the algorithm, both public keys, both nodes'
//! epochs and nonces, and the direction. docs/ipsec.md gives the argument.
//!
//! Both nodes compute the same key for one direction: the sender's values come first in
//! the info string, whichever node computes it. A node's `Epoch` changes (with a fresh
//! random nonce) whenever it loses SA state, so every key it takes part in changes too.

use std::fmt;

use ring::hkdf;
use zeroize::Zeroize;

use crate::{PrivateKey, PublicKey};

/// Domain separation: the label every info string starts with.
const LABEL: &[u8] = b"weft ipsec esp v1";
/// Length of a node's epoch nonce.
pub const NONCE_LEN: usize = 16;
/// The longest key material an ESP algorithm here takes (AES-256 or ChaCha20 + 4-byte salt).
pub const MAX_KEY_LEN: usize = 36;

/// One node's key generation for ESP: a counter it persists and bumps, with a random
/// nonce chosen at each bump, so that the same counter reached twice (a lost state file)
/// still gives different keys.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch {
    pub number: u64,
    pub nonce: [u8; NONCE_LEN],
}

impl Epoch {
    /// The epoch after `self`, with a fresh nonce from the system's random source.
    pub fn next(&self) -> Result<Epoch, crate::KeyError> {
        Ok(Epoch {
            number: self.number.saturating_add(1),
            nonce: crate::random_bytes()?,
        })
    }

    /// The first epoch of a node: 1, fresh nonce.
    pub fn first() -> Result<Epoch, crate::KeyError> {
        Epoch {
            number: 0,
            nonce: [0; NONCE_LEN],
        }
        .next()
    }
}

impl fmt::Debug for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not secret, but long; the first bytes identify it in a log.
        write!(
            f,
            "Epoch({} {:02x}{:02x}{:02x}{:02x}…)",
            self.number, self.nonce[0], self.nonce[1], self.nonce[2], self.nonce[3]
        )
    }
}

/// One side of a direction: its public key and epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Party<'a> {
    pub key: &'a PublicKey,
    pub epoch: &'a Epoch,
}

/// Key material for one SA. Zeroed on drop; `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct SaKey {
    bytes: [u8; MAX_KEY_LEN],
    len: usize,
}

impl SaKey {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl fmt::Debug for SaKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SaKey({} bytes, not shown)", self.len)
    }
}

impl Drop for SaKey {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

/// The two keys of one node pair as seen from one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairKeys {
    /// Encrypts what this node sends to the peer.
    pub outbound: SaKey,
    /// Decrypts what the peer sends to this node.
    pub inbound: SaKey,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeriveError {
    /// A low-order peer key: the shared secret would be predictable.
    #[error("the peer's public key gives a non-contributory X25519 result (a low-order point); no key is derived from it")]
    NonContributory,
    #[error("{0} bytes of key material asked for; 1 to {MAX_KEY_LEN} can be derived")]
    Length(usize),
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// The keys this node (`own`, with its epoch) uses with `peer`: `algorithm` names the
/// ESP algorithm (it is bound into the info), `key_len` its key material length, `psk`
/// salts the derivation when the cluster sets one.
pub fn pair_keys(
    own: &PrivateKey,
    own_epoch: &Epoch,
    peer: Party<'_>,
    psk: Option<&[u8]>,
    algorithm: &str,
    key_len: usize,
) -> Result<PairKeys, DeriveError> {
    if key_len == 0 || key_len > MAX_KEY_LEN {
        return Err(DeriveError::Length(key_len));
    }
    let secret = x25519_dalek::StaticSecret::from(*own.as_bytes());
    let shared = secret.diffie_hellman(&x25519_dalek::PublicKey::from(*peer.key.as_bytes()));
    if !shared.was_contributory() {
        return Err(DeriveError::NonContributory);
    }
    let own_public = own.public_key();
    let me = Party {
        key: &own_public,
        epoch: own_epoch,
    };
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, psk.unwrap_or(&[])).extract(shared.as_bytes());
    let direction = |from: Party<'_>, to: Party<'_>| -> Result<SaKey, DeriveError> {
        let info = info(algorithm, key_len, from, to);
        let mut key = SaKey {
            bytes: [0; MAX_KEY_LEN],
            len: key_len,
        };
        prk.expand(&[&info], Len(key_len))
            .and_then(|okm| okm.fill(&mut key.bytes[..key_len]))
            .map_err(|_| DeriveError::Length(key_len))?;
        Ok(key)
    };
    Ok(PairKeys {
        outbound: direction(me, peer)?,
        inbound: direction(peer, me)?,
    })
}

/// `label | algorithm | key length | sender key, epoch, nonce | receiver key, epoch,
/// nonce`, each variable part length-prefixed.
fn info(algorithm: &str, key_len: usize, from: Party<'_>, to: Party<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(200);
    out.extend_from_slice(LABEL);
    out.push(algorithm.len() as u8);
    out.extend_from_slice(algorithm.as_bytes());
    out.push(key_len as u8);
    for p in [from, to] {
        out.extend_from_slice(p.key.as_bytes());
        out.extend_from_slice(&p.epoch.number.to_be_bytes());
        out.extend_from_slice(&p.epoch.nonce);
    }
    out
}

/// The length of an install fingerprint, in hex digits.
pub const FINGERPRINT_LEN: usize = 40;

/// A short fingerprint of one SA key, for the record of what was ever installed: SHA-256,
/// first 20 bytes, as hex. Not reversible to the key. The key alone counts: installing it
/// again under another SPI or address would restart its sequence numbers all the same.
pub fn install_fingerprint(key: &SaKey) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"weft sa key record v2");
    ctx.update(key.as_bytes());
    let digest = ctx.finish();
    digest.as_ref()[..FINGERPRINT_LEN / 2]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

mod store;

pub use store::{EspStore, Loaded, StoreError, EPOCH_FILE, RECORD_FILE};

#[cfg(test)]
mod tests;
