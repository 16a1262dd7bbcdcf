//! Handshake messages, off the data path: the receiving threads only queue them (a
//! bounded queue, kernel WireGuard's shape) and go on opening data; one handshake thread
//! checks their MACs, answers, and does the Diffie-Hellman work. Under load (the queue an
//! eighth full, and for a second after), an initiation or response must carry a valid
//! mac2, so its sender proved it receives at its address, and each such source address
//! gets at most 20 messages a second of handshake work (`wg::ratelimit`); a message
//! without mac2 gets a cookie reply. A source is charged only once mac2 proved it, so a
//! spoofed source cannot spend a real peer's share. So a flood from one host, with or
//! without its cookie, leaves the data messages of every pair untouched.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::peers::{lock, State};
use super::rx::Outputs;
use super::udp::{Endpoint, Local};
use super::wg::cookie::Macs;
use super::wg::handshake::{initiator_of, COOKIE_LEN, INIT_LEN, RESPONSE_LEN};
use super::wg::ratelimit::Limiter;
use super::wg::{TunnResult, Tunnel};

/// Handshake messages waiting for the handshake thread (kernel WireGuard's
/// MAX_QUEUED_INCOMING_HANDSHAKES).
pub const CAPACITY: usize = 4096;
/// Queued messages from which the device is under load.
const LOAD: usize = CAPACITY / 8;
/// How long the device stays under load after the queue was last that long.
const LOAD_LINGERS: Duration = Duration::from_secs(1);

/// A handshake message waiting in the queue: its bytes, where it came from and to.
pub struct Job {
    bytes: [u8; INIT_LEN],
    len: usize,
    from: SocketAddr,
    local: Option<Local>,
}

/// The handshake message types (type byte and three zero bytes) and their lengths.
pub fn is_handshake(d: &[u8]) -> bool {
    matches!(
        (d.get(..4), d.len()),
        (Some([1, 0, 0, 0]), INIT_LEN)
            | (Some([2, 0, 0, 0]), RESPONSE_LEN)
            | (Some([3, 0, 0, 0]), COOKIE_LEN)
    )
}

/// The queue's sending end, which every receiving thread holds, and the state the
/// handshake thread shares with them.
#[derive(Clone)]
pub struct Queue {
    tx: SyncSender<Job>,
    shared: Arc<Shared>,
}

pub struct Shared {
    queued: AtomicUsize,
    pub limiter: Limiter,
    /// When the queue was last `LOAD` long.
    loaded: Mutex<Option<Instant>>,
}

impl Shared {
    /// Whether the device is under load at `now`.
    fn under_load(&self, now: Instant) -> bool {
        let mut loaded = lock(&self.loaded);
        if self.queued.load(Ordering::Relaxed) >= LOAD {
            *loaded = Some(now);
            return true;
        }
        loaded.is_some_and(|at| now.saturating_duration_since(at) < LOAD_LINGERS)
    }
}

/// A queue and the receiving end the handshake thread drains.
pub fn queue() -> (Queue, Receiver<Job>) {
    let (tx, rx) = sync_channel(CAPACITY);
    let shared = Arc::new(Shared {
        queued: AtomicUsize::new(0),
        limiter: Limiter::default(),
        loaded: Mutex::new(None),
    });
    (Queue { tx, shared }, rx)
}

impl Queue {
    /// Queues a handshake message (`is_handshake`); dropped when the queue is full. No
    /// source is charged here: nothing about a message's source is proven yet, and a
    /// spoofed one must not spend a real peer's share.
    pub fn push(&self, d: &[u8], (from, local): (SocketAddr, Option<Local>)) {
        let mut bytes = [0u8; INIT_LEN];
        let Some(to) = bytes.get_mut(..d.len()) else {
            return;
        };
        to.copy_from_slice(d);
        let job = Job {
            bytes,
            len: d.len(),
            from,
            local,
        };
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(job) {
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

/// Takes the next job off the queue, waiting up to `wait` for one.
pub fn next(rx: &Receiver<Job>, shared: &Shared, wait: Duration) -> Option<Job> {
    let job = rx.recv_timeout(wait).ok()?;
    shared.queued.fetch_sub(1, Ordering::Relaxed);
    Some(job)
}

/// Handles one queued message against the device's `state` (see `handle`).
pub fn run_job(
    state: &State,
    job: &Job,
    shared: &Shared,
    plain: &mut [u8],
    out: &mut impl Outputs,
) {
    let load = shared.under_load(Instant::now());
    handle(
        state,
        &job.bytes[..job.len],
        (job.from, job.local),
        (load, &shared.limiter),
        plain,
        out,
    );
}

/// A handshake or cookie message: its MACs checked (under `load`, mac2 and the source's
/// share of `limiter` too), then answered; only a message the peer's keys verified moves
/// its endpoint and sends it what was queued.
pub fn handle(
    state: &State,
    datagram: &[u8],
    (from, local): (SocketAddr, Option<Local>),
    (load, limiter): (bool, &Limiter),
    plain: &mut [u8],
    out: &mut impl Outputs,
) {
    let now = Instant::now();
    let Some(id) = &state.identity else { return };
    // Answers go back from the address the message came to.
    let back = Endpoint {
        to: from,
        from: local,
    };
    let kind = datagram[0];
    if kind != 3 {
        match id.cookies.check(datagram, from, now) {
            Macs::Invalid => return,
            // A cookie reply costs a MAC and an XAEAD, is smaller than the message, and is
            // not limited: a limit here would let a spoofed source starve the real one of
            // its cookie (kernel WireGuard answers each one too).
            Macs::Mac1 if load => {
                if let Some(reply) = id.cookies.reply(datagram, from, now) {
                    out.send(back, &reply);
                }
                return;
            }
            // The source proved it receives at its address: only now is it charged.
            Macs::Mac2 if load && !limiter.allow(from.ip(), now) => return,
            _ => {}
        }
    }
    let peer = if kind == 1 {
        initiator_of(&id.secret, &id.public, datagram).and_then(|key| state.peers.get(&key))
    } else {
        let at = if kind == 2 { 8 } else { 4 };
        let r = u32::from_le_bytes([
            datagram[at],
            datagram[at + 1],
            datagram[at + 2],
            datagram[at + 3],
        ]);
        state.by_receiver(r)
    };
    let Some(peer) = peer else { return };
    let mut noise = lock(&peer.noise);
    let Some(tunn) = state.session(&mut noise, peer) else {
        return;
    };
    let (verified, answered) = match tunn.decapsulate(datagram, now, plain) {
        TunnResult::WriteToNetwork(answer) => {
            // An initiation answered with a response, a response with the confirming
            // keepalive: consumed, so verified by the peer's keys. A cookie reply
            // (consumed with no answer) proves nothing: anyone who saw our message can
            // make one.
            let answered = if kind == 1 { answer.len() } else { 0 };
            out.send(back, answer);
            (true, answered)
        }
        _ => (false, 0),
    };
    if verified {
        if kind == 1 {
            state
                .handshaken
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        peer.roam(from, local);
        flush_queue(tunn, plain, out, back);
    }
    noise.handshake_tx += answered;
}

/// Sends the packets a tunnel queued while it had no session to send on.
pub fn flush_queue(tunn: &mut Tunnel, buf: &mut [u8], out: &mut impl Outputs, to: Endpoint) {
    let now = Instant::now();
    while let TunnResult::WriteToNetwork(datagram) = tunn.decapsulate(&[], now, buf) {
        out.send(to, datagram);
    }
}
