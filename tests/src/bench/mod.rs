//! The benchmarks (`weft-lab bench control-plane|data-plane|liveness|path-mtu|post-quantum|rotation|soak`): figures as medians and
//! percentiles, from runs on this machine; the method and the tables are in BENCHMARKS.md.

pub mod churn;
pub mod control_plane;
pub mod control_targets;
pub mod data_plane;
pub mod flood;
pub mod iperf;
pub mod liveness;
pub mod path_mtu;
pub mod post_quantum;
pub mod post_quantum_agent;
pub mod relay;
pub mod rollout;
pub mod rotation;
pub mod soak;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The `q`-quantile (0..=1) of `values` by nearest rank; `None` when empty.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

pub fn median(values: &[f64]) -> Option<f64> {
    quantile(values, 0.5)
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The timestamp that starts a `tracing` log line (`2026-11-21T07:18:44.559723Z …`).
pub fn log_time(line: &str) -> Option<SystemTime> {
    let ts = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, min) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    let sec: f64 = t.next()?.parse().ok()?;
    let whole = days_from_civil(y, m, day) * 86_400 + h * 3600 + min * 60;
    let at = Duration::from_secs(u64::try_from(whole).ok()?) + Duration::from_secs_f64(sec);
    Some(UNIX_EPOCH + at)
}

/// `key=value` from a `tracing` line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(median(&v), Some(50.0));
        assert_eq!(quantile(&v, 0.99), Some(99.0));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn log_lines_give_their_time_and_fields() {
        let line = "2026-11-21T07:18:44.500000Z  INFO weft::agent: reconciled pass=3 writes=0";
        let t = log_time(line).unwrap();
        assert_eq!(
            t.duration_since(UNIX_EPOCH).unwrap(),
            Duration::from_secs_f64(1_795_245_524.5)
        );
        assert_eq!(field(line, "writes"), Some("0"));
        assert_eq!(field(line, "pass"), Some("3"));
    }
}
