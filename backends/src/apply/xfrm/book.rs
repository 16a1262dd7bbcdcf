//! What the ipsec reconciler keeps besides the kernel's states: this node's epoch and the
//! record of every key installed under it (`EspBook`, persisted), and each pair's keys
//! derived once (`KeyCache`).

use std::collections::{HashMap, HashSet};

use weft_crypto::esp::{
    pair_keys, DeriveError, Epoch, EspStore, Loaded, PairKeys, Party, StoreError,
};
use weft_crypto::{PrivateKey, PublicKey};

use crate::model::{EspPq, EspSa, IpsecSpec};

/// This node's epoch and the fingerprints of the states installed under it.
#[derive(Debug)]
pub struct EspBook {
    /// `None`: kept in memory only (tests).
    store: Option<EspStore>,
    epoch: Epoch,
    /// The epoch a rotation left: its keys may still be installed (the record covers it)
    /// while the rotation settles. `None` after a bump or a restart.
    previous: Option<Epoch>,
    pub(super) installed: HashSet<String>,
}

impl EspBook {
    pub fn new(store: Option<EspStore>, loaded: Loaded) -> Self {
        EspBook {
            store,
            epoch: loaded.epoch,
            previous: None,
            installed: loaded.installed,
        }
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// When this node's epoch began: the epoch file's last write (`None` in memory only).
    pub fn epoch_since(&self) -> Option<std::time::SystemTime> {
        let store = self.store.as_ref()?;
        std::fs::metadata(store.epoch_path()).ok()?.modified().ok()
    }

    /// A new epoch (persisted first), with an empty record.
    pub fn bump(&mut self) -> Result<Epoch, StoreError> {
        self.epoch = match &self.store {
            Some(store) => store.bump(&self.epoch)?,
            None => self.epoch.next()?,
        };
        self.previous = None;
        self.installed.clear();
        Ok(self.epoch)
    }

    /// A rotation's next epoch (persisted first): the record goes on, and the keys of the
    /// epoch left may still be installed (each at most once, as ever).
    pub fn advance(&mut self) -> Result<Epoch, StoreError> {
        let next = match &self.store {
            Some(store) => store.advance(&self.epoch)?,
            None => self.epoch.next()?,
        };
        self.previous = Some(self.epoch);
        self.epoch = next;
        Ok(next)
    }

    /// Whether keys of this node's `epoch` may be installed.
    pub(super) fn installs(&self, epoch: &Epoch) -> bool {
        *epoch == self.epoch || Some(*epoch) == self.previous
    }

    pub(super) fn record(&mut self, fingerprints: &[String]) -> Result<(), StoreError> {
        if let Some(store) = &self.store {
            store.record(&self.epoch, fingerprints)?;
        }
        self.installed.extend(fingerprints.iter().cloned());
        Ok(())
    }
}

/// Each pair's keys, derived once (an X25519 and two HKDFs a pair): a steady-state pass
/// derives nothing. Entries a pass did not use are dropped.
#[derive(Default)]
pub struct KeyCache {
    keys: HashMap<CacheKey, PairKeys>,
    used: HashSet<CacheKey>,
    /// A digest of the PSK the keys were derived with: another PSK empties the cache.
    salt: Option<[u8; 32]>,
}

/// This node's public key, the peer's, both epochs, the algorithm, and the slot and a
/// digest of the post-quantum PSK (none for a classical state).
type CacheKey = (
    PublicKey,
    PublicKey,
    Epoch,
    Epoch,
    &'static str,
    Option<(u8, [u8; 32])>,
);

impl std::fmt::Debug for KeyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyCache({} pairs)", self.keys.len())
    }
}

impl KeyCache {
    pub(super) fn pair(
        &mut self,
        own: &PrivateKey,
        spec: &IpsecSpec,
        peer: &PublicKey,
        sa: &EspSa,
    ) -> Result<PairKeys, DeriveError> {
        let alg = spec.algorithm;
        let pq = sa
            .pq
            .as_ref()
            .map(|pq| (pq.slot, digest(pq.psk.as_bytes())));
        let id = (
            own.public_key(),
            *peer,
            sa.local_epoch,
            sa.peer_epoch,
            alg.kernel_name(),
            pq,
        );
        self.used.insert(id);
        if let Some(k) = self.keys.get(&id) {
            return Ok(k.clone());
        }
        let party = Party {
            key: peer,
            epoch: &sa.peer_epoch,
        };
        let cluster = spec.psk.as_ref().map(|k| k.0.as_slice());
        let salt = salt(sa.pq.as_ref(), cluster);
        let keys = pair_keys(
            own,
            &sa.local_epoch,
            party,
            salt.as_ref().map(|s| s.as_slice()),
            alg.kernel_name(),
            alg.key_len(),
        )?;
        self.keys.insert(id, keys.clone());
        Ok(keys)
    }

    /// Empties the cache when the PSK (every key's salt) is not the one it was filled with.
    pub(super) fn salted_with(&mut self, psk: Option<&[u8]>) {
        let salt = psk.map(digest);
        if self.salt != salt {
            self.keys.clear();
            self.salt = salt;
        }
    }

    pub(super) fn sweep(&mut self) {
        let used = std::mem::take(&mut self.used);
        self.keys.retain(|k, _| used.contains(k));
    }
}

/// SHA-256 of a secret: what the cache keeps to tell secrets apart, never the secret.
fn digest(secret: &[u8]) -> [u8; 32] {
    let mut out = [0; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, secret).as_ref());
    out
}

/// The salt of a state's key derivation: the cluster PSK (`cluster`) for a classical
/// state; for a post-quantum one, the pair's post-quantum PSK (32 bytes) followed by the
/// cluster PSK, so the keys hold if either secret does.
fn salt(pq: Option<&EspPq>, cluster: Option<&[u8]>) -> Option<zeroize::Zeroizing<Vec<u8>>> {
    match pq {
        None => cluster.map(|c| zeroize::Zeroizing::new(c.to_vec())),
        Some(pq) => {
            let cluster = cluster.unwrap_or(&[]);
            // Sized at once: no reallocation leaves a copy behind unzeroed.
            let mut out = zeroize::Zeroizing::new(Vec::with_capacity(32 + cluster.len()));
            out.extend_from_slice(pq.psk.as_bytes());
            out.extend_from_slice(cluster);
            Some(out)
        }
    }
}
