//! Reading an agent's log: when it logged a line (its timestamp, the agent's clock, which
//! is this machine's), to line up what the agent did with a capture's packets.

use std::time::{Duration, SystemTime};

use super::Node;

impl Node {
    /// When this node's agent last logged a line containing `needle`.
    pub fn logged_at(&self, needle: &str) -> Option<SystemTime> {
        let text = std::fs::read_to_string(self.agent_log()).ok()?;
        text.lines()
            .rev()
            .find(|l| l.contains(needle))
            .and_then(|l| timestamp(l.split_whitespace().next()?))
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
            .and_then(|l| timestamp(l.split_whitespace().next()?))
    }
}

/// A tracing timestamp, `2026-11-26T09:40:01.123456Z` (UTC), as a moment.
pub fn timestamp(text: &str) -> Option<SystemTime> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<u64>().ok());
    let (h, m, s) = (t.next()??, t.next()??, t.next()??);
    let nanos: u64 = format!("{fraction:0<9}").get(..9)?.parse().ok()?;
    // Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    let secs = days * 86_400 + h * 3_600 + m * 60 + s;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_nanos(nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracing_timestamps_are_read_as_utc_moments() {
        let t = timestamp("2026-11-26T09:40:01.123456Z").unwrap();
        let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap();
        // date -u -d 2026-11-26T09:40:01Z +%s
        assert_eq!(since.as_secs(), 1_795_686_001);
        assert_eq!(since.subsec_micros(), 123_456);
        assert_eq!(
            timestamp("2024-02-29T00:00:00Z")
                .unwrap()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_secs(),
            1_709_164_800
        );
        assert_eq!(timestamp("yesterday"), None);
    }
}
