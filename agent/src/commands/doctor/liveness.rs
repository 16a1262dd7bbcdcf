//! The "pairs alive" check: every WireGuard pair that carries traffic is answered, as the
//! agent's liveness watcher judges it each second (see `crate::liveness`).

use std::time::{Duration, SystemTime};

use super::Check;
use crate::observe::snapshot::Snapshot;

const NAME: &str = "pairs alive";
/// The watcher's judgement older than this is not news of now.
const STALE: Duration = Duration::from_secs(10);

pub(super) fn pairs(snapshot: &Snapshot, now: SystemTime) -> Check {
    if snapshot.liveness_at_ms == 0 {
        return Check::warn(
            NAME,
            "the agent has not judged its pairs yet",
            "wait a few seconds after the agent starts; if it lasts, the agent's log says why its liveness watcher is not running",
        );
    }
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(snapshot.liveness_at_ms);
    let age = now.duration_since(at).unwrap_or_default();
    if age > STALE {
        return Check::warn(
            NAME,
            format!("the agent last judged its pairs {} s ago", age.as_secs()),
            "the device may not answer the agent: `weft status`, and the agent's log",
        );
    }
    let dead: Vec<String> = snapshot
        .liveness
        .iter()
        .filter(|l| l.state == "dead")
        .map(|l| {
            let detail = l.detail.as_deref().unwrap_or("no answer");
            match l.dead_secs {
                Some(s) => format!("{} on {}: {detail} (dead {s} s)", l.node, l.device),
                None => format!("{} on {}: {detail}", l.node, l.device),
            }
        })
        .collect();
    let count = |state: &str| {
        snapshot
            .liveness
            .iter()
            .filter(|l| l.state == state)
            .count()
    };
    if dead.is_empty() {
        return Check::pass(
            NAME,
            format!(
                "{} pairs: {} alive, {} idle, {} waiting for an answer",
                snapshot.liveness.len(),
                count("alive"),
                count("idle"),
                count("waiting")
            ),
        );
    }
    Check::fail(
        NAME,
        format!("{} dead: {}", dead.len(), dead.join("; ")),
        "the agent repairs a dead pair by itself (re-applying it, re-handshaking, re-creating a device at fault) and logs each step; \
         one still dead after that is cut off outside this node: the peer's agent and device, a firewall or NAT on the path (`weft doctor` on the peer, `reachability` below)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::doctor::Verdict;
    use crate::observe::snapshot::PairLiveness;

    fn pair(node: &str, state: &str) -> PairLiveness {
        let dead = state == "dead";
        PairLiveness {
            node: node.into(),
            device: "flannel-wg".into(),
            state: state.into(),
            cause: dead.then(|| "endpoint unanswered".into()),
            detail: dead.then(|| "nothing authenticated comes back from 198.51.100.2:51820".into()),
            dead_secs: dead.then_some(4),
        }
    }

    #[test]
    fn a_dead_pair_fails_with_its_cause_and_the_rest_pass() {
        let now = SystemTime::now();
        let mut s = Snapshot {
            liveness: vec![pair("b", "alive"), pair("c", "idle")],
            liveness_at_ms: crate::keys::rotation::ms(now),
            ..Snapshot::default()
        };
        let c = pairs(&s, now);
        assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        assert!(c.detail.contains("1 alive, 1 idle"), "{c:?}");
        s.liveness.push(pair("d", "dead"));
        let c = pairs(&s, now);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(
            c.detail
                .contains("d on flannel-wg: nothing authenticated comes back from 198.51.100.2:51820 (dead 4 s)"),
            "{c:?}"
        );
        // An old judgement is not trusted.
        assert_eq!(
            pairs(&s, now + Duration::from_secs(60)).verdict,
            Verdict::Warn
        );
    }
}
