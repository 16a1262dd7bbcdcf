//! One peer's tunnel: its handshake, the sessions it made (eight slots by the low bits of
//! their index), the packets queued while no session exists, and the timers that rekey,
//! retry and keep the path alive (whitepaper §6), with the behaviour the device relies on:
//! a responder's session carries traffic once the peer has sent on it, a handshake retries
//! every REKEY_TIMEOUT for REKEY_ATTEMPT_TIME and then gives up with the queue dropped.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boringtun::noise::rate_limiter::RateLimiter;
use x25519_dalek::{PublicKey, StaticSecret};

use super::handshake::{index_at, Handshake, HandshakeError};
use super::session::{OpenError, Session, OVERHEAD, REKEY_AFTER_MESSAGES};
use super::timers::*;

const SLOTS: usize = 8;
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
    /// The rate limiter refused the message (bad mac1, or no mac2 under load).
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
    limiter: Arc<RateLimiter>,
    /// The session index's upper 24 bits (the peer's, in the device) and the low 8 bits
    /// of the next handshake's.
    base: u32,
    next: u8,
    sessions: [Option<Arc<Session>>; SLOTS],
    /// When each slot's session was made.
    made: [Instant; SLOTS],
    current: usize,
    queue: VecDeque<Vec<u8>>,
    timers: Timers,
    keepalive: u16,
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

/// The IP length of a decrypted packet and its source: None when it is not IP or is
/// shorter than it says (padding past the IP length is dropped).
pub fn inner(pkt: &[u8]) -> Option<(usize, IpAddr)> {
    match pkt.first()? >> 4 {
        4 if pkt.len() >= 20 => {
            let len = usize::from(u16::from_be_bytes([pkt[2], pkt[3]]));
            let src = <[u8; 4]>::try_from(&pkt[12..16]).ok()?;
            (len <= pkt.len()).then_some((len, IpAddr::from(src)))
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
    /// A tunnel to `peer`, its sessions indexed `index << 8 | n`.
    pub fn new(
        secret: StaticSecret,
        peer: PublicKey,
        psk: Option<[u8; 32]>,
        keepalive: Option<u16>,
        index: u32,
        limiter: Arc<RateLimiter>,
    ) -> Tunnel {
        let now = Instant::now();
        Tunnel {
            handshake: Handshake::new(secret, peer, psk),
            limiter,
            base: index << 8,
            next: 0,
            sessions: Default::default(),
            made: [now; SLOTS],
            current: 0,
            queue: VecDeque::new(),
            timers: Timers::new(now),
            keepalive: keepalive.unwrap_or(0),
            expired: false,
            tx_bytes: 0,
            rx_bytes: 0,
        }
    }

    fn next_index(&mut self) -> u32 {
        self.next = self.next.wrapping_add(1);
        self.base | u32::from(self.next)
    }

    /// The session outgoing packets are sealed with, if any.
    pub fn sending(&self) -> Option<&Arc<Session>> {
        self.sessions[self.current].as_ref()
    }

    /// Seals `src` into `dst` (`src.len() + 32` bytes, at least 148): a data message, or,
    /// without a session, a handshake initiation (`src` is queued until the session).
    pub fn encapsulate<'a>(&mut self, src: &[u8], dst: &'a mut [u8]) -> TunnResult<'a> {
        if let Some(session) = self.sending().cloned() {
            if let Some(n) = session.seal(src, dst) {
                self.sealed(src.len());
                return TunnResult::WriteToNetwork(&mut dst[..n]);
            }
            // Past REJECT_AFTER_MESSAGES: the session is done.
            self.sessions[self.current] = None;
        }
        if self.queue.len() < MAX_QUEUE {
            self.queue.push_back(src.to_vec());
        }
        self.format_handshake_initiation(dst, false)
    }

    /// The session data messages to `receiver` (their index) are opened with.
    pub fn receiving(&self, receiver: u32) -> Option<&Arc<Session>> {
        self.sessions[receiver as usize % SLOTS]
            .as_ref()
            .filter(|s| s.local == receiver)
    }

    /// Counts data messages to `receiver` that its session (`receiving`) opened, carrying
    /// `bytes` of packets (0: keepalives only): the peer uses that session, so it carries
    /// our traffic from now on.
    pub fn received(&mut self, receiver: u32, bytes: usize) {
        let now = Instant::now();
        self.choose(receiver as usize % SLOTS);
        self.timers.received(now);
        if bytes > 0 {
            self.timers.data_received = now;
            self.rx_bytes += bytes;
        }
    }

    /// Counts packets of `bytes` bytes in all (0: keepalives only) sealed with the
    /// session `sending` gave.
    pub fn sealed(&mut self, bytes: usize) {
        let now = Instant::now();
        self.timers.sent(now);
        if bytes > 0 {
            self.timers.data_sent = now;
        }
        self.tx_bytes += bytes;
    }

    /// Handles a datagram from the network (from `from`): a data message opens into
    /// `dst`; a handshake message is answered into `dst`. An empty `datagram` takes the
    /// next queued packet instead (call again until `Done` after a handshake completes).
    pub fn decapsulate<'a>(
        &mut self,
        from: Option<IpAddr>,
        datagram: &[u8],
        dst: &'a mut [u8],
    ) -> TunnResult<'a> {
        if datagram.is_empty() {
            return self.send_queued(dst);
        }
        if datagram[0] == 4 {
            // Data carries no MACs: the limiter would only parse it.
            return self.data(datagram, dst).unwrap_or_else(TunnResult::Err);
        }
        let mut cookie = [0u8; super::handshake::COOKIE_LEN];
        match self.limiter.verify_packet(from, datagram, &mut cookie) {
            Ok(_) => {}
            Err(boringtun::noise::TunnResult::WriteToNetwork(reply)) => {
                let n = reply.len();
                let Some(out) = dst.get_mut(..n) else {
                    return TunnResult::Err(TunnelError::Refused);
                };
                out.copy_from_slice(reply);
                return TunnResult::WriteToNetwork(out);
            }
            Err(_) => return TunnResult::Err(TunnelError::Refused),
        }
        let result = match datagram[0] {
            1 => self.initiation(datagram, dst),
            2 => self.response(datagram, dst),
            3 => self
                .handshake
                .take_cookie(datagram)
                .map(|()| {
                    self.timers.received(Instant::now());
                    TunnResult::Done
                })
                .map_err(TunnelError::Handshake),
            _ => self.data(datagram, dst),
        };
        result.unwrap_or_else(TunnResult::Err)
    }

    fn initiation<'a>(
        &mut self,
        msg: &[u8],
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, TunnelError> {
        let index = self.next_index();
        let (session, n) = self
            .handshake
            .respond(msg, index, dst)
            .map_err(TunnelError::Handshake)?;
        let now = Instant::now();
        self.install(session, now);
        self.timers.received(now);
        self.timers.sent(now);
        self.established(false, now);
        tracing::debug!(index, "answered a handshake initiation");
        Ok(TunnResult::WriteToNetwork(&mut dst[..n]))
    }

    fn response<'a>(
        &mut self,
        msg: &[u8],
        dst: &'a mut [u8],
    ) -> Result<TunnResult<'a>, TunnelError> {
        let session = self
            .handshake
            .complete(msg)
            .map_err(TunnelError::Handshake)?;
        let now = Instant::now();
        let slot = self.install(session, now);
        self.timers.received(now);
        self.established(true, now);
        tracing::debug!(
            index = self.sessions[slot].as_ref().map(|s| s.local),
            "handshake completed"
        );
        self.choose(slot);
        // The confirming keepalive, which makes the peer use the session.
        let n = self.sessions[slot]
            .as_ref()
            .and_then(|s| s.seal(&[], dst))
            .ok_or(TunnelError::NoSession)?;
        Ok(TunnResult::WriteToNetwork(&mut dst[..n]))
    }

    fn data<'a>(&mut self, msg: &[u8], dst: &'a mut [u8]) -> Result<TunnResult<'a>, TunnelError> {
        if msg.len() < OVERHEAD || msg[0] != 4 {
            return Err(TunnelError::Data(OpenError::Malformed));
        }
        let receiver = index_at(msg, 4);
        let session = self.receiving(receiver).ok_or(TunnelError::NoSession)?;
        let n = session.open(msg, dst).map_err(TunnelError::Data)?;
        if n == 0 {
            self.received(receiver, 0);
            return Ok(TunnResult::Done);
        }
        let (len, src) = inner(&dst[..n]).ok_or(TunnelError::NotIp)?;
        self.received(receiver, len);
        Ok(match src {
            IpAddr::V4(a) => TunnResult::WriteToTunnelV4(&mut dst[..len], a),
            IpAddr::V6(a) => TunnResult::WriteToTunnelV6(&mut dst[..len], a),
        })
    }

    /// Puts a new session in its slot: the slot it took.
    fn install(&mut self, session: Session, now: Instant) -> usize {
        let slot = session.local as usize % SLOTS;
        self.sessions[slot] = Some(Arc::new(session));
        self.made[slot] = now;
        slot
    }

    fn established(&mut self, initiator: bool, now: Instant) {
        self.timers.session_established = now;
        self.timers.initiator = initiator;
        self.expired = false;
    }

    /// Sends on `slot`'s session from now on, unless the one in use is newer (or the slot
    /// lost its session meanwhile: a run is counted after it was opened).
    fn choose(&mut self, slot: usize) {
        if slot != self.current
            && self.sessions[slot].is_some()
            && (self.sessions[self.current].is_none() || self.made[slot] >= self.made[self.current])
        {
            self.current = slot;
        }
    }

    fn send_queued<'a>(&mut self, dst: &'a mut [u8]) -> TunnResult<'a> {
        if self.sending().is_none() {
            return TunnResult::Done;
        }
        match self.queue.pop_front() {
            Some(pkt) => self.encapsulate(&pkt, dst),
            None => TunnResult::Done,
        }
    }

    /// A handshake initiation into `dst`, unless one is in flight (`force`: even then, a
    /// retry).
    pub fn format_handshake_initiation<'a>(
        &mut self,
        dst: &'a mut [u8],
        force: bool,
    ) -> TunnResult<'a> {
        let in_flight = self.handshake.in_flight().is_some();
        if in_flight && !force {
            return TunnResult::Done;
        }
        let now = Instant::now();
        if self.expired {
            self.timers.clear(now);
            self.expired = false;
        }
        let index = self.next_index();
        let Some(n) = self.handshake.initiate(index, dst) else {
            return TunnResult::Err(TunnelError::Refused);
        };
        if !in_flight {
            self.timers.handshake_started = now;
        }
        tracing::debug!(index, retry = in_flight, "sending a handshake initiation");
        self.timers.sent(now);
        TunnResult::WriteToNetwork(&mut dst[..n])
    }

    /// Drops every session and queued packet; no handshake until traffic asks for one.
    fn expire(&mut self, now: Instant) {
        tracing::debug!(base = self.base >> 8, "no handshake answered in time, or the last session is long gone: sessions and queue dropped");
        self.sessions = Default::default();
        self.queue.clear();
        self.timers.clear(now);
        self.handshake.abandon();
        self.expired = true;
    }

    /// Runs the timers (about every 250 ms): a handshake or keepalive due is written to
    /// `dst`.
    pub fn update_timers<'a>(&mut self, dst: &'a mut [u8]) -> TunnResult<'a> {
        let now = Instant::now();
        for (slot, made) in self.made.iter_mut().enumerate() {
            if now.duration_since(*made) > REJECT_AFTER_TIME {
                self.sessions[slot] = None;
                *made = now;
            }
        }
        if self.expired {
            return TunnResult::Err(TunnelError::Expired);
        }
        self.handshake.expire_cookie(now);
        let t = &self.timers;
        let since = |at: Instant| now.duration_since(at);
        if since(t.session_established) >= REJECT_AFTER_TIME * 3 {
            self.expire(now);
            return TunnResult::Err(TunnelError::Expired);
        }
        let mut handshake = false;
        let mut keepalive = false;
        if let Some(sent) = self.handshake.in_flight() {
            if since(t.handshake_started) >= REKEY_ATTEMPT_TIME {
                self.expire(now);
                return TunnResult::Err(TunnelError::Expired);
            }
            handshake = since(sent) >= REKEY_TIMEOUT;
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
            if t.data_sent > t.packet_received
                && since(t.packet_received) >= KEEPALIVE_TIMEOUT + REKEY_TIMEOUT
                && t.want_handshake
            {
                self.timers.want_handshake = false;
                handshake = true;
            }
            let t = &self.timers;
            if !handshake {
                if t.data_received > t.packet_sent
                    && since(t.packet_sent) >= KEEPALIVE_TIMEOUT
                    && t.want_keepalive
                {
                    self.timers.want_keepalive = false;
                    keepalive = true;
                }
                let every = Duration::from_secs(u64::from(self.keepalive));
                if self.keepalive > 0 && since(self.timers.persistent_keepalive) >= every {
                    self.timers.persistent_keepalive = now;
                    keepalive = true;
                }
            }
        }
        if handshake {
            return self.format_handshake_initiation(dst, true);
        }
        if keepalive {
            return self.encapsulate(&[], dst);
        }
        TunnResult::Done
    }

    /// How long ago the session in use was made; None without one.
    pub fn time_since_last_handshake(&self) -> Option<Duration> {
        self.sending()?;
        Some(self.timers.session_established.elapsed())
    }

    /// (time since the last handshake, data bytes sent, data bytes received).
    pub fn stats(&self) -> (Option<Duration>, usize, usize) {
        (
            self.time_since_last_handshake(),
            self.tx_bytes,
            self.rx_bytes,
        )
    }
}

#[cfg(test)]
#[path = "tunnel_tests.rs"]
mod tests;
