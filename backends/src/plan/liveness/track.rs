//! One pair's liveness from its counters: whether what this node sends is answered.
//!
//! A WireGuard device counts, per peer, the bytes it sent and the bytes it received and
//! authenticated (a handshake answer, data, a keepalive: nothing a stranger can forge).
//! Read every `POLL`, they tell the three cases apart that matter:
//! - nothing sent (a keepalive aside): the pair is idle, whatever came back (never dead,
//!   never repaired);
//! - sent, and received since: alive;
//! - sent, and nothing authenticated back since: unanswered. WireGuard answers a data
//!   packet only with the data the other side has to send, or a keepalive after 10 s, so
//!   one-way traffic is unanswered for a while on a healthy pair too: after `PROBE_AFTER`
//!   the agent sends a probe through the tunnel (an ICMP echo to the peer's tunnel address,
//!   which the peer's kernel answers at once), and only a pair whose probe is unanswered
//!   as well for `DEAD_AFTER` is dead. A handshake lost once is retried by WireGuard after
//!   5 s (REKEY_TIMEOUT); the probe's own packet starts one at once, and its answer comes
//!   within a round trip.
//!
//! Counters that go back (a peer re-added, a device made again) start the count afresh.

use std::time::{Duration, Instant};

/// How often the devices are read, at the most (a device with many peers is read less
/// often: `poll_period`).
pub const POLL: Duration = Duration::from_millis(500);

/// The period between reads of devices holding `peers` peers in all: `POLL`, or 250 µs a
/// peer past 2,000 (a read of 10,000 peers every 2.5 s: at most 4,000 peers read a second,
/// about 1 % of a core for the agent), at most 5 s.
pub fn poll_period(peers: usize) -> Duration {
    (Duration::from_micros(250) * u32::try_from(peers).unwrap_or(u32::MAX))
        .clamp(POLL, Duration::from_secs(5))
}
/// Sent and unanswered this long: a probe goes out.
pub const PROBE_AFTER: Duration = Duration::from_millis(500);
/// Sent, probed and unanswered this long: dead. (Detection within 5 s of a fault: at most
/// one poll to see the first unanswered packet, then this.)
pub const DEAD_AFTER: Duration = Duration::from_secs(2);
/// A probe is answered within this, or the pair is not answering.
pub const PROBE_WAIT: Duration = Duration::from_secs(1);

/// A relayed pair (`Track::observe_watched`) heard nothing for this long is probed, so
/// that a gateway that died is found at both ends within seconds, not only at the end
/// that sends (the other end's silence would otherwise be "idle").
pub const WATCHED_QUIET: Duration = Duration::from_millis(1500);

/// What a keepalive adds to the sent bytes at most (kernel WireGuard counts its 32-byte
/// message; the userspace device counts payload only, 0).
pub const KEEPALIVE_BYTES: u64 = 32;

/// A peer's counters as one read of the device gave them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

/// What a pair's counters say, after a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing sent since the last answer.
    Idle,
    /// Sent, and answered.
    Alive,
    /// Sent and unanswered since `since`; the shell probes when `probe` is set.
    Unanswered { since: Instant, probe: bool },
    /// Sent, probed and unanswered since `since`.
    Dead { since: Instant },
}

impl Verdict {
    pub fn is_dead(&self) -> bool {
        matches!(self, Verdict::Dead { .. })
    }
}

/// One pair's memory between reads.
#[derive(Debug, Clone, Default)]
pub struct Track {
    last: Option<Counters>,
    /// When something sent was first left unanswered (cleared by an answer).
    unanswered_since: Option<Instant>,
    /// When the last probe went out in this unanswered stretch.
    probed_at: Option<Instant>,
    /// When an answer last came.
    answered_at: Option<Instant>,
    /// When the last read was.
    read_at: Option<Instant>,
}

impl Track {
    /// Takes one read at `now`; says what it shows.
    pub fn observe(&mut self, read: Counters, now: Instant) -> Verdict {
        self.observe_with(read, now, false)
    }

    /// As `observe`, for a pair that must be heard from even when this end sends nothing
    /// (a relayed pair): silence for `WATCHED_QUIET` counts as unanswered, so it is probed,
    /// and dead if the probe goes unanswered too.
    pub fn observe_watched(&mut self, read: Counters, now: Instant) -> Verdict {
        self.observe_with(read, now, true)
    }

    fn observe_with(&mut self, read: Counters, now: Instant, watched: bool) -> Verdict {
        let previous_read = self.read_at.replace(now);
        let last = match self.last.replace(read) {
            // Back to lower counts: the peer or the device is new; start again.
            Some(l) if l.tx_bytes <= read.tx_bytes && l.rx_bytes <= read.rx_bytes => l,
            _ => {
                self.unanswered_since = None;
                self.probed_at = None;
                return Verdict::Idle;
            }
        };
        if read.rx_bytes > last.rx_bytes {
            self.answered_at = Some(now);
            self.unanswered_since = None;
            self.probed_at = None;
            return Verdict::Alive;
        }
        // A keepalive alone expects no answer: WireGuard sends one 10 s after it last
        // received when it had nothing to send (a persistent keepalive, every interval).
        let quiet = self
            .answered_at
            .or(previous_read)
            .is_some_and(|at| now.saturating_duration_since(at) >= WATCHED_QUIET);
        let sent = read.tx_bytes - last.tx_bytes > KEEPALIVE_BYTES || (watched && quiet);
        if sent && self.unanswered_since.is_none() {
            // The first unanswered packet went out somewhere since the last read: halfway,
            // on average.
            let between =
                previous_read.map_or(Duration::ZERO, |p| now.saturating_duration_since(p));
            self.unanswered_since = Some(now.checked_sub(between / 2).unwrap_or(now));
        }
        let Some(since) = self.unanswered_since else {
            return Verdict::Idle;
        };
        let unanswered = now.saturating_duration_since(since);
        let probe_old = self.probed_at.map(|at| now.saturating_duration_since(at));
        if unanswered >= DEAD_AFTER && probe_old.is_some_and(|p| p >= PROBE_WAIT) {
            return Verdict::Dead { since };
        }
        // Probe once per `PROBE_WAIT` while unanswered: a probe lost on the way (a
        // handshake initiation dropped once) is not the end of the pair.
        let probe = unanswered >= PROBE_AFTER && probe_old.is_none_or(|p| p >= PROBE_WAIT);
        Verdict::Unanswered { since, probe }
    }

    /// The shell sent a probe at `now`.
    pub fn probed(&mut self, now: Instant) {
        self.probed_at = Some(now);
    }

    /// A repair changed the pair at `now`: what was unanswered before it does not count
    /// against what the repair did (the next verdict needs fresh evidence).
    pub fn repaired(&mut self, now: Instant) {
        if self.unanswered_since.is_some() {
            self.unanswered_since = Some(now);
            self.probed_at = None;
        }
    }

    /// When the pair last answered, if it has since this agent started watching it.
    pub fn answered_at(&self) -> Option<Instant> {
        self.answered_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests read once a second.
    const READ: Duration = Duration::from_secs(1);

    /// Reads once a second: `(tx, rx)` per second; the shell probes when told to.
    fn run(reads: &[(u64, u64)]) -> Vec<Verdict> {
        let start = Instant::now();
        let mut track = Track::default();
        reads
            .iter()
            .enumerate()
            .map(|(i, (tx, rx))| {
                let now = start + READ * i as u32;
                let v = track.observe(
                    Counters {
                        tx_bytes: *tx,
                        rx_bytes: *rx,
                    },
                    now,
                );
                if let Verdict::Unanswered { probe: true, .. } = v {
                    track.probed(now);
                }
                v
            })
            .collect()
    }

    fn first_dead(verdicts: &[Verdict]) -> Option<usize> {
        verdicts.iter().position(Verdict::is_dead)
    }

    #[test]
    fn an_idle_pair_is_never_dead() {
        let idle: Vec<(u64, u64)> = (0..100).map(|_| (500, 300)).collect();
        let v = run(&idle);
        assert!(v.iter().all(|v| *v == Verdict::Idle), "{v:?}");
        // Keepalives coming in with nothing sent: still not dead.
        let keepalives: Vec<(u64, u64)> = (0..100).map(|i| (500, 300 + 32 * (i / 25))).collect();
        assert_eq!(first_dead(&run(&keepalives)), None);
    }

    #[test]
    fn a_watched_pair_that_falls_silent_is_probed_and_found_dead_though_it_sends_nothing() {
        // A relayed pair: answers (its probes', the peer's keepalives) for 5 s, then
        // nothing, while this end sends nothing but keepalives.
        let start = Instant::now();
        let mut track = Track::default();
        let mut verdicts = Vec::new();
        for i in 0..30u32 {
            let now = start + Duration::from_millis(500) * i;
            let rx = 100 + 64 * u64::from(i.min(10));
            let v = track.observe_watched(
                Counters {
                    tx_bytes: 500 + 32 * u64::from(i / 10),
                    rx_bytes: rx,
                },
                now,
            );
            if let Verdict::Unanswered { probe: true, .. } = v {
                track.probed(now);
            }
            verdicts.push(v);
        }
        let dead = first_dead(&verdicts).expect("never dead");
        // Silent from read 10 (5 s): probed after WATCHED_QUIET, dead DEAD_AFTER later.
        assert!(
            (16..=20).contains(&dead),
            "dead at read {dead}: {verdicts:?}"
        );
        // The same reads, unwatched: idle for ever.
        let mut track = Track::default();
        let idle = (0..30u32).all(|i| {
            let now = start + Duration::from_millis(500) * i;
            let rx = 100 + 64 * u64::from(i.min(10));
            !track
                .observe(
                    Counters {
                        tx_bytes: 500 + 32 * u64::from(i / 10),
                        rx_bytes: rx,
                    },
                    now,
                )
                .is_dead()
        });
        assert!(idle);
    }

    #[test]
    fn the_period_grows_with_the_peers_read() {
        assert_eq!(poll_period(3), POLL);
        assert_eq!(poll_period(10_000), Duration::from_millis(2500));
        assert_eq!(poll_period(1_000_000), Duration::from_secs(5));
    }

    #[test]
    fn keepalives_alone_are_not_traffic_that_waits_for_an_answer() {
        // A keepalive every 10 s (passive) or 2 s (persistent), never answered.
        let reads: Vec<(u64, u64)> = (0..60).map(|i| (500 + 32 * (i / 2), 300)).collect();
        let v = run(&reads);
        assert!(v.iter().all(|v| *v == Verdict::Idle), "{v:?}");
    }

    #[test]
    fn traffic_both_ways_is_alive() {
        let both: Vec<(u64, u64)> = (0..30).map(|i| (1000 * i, 900 * i)).collect();
        let v = run(&both);
        assert!(v[1..].iter().all(|v| *v == Verdict::Alive), "{v:?}");
    }

    #[test]
    fn one_way_traffic_answered_by_its_probes_is_not_dead() {
        // Sent every second; the only answers are the probes' (the second after each).
        let mut reads = Vec::new();
        let mut rx = 0;
        let start = Instant::now();
        let mut track = Track::default();
        for i in 0..60u64 {
            let now = start + READ * i as u32;
            let v = track.observe(
                Counters {
                    tx_bytes: 1000 * i,
                    rx_bytes: rx,
                },
                now,
            );
            if let Verdict::Unanswered { probe: true, .. } = v {
                track.probed(now);
                rx += 84; // the echo reply, within the next read
            }
            reads.push(v);
        }
        assert_eq!(first_dead(&reads), None, "{reads:?}");
        assert!(reads
            .iter()
            .any(|v| matches!(v, Verdict::Unanswered { probe: true, .. })));
    }

    #[test]
    fn sent_and_never_answered_is_dead_within_five_seconds() {
        // Alive for 10 s, then nothing comes back.
        let reads: Vec<(u64, u64)> = (0..30).map(|i| (1000 * i, 900 * i.min(10))).collect();
        let v = run(&reads);
        let dead = first_dead(&v).expect("never dead");
        // The fault came between reads 10 and 11: dead at most 5 reads later.
        assert!((11..=15).contains(&dead), "dead at {dead}: {v:?}");
        assert!(v[dead..].iter().all(Verdict::is_dead), "{v:?}");
        // It was probed before.
        assert!(v[10..dead]
            .iter()
            .any(|v| matches!(v, Verdict::Unanswered { probe: true, .. })));
    }

    #[test]
    fn an_answer_ends_it_and_a_repair_needs_fresh_evidence() {
        let start = Instant::now();
        let mut track = Track::default();
        let at = |i: u32, tx: u64, rx: u64, t: &mut Track| {
            let now = start + READ * i;
            let v = t.observe(
                Counters {
                    tx_bytes: tx,
                    rx_bytes: rx,
                },
                now,
            );
            if let Verdict::Unanswered { probe: true, .. } = v {
                t.probed(now);
            }
            v
        };
        for i in 0..10 {
            at(i, 100 * u64::from(i), 0, &mut track);
        }
        assert!(at(10, 1000, 0, &mut track).is_dead());
        track.repaired(start + READ * 10);
        // Right after a repair: unanswered, not dead, until the evidence is fresh again.
        assert!(matches!(
            at(11, 1100, 0, &mut track),
            Verdict::Unanswered { probe: true, .. }
        ));
        assert_eq!(at(12, 1200, 50, &mut track), Verdict::Alive);
        assert_eq!(at(13, 1200, 50, &mut track), Verdict::Idle);
    }

    #[test]
    fn counters_that_go_back_start_again() {
        let mut reads: Vec<(u64, u64)> = (0..10).map(|i| (1000 * i, 0)).collect();
        // The peer was re-added: its counters start again from nothing.
        reads.extend((0..3).map(|i| (100 * i, 0)));
        let v = run(&reads);
        assert!(v[9].is_dead(), "{v:?}");
        assert_eq!(v[10], Verdict::Idle);
        assert!(!v[11].is_dead() && !v[12].is_dead(), "{v:?}");
    }
}
