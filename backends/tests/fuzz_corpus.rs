//! The coverage-guided fuzzer's corpus (`fuzz/corpus/<target>/`, grown by `scripts/fuzz`
//! with libFuzzer), replayed through the same targets on every test run: every input
//! that once found a new path, and every crash found and fixed, must run through its
//! parser without a panic. Each target's corpus must exist and be non-empty.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use weft_backends::fuzz_targets::TARGETS;

#[test]
fn every_fuzz_targets_corpus_replays_without_a_panic() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    let mut failures = Vec::new();
    for (name, target) in TARGETS {
        let dir = root.join(name);
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("the corpus of {name} ({}): {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "the corpus of {name} is empty");
        for input in &inputs {
            let data = std::fs::read(input).unwrap();
            if catch_unwind(AssertUnwindSafe(|| target(&data))).is_err() {
                failures.push(input.display().to_string());
            }
        }
        eprintln!("{name}: {} inputs replayed", inputs.len());
    }
    assert!(failures.is_empty(), "panicked on {failures:?}");
}
