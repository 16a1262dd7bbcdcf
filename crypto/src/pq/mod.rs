//! Post-quantum pair secrets: each node's ML-KEM-768 key pair, the authenticated messages
//! two nodes exchange to agree on a secret, and the derivation of the pair's PSK from it.
//!
//! A recorded handshake protected by X25519 alone falls to whoever can later break X25519;
//! mixing a secret from ML-KEM into the pair's PSK keeps recorded traffic secret unless
//! ML-KEM is broken too. Pure: no I/O beyond the system's random source.

mod derive;
mod exchange;
mod kem;
mod message;

pub use derive::{combine, AuthKey, Pair, PairKeyError, RoundInput, RoundSecret};
pub use exchange::{slot, Exchange, Installed, Own, Poll, Refused, Timing, MIN_GAP};
pub use kem::{
    encapsulate, seed_from_base64, seed_to_base64, Ciphertext, EncapsKey, KemError, KemKeyPair,
    SharedSecret, CIPHERTEXT_LEN, ENCAPS_KEY_BASE64_LEN, ENCAPS_KEY_LEN, SECRET_LEN, SEED_LEN,
};
pub use message::{
    Body, Message, MessageError, CLASSICAL_KIND, CONFIRM_LEN, FINGERPRINT_LEN, MAX_LEN,
};

#[cfg(test)]
mod exchange_recovery_tests;
#[cfg(test)]
mod exchange_tests;
#[cfg(test)]
mod kat;
#[cfg(test)]
mod tests;
