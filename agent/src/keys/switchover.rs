//! When a peer's announced key takes over on this node (docs/key-rotation.md): the loop's
//! memory of what the device showed, nothing more. The decision is the planner's
//! (`weft_backends::plan`, `rotated`): an announced key takes over once it has handshaken
//! on our device, and at the latest `SWITCH_GRACE` after its moment.
//!
//! The rotating node switches its device at the announced moment and at once starts a
//! handshake with every peer; here that handshake lands on the staged entry of its next
//! key. The plan says when to look (`KeyWatch`: from shortly before the moment until the
//! grace is over); the key-switch watcher (`switch_watch`) reads the device then, moves the
//! AllowedIPs as soon as the key has handshaken and records it in `Switched`, which
//! becomes a plan input here.

use std::time::SystemTime;

use weft_backends::model::{ClusterView, Observed};
use weft_crypto::PublicKey;

use super::switch_watch::Switched;

#[derive(Default)]
pub struct Switchover {
    observed: Observed,
    /// The next keys the watcher found handshaken (and switched to).
    switched: Switched,
}

impl Switchover {
    /// Plans with what the watcher holding `switched` switches.
    pub fn new(switched: Switched) -> Self {
        Switchover {
            observed: Observed::default(),
            switched,
        }
    }

    /// What the plan takes as input. Keys no peer announces any more are forgotten first.
    /// Announced keys seen for the first time are noted at `now` (`SEEN_LEAD`).
    pub fn observed(&mut self, view: &ClusterView, me: &str, now: SystemTime) -> &Observed {
        let announced: Vec<PublicKey> = view
            .leases
            .values()
            .filter(|l| l.node != me)
            .filter_map(|l| l.next_key.as_ref()?.public_key.parse().ok())
            .collect();
        self.observed.next_keys_in_use = self.switched.keep_only(&announced);
        self.observed
            .next_keys_seen
            .retain(|k, _| announced.contains(k));
        for key in announced {
            self.observed.next_keys_seen.entry(key).or_insert(now);
        }
        &self.observed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_backends::model::{Lease, LeaseAttrs, NextKey};

    fn lease(node: &str, next: Option<NextKey>) -> Lease {
        let mut l = LeaseAttrs {
            backend_type: "wireguard".into(),
            ..Default::default()
        }
        .into_lease(node.into(), None, None);
        l.next_key = next;
        l
    }

    #[test]
    fn a_switched_key_is_planned_with_while_it_is_announced() {
        let key = weft_crypto::PrivateKey::from_bytes([9; 32]).public_key();
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
        let switched = Switched::default();
        let mut s = Switchover::new(switched.clone());
        assert!(s
            .observed(&view, "me", SystemTime::now())
            .next_keys_in_use
            .is_empty());
        // The watcher switches to it.
        assert!(switched.insert(key));
        assert!(s
            .observed(&view, "me", SystemTime::now())
            .next_keys_in_use
            .contains(&key));
        // Once no peer announces it, it is forgotten, by the watcher's record too.
        view.insert(lease("peer", None));
        assert!(s
            .observed(&view, "me", SystemTime::now())
            .next_keys_in_use
            .is_empty());
        assert!(!switched.contains(&key));
    }
}
