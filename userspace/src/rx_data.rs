//! The receiving side's data messages: a run of them for one session is opened with the
//! session taken once (straight into the packet being coalesced, or in place in parts
//! across the crypto helpers), each packet's inner source checked against the peer's
//! AllowedIPs, and what the run opened counted on the peer's tunnel once.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::super::handshakes::flush_queue;
use super::super::peers::{lock, Peer, State};
use super::super::udp::Local;
use super::super::wg::session::{counter_of, Session, HEADER};
use super::super::wg::tunnel::inner;
use super::{Outputs, Receiver};

/// Runs of data messages at least this long are opened in parts across the crypto pool
/// (shorter ones cost more to hand over than to open).
pub(super) const SPLIT_RUN: usize = 4;
/// A part's result for a message that did not open.
const NOT_OPENED: usize = usize::MAX;

impl<O: Outputs> Receiver<O> {
    /// The session a run of data messages to `receiver` is opened with: taken under the
    /// peer's lock once per run, then used without it (sessions open through `&self`), so
    /// the sending thread is never kept waiting by a decryption.
    fn session_of(peer: &Peer, receiver: u32) -> Option<Arc<Session>> {
        lock(&peer.noise)
            .tunn
            .as_deref()
            .and_then(|t| t.receiving(receiver).cloned())
    }

    /// Counts what a run opened on the peer's tunnel, once per run: which session the
    /// peer uses (ours from now on), its timers, its bytes. Packets queued while the
    /// tunnel had no session to send on go out now: the first message on a session this
    /// side answered is what lets it send (kernel WireGuard sends its queue then too).
    fn opened_run(&mut self, peer: &Peer, receiver: u32, got: &Got) {
        if got.messages == 0 {
            return;
        }
        let mut noise = lock(&peer.noise);
        if let Some(tunn) = noise.tunn.as_deref_mut() {
            tunn.received(receiver, got.bytes, std::time::Instant::now());
            if let Some(to) = peer.route() {
                flush_queue(tunn, &mut self.plain, &mut self.out, to);
            }
        }
    }

    /// Opens a run of data messages for one session in place, in parts across the
    /// crypto pool, then hands each opened packet on in order (as `data_run` does, with a
    /// copy into the packet being coalesced instead of opening straight into it).
    pub(super) fn data_run_split(
        &mut self,
        state: &State,
        (peer, receiver): (&Arc<Peer>, u32),
        run: &mut [u8],
        segment: usize,
        from: (SocketAddr, Option<Local>),
    ) {
        let Some(session) = Self::session_of(peer, receiver) else {
            return; // no session state for it: nothing of ours to decrypt with
        };
        let count = run.len().div_ceil(segment);
        let width = self.pool.width().min(count);
        let per = count.div_ceil(width);
        let opened: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(NOT_OPENED)).collect();
        let parts: Vec<Mutex<Option<&mut [u8]>>> = run
            .chunks_mut(per * segment)
            .map(|p| Mutex::new(Some(p)))
            .collect();
        let finished = self.pool.run(parts.len(), &|p| {
            let Some(part) = parts[p].lock().unwrap_or_else(|e| e.into_inner()).take() else {
                return;
            };
            for (i, msg) in part.chunks_mut(segment).enumerate() {
                if msg.len() < HEADER {
                    continue;
                }
                let n = counter_of(msg);
                if let Ok(len) = session.open_in_place(n, &mut msg[HEADER..]) {
                    opened[p * per + i].store(len, Ordering::Relaxed);
                }
            }
        });
        drop(parts);
        if !finished {
            // A part's messages are left unopened (never delivered); the rest go on.
            tracing::error!("opening a run of data messages panicked in part");
        }
        let out = &mut self.out;
        let mut write = |pkt: &[u8]| out.deliver(pkt);
        let mut got = Got::default();
        for (msg, len) in run.chunks_mut(segment).zip(&opened) {
            let len = len.load(Ordering::Relaxed);
            if len == NOT_OPENED {
                continue;
            }
            let body = &msg[HEADER..HEADER + len];
            let Some(Opened { pkt, src }) = inspect(body) else {
                continue; // authenticated, but not IP
            };
            got.count(pkt, peer, from);
            if let Some((at, n)) = pkt.filter(|_| allowed(state, peer, src)) {
                self.coalescer.push(&body[at..at + n], &mut write);
            }
        }
        self.opened_run(peer, receiver, &got);
    }

    /// Decrypts a run of data messages for one session of a peer (back to back,
    /// `segment` bytes each but the last, all to `receiver`), each straight into the
    /// packet being coalesced (no copy per datagram).
    pub(super) fn data_run(
        &mut self,
        state: &State,
        (peer, receiver): (&Arc<Peer>, u32),
        run: &[u8],
        segment: usize,
        from: (SocketAddr, Option<Local>),
    ) {
        let Some(session) = Self::session_of(peer, receiver) else {
            return; // no session state for it: nothing of ours to decrypt with
        };
        let out = &mut self.out;
        let mut write = |pkt: &[u8]| out.deliver(pkt);
        let mut got = Got::default();
        for datagram in run.chunks(segment) {
            let dst = self.coalescer.landing(datagram.len(), &mut write);
            let Some(Opened { pkt, src }) = open(&session, datagram, dst) else {
                self.coalescer.landed(None, &mut write);
                continue;
            };
            got.count(pkt, peer, from);
            let pkt = pkt.filter(|_| allowed(state, peer, src));
            self.coalescer.landed(pkt, &mut write);
        }
        self.opened_run(peer, receiver, &got);
    }
}

/// A data message the peer's session opened: where in the landing place its packet is
/// (offset, length) and the packet's inner source; neither for a keepalive.
struct Opened {
    pkt: Option<(usize, usize)>,
    src: Option<IpAddr>,
}

/// Decrypts one data message into `dst` with `session`; `None` for a message that is not
/// the peer's (it is never answered: nothing goes to an unverified source), or not IP.
fn open(session: &Session, datagram: &[u8], dst: &mut [u8]) -> Option<Opened> {
    let n = session.open(datagram, dst).ok()?;
    inspect(&dst[..n])
}

/// What an opened data message holds: nothing (a keepalive), or an IP packet at its
/// start (trimmed to its IP length) and its source. None when it is not IP.
fn inspect(plain: &[u8]) -> Option<Opened> {
    if plain.is_empty() {
        return Some(Opened {
            pkt: None,
            src: None,
        });
    }
    let (len, src) = inner(plain)?;
    Some(Opened {
        pkt: Some((0, len)),
        src: Some(src),
    })
}

/// Whether `src`, the inner source of a packet from `peer`, is one of its AllowedIPs.
fn allowed(state: &State, peer: &Arc<Peer>, src: Option<IpAddr>) -> bool {
    src.is_some_and(|src| state.route(src).is_some_and(|p| Arc::ptr_eq(p, peer)))
}

/// What a run of data messages opened.
#[derive(Default)]
struct Got {
    messages: usize,
    /// IP bytes of its packets (keepalives count none).
    bytes: usize,
}

impl Got {
    /// Counts an opened message. The first moves the peer's endpoint, before anything it
    /// carried reaches the TUN device: an answer to it (a ping's reply, a TCP ACK) must
    /// go where the peer now is, not where it was (kernel WireGuard moves the endpoint
    /// first too). A peer that had just changed its port lost about every other first
    /// answer when this came after the delivery.
    fn count(
        &mut self,
        pkt: Option<(usize, usize)>,
        peer: &Peer,
        (from, local): (SocketAddr, Option<Local>),
    ) {
        if self.messages == 0 {
            peer.roam(from, local);
        }
        self.messages += 1;
        self.bytes += pkt.map_or(0, |(_, n)| n);
    }
}
