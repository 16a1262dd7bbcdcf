//! The coverage-guided fuzzer's corpus of the userspace device's targets
//! (`fuzz/corpus/<target>/`), replayed on every test run: every input that once found a
//! new path, and every crash found and fixed, must run through without a panic.

use std::path::PathBuf;

use weft_userspace::fuzz_targets::{replay, TARGETS};

#[test]
fn every_fuzz_targets_corpus_replays_without_a_panic() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    let failures = replay(&root, TARGETS).unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "panicked on {failures:?}");
}
