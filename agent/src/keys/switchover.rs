//! When a peer's announced key takes over on this node (docs/key-rotation.md).
//!
//! The rotating node switches its device at the announced moment and at once starts a
//! handshake with every peer; here that handshake lands on the staged entry of its next
//! key. So this node moves the peer's AllowedIPs to the next key as soon as that key has
//! handshaken (it is in use: the device is watched from shortly before the moment), and
//! at the latest `GRACE` after the moment (the rotating node is late, or down: it
//! switches when it returns). Switching on the handshake rather than on the clock means no
//! packet goes to a key not yet in use, and no handshake is sent to it early (a refused
//! one would only be retried after WireGuard's 5 s timeout).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use weft_backends::model::ClusterView;
use weft_crypto::PublicKey;

pub const GRACE: Duration = Duration::from_secs(2);
/// How often the device is read while a switch is near.
pub const POLL: Duration = Duration::from_millis(20);
/// How long before the announced moment the watching starts.
pub const POLL_BEFORE: Duration = Duration::from_millis(300);

#[derive(Default)]
pub struct Switchover {
    /// Announced keys that have handshaken.
    confirmed: HashSet<String>,
}

fn pending<'a>(
    view: &'a ClusterView,
    me: &'a str,
) -> impl Iterator<Item = (&'a str, SystemTime)> + 'a {
    view.leases
        .values()
        .filter(move |l| l.node != me)
        .filter_map(|l| l.next_key.as_ref())
        .map(|n| (n.public_key.as_str(), n.switch_at()))
}

impl Switchover {
    /// The view the planner sees: each peer's announced key takes over at once if it has
    /// handshaken, else `GRACE` after its moment.
    pub fn view(&mut self, view: &Arc<ClusterView>, me: &str) -> Arc<ClusterView> {
        let announced: HashSet<&str> = pending(view, me).map(|(k, _)| k).collect();
        self.confirmed.retain(|k| announced.contains(k.as_str()));
        if announced.is_empty() {
            return view.clone();
        }
        let mut v = (**view).clone();
        for l in v.leases.values_mut().filter(|l| l.node != me) {
            if let Some(n) = l.next_key.as_mut() {
                n.switch_at_ms = if self.confirmed.contains(&n.public_key) {
                    0
                } else {
                    n.switch_at_ms.saturating_add(GRACE.as_millis() as u64)
                };
            }
        }
        Arc::new(v)
    }

    /// When to read the device next, if a switch is near and not yet confirmed.
    pub fn poll_at(&self, view: &ClusterView, me: &str, now: SystemTime) -> Option<SystemTime> {
        let earliest = pending(view, me)
            .filter(|(k, _)| !self.confirmed.contains(*k))
            .map(|(_, at)| at)
            .filter(|at| now < *at + GRACE)
            .min()?;
        Some((now + POLL).max(earliest - POLL_BEFORE))
    }

    /// Notes the announced keys that have handshaken; true if one newly has.
    pub fn observe(
        &mut self,
        view: &ClusterView,
        me: &str,
        handshakes: &HashMap<PublicKey, Duration>,
    ) -> bool {
        let mut new = false;
        for (key, _) in pending(view, me) {
            let used = key
                .parse::<PublicKey>()
                .is_ok_and(|k| handshakes.contains_key(&k));
            if used && self.confirmed.insert(key.to_string()) {
                tracing::info!(
                    key,
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
    use weft_backends::model::{Lease, LeaseAttrs, NextKey};

    fn lease(node: &str, next: Option<NextKey>) -> Lease {
        let mut l = LeaseAttrs {
            public_ip: None,
            public_ipv6: None,
            backend_type: "wireguard".into(),
            backend_data: None,
            backend_v6_data: None,
            next_key: None,
        }
        .into_lease(node.into(), None, None);
        l.next_key = next;
        l
    }

    #[test]
    fn an_announced_key_takes_over_on_its_handshake_or_after_the_grace() {
        let key = weft_crypto::PrivateKey::from_bytes([9; 32]).public_key();
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let next = NextKey {
            public_key: key.to_string(),
            switch_at_ms: 1_000_000,
            generation: 2,
        };
        let mut view = ClusterView::default();
        view.insert(lease("me", None));
        view.insert(lease("peer", Some(next.clone())));
        let view = Arc::new(view);
        let mut s = Switchover::default();
        // Before: the moment moves back by the grace; the device is watched from 300 ms
        // ahead of the moment.
        let seen = s.view(&view, "me");
        assert_eq!(
            seen.get("peer")
                .unwrap()
                .next_key
                .as_ref()
                .unwrap()
                .switch_at_ms,
            1_002_000
        );
        assert_eq!(
            s.poll_at(&view, "me", t - Duration::from_secs(10)),
            Some(t - POLL_BEFORE)
        );
        assert_eq!(s.poll_at(&view, "me", t), Some(t + POLL));
        assert_eq!(
            s.poll_at(&view, "me", t + GRACE),
            None,
            "past the grace: the clock decides"
        );
        // The key handshakes: it takes over now, and there is nothing more to watch.
        assert!(!s.observe(&view, "me", &HashMap::new()));
        assert!(s.observe(&view, "me", &HashMap::from([(key, Duration::from_secs(1))])));
        assert_eq!(
            s.view(&view, "me")
                .get("peer")
                .unwrap()
                .next_key
                .as_ref()
                .unwrap()
                .switch_at_ms,
            0
        );
        assert_eq!(s.poll_at(&view, "me", t), None);
        // Our own announcement is not ours to switch to.
        let mut own = ClusterView::default();
        own.insert(lease("me", Some(next)));
        assert_eq!(s.poll_at(&own, "me", t), None);
    }
}
