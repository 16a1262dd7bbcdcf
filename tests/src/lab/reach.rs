//! Whether the lab's pods reach each other.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::Lab;

impl Lab {
    /// Pings every pod from every pod on another node (each address of each pod, in a
    /// dual-stack lab); returns how many pairs were tried
    /// and the ones that failed, as `from (node) -> to`.
    pub fn all_pairs(&self, within: Duration) -> (usize, Vec<String>) {
        let mut failures = Vec::new();
        let mut pairs = 0;
        for a in &self.nodes {
            for b in self.nodes.iter().filter(|b| b.index != a.index) {
                for pa in &a.pods {
                    for pb in b.pods.iter() {
                        if !pb.ip.is_unspecified() {
                            pairs += 1;
                            if !self.ping(&pa.ns, pb.ip, within) {
                                failures.push(format!("{} ({}) -> {}", pa.ip, a.index, pb.ip));
                            }
                        }
                        if let Some(to) = pb.ip6 {
                            pairs += 1;
                            if !self.ping(&pa.ns, to, within) {
                                failures.push(format!("{} ({}) -> {to}", pa.ns, a.index));
                            }
                        }
                    }
                }
            }
        }
        (pairs, failures)
    }

    /// `all_pairs` for tests: panics naming the unreachable pairs, with every agent's log.
    /// Returns how many pairs were tried.
    pub fn assert_all_pairs(&self) -> usize {
        let (pairs, failures) = self.all_pairs(Duration::from_secs(10));
        assert!(
            failures.is_empty(),
            "{} of {pairs} pod pairs unreachable: {failures:?}\n{}",
            failures.len(),
            self.logs()
        );
        pairs
    }

    /// Pings `to` from pod namespace `from` until one reply or `within` passes (an echo
    /// a second at most, from this process: `icmp::echo`).
    pub fn ping(&self, from: &str, to: impl Into<IpAddr>, within: Duration) -> bool {
        let to = to.into();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let tried = Instant::now();
            let wait = deadline.duration_since(tried).min(Duration::from_secs(1));
            if crate::icmp::echo(from, to, wait).unwrap_or(false) {
                return true;
            }
            // Unanswered at once (no route yet): asked again shortly, not in a tight loop.
            std::thread::sleep(Duration::from_millis(20).saturating_sub(tried.elapsed()));
        }
        false
    }
}
