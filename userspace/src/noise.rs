//! A peer's Noise state: its tunnel (`wg::Tunnel`, called `Tunn` here), made on first
//! use and kept for the peer's life: a PSK, keepalive or private key change is applied to
//! it in place (`wg::Tunnel::set_psk` and the like), so the peer's newest initiation
//! timestamp and the session in use survive every change, as kernel WireGuard keeps them
//! in its peer.

use std::time::{Duration, Instant};

use super::wg::Tunnel as Tunn;

pub struct Noise {
    /// Made on first use (`State::session`): a peer that never carries traffic costs no
    /// handshake state.
    pub tunn: Option<Box<Tunn>>,
    /// A change (PSK, private key) asks for a handshake at once (the timer thread), not
    /// only when traffic asks for one.
    pub initiate: bool,
    /// Bytes of handshake messages sent to the peer (initiations, responses), which the
    /// tunnel does not count: `tx_bytes` includes them as kernel WireGuard's does, so a
    /// pair whose handshakes go unanswered (a wrong endpoint or PSK from the start, no
    /// session ever made) shows as sending, and the liveness watcher finds it dead.
    pub handshake_tx: usize,
}

impl Noise {
    pub fn new() -> Noise {
        Noise {
            tunn: None,
            initiate: false,
            handshake_tx: 0,
        }
    }

    /// What `wg show` reports: the handshake of the session in use, and the bytes sent
    /// (handshake messages included) and received.
    pub fn stats(&self, now: Instant) -> (Option<Duration>, usize, usize) {
        let (since, tx, rx) = self.tunn.as_deref().map_or((None, 0, 0), |t| t.stats(now));
        (since, tx + self.handshake_tx, rx)
    }
}
