//! X25519 key material for weft: WireGuard private/public keys, pre-shared keys, and the
//! on-disk key file.
//!
//! Keys travel as base64 (the `wg` text form) and are parsed once, at the edge, into the
//! newtypes here. `Debug` and `Display` never print secret material. This crate does no
//! networking; its only I/O is reading and writing the key file (`keyfile`) and the
//! atomic file replacement every weft crate uses (`atomic_file`).

pub mod atomic_file;
pub mod esp;
#[doc(hidden)]
pub mod fuzz_targets;
mod keyfile;
mod keys;
pub mod pq;
pub mod proof;

pub use keyfile::{
    load_or_create, load_or_create_secret, read_key, write_new_key, write_new_secret, KeyFileError,
    Origin, StoredSecret, DEFAULT_KEY_FILE, KEM_SEED_FILE, KEY_FILE_ENV,
};
pub use keys::{random_bytes, KeyError, PresharedKey, PrivateKey, PublicKey, KEY_LEN};
