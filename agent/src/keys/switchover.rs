//! When a peer's announced key takes over on this node (docs/key-rotation.md): the loop's
//! memory of what the device showed, nothing more. The decision is the planner's
//! (`weft_backends::plan`, `rotated`): an announced key takes over once it has handshaken
//! on our device, and at the latest `SWITCH_GRACE` after its moment.
//!
//! The rotating node switches its device at the announced moment and at once starts a
//! handshake with every peer; here that handshake lands on the staged entry of its next
//! key. The plan says when to look (`KeyWatch`: from shortly before the moment until the
//! grace is over); the loop reads the device's handshakes then, every `HANDSHAKE_POLL`,
//! and each announced key seen handshaking is recorded here and becomes a plan input.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use weft_backends::model::{ClusterView, KeyWatch, Observed};
use weft_crypto::PublicKey;

#[derive(Default)]
pub struct Switchover {
    observed: Observed,
    /// When the device was last read for a watch.
    last_poll: Option<SystemTime>,
}

impl Switchover {
    /// What the plan takes as input. Keys no peer announces any more are forgotten first.
    /// Announced keys seen for the first time are noted at `now` (`SEEN_LEAD`).
    pub fn observed(&mut self, view: &ClusterView, me: &str, now: SystemTime) -> &Observed {
        let announced: Vec<PublicKey> = view
            .leases
            .values()
            .filter(|l| l.node != me)
            .filter_map(|l| l.next_key.as_ref()?.public_key.parse().ok())
            .collect();
        self.observed
            .next_keys_in_use
            .retain(|k| announced.contains(k));
        self.observed
            .next_keys_seen
            .retain(|k, _| announced.contains(k));
        for key in announced {
            self.observed.next_keys_seen.entry(key).or_insert(now);
        }
        &self.observed
    }

    /// When to read the device next for `watch` (the last plan's), if at all.
    pub fn poll_at(&self, watch: Option<&KeyWatch>, now: SystemTime) -> Option<SystemTime> {
        watch?.next_poll(self.last_poll, now)
    }

    /// Records a read of the device at `now`: the watched keys that have handshaken are in
    /// use. True if one newly is (then the node plans again).
    pub fn observe(
        &mut self,
        watch: &KeyWatch,
        handshakes: &HashMap<PublicKey, Duration>,
        now: SystemTime,
    ) -> bool {
        self.last_poll = Some(now);
        let mut new = false;
        for key in watch.keys.iter().filter(|k| handshakes.contains_key(k)) {
            if self.observed.next_keys_in_use.insert(*key) {
                tracing::info!(
                    key = %key,
                    "a peer's announced key has handshaken: switching to it"
                );
                new = true;
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_backends::model::{Lease, LeaseAttrs, NextKey, HANDSHAKE_POLL, WATCH_BEFORE};

    fn lease(node: &str, next: Option<NextKey>) -> Lease {
        let mut l = LeaseAttrs {
            public_ip: None,
            public_ipv6: None,
            backend_type: "wireguard".into(),
            backend_data: None,
            backend_v6_data: None,
            next_key: None,
            key_proof: None,
        }
        .into_lease(node.into(), None, None);
        l.next_key = next;
        l
    }

    #[test]
    fn a_handshaken_key_is_remembered_while_it_is_announced() {
        let key = weft_crypto::PrivateKey::from_bytes([9; 32]).public_key();
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let watch = KeyWatch {
            keys: vec![key],
            from: t - WATCH_BEFORE,
            until: t + Duration::from_secs(2),
        };
        let mut view = ClusterView::default();
        view.insert(lease("me", None));
        view.insert(lease(
            "peer",
            Some(NextKey {
                public_key: key.to_string(),
                switch_at_ms: 1_000_000,
                generation: 2,
            }),
        ));
        let mut s = Switchover::default();
        assert_eq!(
            s.poll_at(Some(&watch), t - Duration::from_secs(9)),
            Some(t - WATCH_BEFORE)
        );
        assert!(!s.observe(&watch, &HashMap::new(), t));
        assert_eq!(s.poll_at(Some(&watch), t), Some(t + HANDSHAKE_POLL));
        assert!(s.observe(&watch, &HashMap::from([(key, Duration::from_secs(1))]), t));
        assert!(!s.observe(&watch, &HashMap::from([(key, Duration::from_secs(1))]), t));
        assert!(s
            .observed(&view, "me", SystemTime::now())
            .next_keys_in_use
            .contains(&key));
        // Once no peer announces it, it is forgotten.
        view.insert(lease("peer", None));
        assert!(s
            .observed(&view, "me", SystemTime::now())
            .next_keys_in_use
            .is_empty());
    }
}
