//! What a pair derives: the key that authenticates its exchange messages (from the two
//! nodes' X25519 keys), and each round's secret (from the two ML-KEM shared secrets).
//!
//! Both nodes compute the same values: every input is ordered by the pair's order, the
//! node with the lower X25519 public key first, whichever node computes.

use std::fmt;

use ring::{hkdf, hmac};
use zeroize::Zeroize;

use super::message::CONFIRM_LEN;
use super::SharedSecret;
use crate::{PresharedKey, PrivateKey, PublicKey, KEY_LEN};

const AUTH_LABEL: &[u8] = b"weft pq auth v1";
const ROUND_LABEL: &[u8] = b"weft pq round v1";
const PSK_INFO: &[u8] = b"psk";
const CONFIRM_INFO: &[u8] = b"confirm";
const COMBINE_LABEL: &[u8] = b"weft pq with cluster psk v1";

/// The two nodes of a pair in the pair's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pair {
    pub lo: PublicKey,
    pub hi: PublicKey,
}

impl Pair {
    /// The pair of `a` and `b`, in either order; `None` if they are one key.
    pub fn new(a: PublicKey, b: PublicKey) -> Option<Pair> {
        match a.cmp(&b) {
            std::cmp::Ordering::Less => Some(Pair { lo: a, hi: b }),
            std::cmp::Ordering::Greater => Some(Pair { lo: b, hi: a }),
            std::cmp::Ordering::Equal => None,
        }
    }

    /// Whether `key` is the pair's lower key (the node that leads the pair's rounds).
    pub fn is_lo(&self, key: &PublicKey) -> bool {
        self.lo == *key
    }

    fn bytes(&self) -> [u8; 2 * KEY_LEN] {
        let mut out = [0; 2 * KEY_LEN];
        out[..KEY_LEN].copy_from_slice(self.lo.as_bytes());
        out[KEY_LEN..].copy_from_slice(self.hi.as_bytes());
        out
    }
}

/// Why no key could be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PairKeyError {
    #[error("the peer's public key gives a non-contributory X25519 result (a low-order point); no key is derived from it")]
    NonContributory,
    #[error("the peer's public key is this node's own")]
    OwnKey,
    #[error("the label is the exchange's own; another purpose needs a label of its own")]
    ReservedLabel,
}

/// Authenticates one pair's exchange messages: HMAC-SHA256 under a key from the two
/// nodes' static X25519 keys, so that only the two nodes can write them. Recorded
/// traffic gains nothing from it later: it authenticates, it hides nothing.
pub struct AuthKey {
    key: hmac::Key,
    pair: Pair,
}

impl AuthKey {
    /// The key `own` shares with `peer`.
    pub fn new(own: &PrivateKey, peer: &PublicKey) -> Result<AuthKey, PairKeyError> {
        AuthKey::labelled(own, peer, AUTH_LABEL)
    }

    /// The key `own` shares with `peer` for another purpose than the exchange, named by
    /// `label` (its own key: a tag made for one purpose is never valid for another).
    pub fn for_purpose(
        own: &PrivateKey,
        peer: &PublicKey,
        label: &'static [u8],
    ) -> Result<AuthKey, PairKeyError> {
        if label == AUTH_LABEL {
            return Err(PairKeyError::ReservedLabel);
        }
        AuthKey::labelled(own, peer, label)
    }

    fn labelled(
        own: &PrivateKey,
        peer: &PublicKey,
        label: &'static [u8],
    ) -> Result<AuthKey, PairKeyError> {
        let pair = Pair::new(own.public_key(), *peer).ok_or(PairKeyError::OwnKey)?;
        let secret = x25519_dalek::StaticSecret::from(*own.as_bytes());
        let shared = secret.diffie_hellman(&x25519_dalek::PublicKey::from(*peer.as_bytes()));
        if !shared.was_contributory() {
            return Err(PairKeyError::NonContributory);
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, label).extract(shared.as_bytes());
        let mut bytes = expand32(&prk, &[&pair.bytes()]);
        let key = hmac::Key::new(hmac::HMAC_SHA256, &bytes);
        bytes.zeroize();
        Ok(AuthKey { key, pair })
    }

    pub fn pair(&self) -> &Pair {
        &self.pair
    }

    /// HMAC-SHA256 of `data`, cut to `N` bytes.
    pub fn tag<const N: usize>(&self, data: &[u8]) -> [u8; N] {
        truncated(&self.key, data)
    }

    /// Constant-time check of a tag of `tag.len()` bytes over `data`.
    pub fn verify(&self, data: &[u8], tag: &[u8]) -> bool {
        verify_truncated(&self.key, data, tag)
    }
}

impl fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AuthKey({:?}, <secret>)", self.pair)
    }
}

/// Everything one round of a pair's exchange mixes into its secret.
pub struct RoundInput<'a> {
    pub pair: &'a Pair,
    /// The round's number (its leader's clock, milliseconds since the Unix epoch).
    pub round: u64,
    /// The secret the lower key's node encapsulated to the higher key's node.
    pub lo_to_hi: &'a SharedSecret,
    /// The secret the higher key's node encapsulated to the lower key's node.
    pub hi_to_lo: &'a SharedSecret,
    /// Fingerprints of the encapsulation keys used: the higher node's and the lower's.
    pub ek_hi: &'a [u8; 32],
    pub ek_lo: &'a [u8; 32],
}

/// A round's secret: the pair's PSK and the key that confirms both nodes hold it.
pub struct RoundSecret {
    psk: PresharedKey,
    confirm: hmac::Key,
}

impl RoundSecret {
    /// HKDF-SHA256: input both shared secrets in the pair's order, info the label, both
    /// X25519 keys, both encapsulation keys and the round.
    pub fn derive(input: &RoundInput<'_>) -> RoundSecret {
        let mut ikm = [0u8; 64];
        ikm[..32].copy_from_slice(input.lo_to_hi.as_bytes());
        ikm[32..].copy_from_slice(input.hi_to_lo.as_bytes());
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, ROUND_LABEL).extract(&ikm);
        ikm.zeroize();
        let pair = input.pair.bytes();
        let round = input.round.to_be_bytes();
        let expand = |what: &[u8]| {
            expand32(
                &prk,
                &[ROUND_LABEL, &pair, input.ek_lo, input.ek_hi, &round, what],
            )
        };
        let psk = PresharedKey::from_bytes(expand(PSK_INFO));
        let mut confirm = expand(CONFIRM_INFO);
        let key = hmac::Key::new(hmac::HMAC_SHA256, &confirm);
        confirm.zeroize();
        RoundSecret { psk, confirm: key }
    }

    pub fn psk(&self) -> &PresharedKey {
        &self.psk
    }

    /// A tag that proves holding this round's secret, over `fields` (a message's kind and
    /// what it commits to).
    pub fn confirm(&self, fields: &[u8]) -> [u8; CONFIRM_LEN] {
        truncated(&self.confirm, fields)
    }

    /// Constant-time check of a confirmation.
    pub fn confirms(&self, fields: &[u8], tag: &[u8; CONFIRM_LEN]) -> bool {
        verify_truncated(&self.confirm, fields, tag)
    }
}

/// The PSK a WireGuard peer gets: the pair's post-quantum PSK combined with the cluster's
/// PSK when one is set (HKDF-SHA256, the cluster PSK as salt), so that it is never weaker
/// than either alone, and a rotation of the cluster PSK changes it at the same moment on
/// both nodes without a new round.
pub fn combine(pair: &PresharedKey, cluster: Option<&PresharedKey>) -> PresharedKey {
    let Some(cluster) = cluster else {
        return pair.clone();
    };
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, cluster.as_bytes()).extract(pair.as_bytes());
    PresharedKey::from_bytes(expand32(&prk, &[COMBINE_LABEL]))
}

/// 32 bytes of HKDF-SHA256 output from `prk` for `info`.
fn expand32(prk: &hkdf::Prk, info: &[&[u8]]) -> [u8; 32] {
    let mut out = [0u8; 32];
    prk.expand(info, hkdf::HKDF_SHA256)
        .and_then(|okm| okm.fill(&mut out))
        .expect("32 bytes are within HKDF-SHA256's limit of 8160");
    out
}

/// HMAC-SHA256 cut to its first `N` bytes (at most 32).
fn truncated<const N: usize>(key: &hmac::Key, data: &[u8]) -> [u8; N] {
    let tag = hmac::sign(key, data);
    let mut out = [0; N];
    out.copy_from_slice(&tag.as_ref()[..N]);
    out
}

fn verify_truncated(key: &hmac::Key, data: &[u8], tag: &[u8]) -> bool {
    let want = hmac::sign(key, data);
    let want = &want.as_ref()[..tag.len().min(want.as_ref().len())];
    !tag.is_empty() && bool::from(subtle::ConstantTimeEq::ct_eq(want, tag))
}

impl fmt::Debug for RoundSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RoundSecret(<secret>)")
    }
}
