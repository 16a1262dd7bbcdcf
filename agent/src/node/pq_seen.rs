//! When this node's loop first planned with each pair's post-quantum PSK.
//!
//! An ipsec pair sends with a new PSK's keys `CONFIRM_GRACE` after the PSK took over, each
//! node by its own clock, and receives on them from the moment it plans with it. A pass
//! that comes seconds late (the loop in a full pass that the machine's load stretched)
//! would install the states to receive on and start sending in one go: a peer late in the
//! same way could not receive yet. Seen in the VM: all three nodes' resync passes
//! outlasted a PSK's moment by 3.7–4.1 s, and the first node to plan sent on keys its peer
//! installed 0.4 s later (24 pings lost). So the plan is given, for a PSK this node first
//! planned with later than its moment, that first moment instead: the grace then runs on
//! each node from when it could receive, and a delay the two nodes share costs nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use weft_backends::model::PairSecret;
use weft_crypto::PublicKey;

/// A PSK's moment is moved only when this node first planned with it this much later: a
/// pass a moment after the PSK took over changes nothing (and copies nothing).
const LATE: std::time::Duration = std::time::Duration::from_millis(500);

/// Only a PSK that replaced another matters (a pair switching from it), and only while the
/// replaced one is still received on: after that the moment no longer changes the plan.
fn switching(secret: &PairSecret, first: SystemTime, now: SystemTime) -> bool {
    secret.previous.is_some() && now < first + weft_backends::plan::IPSEC_PQ_SETTLE
}

/// Each pair's PSK moment as published, and when this node first planned with it.
#[derive(Debug, Default)]
pub(super) struct PqSeen {
    first: HashMap<PublicKey, (SystemTime, SystemTime)>,
}

impl PqSeen {
    /// The PSKs to plan with at `now`: `published`, with the moment of each PSK this node
    /// first planned with more than `LATE` after it moved to that first plan.
    pub(super) fn plan_with(
        &mut self,
        published: Arc<BTreeMap<PublicKey, PairSecret>>,
        now: SystemTime,
    ) -> Arc<BTreeMap<PublicKey, PairSecret>> {
        self.first.retain(|key, _| published.contains_key(key));
        let mut late = Vec::new();
        for (key, secret) in published.iter() {
            let first = match self.first.get(key) {
                Some((since, first)) if *since == secret.since => *first,
                _ => {
                    self.first.insert(*key, (secret.since, now));
                    now
                }
            };
            if first > secret.since + LATE && switching(secret, first, now) {
                late.push((*key, first));
            }
        }
        if late.is_empty() {
            return published;
        }
        let mut moved = (*published).clone();
        for (key, first) in late {
            if let Some(secret) = moved.get_mut(&key) {
                secret.since = first;
            }
        }
        Arc::new(moved)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use weft_crypto::{PresharedKey, PrivateKey};

    fn secret(since: SystemTime) -> PairSecret {
        PairSecret {
            psk: PresharedKey::generate().unwrap(),
            slot: 1,
            since,
            previous: Some((PresharedKey::generate().unwrap(), 2)),
        }
    }

    #[test]
    fn a_psk_first_planned_late_takes_that_moment_and_keeps_it() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let (a, b) = (
            PrivateKey::generate().unwrap().public_key(),
            PrivateKey::generate().unwrap().public_key(),
        );
        let published = Arc::new(BTreeMap::from([(a, secret(t0)), (b, secret(t0))]));
        let mut seen = PqSeen::default();
        // On time: nothing moved, nothing copied.
        let on_time = seen.plan_with(published.clone(), t0 + Duration::from_millis(200));
        assert!(Arc::ptr_eq(&on_time, &published));

        // `b`'s next PSK is first planned 3.7 s after its moment: planned from then on,
        // in this pass and the ones after it; `a`'s is untouched.
        let mut next = (*published).clone();
        next.insert(b, secret(t0 + Duration::from_secs(8)));
        let next = Arc::new(next);
        let late = t0 + Duration::from_millis(11_700);
        for now in [late, late + Duration::from_secs(1)] {
            let planned = seen.plan_with(next.clone(), now);
            assert_eq!(planned[&b].since, late);
            assert_eq!(planned[&b].psk, next[&b].psk);
            assert_eq!(planned[&a].since, t0);
        }
        // Once the replaced PSK is no longer received on, the moment changes nothing: the
        // map is no longer copied.
        let settled = seen.plan_with(next.clone(), late + Duration::from_secs(10));
        assert!(Arc::ptr_eq(&settled, &next));
        // A PSK restored after a restart replaced none: its moment is left as it is.
        let mut restored = (*next).clone();
        let restored_at = t0 + Duration::from_secs(30);
        restored.insert(
            a,
            PairSecret {
                previous: None,
                ..secret(restored_at)
            },
        );
        let restored = Arc::new(restored);
        let planned = seen.plan_with(restored.clone(), late + Duration::from_secs(20));
        assert_eq!(planned[&a].since, restored_at);
        // A pair gone is forgotten.
        let only_a = Arc::new(BTreeMap::from([(a, published[&a].clone())]));
        seen.plan_with(only_a, late);
        assert_eq!(seen.first.len(), 1);
    }
}
