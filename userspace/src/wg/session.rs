//! One session's transport keys (whitepaper §5.4.6): a sending key with its counter and a
//! receiving key with its replay window. Sealing and opening take `&self`, so any thread
//! may seal or open with a session another holds: the counter is atomic, the window is
//! locked for the few instructions of its check.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use ring::aead::Aad;

pub use super::primitives::TAG;
use super::primitives::{aead_key, nonce};

/// WireGuard's REKEY_AFTER_MESSAGES and REJECT_AFTER_MESSAGES.
pub const REKEY_AFTER_MESSAGES: u64 = 1 << 60;
pub const REJECT_AFTER_MESSAGES: u64 = u64::MAX - (1 << 13);

/// A data message's header: type 4, three zero bytes, receiver index, counter.
pub const HEADER: usize = 16;
pub const OVERHEAD: usize = HEADER + TAG;

/// The bitmap's size in 64-bit words, and how far behind the newest counter a late one
/// is still taken (once): one word less than the bitmap, so a counter's word never shares
/// its place with the newest one's (RFC 6479).
const WORDS: usize = 32;
const WINDOW: u64 = (WORDS as u64 - 1) * 64;

/// The replay window (RFC 6479's bitmap, without its lookahead).
struct Replay {
    /// One more than the greatest counter accepted; 0 before any.
    next: u64,
    bits: [u64; WORDS],
}

impl Replay {
    /// Whether `n` is new (and records it): never seen, and not older than the window.
    fn accept(&mut self, n: u64) -> bool {
        if n >= REJECT_AFTER_MESSAGES {
            return false;
        }
        if n + WINDOW < self.next {
            return false;
        }
        let word = |c: u64| ((c / 64) % WORDS as u64) as usize;
        if n >= self.next {
            // Clear the words the window slides onto (all of them after a long jump).
            if let Some(top) = self.next.checked_sub(1) {
                let (from, to) = (top / 64, n / 64);
                for w in from + 1..=to.min(from + WORDS as u64) {
                    self.bits[word(w * 64)] = 0;
                }
            }
            self.next = n + 1;
        }
        let (w, bit) = (word(n), 1u64 << (n % 64));
        if self.bits[w] & bit != 0 {
            return false;
        }
        self.bits[w] |= bit;
        true
    }
}

/// A transport key, zeroed when its session goes.
struct Key([u8; 32]);

impl Drop for Key {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

pub struct Session {
    /// The index the peer puts on messages to us.
    pub local: u32,
    /// The index we put on messages to the peer.
    pub remote: u32,
    /// The raw keys (64 bytes; ring's key objects are 544 bytes each): a key object is
    /// made per seal or open, which costs a copy of 32 bytes.
    send: Key,
    recv: Key,
    counter: AtomicU64,
    replay: Mutex<Replay>,
    pub made: Instant,
}

/// Why a data message was not opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenError {
    /// Not a data message of this length, or `dst` too short.
    Malformed,
    /// The tag did not verify.
    Forged,
    /// The counter was seen, is too old, or is past REJECT_AFTER_MESSAGES.
    Replayed,
}

impl Session {
    /// A session made at `made`, keyed `send` and `recv`.
    pub fn new(
        local: u32,
        remote: u32,
        send: &[u8; 32],
        recv: &[u8; 32],
        made: Instant,
    ) -> Session {
        Session {
            local,
            remote,
            send: Key(*send),
            recv: Key(*recv),
            counter: AtomicU64::new(0),
            replay: Mutex::new(Replay {
                next: 0,
                bits: [0; WORDS],
            }),
            made,
        }
    }

    /// Moves the sending counter (tests: a session near its message limits).
    #[cfg(test)]
    pub fn set_sent(&self, n: u64) {
        self.counter.store(n, Ordering::Relaxed);
    }

    /// The counter the next message would take (how many were sealed).
    pub fn sent(&self) -> u64 {
        self.counter.load(Ordering::Relaxed)
    }

    /// Seals `plain` as a data message into `dst` (`plain.len() + OVERHEAD` bytes).
    /// None when the session has sent all it may, or `dst` is too short.
    pub fn seal(&self, plain: &[u8], dst: &mut [u8]) -> Option<usize> {
        let len = plain.len() + OVERHEAD;
        let out = dst.get_mut(..len)?;
        out[HEADER..HEADER + plain.len()].copy_from_slice(plain);
        self.seal_in_place(out)
    }

    /// Seals the message whose plaintext is already at `msg[HEADER..msg.len() - TAG]`:
    /// writes its header and tag. None when the session has sent all it may.
    pub fn seal_in_place(&self, msg: &mut [u8]) -> Option<usize> {
        let len = msg.len();
        if len < OVERHEAD {
            return None;
        }
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        if n >= REJECT_AFTER_MESSAGES {
            self.counter.store(REJECT_AFTER_MESSAGES, Ordering::Relaxed);
            return None;
        }
        let (header, rest) = msg.split_at_mut(HEADER);
        header[..4].copy_from_slice(&[4, 0, 0, 0]);
        header[4..8].copy_from_slice(&self.remote.to_le_bytes());
        header[8..16].copy_from_slice(&n.to_le_bytes());
        let (body, tag_out) = rest.split_at_mut(len - OVERHEAD);
        let tag = aead_key(&self.send.0)
            .seal_in_place_separate_tag(nonce(n), Aad::empty(), body)
            .ok()?;
        tag_out.copy_from_slice(tag.as_ref());
        Some(len)
    }

    /// Opens data message `msg` (header included) into `dst`: the plaintext's length.
    pub fn open(&self, msg: &[u8], dst: &mut [u8]) -> Result<usize, OpenError> {
        if !is_data(msg) || index_of(msg) != self.local {
            return Err(OpenError::Malformed);
        }
        let out = dst
            .get_mut(..msg.len() - HEADER)
            .ok_or(OpenError::Malformed)?;
        out.copy_from_slice(&msg[HEADER..]);
        self.open_in_place(counter_of(msg), out)
    }

    /// Opens a message body (ciphertext and tag) in place, with counter `n` from its
    /// header: the plaintext's length (it stays at the start of `body`).
    pub fn open_in_place(&self, n: u64, body: &mut [u8]) -> Result<usize, OpenError> {
        if n >= REJECT_AFTER_MESSAGES {
            return Err(OpenError::Replayed);
        }
        let plain = aead_key(&self.recv.0)
            .open_in_place(nonce(n), Aad::empty(), body)
            .map_err(|_| OpenError::Forged)?;
        let len = plain.len();
        // Checked after the tag: a forged counter must not move the window.
        let mut replay = self.replay.lock().unwrap_or_else(|p| p.into_inner());
        if !replay.accept(n) {
            return Err(OpenError::Replayed);
        }
        Ok(len)
    }
}

/// Whether `msg` is a data message: type 4 with its three reserved bytes zero (kernel
/// WireGuard and wireguard-go read the type as one 32-bit word), and long enough.
pub fn is_data(msg: &[u8]) -> bool {
    msg.len() >= OVERHEAD && msg[..4] == [4, 0, 0, 0]
}

/// The receiver index in a data message's header (`msg` at least `HEADER` bytes).
pub fn index_of(msg: &[u8]) -> u32 {
    u32::from_le_bytes([msg[4], msg[5], msg[6], msg[7]])
}

/// The counter in a data message's header (`msg` at least `HEADER` bytes).
pub fn counter_of(msg: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&msg[8..16]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Session, Session) {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let now = Instant::now();
        (
            Session::new(10, 20, &a, &b, now),
            Session::new(20, 10, &b, &a, now),
        )
    }

    #[test]
    fn a_sealed_message_opens_once_on_the_other_side() {
        let (s, r) = pair();
        let mut msg = [0u8; 100 + OVERHEAD];
        assert_eq!(s.seal(&[9u8; 100], &mut msg), Some(100 + OVERHEAD));
        assert_eq!(&msg[4..8], &20u32.to_le_bytes(), "the receiver's index");
        let mut out = [0u8; 200];
        assert_eq!(r.open(&msg, &mut out), Ok(100));
        assert_eq!(out[..100], [9u8; 100]);
        assert_eq!(r.open(&msg, &mut out), Err(OpenError::Replayed));
        let mut bad = msg;
        bad[20] ^= 1;
        assert_eq!(r.open(&bad, &mut out), Err(OpenError::Forged));
        assert_eq!(
            s.open(&msg, &mut out),
            Err(OpenError::Malformed),
            "a message is opened only by the session its index names"
        );
        let mut renamed = msg;
        renamed[4..8].copy_from_slice(&10u32.to_le_bytes());
        assert_eq!(
            s.open(&renamed, &mut out),
            Err(OpenError::Forged),
            "keys per direction"
        );
        let mut reserved = msg;
        reserved[2] = 1;
        assert_eq!(
            r.open(&reserved, &mut out),
            Err(OpenError::Malformed),
            "reserved bytes must be zero"
        );
    }

    #[test]
    fn the_window_takes_late_counters_once_and_drops_older_ones() {
        let mut w = Replay {
            next: 0,
            bits: [0; WORDS],
        };
        assert!(w.accept(5));
        assert!(w.accept(0));
        assert!(!w.accept(5));
        assert!(w.accept(5000));
        assert!(!w.accept(5000 - WINDOW - 1), "older than the window");
        assert!(w.accept(5000 - WINDOW + 64));
        assert!(!w.accept(5000 - WINDOW + 64));
        // A long jump clears the whole window: a counter it covers again is new.
        assert!(w.accept(1_000_000));
        assert!(w.accept(1_000_000 - 100));
        assert!(!w.accept(REJECT_AFTER_MESSAGES));
        // Every counter once, in a shuffled order within the window.
        let mut w = Replay {
            next: 0,
            bits: [0; WORDS],
        };
        let mut seen = std::collections::HashSet::new();
        let mut x = 12345u64;
        for i in 0..100_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = i + (x >> 40) % 1000;
            assert_eq!(w.accept(n), seen.insert(n), "counter {n}");
        }
    }

    #[test]
    fn a_counter_past_reject_after_messages_is_refused_both_ways() {
        let (s, _) = pair();
        s.counter.store(REJECT_AFTER_MESSAGES, Ordering::Relaxed);
        let mut msg = [0u8; OVERHEAD];
        assert_eq!(s.seal(&[], &mut msg), None);
        assert_eq!(s.seal(&[], &mut msg), None, "and stays refused");
        // A message whose counter is past the limit, even with a valid tag.
        let (s2, r2) = pair();
        s2.counter
            .store(REJECT_AFTER_MESSAGES - 1, Ordering::Relaxed);
        assert!(s2.seal(&[], &mut msg).is_some());
        let mut out = [0u8; 16];
        assert_eq!(r2.open(&msg, &mut out), Ok(0), "the last allowed counter");
        // One past it, sealed with the right key all the same, is refused.
        let mut past = msg;
        past[8..16].copy_from_slice(&REJECT_AFTER_MESSAGES.to_le_bytes());
        assert_eq!(r2.open(&past, &mut out), Err(OpenError::Replayed));
    }
}
