//! The coverage-guided fuzzer's corpus of weft-crypto's targets
//! (`fuzz/corpus/<target>/`), replayed on every test run: every input that once found a
//! new path, and every crash found and fixed, must run through without a panic. The
//! seeds made by code (`SEEDS`) run too, whatever minimizing kept of them; with
//! `WEFT_WRITE_SEEDS=1` they are written into the corpus instead.

use std::path::PathBuf;

use weft_crypto::fuzz_targets::{replay, seeds, SEEDS, TARGETS};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus")
}

#[test]
fn every_fuzz_targets_corpus_replays_without_a_panic() {
    let failures = replay(&root(), TARGETS).unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "panicked on {failures:?}");
}

#[test]
fn every_seed_runs_without_a_panic() {
    let write = std::env::var_os("WEFT_WRITE_SEEDS").is_some_and(|v| v == "1");
    let failures = seeds(&root(), TARGETS, SEEDS, write).unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "panicked on {failures:?}");
}
