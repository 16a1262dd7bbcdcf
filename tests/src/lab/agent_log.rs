//! Reading an agent's log: when it logged a line (its timestamp, the agent's clock, which
//! is this machine's), to line up what the agent did with a capture's packets.

use std::time::SystemTime;

use super::Node;
use crate::bench::log_time;

impl Node {
    /// When this node's agent last logged a line containing `needle`.
    pub fn logged_at(&self, needle: &str) -> Option<SystemTime> {
        let text = std::fs::read_to_string(self.agent_log()).ok()?;
        text.lines()
            .rev()
            .find(|l| l.contains(needle))
            .and_then(log_time)
    }

    /// When this node's agent first logged a line containing `needle` at or after `since`.
    pub fn logged_since(&self, needle: &str, since: SystemTime) -> Option<SystemTime> {
        let text = std::fs::read_to_string(self.agent_log()).ok()?;
        text.lines()
            .filter(|l| l.contains(needle))
            .filter_map(log_time)
            .find(|t| *t >= since)
    }

    /// The last `max` lines this node's agent logged at or after `since`, for a failure's
    /// message (a line without a timestamp goes with the one before it).
    pub fn lines_since(&self, since: SystemTime, max: usize) -> Vec<String> {
        let text = std::fs::read_to_string(self.agent_log()).unwrap_or_default();
        let mut keep = false;
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| {
                if let Some(t) = log_time(l) {
                    keep = t >= since;
                }
                keep
            })
            .collect();
        let from = lines.len().saturating_sub(max);
        lines[from..].iter().map(|l| l.to_string()).collect()
    }

    /// When this node's agent logged the first line containing `then` after the last line
    /// containing `first` (say, the pass that applied a change it planned).
    pub fn logged_after(&self, first: &str, then: &str) -> Option<SystemTime> {
        let text = std::fs::read_to_string(self.agent_log()).ok()?;
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.iter().rposition(|l| l.contains(first))?;
        lines[from..]
            .iter()
            .find(|l| l.contains(then))
            .and_then(|l| log_time(l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracing_timestamps_are_read_as_utc_moments() {
        let t = log_time("2026-11-26T09:40:01.123456Z  INFO weft: hello").unwrap();
        let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap();
        // date -u -d 2026-11-26T09:40:01Z +%s
        let want = 1_795_686_001_123_456_000u128;
        assert!(since.as_nanos().abs_diff(want) < 1_000, "{since:?}");
        assert_eq!(log_time("yesterday"), None);
    }
}
