//! How many probes the responder answers: a token bucket per source address, so that a
//! flood of probes from one host gets `BURST` acks at once and `RATE` a second after
//! that, whoever else probes. Pure: the clock is an argument.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

/// Acks to one source at once: a full search (5 rounds of up to 12 sizes, 44 probes at
/// most) fits, with room for the checks beside it.
pub(super) const BURST: u32 = 64;
/// Acks to one source a second, once its burst is spent: 8 times a peer's steady checks
/// (2 probes every 2 s, a retry round beside them).
pub(super) const RATE: u32 = 16;
/// Sources tracked at once. When a new one finds no room, those whose bucket has filled
/// again (idle for `BURST / RATE` s) make room; failing that it is not answered until
/// they do (a flood from spoofed addresses costs this table, not the other peers' acks).
pub(super) const SOURCES: usize = 4096;

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(&self, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + elapsed * f64::from(RATE)).min(f64::from(BURST))
    }
}

#[derive(Default)]
pub(super) struct Limiter {
    buckets: HashMap<IpAddr, Bucket>,
}

impl Limiter {
    /// Whether a probe from `source` at `now` is answered (and counted).
    pub(super) fn allow(&mut self, source: IpAddr, now: Instant) -> bool {
        if !self.buckets.contains_key(&source) && self.buckets.len() >= SOURCES {
            self.buckets
                .retain(|_, b| b.refilled(now) < f64::from(BURST));
            if self.buckets.len() >= SOURCES {
                return false;
            }
        }
        let bucket = self.buckets.entry(source).or_insert(Bucket {
            tokens: f64::from(BURST),
            at: now,
        });
        let tokens = bucket.refilled(now);
        bucket.at = now;
        if tokens < 1.0 {
            bucket.tokens = tokens;
            return false;
        }
        bucket.tokens = tokens - 1.0;
        true
    }
}

/// How long one source's emptied bucket takes to fill again.
#[cfg(test)]
fn refill() -> std::time::Duration {
    std::time::Duration::from_secs(u64::from(BURST / RATE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 2));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 3));

    #[test]
    fn one_source_gets_its_burst_then_its_rate_and_another_is_unaffected() {
        let mut limiter = Limiter::default();
        let t0 = Instant::now();
        let answered = (0..1000).filter(|_| limiter.allow(A, t0)).count();
        assert_eq!(answered, BURST as usize);
        assert!(limiter.allow(B, t0), "another source has its own bucket");
        let t1 = t0 + Duration::from_secs(1);
        let answered = (0..1000).filter(|_| limiter.allow(A, t1)).count();
        assert_eq!(answered, RATE as usize, "one second's worth");
        let t2 = t1 + refill() + Duration::from_secs(10);
        let answered = (0..1000).filter(|_| limiter.allow(A, t2)).count();
        assert_eq!(
            answered, BURST as usize,
            "never more than the burst, idle or not"
        );
    }

    #[test]
    fn a_full_table_makes_room_only_of_idle_sources() {
        let mut limiter = Limiter::default();
        let t0 = Instant::now();
        let source = |i: usize| IpAddr::V6(std::net::Ipv6Addr::from(i as u128 + 1));
        for i in 0..SOURCES {
            assert!(limiter.allow(source(i), t0));
        }
        assert!(
            !limiter.allow(A, t0),
            "no room while every source is recent"
        );
        assert!(limiter.allow(source(7), t0), "a tracked source still is");
        let later = t0 + refill();
        assert!(limiter.allow(A, later), "room once they are idle");
        assert!(limiter.buckets.len() <= SOURCES);
    }
}
