//! A per-source limit on handshake work (kernel WireGuard's ratelimiter): a token bucket
//! per source address (IPv6 by its /64), 20 messages a second with a burst of 5. Checked
//! before any Diffie-Hellman, so one host, with or without a valid cookie, cannot buy more
//! than its share of handshake work. Idle sources are forgotten after a second; past
//! `MAX_SOURCES` sources at once, new ones are refused until some go idle.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const PER_SECOND: u64 = 20;
const BURST: u64 = 5;
const NANOS_PER_MESSAGE: u64 = 1_000_000_000 / PER_SECOND;
const MAX_TOKENS: u64 = NANOS_PER_MESSAGE * BURST;
/// Sources tracked at once (about 48 bytes each).
const MAX_SOURCES: usize = 65_536;
const IDLE: Duration = Duration::from_secs(1);

struct Bucket {
    tokens: u64,
    last: Instant,
}

#[derive(Default)]
struct Table {
    buckets: HashMap<u128, Bucket>,
    swept: Option<Instant>,
}

#[derive(Default)]
pub struct Limiter {
    table: Mutex<Table>,
}

/// The key of a source: an IPv4 address, or an IPv6 address's /64.
fn key(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => (u128::from(a) >> 64) | (1 << 127),
    }
}

impl Limiter {
    /// Whether one more handshake message from `ip` may be worked on at `now`.
    pub fn allow(&self, ip: IpAddr, now: Instant) -> bool {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if t.swept
            .is_none_or(|at| now.saturating_duration_since(at) >= IDLE)
        {
            t.buckets
                .retain(|_, b| now.saturating_duration_since(b.last) < IDLE);
            t.swept = Some(now);
        }
        let full = t.buckets.len() >= MAX_SOURCES;
        let b = match t.buckets.get_mut(&key(ip)) {
            Some(b) => b,
            None if full => return false,
            None => t.buckets.entry(key(ip)).or_insert(Bucket {
                tokens: MAX_TOKENS,
                last: now,
            }),
        };
        let elapsed = now.saturating_duration_since(b.last).as_nanos();
        b.tokens = (b.tokens as u128 + elapsed).min(u128::from(MAX_TOKENS)) as u64;
        b.last = now;
        if b.tokens >= NANOS_PER_MESSAGE {
            b.tokens -= NANOS_PER_MESSAGE;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_source_gets_a_burst_then_twenty_a_second_and_others_are_not_held_back() {
        let l = Limiter::default();
        let t0 = Instant::now();
        let a = ip("198.51.100.7");
        let allowed = (0..100).filter(|_| l.allow(a, t0)).count();
        assert_eq!(allowed, BURST as usize, "the burst, then nothing at once");
        assert!(
            l.allow(ip("198.51.100.8"), t0),
            "another source has its own"
        );
        // One second later: twenty more (the bucket refills at 20 a second, up to 5).
        let mut got = 0;
        for ms in (0..1000).step_by(10) {
            got += usize::from(l.allow(a, t0 + Duration::from_millis(1000 + ms)));
        }
        assert!((20..=26).contains(&got), "{got} in a second");
        // IPv6 sources share their /64.
        let t = t0 + Duration::from_secs(10);
        let v6 = (0..10)
            .filter(|i| l.allow(ip(&format!("2001:db8::{i}")), t))
            .count();
        assert_eq!(v6, BURST as usize);
        assert!(l.allow(ip("2001:db8:0:1::1"), t), "another /64");
    }

    #[test]
    fn past_the_table_size_new_sources_wait_until_old_ones_go_idle() {
        let l = Limiter::default();
        let t0 = Instant::now();
        for i in 0..MAX_SOURCES as u32 {
            assert!(l.allow(IpAddr::from(std::net::Ipv4Addr::from(i)), t0));
        }
        assert!(!l.allow(ip("203.0.113.1"), t0), "full");
        assert!(
            l.allow(ip("203.0.113.1"), t0 + IDLE),
            "the idle ones were swept"
        );
    }
}
