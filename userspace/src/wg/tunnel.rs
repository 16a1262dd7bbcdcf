//! One peer's tunnel: its handshake, the sessions it made, the packets queued while no
//! session exists, and the timers that rekey, retry and keep the path alive (whitepaper
//! §6), shaped as kernel WireGuard's peer: three session slots (`current`, the one we
//! send on; `previous`, still opened while the peer moves over; `next`, a session we
//! answered, used only once the peer's first data message on it confirms it), so a new
//! handshake never replaces the session in use before the peer has it. The tunnel lives
//! as long as the peer: a PSK, keepalive or private key change is applied in place, and
//! the newest initiation timestamp (the handshake's) survives every change.
//!
//! Time is an input: every call that acts takes `now`; nothing here reads a clock.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use super::handshake::{index_at, Handshake, HandshakeError, Latest};
use super::index::{Indices, Owner};
use super::session::{is_data, OpenError, Session, REKEY_AFTER_MESSAGES};
use super::timers::*;

/// Packets held for a peer while its handshake runs (past it, new ones are dropped).
const MAX_QUEUE: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunnelError {
    Handshake(HandshakeError),
    Data(OpenError),
    /// A data message for a session this tunnel does not hold.
    NoSession,
    /// A decrypted packet that is not IP, or shorter than its IP length says.
    NotIp,
    /// The handshake gave up (REKEY_ATTEMPT_TIME) or the last session is long gone: no
    /// handshake runs until traffic asks for one.
    Expired,
    /// No handshake could be made (no randomness for a key or an index).
    Refused,
}

#[derive(Debug)]
pub enum TunnResult<'a> {
    Done,
    Err(TunnelError),
    WriteToNetwork(&'a mut [u8]),
    WriteToTunnelV4(&'a mut [u8], Ipv4Addr),
    WriteToTunnelV6(&'a mut [u8], Ipv6Addr),
}

pub struct Tunnel {
    handshake: Handshake,
    /// The device's session indices, and the peer's key they are held under.
    indices: Arc<Indices>,
    owner: Owner,
    /// The indices this tunnel holds (sessions and handshakes in flight).
    held: Vec<u32>,
    current: Option<Arc<Session>>,
    previous: Option<Arc<Session>>,
    next: Option<Arc<Session>>,
    /// Plaintext waiting for a session, zeroed as it goes.
    queue: VecDeque<Zeroizing<Vec<u8>>>,
    timers: Timers,
    keepalive: u16,
    /// A persistent keepalive is due at the next timer run (its interval was just set).
    keepalive_now: bool,
    expired: bool,
    tx_bytes: usize,
    rx_bytes: usize,
}

/// The destination address of an IP packet.
pub fn dst_address(pkt: &[u8]) -> Option<IpAddr> {
    match pkt.first()? >> 4 {
        4 if pkt.len() >= 20 => Some(IpAddr::from(<[u8; 4]>::try_from(&pkt[16..20]).ok()?)),
        6 if pkt.len() >= 40 => Some(IpAddr::from(<[u8; 16]>::try_from(&pkt[24..40]).ok()?)),
        _ => None,
    }
}

/// The IP length of a decrypted packet and its source: None when it is not IP, is
/// shorter than it says, or says it is shorter than its header (padding past the IP
/// length is dropped).
pub fn inner(pkt: &[u8]) -> Option<(usize, IpAddr)> {
    match pkt.first()? >> 4 {
        4 if pkt.len() >= 20 => {
            let len = usize::from(u16::from_be_bytes([pkt[2], pkt[3]]));
            let src = <[u8; 4]>::try_from(&pkt[12..16]).ok()?;
            // An IPv4 header is at least 20 bytes: a shorter total length is not IP.
            (20..=pkt.len())
                .contains(&len)
                .then_some((len, IpAddr::from(src)))
        }
        6 if pkt.len() >= 40 => {
            let len = usize::from(u16::from_be_bytes([pkt[4], pkt[5]])) + 40;
            let src = <[u8; 16]>::try_from(&pkt[8..24]).ok()?;
            (len <= pkt.len()).then_some((len, IpAddr::from(src)))
        }
        _ => None,
    }
}

impl Tunnel {
    /// A tunnel to `peer`, its session indices taken from `indices`.
    pub fn new(
        secret: StaticSecret,
        peer: PublicKey,
        psk: Option<[u8; 32]>,
        keepalive: Option<u16>,
        indices: Arc<Indices>,
        now: Instant,
    ) -> Tunnel {
        let keepalive = keepalive.unwrap_or(0);
        Tunnel {
            owner: *peer.as_bytes(),
            handshake: Handshake::new(secret, peer, psk),
            indices,
            held: Vec::new(),
            current: None,
            previous: None,
            next: None,
            queue: VecDeque::new(),
            timers: Timers::new(now),
            keepalive,
            keepalive_now: keepalive > 0,
            expired: false,
            tx_bytes: 0,
            rx_bytes: 0,
        }
    }

    /// A new PSK: mixed into the next handshake, which starts now (the sessions made
    /// with the old one carry traffic until the new one is in use).
    pub fn set_psk(&mut self, psk: Option<[u8; 32]>) {
        self.handshake.set_psk(psk);
    }

    /// A new persistent keepalive interval (0: none): a keepalive goes out at the next
    /// timer run when one is set, as kernel WireGuard sends one when it is configured.
    pub fn set_keepalive(&mut self, keepalive: u16) {
        if keepalive != self.keepalive {
            self.keepalive = keepalive;
            self.keepalive_now = keepalive > 0;
        }
    }

    /// A new private key of ours: handshakes in flight are abandoned; the sessions keep
    /// carrying traffic until a handshake under the new key replaces them.
    pub fn set_secret(&mut self, secret: StaticSecret) {
        self.handshake.set_secret(secret);
        self.release_unused();
    }

    /// Nothing more is sealed on the sessions we have (the device lost its private key):
    /// they still open what the peer sends until they age out, as kernel WireGuard's
    /// expired keypairs do.
    pub fn stop_sending(&mut self) {
        self.previous = self.current.take().or(self.previous.take());
        self.next = None;
        self.release_unused();
    }

    /// The newest initiation consumed from the peer (`Handshake::latest`).
    pub fn latest(&self) -> Option<Latest> {
        self.handshake.latest()
    }

    /// See `Handshake::remember`.
    pub fn remember(&mut self, latest: Latest) {
        self.handshake.remember(latest);
    }

    /// Gives back the indices no session or pending handshake holds any more.
    fn release_unused(&mut self) {
        let live: Vec<u32> = [&self.current, &self.previous, &self.next]
            .into_iter()
            .flatten()
            .map(|s| s.local)
            .chain(self.handshake.pending())
            .collect();
        let (indices, owner) = (&self.indices, &self.owner);
        self.held.retain(|i| {
            let keep = live.contains(i);
            if !keep {
                indices.release(*i, owner);
            }
            keep
        });
    }

    /// A fresh index for a handshake or session of this tunnel.
    fn claim(indices: &Indices, owner: Owner, held: &mut Vec<u32>) -> Option<u32> {
        let index = indices.claim(owner)?;
        held.push(index);
        Some(index)
    }

    /// The session outgoing packets are sealed with, if any.
    pub fn sending(&self) -> Option<&Arc<Session>> {
        self.current.as_ref()
    }

    /// Seals `src` into `dst` (`src.len() + 32` bytes, at least 148): a data message, or,
    /// without a session, a handshake initiation (`src` is queued until the session).
    pub fn encapsulate<'a>(
        &mut self,
        src: &[u8],
        now: Instant,
        dst: &'a mut [u8],
    ) -> TunnResult<'a> {
        if let Some(session) = self.current.clone() {
            if let Some(n) = session.seal(src, dst) {
                self.sealed(src.len(), now);
                return TunnResult::WriteToNetwork(&mut dst[..n]);
            }
            // Past REJECT_AFTER_MESSAGES: the session is done.
            self.current = None;
            self.release_unused();
        }
        // A keepalive waits only if nothing else does (one is enough to confirm a
        // session), as kernel WireGuard stages one only on an empty queue.
        if self.queue.len() < MAX_QUEUE && (!src.is_empty() || self.queue.is_empty()) {
            self.queue.push_back(Zeroizing::new(src.to_vec()));
        }
        self.format_handshake_initiation(now, dst, false)
    }

    /// The session data messages to `receiver` (their index) are opened with: the slot
    /// whose session has exactly that index.
    pub fn receiving(&self, receiver: u32) -> Option<&Arc<Session>> {
        [&self.current, &self.next, &self.previous]
            .into_iter()
            .flatten()
            .find(|s| s.local == receiver)
    }

    /// Counts data messages to `receiver` that its session (`receiving`) opened, carrying
    /// `bytes` of packets (0: keepalives only). A first message on the `next` session
    /// confirms it: it becomes the one we send on, the one in use before it `previous`.
    pub fn received(&mut self, receiver: u32, bytes: usize, now: Instant) {
        if self.next.as_ref().is_some_and(|s| s.local == receiver) {
            self.previous = self.current.take();
            self.current = self.next.take();
            self.timers.session_established = now;
            self.timers.initiator = false;
            // The handshake is complete: our own attempt, if any, is over (kernel
            // WireGuard stops its retransmissions here).
            self.handshake.abandon();
            self.release_unused();
        }
        self.timers.received(now, bytes > 0);
        self.rx_bytes += bytes;
    }

    /// Counts packets of `bytes` bytes in all (0: keepalives only) sealed with the
    /// session `sending` gave.
    pub fn sealed(&mut self, bytes: usize, now: Instant) {
        self.timers.sent(now, bytes > 0);
        self.tx_bytes += bytes;
    }

    /// Handles a datagram from the network whose MACs the device checked: a data message
    /// opens into `dst`; a handshake message is answered into `dst`. An empty `datagram`
    /// takes the next queued packet instead (call again until `Done` once a session can
    /// send).
    pub fn decapsulate<'a>(
        &mut self,
        datagram: &[u8],
        now: Instant,
        dst: &'a mut [u8],
    ) -> TunnResult<'a> {
        if datagram.is_empty() {
            return self.send_queued(now, dst);
        }
        let result = match datagram.get(..4) {
            Some([1, 0, 0, 0]) => self.initiation(datagram, now, dst),
            Some([2, 0, 0, 0]) => self.response(datagram, now, dst),
            Some([3, 0, 0, 0]) => self
                .handshake
                .take_cookie(datagram, now)
                .map(|()| TunnResult::Done)
                .map_err(TunnelError::Handshake),
            _ => self.data(datagram, now, dst),
        };
        result.unwrap_or_else(TunnResult::Err)
    }

    fn initiation<'a>(
        &mut self,
        msg: &[u8],
        now: Instant,
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, TunnelError> {
        let (indices, owner, held) = (&self.indices, self.owner, &mut self.held);
        let responded = self
            .handshake
            .respond(msg, now, || Self::claim(indices, owner, held), dst);
        let (session, n) = match responded {
            Ok(answer) => answer,
            Err(e) => {
                // An index claimed for a response that failed after it goes back.
                self.release_unused();
                return Err(TunnelError::Handshake(e));
            }
        };
        let index = session.local;
        // Used only once the peer's first data message on it confirms it; a `next` not
        // confirmed is replaced, and the session in use stays.
        self.next = Some(Arc::new(session));
        self.timers.received(now, false);
        self.timers.sent(now, false);
        self.timers.derived = now;
        self.timers.handshake_sent = Some(now);
        self.expired = false;
        self.release_unused();
        tracing::debug!(index, "answered a handshake initiation");
        Ok(TunnResult::WriteToNetwork(&mut dst[..n]))
    }

    fn response<'a>(
        &mut self,
        msg: &[u8],
        now: Instant,
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, TunnelError> {
        let session = Arc::new(
            self.handshake
                .complete(msg, now)
                .map_err(TunnelError::Handshake)?,
        );
        tracing::debug!(index = session.local, "handshake completed");
        // Ours is confirmed by the response itself: it is the one we send on now.
        match self.next.take() {
            Some(next) => self.previous = Some(next),
            None => self.previous = self.current.take(),
        }
        self.current = Some(session.clone());
        self.timers.received(now, false);
        self.timers.session_established = now;
        self.timers.derived = now;
        self.timers.initiator = true;
        self.expired = false;
        self.release_unused();
        // The confirming keepalive, which makes the peer use the session.
        let n = session.seal(&[], dst).ok_or(TunnelError::NoSession)?;
        self.sealed(0, now);
        Ok(TunnResult::WriteToNetwork(&mut dst[..n]))
    }

    fn data<'a>(
        &mut self,
        msg: &[u8],
        now: Instant,
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, TunnelError> {
        if !is_data(msg) {
            return Err(TunnelError::Data(OpenError::Malformed));
        }
        let receiver = index_at(msg, 4);
        let session = self.receiving(receiver).ok_or(TunnelError::NoSession)?;
        let n = session.open(msg, dst).map_err(TunnelError::Data)?;
        if n == 0 {
            self.received(receiver, 0, now);
            return Ok(TunnResult::Done);
        }
        let (len, src) = inner(&dst[..n]).ok_or(TunnelError::NotIp)?;
        self.received(receiver, len, now);
        Ok(match src {
            IpAddr::V4(a) => TunnResult::WriteToTunnelV4(&mut dst[..len], a),
            IpAddr::V6(a) => TunnResult::WriteToTunnelV6(&mut dst[..len], a),
        })
    }

    fn send_queued<'a>(&mut self, now: Instant, dst: &'a mut [u8]) -> TunnResult<'a> {
        if self.current.is_none() {
            return TunnResult::Done;
        }
        match self.queue.pop_front() {
            Some(pkt) => self.encapsulate(&pkt, now, dst),
            None => TunnResult::Done,
        }
    }

    /// A handshake initiation into `dst`, unless one is in flight (`force`: even then, a
    /// retry).
    pub fn format_handshake_initiation<'a>(
        &mut self,
        now: Instant,
        dst: &'a mut [u8],
        force: bool,
    ) -> TunnResult<'a> {
        let in_flight = self.handshake.in_flight().is_some();
        let recent = self
            .timers
            .handshake_sent
            .is_some_and(|at| now.saturating_duration_since(at) < REKEY_TIMEOUT);
        if (in_flight || recent) && !force {
            return TunnResult::Done;
        }
        if self.expired {
            self.timers.clear(now);
            self.expired = false;
        }
        let Some(index) = Self::claim(&self.indices, self.owner, &mut self.held) else {
            return TunnResult::Err(TunnelError::Refused);
        };
        let written = self.handshake.initiate(index, now, dst);
        self.release_unused();
        let Some(n) = written else {
            return TunnResult::Err(TunnelError::Refused);
        };
        if !in_flight {
            self.timers.handshake_started = now;
        }
        tracing::debug!(index, retry = in_flight, "sending a handshake initiation");
        self.timers.sent(now, false);
        self.timers.handshake_sent = Some(now);
        TunnResult::WriteToNetwork(&mut dst[..n])
    }

    /// Gives the attempt up: queued packets are dropped, and no handshake runs until
    /// traffic or a persistent keepalive asks for one. With `zero`, every session goes
    /// too (its key material is old); without, sessions age out on their own.
    fn expire(&mut self, now: Instant, zero: bool) {
        tracing::debug!(
            zero,
            "no handshake answered in time, or the last session is long gone: queue dropped"
        );
        if zero {
            (self.current, self.previous, self.next) = (None, None, None);
            self.timers.clear(now);
        }
        self.queue.clear();
        self.handshake.abandon();
        self.release_unused();
        self.expired = true;
    }

    /// Whether the persistent keepalive is due at `now` (and marks it sent).
    fn keepalive_due(&mut self, now: Instant) -> bool {
        let every = Duration::from_secs(u64::from(self.keepalive));
        let due = self.keepalive > 0
            && (self.keepalive_now
                || now.saturating_duration_since(self.timers.persistent_keepalive) >= every);
        if due {
            self.keepalive_now = false;
        }
        due
    }

    /// Drops the sessions past REJECT_AFTER_TIME, in every slot.
    fn age_sessions(&mut self, now: Instant) {
        let mut aged = false;
        for slot in [&mut self.current, &mut self.previous, &mut self.next] {
            if slot
                .as_ref()
                .is_some_and(|s| now.saturating_duration_since(s.made) >= REJECT_AFTER_TIME)
            {
                *slot = None;
                aged = true;
            }
        }
        if aged {
            self.release_unused();
        }
    }

    /// Runs the timers (about every 250 ms): a handshake or keepalive due is written to
    /// `dst`.
    pub fn update_timers<'a>(&mut self, now: Instant, dst: &'a mut [u8]) -> TunnResult<'a> {
        self.age_sessions(now);
        if self.expired {
            // Given up: only a persistent keepalive goes on (without a session it starts
            // a new attempt), so a node behind NAT keeps trying to open its mapping.
            if self.keepalive_due(now) {
                return self.encapsulate(&[], now, dst);
            }
            return TunnResult::Err(TunnelError::Expired);
        }
        self.handshake.expire_cookie(now);
        let t = &self.timers;
        let since = |at: Instant| now.saturating_duration_since(at);
        if since(t.derived) >= REJECT_AFTER_TIME * 3 {
            self.expire(now, true);
            return TunnResult::Err(TunnelError::Expired);
        }
        let mut handshake = false;
        let mut retry = false;
        let mut keepalive = false;
        if let Some(sent) = self.handshake.in_flight() {
            if since(t.handshake_started) >= REKEY_ATTEMPT_TIME {
                self.expire(now, false);
                return TunnResult::Err(TunnelError::Expired);
            }
            handshake = since(sent) >= REKEY_TIMEOUT;
            retry = handshake;
        } else {
            if t.initiator {
                let worn = self
                    .sending()
                    .is_some_and(|s| s.sent() >= REKEY_AFTER_MESSAGES);
                handshake |= worn
                    || (t.session_established < t.data_sent
                        && since(t.session_established) >= REKEY_AFTER_TIME)
                    || (t.session_established < t.data_received
                        && since(t.session_established)
                            >= REJECT_AFTER_TIME - KEEPALIVE_TIMEOUT - REKEY_TIMEOUT);
            }
            // Data went out and nothing came back for KEEPALIVE + REKEY timeouts.
            if t.answer_owed
                .is_some_and(|at| since(at) >= KEEPALIVE_TIMEOUT + REKEY_TIMEOUT)
            {
                self.timers.answer_owed = None;
                handshake = true;
            }
            let t = &self.timers;
            if !handshake {
                // Data came in and nothing went out for KEEPALIVE_TIMEOUT.
                if t.keepalive_owed
                    .is_some_and(|at| since(at) >= KEEPALIVE_TIMEOUT)
                {
                    keepalive = true;
                }
                keepalive |= self.keepalive_due(now);
            }
        }
        if handshake {
            // Only a retry passes the REKEY_TIMEOUT since our last handshake message; a
            // rekey right after we answered the peer waits (kernel WireGuard's rule).
            return self.format_handshake_initiation(now, dst, retry);
        }
        if keepalive {
            return self.encapsulate(&[], now, dst);
        }
        TunnResult::Done
    }

    /// How long before `now` the session in use was made; None without one.
    pub fn time_since_last_handshake(&self, now: Instant) -> Option<Duration> {
        self.sending()?;
        Some(now.saturating_duration_since(self.timers.session_established))
    }

    /// Whether a session carries our traffic.
    pub fn established(&self) -> bool {
        self.current.is_some()
    }

    /// (time since the last handshake, data bytes sent, data bytes received).
    pub fn stats(&self, now: Instant) -> (Option<Duration>, usize, usize) {
        (
            self.time_since_last_handshake(now),
            self.tx_bytes,
            self.rx_bytes,
        )
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        for index in self.held.drain(..) {
            self.indices.release(index, &self.owner);
        }
    }
}

#[cfg(test)]
#[path = "tunnel_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "timer_tests.rs"]
mod timer_tests;
