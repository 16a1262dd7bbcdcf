//! ML-KEM-768 (FIPS 203) through libcrux-ml-kem: a node's key pair, a peer's encapsulation
//! key as it arrives from the registry, ciphertexts as they arrive from a peer, and the
//! shared secrets. Every input from outside is checked for length (and an encapsulation
//! key for FIPS 203's modulus check) before it reaches the KEM.

use std::fmt;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use libcrux_ml_kem::mlkem768;
use zeroize::Zeroize;

use crate::KeyError;

/// Bytes of an ML-KEM-768 encapsulation (public) key.
pub const ENCAPS_KEY_LEN: usize = 1184;
/// Bytes of an ML-KEM-768 ciphertext.
pub const CIPHERTEXT_LEN: usize = 1088;
/// Bytes of the seed a key pair is made from and stored as: d ‖ z (FIPS 203, §6.1).
pub const SEED_LEN: usize = 64;
/// Bytes of an expanded ML-KEM-768 decapsulation key (never stored; made from the seed).
const SECRET_KEY_LEN: usize = 2400;
/// Bytes of a shared secret.
pub const SECRET_LEN: usize = 32;
/// Characters of an encapsulation key in base64 (its annotation or etcd field).
pub const ENCAPS_KEY_BASE64_LEN: usize = ENCAPS_KEY_LEN.div_ceil(3) * 4;

/// Why an encapsulation key or a ciphertext was refused. Carries no key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KemError {
    #[error("not valid base64 ({0})")]
    Base64(String),
    #[error("{what} is {got} bytes; ML-KEM-768 takes exactly {want}")]
    Length {
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("not an ML-KEM-768 encapsulation key: a coefficient is not reduced modulo q (FIPS 203, §7.2)")]
    NotReduced,
}

/// A node's ML-KEM-768 key pair. Only its seed is ever stored; the decapsulation key is
/// zeroed on drop and neither prints.
pub struct KemKeyPair {
    seed: [u8; SEED_LEN],
    pair: mlkem768::MlKem768KeyPair,
}

impl KemKeyPair {
    /// A fresh key pair from the system's random source.
    pub fn generate() -> Result<Self, KeyError> {
        Ok(Self::from_seed(crate::random_bytes()?))
    }

    /// The key pair a seed (d ‖ z) gives; the same seed always gives the same pair.
    pub fn from_seed(seed: [u8; SEED_LEN]) -> Self {
        let pair = mlkem768::generate_key_pair(seed);
        Self { seed, pair }
    }

    /// The seed, to store (secret: the key file's rules apply).
    pub fn seed(&self) -> &[u8; SEED_LEN] {
        &self.seed
    }

    /// The key peers encapsulate to: what the node publishes.
    pub fn encaps_key(&self) -> EncapsKey {
        EncapsKey(Box::new(*self.pair.pk()))
    }

    /// The secret a peer encapsulated in `ct`. ML-KEM rejects implicitly: a tampered
    /// ciphertext gives an unrelated secret rather than an error, which the key
    /// confirmation of the exchange then refuses.
    pub fn decapsulate(&self, ct: &Ciphertext) -> SharedSecret {
        let ct = mlkem768::MlKem768Ciphertext::from(&*ct.0);
        SharedSecret(mlkem768::decapsulate(self.pair.private_key(), &ct))
    }
}

impl Drop for KemKeyPair {
    fn drop(&mut self) {
        self.seed.zeroize();
        // The expanded decapsulation key: the crate's type offers no zeroing of its own, so
        // it is moved out and its bytes zeroed (best effort: a move may leave a copy).
        let blank = mlkem768::MlKem768KeyPair::new([0; SECRET_KEY_LEN], [0; ENCAPS_KEY_LEN]);
        let (mut sk, _) = std::mem::replace(&mut self.pair, blank).into_parts();
        sk[0..].zeroize();
    }
}

impl fmt::Debug for KemKeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KemKeyPair({})", self.encaps_key().fingerprint_hex())
    }
}

/// A seed from its base64 line (a key file's content).
pub fn seed_from_base64(text: &str) -> Result<[u8; SEED_LEN], KeyError> {
    crate::keys::decode_secret(text, |got| KeyError::SeedLength { got })
}

/// A seed's base64 line (secret).
pub fn seed_to_base64(seed: &[u8; SEED_LEN]) -> String {
    STANDARD.encode(seed)
}

/// An ML-KEM-768 encapsulation key that passed FIPS 203's input check. Not secret.
#[derive(Clone, PartialEq, Eq)]
pub struct EncapsKey(Box<[u8; ENCAPS_KEY_LEN]>);

impl EncapsKey {
    /// Checks `bytes` as FIPS 203 asks before encapsulating to it: the length, and that
    /// every coefficient is reduced modulo q.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KemError> {
        let raw = <[u8; ENCAPS_KEY_LEN]>::try_from(bytes).map_err(|_| KemError::Length {
            what: "the encapsulation key",
            got: bytes.len(),
            want: ENCAPS_KEY_LEN,
        })?;
        if !mlkem768::validate_public_key(&mlkem768::MlKem768PublicKey::from(&raw)) {
            return Err(KemError::NotReduced);
        }
        Ok(Self(Box::new(raw)))
    }

    /// From its base64 text; the length is checked before anything is decoded.
    pub fn from_base64(text: &str) -> Result<Self, KemError> {
        let text = text.trim();
        if text.len() != ENCAPS_KEY_BASE64_LEN {
            return Err(KemError::Length {
                what: "the encapsulation key's base64",
                got: text.len(),
                want: ENCAPS_KEY_BASE64_LEN,
            });
        }
        let bytes = STANDARD
            .decode(text)
            .map_err(|e| KemError::Base64(e.to_string()))?;
        Self::from_bytes(&bytes)
    }

    pub fn as_bytes(&self) -> &[u8; ENCAPS_KEY_LEN] {
        &self.0
    }

    pub fn to_base64(&self) -> String {
        STANDARD.encode(*self.0)
    }

    /// SHA-256 of the key: names it in messages (which key a ciphertext is for) and logs.
    pub fn fingerprint(&self) -> [u8; 32] {
        let digest = ring::digest::digest(&ring::digest::SHA256, &self.0[..]);
        let mut out = [0; 32];
        out.copy_from_slice(digest.as_ref());
        out
    }

    /// The fingerprint's first bytes, as a message names the key.
    pub fn short_fingerprint(&self) -> [u8; super::FINGERPRINT_LEN] {
        let mut out = [0; super::FINGERPRINT_LEN];
        out.copy_from_slice(&self.fingerprint()[..super::FINGERPRINT_LEN]);
        out
    }

    fn fingerprint_hex(&self) -> String {
        self.fingerprint()[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

impl fmt::Debug for EncapsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EncapsKey({}…)", self.fingerprint_hex())
    }
}

/// An ML-KEM-768 ciphertext. Not secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Ciphertext(Box<[u8; CIPHERTEXT_LEN]>);

impl Ciphertext {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KemError> {
        <[u8; CIPHERTEXT_LEN]>::try_from(bytes)
            .map(|raw| Self(Box::new(raw)))
            .map_err(|_| KemError::Length {
                what: "the ciphertext",
                got: bytes.len(),
                want: CIPHERTEXT_LEN,
            })
    }

    pub(crate) fn from_array(raw: [u8; CIPHERTEXT_LEN]) -> Self {
        Self(Box::new(raw))
    }

    pub fn as_bytes(&self) -> &[u8; CIPHERTEXT_LEN] {
        &self.0
    }
}

impl fmt::Debug for Ciphertext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Ciphertext({CIPHERTEXT_LEN} bytes)")
    }
}

/// A shared secret of one encapsulation. Zeroed on drop; never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct SharedSecret([u8; SECRET_LEN]);

impl SharedSecret {
    pub fn as_bytes(&self) -> &[u8; SECRET_LEN] {
        &self.0
    }
}

impl Drop for SharedSecret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedSecret(<secret>)")
    }
}

/// A fresh secret for the holder of `ek`, and the ciphertext that carries it.
pub fn encapsulate(ek: &EncapsKey) -> Result<(Ciphertext, SharedSecret), KeyError> {
    let mut m = crate::random_bytes::<SECRET_LEN>()?;
    let out = encapsulate_with(ek, m);
    m.zeroize();
    Ok(out)
}

/// Encapsulation with the caller's randomness `m`: the known-answer tests' entry.
pub(crate) fn encapsulate_with(ek: &EncapsKey, m: [u8; SECRET_LEN]) -> (Ciphertext, SharedSecret) {
    let pk = mlkem768::MlKem768PublicKey::from(&*ek.0);
    let (ct, ss) = mlkem768::encapsulate(&pk, m);
    (Ciphertext::from_array(ct.into()), SharedSecret(ss))
}

/// Decapsulation with an expanded decapsulation key (FIPS 203's 2400-byte form): only the
/// known-answer tests hold one; nodes keep seeds.
#[cfg(test)]
pub(crate) fn decapsulate_expanded(dk: &[u8], ct: &Ciphertext) -> Option<SharedSecret> {
    let sk = mlkem768::MlKem768PrivateKey::try_from(dk).ok()?;
    let ct = mlkem768::MlKem768Ciphertext::from(&*ct.0);
    Some(SharedSecret(mlkem768::decapsulate(&sk, &ct)))
}

/// The expanded decapsulation key of a pair, for the known-answer tests.
#[cfg(test)]
pub(crate) fn expanded_decaps_key(pair: &KemKeyPair) -> Vec<u8> {
    pair.pair.sk().to_vec()
}
