//! The "pairs post-quantum" check (`Backend.PostQuantum`): every pair's PSK comes from a
//! completed ML-KEM-768 round, recently enough.

use std::time::{Duration, SystemTime};

use super::Check;
use crate::observe::snapshot::Snapshot;

const NAME: &str = "pairs post-quantum";
/// A secret older than this (the period is 2 min) means rounds stopped completing.
const STALE: Duration = Duration::from_secs(10 * 60);

pub(super) fn pairs(snapshot: &Snapshot, now: SystemTime) -> Check {
    let mut classical = Vec::new();
    let mut stale = Vec::new();
    for p in &snapshot.post_quantum {
        match p.round_ms {
            None => classical.push(format!(
                "{}: {}",
                p.node,
                p.classical_because
                    .as_deref()
                    .unwrap_or("no round completed yet")
            )),
            Some(ms) => {
                let at = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
                let age = now.duration_since(at).unwrap_or_default();
                if age > STALE {
                    stale.push(format!("{}: secret {} s old", p.node, age.as_secs()));
                }
            }
        }
    }
    let total = snapshot.post_quantum.len();
    if classical.is_empty() && stale.is_empty() {
        return Check::pass(NAME, format!("{total} pairs, each with a post-quantum PSK"));
    }
    let mut detail = Vec::new();
    if !classical.is_empty() {
        detail.push(format!(
            "{} classical ({})",
            classical.len(),
            classical.join("; ")
        ));
    }
    if !stale.is_empty() {
        detail.push(format!(
            "{} with no round for long ({})",
            stale.len(),
            stale.join("; ")
        ));
    }
    Check::warn(
        NAME,
        format!("of {total} pairs, {}", detail.join(", ")),
        "a classical pair still encrypts (X25519, and the cluster PSK if set), but recorded traffic is not protected against a future quantum computer; \
         a peer that publishes no ML-KEM key runs an older weft, flanneld or PostQuantum off; otherwise the pair's rounds (UDP --post-quantum-port: inside the tunnel on WireGuard, between the public IPs on ipsec) do not pass: the agent's log on both nodes says why",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::doctor::Verdict;
    use crate::observe::snapshot::PqPairInfo;

    fn pair(node: &str, round_ms: Option<u64>) -> PqPairInfo {
        PqPairInfo {
            node: node.into(),
            round_ms,
            rounds: u64::from(round_ms.is_some()),
            classical_because: round_ms
                .is_none()
                .then(|| "it publishes no ML-KEM key".into()),
            last_refusal: None,
        }
    }

    #[test]
    fn classical_or_stale_pairs_are_named() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let fresh = Some(9_900_000);
        let mut snapshot = Snapshot {
            post_quantum: vec![pair("node-b", fresh), pair("node-c", fresh)],
            ..Snapshot::default()
        };
        let check = pairs(&snapshot, now);
        assert_eq!(check.verdict, Verdict::Pass, "{check:?}");
        snapshot.post_quantum.push(pair("node-d", None));
        snapshot.post_quantum.push(pair("node-e", Some(1_000)));
        let check = pairs(&snapshot, now);
        assert_eq!(check.verdict, Verdict::Warn);
        assert!(
            check.detail.contains("node-d: it publishes no ML-KEM key"),
            "{check:?}"
        );
        assert!(
            check.detail.contains("node-e: secret 9999 s old"),
            "{check:?}"
        );
    }
}
