//! A peer's Noise state: its tunnel (`wg::Tunnel`, called `Tunn` here), made on first
//! use, and for a while after a PSK, keepalive or private key change the one before it. A
//! tunnel's PSK and keepalive are fixed at its creation (and a key change must not drop the sessions the peers still send
//! on), so a change makes a new `Tunn` that handshakes with the new values at once, while
//! the old one keeps carrying traffic in both directions on the session it has, as the
//! kernel keeps a session across such a change. The old one goes once the peer has used the new
//! session, or when its session could no longer be valid (WireGuard's reject-after time).

use std::time::{Duration, Instant};

use super::wg::Tunnel as Tunn;

/// WireGuard's REJECT_AFTER_TIME: no session is used longer than this after its handshake.
pub const REJECT_AFTER: Duration = Duration::from_secs(180);

/// The `Tunn` a PSK, keepalive or private key change replaced, still holding the session
/// traffic uses.
pub struct Retiring {
    /// Its session index (`receiver >> 8`).
    pub index: u32,
    pub tunn: Box<Tunn>,
    pub since: Instant,
}

pub struct Noise {
    /// The session index of `tunn` (`receiver >> 8`), set when the peer is added or its
    /// `Tunn` is replaced.
    pub index: u32,
    /// Made on first use (`State::session`): a peer that never carries traffic costs no
    /// handshake state.
    pub tunn: Option<Box<Tunn>>,
    pub retiring: Option<Retiring>,
    /// The index of the last `Tunn` retired, kept in the device's index map until the
    /// next change or the peer's removal (then taken out of it).
    pub retired_index: Option<u32>,
    /// `tunn` answered an initiation: it holds a session the peer sends on as soon as it
    /// has the response, which counts as established only once the peer's
    /// first packet arrived on it.
    pub answered: bool,
    /// A change replaced a `Tunn` that was in use: the next one handshakes at once (the
    /// timer thread), not only when traffic asks for it.
    pub initiate: bool,
    /// Bytes of handshake messages sent to the peer (initiations, responses), which the
    /// tunnel does not count: `tx_bytes` includes them as kernel WireGuard's does, so a
    /// pair whose handshakes go unanswered (a wrong endpoint or PSK from the start, no
    /// session ever made) shows as sending, and the liveness watcher finds it dead.
    pub handshake_tx: usize,
    /// Bytes (sent, received) of the `Tunn`s this peer had before: `wg show`'s transfer
    /// counts never go back (kernel WireGuard's are the peer's, across its sessions), nor
    /// do the `/metrics` counters read from them.
    carried: (usize, usize),
}

/// Whether `tunn` holds an established session.
pub fn established(tunn: &Tunn) -> bool {
    tunn.time_since_last_handshake().is_some()
}

impl Noise {
    pub fn new(index: u32) -> Noise {
        Noise {
            index,
            tunn: None,
            retiring: None,
            retired_index: None,
            answered: false,
            initiate: false,
            handshake_tx: 0,
            carried: (0, 0),
        }
    }

    /// Replaces the `Tunn` with a fresh one under session index `index`, made on first
    /// use (at once by the timer thread if the old one was in use); a `Tunn` with a
    /// session, or one that answered an initiation (the peer may be sending on that
    /// session already), is kept as the retiring one. Returns the indices that no longer
    /// belong to this peer.
    pub fn replace(&mut self, index: u32) -> Vec<u32> {
        let old_index = std::mem::replace(&mut self.index, index);
        let mut freed: Vec<u32> = self.retired_index.take().into_iter().collect();
        let answered = std::mem::take(&mut self.answered);
        self.initiate |= self.tunn.is_some();
        match self.tunn.take() {
            Some(tunn) if answered || established(&tunn) => {
                if let Some(r) = self.retiring.take() {
                    self.carry(&r.tunn);
                    freed.push(r.index);
                }
                self.retiring = Some(Retiring {
                    index: old_index,
                    tunn,
                    since: Instant::now(),
                });
            }
            dropped => {
                if let Some(tunn) = dropped {
                    self.carry(&tunn);
                }
                freed.push(old_index);
            }
        }
        freed
    }

    /// Adds the bytes of `tunn`, going now, to what this peer carried.
    fn carry(&mut self, tunn: &Tunn) {
        let (_, tx, rx) = tunn.stats();
        self.carried = (self.carried.0 + tx, self.carried.1 + rx);
    }

    /// The `Tunn` whose session index is `receiver >> 8`.
    pub fn for_receiver(&mut self, receiver: u32) -> Option<&mut Tunn> {
        let index = receiver >> 8;
        if index == self.index {
            return self.tunn.as_deref_mut();
        }
        self.retiring
            .as_mut()
            .filter(|r| r.index == index)
            .map(|r| &mut *r.tunn)
    }

    /// The retiring `Tunn`, while the new one has no session: what traffic goes out on
    /// (once the retiring one's session is confirmed; until then the new one queues
    /// traffic behind its handshake).
    pub fn sending_retiring(&mut self) -> Option<&mut Tunn> {
        let retiring = self.retiring.as_mut().filter(|r| established(&r.tunn))?;
        if self.tunn.as_deref().is_some_and(established) {
            return None;
        }
        Some(&mut *retiring.tunn)
    }

    /// Drops the retiring `Tunn` once the peer has sent on the new session, or when its
    /// session is past WireGuard's reject-after time.
    pub fn retire(&mut self) {
        let Some(r) = &self.retiring else { return };
        let taken_over = self
            .tunn
            .as_deref()
            .is_some_and(|t| established(t) && t.stats().2 > 0);
        if taken_over || r.since.elapsed() >= REJECT_AFTER {
            if let Some(r) = self.retiring.take() {
                self.carry(&r.tunn);
                self.retired_index = Some(r.index);
            }
        }
    }

    /// What `wg show` reports: the handshake of the session in use, and the bytes sent
    /// (handshake messages included) and received over every `Tunn` the peer had.
    pub fn stats(&self) -> (Option<Duration>, usize, usize) {
        let current = self.tunn.as_deref().map(Tunn::stats);
        let retiring = self.retiring.as_ref().map(|r| r.tunn.stats());
        let since = match (&current, &retiring) {
            (Some(c), _) if c.0.is_some() => c.0,
            (_, Some(r)) => r.0,
            _ => None,
        };
        let (tx, rx) = [current, retiring]
            .into_iter()
            .flatten()
            .fold(self.carried, |(tx, rx), s| (tx + s.1, rx + s.2));
        (since, tx + self.handshake_tx, rx)
    }

    /// Every index this peer holds in the device's index map.
    pub fn indices(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.index)
            .chain(self.retiring.as_ref().map(|r| r.index))
            .chain(self.retired_index)
    }
}
