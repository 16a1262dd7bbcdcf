//! The relay's limits on handshake messages, which cost it BLAKE2s work (a mac1 trial per
//! member, for an initiation): per source address and port (one node's WireGuard socket as
//! its NAT maps it) first, so a source over its limit spends nothing of the others'; then
//! the mac1 work of all messages together, and their number. Pure: the time passed in.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::wg::cookie::mac1_matches;

/// Handshake messages per second and burst, per source address and port (one node's
/// WireGuard socket as the NAT maps it), and for all sources together.
const PER_SOURCE: (f64, f64) = (50.0, 100.0);
const IN_TOTAL: (f64, f64) = (5_000.0, 1_000.0);
/// The mac1 trials (a BLAKE2s each, about 0.3 µs) all initiations and responses may cost
/// a second, and at once: a flood of initiations that match no member costs the relay at
/// most this, however many members it has.
const MAC1_WORK: (f64, f64) = (200_000.0, 50_000.0);
const SOURCES_MAX: usize = 65_536;

struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Bucket {
        Bucket {
            tokens: burst,
            last: now,
        }
    }

    fn refill(&mut self, (rate, burst): (f64, f64), now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(burst);
        self.last = now;
    }

    fn take(&mut self, limit: (f64, f64), now: Instant) -> bool {
        self.refill(limit, now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

pub(crate) struct Limits {
    sources: HashMap<SocketAddr, Bucket>,
    total: Bucket,
    /// Mac1 trials left to spend (`MAC1_WORK`); may go below zero, then refills.
    work: Bucket,
}

impl Limits {
    pub(crate) fn new(now: Instant) -> Limits {
        Limits {
            sources: HashMap::new(),
            total: Bucket::full(IN_TOTAL.1, now),
            work: Bucket::full(MAC1_WORK.1, now),
        }
    }

    /// Whether one more handshake message from `from` may be worked on at `now`.
    pub(crate) fn allow(&mut self, from: SocketAddr, now: Instant) -> bool {
        if self.sources.len() >= SOURCES_MAX {
            self.sources
                .retain(|_, b| now.saturating_duration_since(b.last) < Duration::from_secs(1));
        }
        if self.sources.len() >= SOURCES_MAX && !self.sources.contains_key(&from) {
            return false;
        }
        let bucket = self
            .sources
            .entry(from)
            .or_insert_with(|| Bucket::full(PER_SOURCE.1, now));
        if !bucket.take(PER_SOURCE, now) {
            return false;
        }
        self.work.refill(MAC1_WORK, now);
        self.work.tokens >= 1.0 && self.total.take(IN_TOTAL, now)
    }

    /// Tries `key`'s mac1 on `msg`, spending one trial of the work budget.
    pub(crate) fn mac1(&mut self, key: &[u8; 32], msg: &[u8]) -> bool {
        self.work.tokens -= 1.0;
        mac1_matches(key, msg)
    }

    /// Forgets sources idle for 10 s.
    pub(crate) fn expire(&mut self, now: Instant) {
        self.sources
            .retain(|_, b| now.saturating_duration_since(b.last) < Duration::from_secs(10));
    }

    pub(crate) fn estimated_bytes(&self) -> usize {
        self.sources.capacity() * (std::mem::size_of::<(SocketAddr, Bucket)>() + 1)
    }
}
