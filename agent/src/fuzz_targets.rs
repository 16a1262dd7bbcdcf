//! The agent's parsers of outside data that listen on the network, as functions of raw
//! bytes for the coverage-guided fuzzer (`fuzz/`, `scripts/fuzz`) and the replay of its
//! corpus on every test run (`tests/fuzz_corpus.rs`).
//!
//! - `path_mtu`: datagrams to the path-MTU prober's port (probes and acks).

pub use weft_crypto::fuzz_targets::{Seeds, Target};

/// Every target, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus folders).
pub const TARGETS: &[(&str, Target)] = &[("path_mtu", crate::pathmtu::fuzz::path_mtu)];

/// The seeds made by code, by target.
pub const SEEDS: &[(&str, Seeds)] = &[("path_mtu", crate::pathmtu::fuzz::seeds)];
