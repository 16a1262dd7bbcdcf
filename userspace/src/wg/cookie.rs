//! The MACs of handshake messages sent to us (whitepaper §5.4.4, §5.4.7): `mac1` proves
//! the sender knows our public key; under load, `mac2` proves it can receive at its source
//! address and port, which a cookie reply gives it. The cookie is a MAC of the source
//! address and port under a secret that changes every two minutes. Checked before any
//! Diffie-Hellman: a message that fails costs a BLAKE2s.

use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use x25519_dalek::PublicKey;
use zeroize::Zeroize;

use super::handshake::{COOKIE_LEN, LABEL_COOKIE, LABEL_MAC1};
use super::primitives::{hash, mac, xseal};

/// How long a cookie secret is used (the whitepaper's two minutes).
const SECRET_LIFE: Duration = Duration::from_secs(120);

/// What a handshake message's MACs allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Macs {
    /// mac1 does not verify: not for us, or altered. Dropped without an answer.
    Invalid,
    /// mac1 verifies, mac2 does not (or is absent).
    Mac1,
    /// Both verify: the sender received our cookie at this address and port.
    Mac2,
}

pub struct Checker {
    /// `HASH(LABEL_MAC1 || our public key)`.
    mac1_key: [u8; 32],
    /// `HASH(LABEL_COOKIE || our public key)`: what seals our cookie replies.
    cookie_key: [u8; 32],
    /// The random secret cookies are made with, and when it was drawn (None: none yet).
    secret: Mutex<Option<([u8; 32], Instant)>>,
}

impl Drop for Checker {
    fn drop(&mut self) {
        if let Some((s, _)) = self.secret.get_mut().unwrap_or_else(|p| p.into_inner()) {
            s.zeroize();
        }
    }
}

/// Writes into `msg` (a handshake message, its MACs last) the mac1 a message to `to`
/// carries: what anyone who knows `to`'s public key can compute (tests and the flood
/// benchmark make messages that pass the first check this way).
pub fn write_mac1(to: &[u8; 32], msg: &mut [u8]) {
    let Some(at) = msg.len().checked_sub(32) else {
        return;
    };
    let m = mac(&hash(LABEL_MAC1, to), &msg[..at]);
    msg[at..at + 16].copy_from_slice(&m);
}

/// The key a handshake message's mac1 to `to` is made with: `HASH(LABEL_MAC1 || to)`.
pub fn mac1_key(to: &[u8; 32]) -> [u8; 32] {
    hash(LABEL_MAC1, to)
}

/// Whether `msg` (a handshake message, its MACs last) carries a mac1 made with `key`
/// (`mac1_key`): the message is addressed to that key's holder. A relay tells with it whom
/// a handshake message is for without holding any key.
pub fn mac1_matches(key: &[u8; 32], msg: &[u8]) -> bool {
    let n = msg.len();
    n >= 32 + 4 && equal(&mac(key, &msg[..n - 32]), &msg[n - 32..n - 16])
}

/// Whether two MACs are equal, in time that does not depend on where they differ.
fn equal(a: &[u8], b: &[u8]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    a.len() == b.len() && std::hint::black_box(diff) == 0
}

/// The source bytes a cookie is bound to: the address, then the port (big-endian).
fn source(from: SocketAddr) -> Vec<u8> {
    let mut b = match from.ip() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    b.extend_from_slice(&from.port().to_be_bytes());
    b
}

impl Checker {
    pub fn new(public: &PublicKey) -> Checker {
        Checker {
            mac1_key: hash(LABEL_MAC1, public.as_bytes()),
            cookie_key: hash(LABEL_COOKIE, public.as_bytes()),
            secret: Mutex::new(None),
        }
    }

    /// The cookie for `from` at `now`: None when the kernel gives no randomness for a
    /// secret (then no message passes the mac2 check and no cookie is sent).
    fn cookie(&self, from: SocketAddr, now: Instant) -> Option<[u8; 16]> {
        let mut secret = self.secret.lock().unwrap_or_else(|p| p.into_inner());
        let stale = secret.is_none_or(|(_, at)| now.saturating_duration_since(at) >= SECRET_LIFE);
        if stale {
            *secret = Some((weft_crypto::random_bytes::<32>().ok()?, now));
        }
        let (key, _) = secret.as_ref()?;
        Some(mac(key, &source(from)))
    }

    /// Checks a handshake message's MACs (its last 32 bytes), as sent from `from`.
    pub fn check(&self, msg: &[u8], from: SocketAddr, now: Instant) -> Macs {
        let n = msg.len();
        if n < 32 + 4 || !equal(&mac(&self.mac1_key, &msg[..n - 32]), &msg[n - 32..n - 16]) {
            return Macs::Invalid;
        }
        let valid = self
            .cookie(from, now)
            .is_some_and(|cookie| equal(&mac(&cookie, &msg[..n - 16]), &msg[n - 16..]));
        if valid {
            Macs::Mac2
        } else {
            Macs::Mac1
        }
    }

    /// A cookie reply to `msg` (an initiation or response whose mac1 verified), for its
    /// sender at `from`: its index, a random nonce, the cookie sealed under our cookie
    /// key with the message's mac1 as associated data.
    pub fn reply(&self, msg: &[u8], from: SocketAddr, now: Instant) -> Option<[u8; COOKIE_LEN]> {
        let n = msg.len();
        let sender = msg.get(4..8)?;
        let mac1 = msg.get(n.checked_sub(32)?..n - 16)?;
        let cookie = self.cookie(from, now)?;
        let nonce = weft_crypto::random_bytes::<24>().ok()?;
        let mut out = [0u8; COOKIE_LEN];
        out[..4].copy_from_slice(&[3, 0, 0, 0]);
        out[4..8].copy_from_slice(sender);
        out[8..32].copy_from_slice(&nonce);
        out[32..].copy_from_slice(&xseal(&self.cookie_key, &nonce, &cookie, mac1));
        Some(out)
    }
}

#[cfg(test)]
#[path = "cookie_tests.rs"]
mod tests;
