//! The coverage-guided fuzzer's corpus of the agent's network-facing targets
//! (`fuzz/corpus/<target>/`), replayed on every test run; the seeds made by code run too
//! (with `WEFT_WRITE_SEEDS=1` they are written into the corpus instead).

use std::path::PathBuf;

use weft::fuzz_targets::{SEEDS, TARGETS};
use weft_crypto::fuzz_targets::{replay, seeds};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus")
}

#[test]
fn every_seed_runs_and_every_corpus_replays_without_a_panic() {
    let write = std::env::var_os("WEFT_WRITE_SEEDS").is_some_and(|v| v == "1");
    let failures = seeds(&root(), TARGETS, SEEDS, write).unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "seeds panicked: {failures:?}");
    let failures = replay(&root(), TARGETS).unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "panicked on {failures:?}");
}
