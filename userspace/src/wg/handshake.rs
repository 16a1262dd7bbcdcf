//! WireGuard's handshake (whitepaper §5.4.2–5.4.7): Noise IKpsk2 between two static
//! X25519 keys, the initiation and response messages with their MACs, and the cookie a
//! peer under load sends back. A completed handshake yields a `Session`.
//!
//! The device's cookie checker (`cookie`) checks a received message's `mac1` (and `mac2`
//! under load) before it gets here; this module checks everything inside it. Time is an
//! input (`now`): nothing here reads a clock but the wall-clock base of our timestamps.
//! The chaining keys, DH results and AEAD keys of a handshake are zeroed when dropped.

use std::time::{Duration, Instant, SystemTime};

use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::{Zeroize, Zeroizing};

use super::primitives::{hash, kdf, mac, open, seal, tai64n, xopen, TAG};
use super::session::Session;

pub const INIT_LEN: usize = 148;
pub const RESPONSE_LEN: usize = 92;
pub const COOKIE_LEN: usize = 64;

const CONSTRUCTION: &[u8] = b"Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s";
const IDENTIFIER: &[u8] = b"WireGuard v1 zx2c4 Jason@zx2c4.com";
pub(super) const LABEL_MAC1: &[u8] = b"mac1----";
pub(super) const LABEL_COOKIE: &[u8] = b"cookie--";
/// A cookie is used this long after it arrived: the two minutes its secret lives at the
/// peer, less five seconds for the trip (kernel WireGuard's figure).
pub(super) const COOKIE_LIFE: Duration = Duration::from_secs(115);
/// Initiations consumed a second, at most, from one peer (kernel WireGuard's figure): a
/// replayed burst cannot make the responder churn sessions.
const MIN_INITIATION_GAP: Duration = Duration::from_millis(20);

/// Why a handshake message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeError {
    /// Not a message of this type and length.
    Malformed,
    /// An AEAD did not open, or a DH gave the all-zero point: not the peer's.
    Forged,
    /// An initiation from a key that is not this peer's.
    WrongKey,
    /// An initiation whose timestamp is not newer than the last one consumed, or that
    /// came too soon after it.
    Replayed,
    /// A response or cookie for no initiation of ours.
    Unexpected,
    /// The kernel gave no randomness for an ephemeral key, or no session index was free.
    NoRandomness,
}

/// The newest initiation consumed from a peer: its TAI64N timestamp and when it was
/// taken. It belongs to the peer for as long as the device knows the peer's key (kernel
/// WireGuard keeps it in `struct wg_peer`): no configuration change resets it, so an
/// initiation recorded once can never be consumed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Latest {
    pub stamp: [u8; 12],
    pub at: Instant,
}

/// The initiation this side sent and awaits the response to.
struct Sent {
    index: u32,
    ephemeral: StaticSecret,
    hash: [u8; 32],
    chain: [u8; 32],
    at: Instant,
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.hash.zeroize();
        self.chain.zeroize();
    }
}

pub struct Handshake {
    secret: StaticSecret,
    public: PublicKey,
    peer: PublicKey,
    psk: [u8; 32],
    /// DH(our static, the peer's static): fixed for the pair.
    static_dh: [u8; 32],
    /// The chaining key and hash every handshake starts from, with the responder's key
    /// mixed in: the peer's (for initiations we send), ours (for those we receive).
    start: [u8; 32],
    to_peer: [u8; 32],
    to_us: [u8; 32],
    /// `HASH(LABEL_MAC1 || peer)`: the mac1 key of messages to the peer.
    mac1_key: [u8; 32],
    /// `HASH(LABEL_COOKIE || peer)`: what opens the peer's cookie replies.
    cookie_key: [u8; 32],
    sent: Option<Sent>,
    /// Our initiation in flight when we answered the peer's (simultaneous initiations),
    /// whose response may still come.
    previous: Option<Sent>,
    latest: Option<Latest>,
    /// A cookie from the peer (under load), and when it came.
    cookie: Option<([u8; 16], Instant)>,
    /// The mac1 of the last handshake message sent: a cookie reply is bound to it.
    last_mac1: Option<[u8; 16]>,
    /// The index of the last response sent, which a cookie reply may name.
    responded: Option<u32>,
}

impl Drop for Handshake {
    fn drop(&mut self) {
        self.psk.zeroize();
        self.static_dh.zeroize();
    }
}

/// DH, refusing the all-zero result of a low-order point.
fn dh(secret: &StaticSecret, public: &[u8; 32]) -> Option<Zeroizing<[u8; 32]>> {
    let shared = secret.diffie_hellman(&PublicKey::from(*public));
    shared
        .was_contributory()
        .then(|| Zeroizing::new(shared.to_bytes()))
}

/// A fresh ephemeral key; None when the kernel gives no randomness (no handshake is made
/// on a guessable key).
fn new_ephemeral() -> Option<StaticSecret> {
    weft_crypto::random_bytes::<32>()
        .ok()
        .map(StaticSecret::from)
}

/// `now` as a TAI64N timestamp: the wall clock read once per process, advanced by the
/// monotonic clock since. A wall clock stepped back later (NTP, an operator) cannot make
/// this device's initiations older than the ones its peers hold, which they would refuse
/// as replays until each side made a new tunnel.
fn timestamp(now: Instant) -> [u8; 12] {
    static BASE: std::sync::OnceLock<(Duration, Instant)> = std::sync::OnceLock::new();
    let (wall, at) = BASE.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        (wall, now)
    });
    let t = *wall + now.saturating_duration_since(*at);
    // Rounded down to 2^24 ns (about 16.8 ms), as kernel WireGuard rounds it: the
    // timestamp tells an observer who can open it nothing finer about this host's clock.
    let nanos = t.subsec_nanos() & !((1 << 24) - 1);
    tai64n(Duration::new(t.as_secs(), nanos))
}

/// The chaining key every handshake starts from, and the hash with `responder` mixed in.
fn initial(responder: &PublicKey) -> ([u8; 32], [u8; 32]) {
    let chain = hash(CONSTRUCTION, &[]);
    (chain, hash(&hash(&chain, IDENTIFIER), responder.as_bytes()))
}

/// The little-endian index at `at` in a message (`msg` at least `at + 4` bytes).
pub(super) fn index_at(msg: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&msg[at..at + 4]);
    u32::from_le_bytes(b)
}

/// The transport keys of a finished handshake's chaining key: (initiator's sending key,
/// responder's sending key).
fn split(chain: &[u8; 32]) -> Zeroizing<[[u8; 32]; 2]> {
    kdf::<2>(chain, &[])
}

/// The static key an initiation was sent from, if it was sent to `secret`'s key (the
/// device's: which peer it is for). Checks only the first AEAD; the peer's handshake checks
/// the rest.
pub fn initiator_of(secret: &StaticSecret, public: &PublicKey, msg: &[u8]) -> Option<[u8; 32]> {
    if msg.len() != INIT_LEN || msg[0] != 1 {
        return None;
    }
    let (chain, h) = initial(public);
    let e: [u8; 32] = msg[8..40].try_into().ok()?;
    let c = kdf::<1>(&chain, &e);
    let h = hash(&h, &e);
    let k = kdf::<2>(&c[0], &*dh(secret, &e)?);
    let mut peer = [0u8; 32];
    open(&k[1], &msg[40..88], &h, &mut peer)?;
    Some(peer)
}

impl Handshake {
    pub fn new(secret: StaticSecret, peer: PublicKey, psk: Option<[u8; 32]>) -> Handshake {
        let mut h = Handshake {
            static_dh: [0; 32],
            start: [0; 32],
            to_peer: [0; 32],
            to_us: [0; 32],
            mac1_key: hash(LABEL_MAC1, peer.as_bytes()),
            cookie_key: hash(LABEL_COOKIE, peer.as_bytes()),
            public: PublicKey::from(&secret),
            secret,
            peer,
            psk: psk.unwrap_or([0; 32]),
            sent: None,
            previous: None,
            latest: None,
            cookie: None,
            last_mac1: None,
            responded: None,
        };
        h.derive();
        h
    }

    /// What follows from the two static keys.
    fn derive(&mut self) {
        self.public = PublicKey::from(&self.secret);
        self.static_dh = dh(&self.secret, self.peer.as_bytes()).map_or([0; 32], |d| *d);
        let (start, to_peer) = initial(&self.peer);
        let (_, to_us) = initial(&self.public);
        (self.start, self.to_peer, self.to_us) = (start, to_peer, to_us);
    }

    /// A new PSK: the next handshake mixes it in; sessions made before keep theirs (as
    /// kernel WireGuard does).
    pub fn set_psk(&mut self, psk: Option<[u8; 32]>) {
        self.psk.zeroize();
        self.psk = psk.unwrap_or([0; 32]);
    }

    /// A new private key of ours: initiations in flight were made with the old one and
    /// are abandoned. The peer's newest timestamp stays.
    pub fn set_secret(&mut self, secret: StaticSecret) {
        self.static_dh.zeroize();
        self.secret = secret;
        self.derive();
        self.abandon();
    }

    /// The newest initiation consumed from the peer.
    pub fn latest(&self) -> Option<Latest> {
        self.latest
    }

    /// Takes `latest` as the newest initiation consumed from the peer, unless a newer
    /// one is known (a peer removed and added again keeps what it had).
    pub fn remember(&mut self, latest: Latest) {
        if self.latest.is_none_or(|l| l.stamp < latest.stamp) {
            self.latest = Some(latest);
        }
    }

    /// When the initiation awaiting its response went out.
    pub fn in_flight(&self) -> Option<Instant> {
        self.sent.as_ref().map(|s| s.at)
    }

    /// The session indices of the initiations whose responses may still come.
    pub fn pending(&self) -> impl Iterator<Item = u32> + '_ {
        [&self.sent, &self.previous]
            .into_iter()
            .flatten()
            .map(|s| s.index)
    }

    /// Forgets the initiations in flight (the attempt is over).
    pub fn abandon(&mut self) {
        self.sent = None;
        self.previous = None;
    }

    /// Drops a cookie past its life.
    pub fn expire_cookie(&mut self, now: Instant) {
        if self
            .cookie
            .is_some_and(|(_, at)| now.saturating_duration_since(at) >= COOKIE_LIFE)
        {
            self.cookie = None;
        }
    }

    /// Writes mac1 and mac2 into the last 32 bytes of `msg`.
    fn macs(&mut self, msg: &mut [u8], now: Instant) {
        let n = msg.len();
        let mac1 = mac(&self.mac1_key, &msg[..n - 32]);
        msg[n - 32..n - 16].copy_from_slice(&mac1);
        self.last_mac1 = Some(mac1);
        let mac2 = match self.cookie {
            Some((cookie, at)) if now.saturating_duration_since(at) < COOKIE_LIFE => {
                mac(&cookie, &msg[..n - 16])
            }
            _ => [0; 16],
        };
        msg[n - 16..].copy_from_slice(&mac2);
    }

    /// Writes an initiation from session index `index` into `out` (`INIT_LEN` bytes).
    pub fn initiate(&mut self, index: u32, now: Instant, out: &mut [u8]) -> Option<usize> {
        let msg = out.get_mut(..INIT_LEN)?;
        let ephemeral = new_ephemeral()?;
        let e = PublicKey::from(&ephemeral);
        msg[..4].copy_from_slice(&[1, 0, 0, 0]);
        msg[4..8].copy_from_slice(&index.to_le_bytes());
        msg[8..40].copy_from_slice(e.as_bytes());
        let c = kdf::<1>(&self.start, e.as_bytes());
        let h = hash(&self.to_peer, e.as_bytes());
        let k = kdf::<2>(&c[0], &*dh(&ephemeral, self.peer.as_bytes())?);
        seal(&k[1], self.public.as_bytes(), &h, &mut msg[40..88]);
        let h = hash(&h, &msg[40..88]);
        let k = kdf::<2>(&k[0], &self.static_dh);
        seal(&k[1], &timestamp(now), &h, &mut msg[88..116]);
        let h = hash(&h, &msg[88..116]);
        self.macs(msg, now);
        // A retry supersedes the attempt before it (its response is refused, as kernel
        // WireGuard refuses it): taking a late response to a superseded initiation would
        // put us on a session the peer already replaced with the retry's.
        self.previous = None;
        self.sent = Some(Sent {
            index,
            ephemeral,
            hash: h,
            chain: k[0],
            at: now,
        });
        Some(INIT_LEN)
    }

    /// Consumes the peer's initiation `msg` and writes the response into `out`
    /// (`RESPONSE_LEN` bytes), from the session index `index` gives, asked for only once
    /// the initiation is verified and new: the new session (not yet confirmed by the
    /// peer) and the response's length.
    pub fn respond(
        &mut self,
        msg: &[u8],
        now: Instant,
        index: impl FnOnce() -> Option<u32>,
        out: &mut [u8],
    ) -> Result<(Session, usize), HandshakeError> {
        if msg.len() != INIT_LEN || msg[0] != 1 {
            return Err(HandshakeError::Malformed);
        }
        let out = out
            .get_mut(..RESPONSE_LEN)
            .ok_or(HandshakeError::Malformed)?;
        let forged = HandshakeError::Forged;
        let peer_index = index_at(msg, 4);
        let e: [u8; 32] = msg[8..40].try_into().map_err(|_| forged)?;
        let c = kdf::<1>(&self.start, &e);
        let h = hash(&self.to_us, &e);
        let k = kdf::<2>(&c[0], &*dh(&self.secret, &e).ok_or(forged)?);
        let mut peer = [0u8; 32];
        open(&k[1], &msg[40..88], &h, &mut peer).ok_or(forged)?;
        if peer != *self.peer.as_bytes() {
            return Err(HandshakeError::WrongKey);
        }
        let h = hash(&h, &msg[40..88]);
        let k = kdf::<2>(&k[0], &self.static_dh);
        let mut stamp = [0u8; 12];
        open(&k[1], &msg[88..116], &h, &mut stamp).ok_or(forged)?;
        let h = hash(&h, &msg[88..116]);
        if let Some(latest) = self.latest {
            if stamp <= latest.stamp
                || now.saturating_duration_since(latest.at) < MIN_INITIATION_GAP
            {
                return Err(HandshakeError::Replayed);
            }
        }
        // Verified and new: only now is a session index taken.
        let index = index().ok_or(HandshakeError::NoRandomness)?;
        let ephemeral = new_ephemeral().ok_or(HandshakeError::NoRandomness)?;
        let er = PublicKey::from(&ephemeral);
        out[..4].copy_from_slice(&[2, 0, 0, 0]);
        out[4..8].copy_from_slice(&index.to_le_bytes());
        out[8..12].copy_from_slice(&peer_index.to_le_bytes());
        out[12..44].copy_from_slice(er.as_bytes());
        let c = kdf::<1>(&k[0], er.as_bytes());
        let h = hash(&h, er.as_bytes());
        let c = kdf::<1>(&c[0], &*dh(&ephemeral, &e).ok_or(forged)?);
        let c = kdf::<1>(&c[0], &*dh(&ephemeral, &peer).ok_or(forged)?);
        let k = kdf::<3>(&c[0], &self.psk);
        let h = hash(&h, &k[1]);
        seal(&k[2], &[], &h, &mut out[44..44 + TAG]);
        self.macs(out, now);
        self.latest = Some(Latest { stamp, at: now });
        self.responded = Some(index);
        // Answering ends our own attempt (no retries while the peer's session stands), but
        // a response to our initiation may still come and is still taken.
        if let Some(sent) = self.sent.take() {
            self.previous = Some(sent);
        }
        let keys = split(&k[0]);
        let session = Session::new(index, peer_index, &keys[1], &keys[0], now);
        Ok((session, RESPONSE_LEN))
    }

    /// Consumes the peer's response to our initiation: the new session.
    pub fn complete(&mut self, msg: &[u8], now: Instant) -> Result<Session, HandshakeError> {
        if msg.len() != RESPONSE_LEN || msg[0] != 2 {
            return Err(HandshakeError::Malformed);
        }
        let forged = HandshakeError::Forged;
        let receiver = index_at(msg, 8);
        let sent = [&self.sent, &self.previous]
            .into_iter()
            .flatten()
            .find(|s| s.index == receiver)
            .ok_or(HandshakeError::Unexpected)?;
        let er: [u8; 32] = msg[12..44].try_into().map_err(|_| forged)?;
        let c = kdf::<1>(&sent.chain, &er);
        let h = hash(&sent.hash, &er);
        let c = kdf::<1>(&c[0], &*dh(&sent.ephemeral, &er).ok_or(forged)?);
        let c = kdf::<1>(&c[0], &*dh(&self.secret, &er).ok_or(forged)?);
        let k = kdf::<3>(&c[0], &self.psk);
        let h = hash(&h, &k[1]);
        open(&k[2], &msg[44..60], &h, &mut []).ok_or(forged)?;
        let keys = split(&k[0]);
        self.abandon();
        Ok(Session::new(
            receiver,
            index_at(msg, 4),
            &keys[0],
            &keys[1],
            now,
        ))
    }

    /// Consumes a cookie reply to our last initiation or response. It only changes the
    /// mac2 of our next messages: a cookie reply is not authenticated by the peer's keys
    /// (anyone who saw our message can make one), so it moves no timer and no endpoint.
    pub fn take_cookie(&mut self, msg: &[u8], now: Instant) -> Result<(), HandshakeError> {
        if msg.len() != COOKIE_LEN || msg[0] != 3 {
            return Err(HandshakeError::Malformed);
        }
        let receiver = index_at(msg, 4);
        let ours = self.sent.as_ref().is_some_and(|s| s.index == receiver)
            || self.responded == Some(receiver);
        let mac1 = self
            .last_mac1
            .filter(|_| ours)
            .ok_or(HandshakeError::Unexpected)?;
        let nonce: [u8; 24] = msg[8..32]
            .try_into()
            .map_err(|_| HandshakeError::Malformed)?;
        let sealed: [u8; 32] = msg[32..64]
            .try_into()
            .map_err(|_| HandshakeError::Malformed)?;
        let cookie =
            xopen(&self.cookie_key, &nonce, &sealed, &mac1).ok_or(HandshakeError::Forged)?;
        self.cookie = Some((cookie, now));
        // One cookie per message sent: a second reply to the same message is refused.
        self.last_mac1 = None;
        Ok(())
    }
}

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
