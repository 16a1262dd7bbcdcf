//! WireGuard's timer constants (whitepaper §6.1) and the instants a tunnel's timers run
//! from.

use std::time::{Duration, Instant};

pub const REKEY_AFTER_TIME: Duration = Duration::from_secs(120);
pub const REJECT_AFTER_TIME: Duration = Duration::from_secs(180);
pub const REKEY_ATTEMPT_TIME: Duration = Duration::from_secs(90);
pub const REKEY_TIMEOUT: Duration = Duration::from_secs(5);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// When each kind of event last happened (all start at the tunnel's creation), and the
/// two timers kernel WireGuard arms from traffic: a keepalive owed for data received,
/// a handshake owed for data sent that nothing answered.
pub struct Timers {
    /// We initiated the session in use.
    pub initiator: bool,
    /// When the session in use was confirmed (the last handshake, as `wg show` says).
    pub session_established: Instant,
    /// When the last session's keys were derived (its key material is zeroed
    /// REJECT_AFTER_TIME × 3 later if no other comes).
    pub derived: Instant,
    pub handshake_started: Instant,
    /// When we last sent a handshake message (initiation or response): a new initiation
    /// waits REKEY_TIMEOUT after it unless it is a retry (kernel WireGuard's
    /// `last_sent_handshake`), so answering the peer does not start a race of our own.
    pub handshake_sent: Option<Instant>,
    pub data_received: Instant,
    pub data_sent: Instant,
    /// The last authenticated packet either way: a persistent keepalive is due its
    /// interval after it.
    pub persistent_keepalive: Instant,
    /// The first data received since we last sent anything: a keepalive is due
    /// KEEPALIVE_TIMEOUT after it, unless something else goes out first.
    pub keepalive_owed: Option<Instant>,
    /// The first data sent since we last received anything: a new handshake is due
    /// KEEPALIVE_TIMEOUT + REKEY_TIMEOUT after it, unless something comes back first.
    pub answer_owed: Option<Instant>,
}

impl Timers {
    pub fn new(now: Instant) -> Timers {
        Timers {
            initiator: false,
            session_established: now,
            derived: now,
            handshake_started: now,
            handshake_sent: None,
            data_received: now,
            data_sent: now,
            persistent_keepalive: now,
            keepalive_owed: None,
            answer_owed: None,
        }
    }

    /// Every instant to `now`, nothing owed.
    pub fn clear(&mut self, now: Instant) {
        let initiator = self.initiator;
        *self = Timers::new(now);
        self.initiator = initiator;
    }

    /// An authenticated packet (of any kind) arrived; `data`: it carried data.
    pub fn received(&mut self, now: Instant, data: bool) {
        self.persistent_keepalive = now;
        self.answer_owed = None;
        if data {
            self.data_received = now;
            self.keepalive_owed.get_or_insert(now);
        }
    }

    /// An authenticated packet (of any kind) went out; `data`: it carried data.
    pub fn sent(&mut self, now: Instant, data: bool) {
        self.persistent_keepalive = now;
        self.keepalive_owed = None;
        if data {
            self.data_sent = now;
            self.answer_owed.get_or_insert(now);
        }
    }
}
