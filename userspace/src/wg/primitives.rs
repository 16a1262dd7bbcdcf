//! The primitives WireGuard's protocol names (whitepaper §5.4): BLAKE2s `HASH` and `MAC`,
//! HMAC-BLAKE2s and the `KDF` chain over it, ChaCha20-Poly1305 with a 64-bit counter
//! nonce (`AEAD`), XChaCha20-Poly1305 for cookies (`XAEAD`), and the TAI64N timestamp.

use blake2::digest::KeyInit;
use blake2::digest::{consts::U16, Mac};
use blake2::{Blake2s256, Blake2sMac, Digest};
use chacha20poly1305::aead::AeadInPlace;
use chacha20poly1305::XChaCha20Poly1305;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use zeroize::{Zeroize, Zeroizing};

pub const TAG: usize = 16;

/// `HASH(a || b)`.
pub fn hash(a: &[u8], b: &[u8]) -> [u8; 32] {
    let mut h = Blake2s256::new();
    h.update(a);
    h.update(b);
    h.finalize().into()
}

/// `MAC(key, input)`: keyed BLAKE2s with a 16-byte output (keys of 32 bytes, or a
/// 16-byte cookie).
pub fn mac(key: &[u8], input: &[u8]) -> [u8; 16] {
    let Ok(mut m) = <Blake2sMac<U16> as KeyInit>::new_from_slice(key) else {
        unreachable!("BLAKE2s takes keys up to 32 bytes; ours are 16 or 32")
    };
    Mac::update(&mut m, input);
    m.finalize().into_bytes().into()
}

/// HMAC-BLAKE2s over `parts` in order.
fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let Ok(mut h) = <hmac::SimpleHmac<Blake2s256> as KeyInit>::new_from_slice(key) else {
        unreachable!("HMAC takes keys of any length")
    };
    for p in parts {
        Mac::update(&mut h, p);
    }
    h.finalize().into_bytes().into()
}

/// `KDF_n(key, input)`: the first `N` outputs of WireGuard's HKDF chain, zeroed when
/// dropped (they are chaining and AEAD keys), as is the chain's own key.
pub fn kdf<const N: usize>(key: &[u8; 32], input: &[u8]) -> Zeroizing<[[u8; 32]; N]> {
    let prk = Zeroizing::new(hmac(key, &[input]));
    let mut out = Zeroizing::new([[0u8; 32]; N]);
    for i in 0..N {
        let counter = [i as u8 + 1];
        out[i] = match i {
            0 => hmac(&*prk, &[&counter]),
            _ => hmac(&*prk, &[&out[i - 1], &counter]),
        };
    }
    out
}

/// A ChaCha20-Poly1305 key (ring's, which has assembly for this CPU), its bytes zeroed
/// when it is dropped: ring's key objects hold the expanded key and do not zero it.
pub struct AeadKey(std::mem::ManuallyDrop<LessSafeKey>);

impl std::ops::Deref for AeadKey {
    type Target = LessSafeKey;
    fn deref(&self) -> &LessSafeKey {
        &self.0
    }
}

impl Drop for AeadKey {
    fn drop(&mut self) {
        let size = std::mem::size_of::<LessSafeKey>();
        let at = (&mut *self.0 as *mut LessSafeKey).cast::<u8>();
        // SAFETY: ring's key is plain data held inline (no heap, nothing to drop), it is
        // never read or dropped after this, and `at` covers exactly its own bytes.
        unsafe { std::slice::from_raw_parts_mut(at, size) }.zeroize();
    }
}

pub fn aead_key(key: &[u8; 32]) -> AeadKey {
    match UnboundKey::new(&CHACHA20_POLY1305, key) {
        Ok(k) => AeadKey(std::mem::ManuallyDrop::new(LessSafeKey::new(k))),
        Err(_) => unreachable!("ChaCha20-Poly1305 takes 32-byte keys"),
    }
}

/// The AEAD nonce of message counter `n`: 32 zero bits, then `n` little-endian.
pub fn nonce(n: u64) -> Nonce {
    let mut b = [0u8; 12];
    b[4..].copy_from_slice(&n.to_le_bytes());
    Nonce::assume_unique_for_key(b)
}

/// `AEAD(key, 0, plain, aad)` into `out` (`plain.len() + TAG` bytes).
pub fn seal(key: &[u8; 32], plain: &[u8], aad: &[u8], out: &mut [u8]) {
    let (body, tag) = out.split_at_mut(plain.len());
    body.copy_from_slice(plain);
    if let Ok(t) = aead_key(key).seal_in_place_separate_tag(nonce(0), Aad::from(aad), body) {
        tag[..TAG].copy_from_slice(t.as_ref());
    }
}

/// Opens `AEAD(key, 0, ·, aad)` of `sealed` into `out` (`sealed.len() - TAG` bytes).
pub fn open(key: &[u8; 32], sealed: &[u8], aad: &[u8], out: &mut [u8]) -> Option<()> {
    let mut buf = Zeroizing::new([0u8; 64]);
    let buf = buf.get_mut(..sealed.len())?;
    buf.copy_from_slice(sealed);
    let plain = aead_key(key)
        .open_in_place(nonce(0), Aad::from(aad), buf)
        .ok()?;
    out.get_mut(..plain.len())?.copy_from_slice(plain);
    Some(())
}

/// `XAEAD(key, nonce, cookie, aad)`: a cookie reply's sealed cookie (16 bytes and a tag).
pub fn xseal(key: &[u8; 32], nonce: &[u8; 24], cookie: &[u8; 16], aad: &[u8]) -> [u8; 32] {
    let cipher = XChaCha20Poly1305::new(key.into());
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(cookie);
    if let Ok(tag) = cipher.encrypt_in_place_detached(nonce.into(), aad, &mut out[..16]) {
        out[16..].copy_from_slice(&tag);
    }
    out
}

/// Opens an `XAEAD(key, nonce, cookie, aad)`: the 16-byte cookie of a cookie reply.
pub fn xopen(key: &[u8; 32], nonce: &[u8; 24], sealed: &[u8; 32], aad: &[u8]) -> Option<[u8; 16]> {
    let cipher = XChaCha20Poly1305::new(key.into());
    let mut cookie = [0u8; 16];
    cookie.copy_from_slice(&sealed[..16]);
    cipher
        .decrypt_in_place_detached(nonce.into(), aad, &mut cookie, sealed[16..].into())
        .ok()?;
    Some(cookie)
}

/// The TAI64N label of `now` (seconds since the epoch): 8 bytes of TAI seconds, 4 of
/// nanoseconds, both big-endian, so later times compare greater byte by byte.
pub fn tai64n(now: std::time::Duration) -> [u8; 12] {
    let mut t = [0u8; 12];
    t[..8].copy_from_slice(&(0x4000_0000_0000_000a_u64 + now.as_secs()).to_be_bytes());
    t[8..].copy_from_slice(&now.subsec_nanos().to_be_bytes());
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kdf_chain_is_hmac_of_the_previous_output_and_a_counter() {
        let key = [7u8; 32];
        let prk = hmac(&key, &[b"input"]);
        let t1 = hmac(&prk, &[&[1]]);
        let t2 = hmac(&prk, &[&t1, &[2]]);
        let t3 = hmac(&prk, &[&t2, &[3]]);
        assert_eq!(*kdf::<3>(&key, b"input"), [t1, t2, t3]);
        assert_eq!(*kdf::<1>(&key, b"input"), [t1]);
    }

    #[test]
    fn sealed_opens_and_a_changed_byte_does_not() {
        let key = [3u8; 32];
        let mut out = [0u8; 48];
        seal(&key, &[5u8; 32], b"aad", &mut out);
        let mut back = [0u8; 32];
        assert!(open(&key, &out, b"aad", &mut back).is_some());
        assert_eq!(back, [5u8; 32]);
        assert!(open(&key, &out, b"aaD", &mut back).is_none());
        out[0] ^= 1;
        assert!(open(&key, &out, b"aad", &mut back).is_none());
    }

    #[test]
    fn timestamps_order_as_times_do() {
        let a = tai64n(std::time::Duration::new(1_700_000_000, 999_999_999));
        let b = tai64n(std::time::Duration::new(1_700_000_001, 0));
        assert!(b > a);
    }
}
