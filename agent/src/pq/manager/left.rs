//! Pairs whose peer left the listing: kept, with their PSKs, for the peer's return (a
//! registry restored from a snapshot, a lease lost and claimed again), within bounds.

use tracing::debug;
use weft_crypto::PublicKey;

use super::{Kept, Manager};

/// How long, and for how many peers at most, the state of a pair whose peer left the
/// listing is kept for its return (`Manager::left`).
const LEFT_KEPT_MS: u64 = 600_000;
const LEFT_MAX: usize = 4096;

impl Manager {
    /// Keeps the PSKs of `key`'s pair, whose peer left the listing, for its return.
    pub(super) fn keep_for_return(&mut self, key: PublicKey, now: u64) {
        let Some(pair) = self.pairs.get_mut(&key) else {
            return;
        };
        let kept = Kept {
            current: pair.ex.psk(now).cloned(),
            next: pair.ex.pending().cloned(),
        };
        if !kept.is_empty() {
            debug!(peer = %pair.node, "post-quantum pair kept for the peer's return");
            self.restored.insert(key, kept);
            self.left.insert(key, now);
        }
    }

    /// Drops what `left` holds past `LEFT_KEPT_MS`, and the oldest past `LEFT_MAX`.
    pub(super) fn prune_left(&mut self, now: u64) {
        let mut by_age: Vec<(u64, PublicKey)> = self.left.iter().map(|(k, t)| (*t, *k)).collect();
        by_age.sort_unstable();
        let over = by_age.len().saturating_sub(LEFT_MAX);
        for (i, (at, key)) in by_age.into_iter().enumerate() {
            if i < over || now.saturating_sub(at) > LEFT_KEPT_MS {
                self.left.remove(&key);
                self.restored.remove(&key);
                self.dirty.insert(key);
            }
        }
    }
}
