//! Key newtypes with `FromStr`/`Display` in WireGuard's base64 text form.
//!
//! Byte-compatible with `wg genkey` (32 random bytes, clamped), `wg pubkey` (X25519 base
//! point multiplication) and `wg genpsk` (32 random bytes).

use std::fmt;
use std::str::FromStr;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use ring::rand::{SecureRandom, SystemRandom};
use zeroize::Zeroize;

/// Length in bytes of every WireGuard key (private, public, pre-shared).
pub const KEY_LEN: usize = 32;

/// Why a text key was refused. Never carries the key text itself: it may be secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("not valid base64 ({0}); a WireGuard key is 44 characters of standard base64, as printed by `wg genkey`")]
    Base64(String),
    #[error("decodes to {got} bytes, but a WireGuard key is exactly {KEY_LEN} bytes (44 base64 characters)")]
    Length { got: usize },
    #[error(
        "decodes to {got} bytes, but an ML-KEM seed is exactly 64 bytes (88 base64 characters)"
    )]
    SeedLength { got: usize },
    #[error("the system random number generator failed")]
    Random,
}

fn decode_key(text: &str) -> Result<[u8; KEY_LEN], KeyError> {
    decode_secret(text, |got| KeyError::Length { got })
}

/// `N` secret bytes from their base64 text; `wrong_length` names a decoded length that is
/// not `N`. The decoded bytes are zeroed whatever the outcome.
pub(crate) fn decode_secret<const N: usize>(
    text: &str,
    wrong_length: impl FnOnce(usize) -> KeyError,
) -> Result<[u8; N], KeyError> {
    let mut bytes = STANDARD
        .decode(text.trim())
        .map_err(|e| KeyError::Base64(e.to_string()))?;
    let out = <[u8; N]>::try_from(bytes.as_slice()).map_err(|_| wrong_length(bytes.len()));
    bytes.zeroize();
    out
}

/// `N` bytes from the system's secure random source.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], KeyError> {
    let mut bytes = [0u8; N];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| KeyError::Random)?;
    Ok(bytes)
}

/// A peer's (or our own) public key. Not secret: prints in full.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey([u8; KEY_LEN]);

impl PublicKey {
    pub const fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(bytes)
    }
    pub const fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }
    pub fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }
}

impl FromStr for PublicKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        decode_key(s).map(Self)
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", self.to_base64())
    }
}

/// A WireGuard private key. Zeroed on drop; `Debug` prints nothing of it, and there is
/// deliberately no `Display`: the text form is only produced by `to_base64_secret`.
#[derive(Clone, PartialEq, Eq)]
pub struct PrivateKey([u8; KEY_LEN]);

impl PrivateKey {
    /// A fresh key from the system RNG, clamped as `wg genkey` does.
    pub fn generate() -> Result<Self, KeyError> {
        let mut bytes = random_bytes()?;
        bytes[0] &= 248;
        bytes[31] &= 127;
        bytes[31] |= 64;
        Ok(Self(bytes))
    }

    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }

    pub fn public_key(&self) -> PublicKey {
        let secret = x25519_dalek::StaticSecret::from(self.0);
        PublicKey(x25519_dalek::PublicKey::from(&secret).to_bytes())
    }

    /// The secret in `wg` text form. Named so that every call site reads as what it is.
    pub fn to_base64_secret(&self) -> String {
        STANDARD.encode(self.0)
    }
}

impl FromStr for PrivateKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        decode_key(s).map(Self)
    }
}

impl fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PrivateKey(<secret>)")
    }
}

impl Drop for PrivateKey {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

/// A WireGuard pre-shared key (`PSK` in net-conf.json). Secret: same rules as `PrivateKey`.
#[derive(Clone, PartialEq, Eq)]
pub struct PresharedKey([u8; KEY_LEN]);

impl PresharedKey {
    /// 32 random bytes, as `wg genpsk`.
    pub fn generate() -> Result<Self, KeyError> {
        random_bytes().map(Self)
    }
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(bytes)
    }
    pub fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }
    pub fn to_base64_secret(&self) -> String {
        STANDARD.encode(self.0)
    }
}

impl FromStr for PresharedKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        decode_key(s).map(Self)
    }
}

impl fmt::Debug for PresharedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PresharedKey(<secret>)")
    }
}

impl Drop for PresharedKey {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RFC 7748 §6.1 test vector (Alice).
    const ALICE_PRIV: &str = "dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=";
    const ALICE_PUB: &str = "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=";

    #[test]
    fn public_key_matches_rfc7748_vector() {
        let key: PrivateKey = ALICE_PRIV.parse().unwrap();
        assert_eq!(key.public_key().to_base64(), ALICE_PUB);
    }

    #[test]
    fn generated_keys_are_clamped_and_distinct() {
        let a = PrivateKey::generate().unwrap();
        let b = PrivateKey::generate().unwrap();
        assert_ne!(a.as_bytes(), b.as_bytes());
        assert_eq!(a.as_bytes()[0] & 7, 0);
        assert_eq!(a.as_bytes()[31] & 0xc0, 0x40);
        let text = a.to_base64_secret();
        assert_eq!(text.len(), 44);
        assert_eq!(text.parse::<PrivateKey>().unwrap(), a);
    }

    #[test]
    fn bad_text_is_refused_with_reason() {
        let short = STANDARD.encode([1u8; 16]);
        assert_eq!(
            short.parse::<PublicKey>(),
            Err(KeyError::Length { got: 16 })
        );
        let err = "not base64!".parse::<PublicKey>().unwrap_err();
        assert!(matches!(err, KeyError::Base64(_)), "{err:?}");
        assert!(err.to_string().contains("44 characters"), "{err}");
    }

    #[test]
    fn debug_never_prints_secrets() {
        let key: PrivateKey = ALICE_PRIV.parse().unwrap();
        let psk = PresharedKey::generate().unwrap();
        let shown = format!("{key:?} {psk:?}");
        assert!(!shown.contains(&ALICE_PRIV[..8]), "{shown}");
        assert!(!shown.contains(&psk.to_base64_secret()[..8]), "{shown}");
        assert_eq!(shown, "PrivateKey(<secret>) PresharedKey(<secret>)");
    }

    #[test]
    fn surrounding_whitespace_is_accepted() {
        let key: PublicKey = format!("  {ALICE_PUB}\n").parse().unwrap();
        assert_eq!(key.to_base64(), ALICE_PUB);
    }
}
