//! Proof that a node holds the private key of the public key it publishes: an XEdDSA
//! signature (Signal's construction: a Schnorr signature on the Edwards form of the
//! X25519 key pair, so a WireGuard key signs without a second key) over the node's name
//! and its public key. A node that copies another node's public key cannot make one for
//! its own name, so of two entries claiming a key the one with a proof keeps it, whichever
//! the registry created first.
//!
//! Pure computation; the only randomness is the 64 bytes every signature mixes in (as
//! XEdDSA asks), from the system's source.

use curve25519_dalek::constants::ED25519_BASEPOINT_TABLE;
use curve25519_dalek::edwards::{CompressedEdwardsY, EdwardsPoint};
use curve25519_dalek::montgomery::MontgomeryPoint;
use curve25519_dalek::scalar::Scalar;
use ring::digest::{Context, SHA512};
use zeroize::Zeroize;

use crate::{random_bytes, KeyError, PrivateKey, PublicKey};

/// Length of a proof: the signature's R and s.
pub const PROOF_LEN: usize = 64;
/// Domain separation: what a proof signs starts with this.
const LABEL: &[u8] = b"weft key proof v1";

/// What a proof signs: the label, then the node's name and its public key, each
/// length-prefixed.
fn message(node: &str, key: &PublicKey) -> Vec<u8> {
    let mut m = Vec::with_capacity(LABEL.len() + node.len() + 40);
    m.extend_from_slice(LABEL);
    m.extend_from_slice(&(node.len() as u32).to_be_bytes());
    m.extend_from_slice(node.as_bytes());
    m.extend_from_slice(key.as_bytes());
    m
}

fn sha512(parts: &[&[u8]]) -> [u8; 64] {
    let mut ctx = Context::new(&SHA512);
    for p in parts {
        ctx.update(p);
    }
    let mut out = [0u8; 64];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

fn reduce(wide: [u8; 64]) -> Scalar {
    Scalar::from_bytes_mod_order_wide(&wide)
}

/// The proof that the holder of `key` publishes as node `node`.
pub fn prove(key: &PrivateKey, node: &str) -> Result<[u8; PROOF_LEN], KeyError> {
    let mut clamped = *key.as_bytes();
    clamped[0] &= 248;
    clamped[31] &= 127;
    clamped[31] |= 64;
    let mut k = Scalar::from_bytes_mod_order(clamped);
    clamped.zeroize();
    // The Edwards key pair with sign bit 0: negate the scalar where the point's is 1.
    let e = EdwardsPoint::mul_base(&k).compress();
    let mut a = if e.as_bytes()[31] & 0x80 != 0 { -k } else { k };
    k.zeroize();
    let mut big_a = e.to_bytes();
    big_a[31] &= 0x7f;
    let m = message(node, &key.public_key());
    let mut z: [u8; 64] = random_bytes()?;
    // hash1: SHA-512 over 2^256 - 2 (little-endian), then a, M and Z.
    let mut prefix = [0xffu8; 32];
    prefix[0] = 0xfe;
    let mut r = reduce(sha512(&[&prefix, a.as_bytes(), &m, &z]));
    z.zeroize();
    let big_r = (&r * ED25519_BASEPOINT_TABLE).compress();
    let h = reduce(sha512(&[big_r.as_bytes(), &big_a, &m]));
    let s = r + h * a;
    r.zeroize();
    a.zeroize();
    let mut proof = [0u8; PROOF_LEN];
    proof[..32].copy_from_slice(big_r.as_bytes());
    proof[32..].copy_from_slice(s.as_bytes());
    Ok(proof)
}

/// A proof as published: standard base64.
pub fn to_text(proof: &[u8; PROOF_LEN]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(proof)
}

/// A published proof: `None` for anything but 64 bytes of standard base64.
pub fn from_text(text: &str) -> Option<[u8; PROOF_LEN]> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .ok()?;
    bytes.as_slice().try_into().ok()
}

/// Whether `proof` shows that node `node` holds the private key of `key`.
pub fn verify(key: &PublicKey, node: &str, proof: &[u8; PROOF_LEN]) -> bool {
    let Some(big_a) = MontgomeryPoint(*key.as_bytes()).to_edwards(0) else {
        return false;
    };
    let (r_bytes, s_bytes) = proof.split_at(32);
    let Ok(r_bytes) = <[u8; 32]>::try_from(r_bytes) else {
        return false;
    };
    let Ok(s_bytes) = <[u8; 32]>::try_from(s_bytes) else {
        return false;
    };
    let Some(s) = Option::<Scalar>::from(Scalar::from_canonical_bytes(s_bytes)) else {
        return false;
    };
    let m = message(node, key);
    let compressed_a = big_a.compress();
    let h = reduce(sha512(&[&r_bytes, compressed_a.as_bytes(), &m]));
    // R == sB - hA, compared in the canonical encoding.
    let check = EdwardsPoint::vartime_double_scalar_mul_basepoint(&-h, &big_a, &s).compress();
    check == CompressedEdwardsY(r_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_verifies_for_its_key_and_node_only() {
        for _ in 0..32 {
            let key = PrivateKey::generate().unwrap();
            let other = PrivateKey::generate().unwrap();
            let proof = prove(&key, "node-1").unwrap();
            assert!(verify(&key.public_key(), "node-1", &proof));
            // Another node copying the key (and the proof) does not pass for itself.
            assert!(!verify(&key.public_key(), "node-2", &proof));
            assert!(!verify(&other.public_key(), "node-1", &proof));
            // Nor does a proof made with another key for this one.
            let forged = prove(&other, "node-2").unwrap();
            assert!(!verify(&key.public_key(), "node-2", &forged));
            for bit in [0, 100, 300, 511] {
                let mut bad = proof;
                bad[bit / 8] ^= 1 << (bit % 8);
                assert!(!verify(&key.public_key(), "node-1", &bad), "bit {bit}");
            }
        }
    }

    #[test]
    fn keys_as_wg_makes_them_prove_too() {
        // Unclamped bytes (as `wg` accepts them) sign as their clamped form, which is the
        // key X25519 uses.
        let key = PrivateKey::from_bytes([0xff; 32]);
        let proof = prove(&key, "n").unwrap();
        assert!(verify(&key.public_key(), "n", &proof));
        assert!(!verify(&PublicKey::from_bytes([0; 32]), "n", &proof));
    }
}
