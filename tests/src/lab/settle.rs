//! A lab at rest: with `Backend.PostQuantum` on, each agent's first rounds complete a
//! second or two after it starts, and the pass that puts their PSKs on the device makes
//! every pair handshake anew. A test of what happens to a settled mesh (a fault, an
//! outage, a count of data-plane writes) begins after that, not across it.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::bail;

use super::Lab;

/// An agent with post-quantum rounds logs this once, at start.
const KEM_KEY: &str = "ML-KEM-768 key";
/// Logged as each pair's PSK takes over, with `peer=<node>`.
const IN_FORCE: &str = "post-quantum PSK in force";
/// Logged at the end of every pass.
const PASS: &str = " reconciled ";

/// What one agent's log says of its pairs' first rounds.
#[derive(Debug, PartialEq)]
pub struct Rounds {
    /// The peers with a PSK in force.
    pub protected: BTreeSet<String>,
    /// A pass ran after the last PSK took over (it put the PSK on the device).
    pub applied: bool,
}

/// Reads `log`: `None` if the agent runs no post-quantum rounds.
pub fn rounds(log: &str) -> Option<Rounds> {
    if !log.contains(KEM_KEY) {
        return None;
    }
    let lines: Vec<&str> = log.lines().collect();
    let last = lines.iter().rposition(|l| l.contains(IN_FORCE));
    let protected = (lines.iter())
        .filter(|l| l.contains(IN_FORCE))
        .filter_map(|l| l.split(" peer=").nth(1)?.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let applied = last.is_none_or(|at| lines[at..].iter().any(|l| l.contains(PASS)));
    Some(Rounds { protected, applied })
}

impl Lab {
    /// Waits until every agent with post-quantum rounds has a PSK in force with every
    /// other such agent, and has applied it. Labs whose agents run none return at once.
    pub fn settle_post_quantum(&self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let logs: Vec<Option<Rounds>> = (self.nodes.iter())
                .map(|n| rounds(&std::fs::read_to_string(n.agent_log()).unwrap_or_default()))
                .collect();
            let peers = logs.iter().flatten().count().saturating_sub(1);
            let unsettled: Vec<String> = (logs.iter().enumerate())
                .filter_map(|(i, r)| Some((i, r.as_ref()?)))
                .filter(|(_, r)| r.protected.len() < peers || !r.applied)
                .map(|(i, r)| format!("node {}: {r:?}", i + 1))
                .collect();
            if unsettled.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "post-quantum pairs not protected within {within:?} of the agents' start \
                     ({peers} peers each): {unsettled:?}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_says_which_pairs_are_protected_and_whether_the_psk_is_applied() {
        assert_eq!(rounds("INFO weft::node::start: WireGuard key"), None);
        let log = "\
INFO weft::pq: ML-KEM-768 key path=/var/lib/weft/mlkem.key
INFO weft::pq::manager::publish: post-quantum PSK in force peer=10.244.69.0-24 round=1 rounds=1
INFO weft::node::error_policy: reconciled pass=6 writes=1
INFO weft::pq::manager::publish: post-quantum PSK in force peer=10.244.8.0-24 round=2 rounds=1";
        let r = rounds(log).unwrap();
        assert_eq!(
            r.protected.into_iter().collect::<Vec<_>>(),
            ["10.244.69.0-24", "10.244.8.0-24"]
        );
        assert!(!r.applied, "no pass after the second PSK");
        let r = rounds(&format!("{log}\nINFO x: reconciled pass=7 writes=1")).unwrap();
        assert!(r.applied);
    }
}
