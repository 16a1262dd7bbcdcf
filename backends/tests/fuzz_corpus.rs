//! The coverage-guided fuzzer's corpus (`fuzz/corpus/<target>/`, grown by `scripts/fuzz`
//! with libFuzzer), replayed through this crate's targets on every test run: every input
//! that once found a new path, and every crash found and fixed, must run through its
//! parser without a panic. Each target's corpus must exist and be non-empty.

use std::path::PathBuf;

use weft_backends::fuzz_targets::TARGETS;
use weft_userspace::fuzz_targets::replay;

#[test]
fn every_fuzz_targets_corpus_replays_without_a_panic() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    let failures = replay(&root, TARGETS).unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "panicked on {failures:?}");
}
