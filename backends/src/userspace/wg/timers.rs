//! WireGuard's timer constants (whitepaper §6.1) and the instants a tunnel's timers run
//! from.

use std::time::{Duration, Instant};

pub const REKEY_AFTER_TIME: Duration = Duration::from_secs(120);
pub const REJECT_AFTER_TIME: Duration = Duration::from_secs(180);
pub const REKEY_ATTEMPT_TIME: Duration = Duration::from_secs(90);
pub const REKEY_TIMEOUT: Duration = Duration::from_secs(5);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// When each kind of event last happened (all start at the tunnel's creation).
pub struct Timers {
    /// We initiated the session in use.
    pub initiator: bool,
    pub session_established: Instant,
    /// When the last session's keys were derived (its key material is zeroed
    /// REJECT_AFTER_TIME × 3 later if no other comes).
    pub derived: Instant,
    pub handshake_started: Instant,
    /// When we last sent a handshake message (initiation or response): a new initiation
    /// waits REKEY_TIMEOUT after it unless it is a retry (kernel WireGuard's
    /// `last_sent_handshake`), so answering the peer does not start a race of our own.
    pub handshake_sent: Option<Instant>,
    pub packet_received: Instant,
    pub packet_sent: Instant,
    pub data_received: Instant,
    pub data_sent: Instant,
    pub persistent_keepalive: Instant,
    /// Something was received since the last send: a keepalive is owed if nothing else
    /// goes out.
    pub want_keepalive: bool,
    /// Something was sent since the last receive: a handshake is due if nothing comes
    /// back.
    pub want_handshake: bool,
}

impl Timers {
    pub fn new(now: Instant) -> Timers {
        Timers {
            initiator: false,
            session_established: now,
            derived: now,
            handshake_started: now,
            handshake_sent: None,
            packet_received: now,
            packet_sent: now,
            data_received: now,
            data_sent: now,
            persistent_keepalive: now,
            want_keepalive: false,
            want_handshake: false,
        }
    }

    /// Every instant to `now`, nothing owed.
    pub fn clear(&mut self, now: Instant) {
        let initiator = self.initiator;
        *self = Timers::new(now);
        self.initiator = initiator;
    }

    pub fn received(&mut self, now: Instant) {
        self.packet_received = now;
        self.want_keepalive = true;
        self.want_handshake = false;
    }

    pub fn sent(&mut self, now: Instant) {
        self.packet_sent = now;
        self.want_handshake = true;
        self.want_keepalive = false;
    }
}
