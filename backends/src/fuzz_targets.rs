//! The parsers of outside data in this crate, each as a function of raw bytes, for the
//! coverage-guided fuzzer (`fuzz/`, `scripts/fuzz`) and for the replay of its corpus on
//! every test run (`tests/fuzz_corpus.rs`). Each must return for any input without
//! panicking; what they return does not matter. The userspace device's targets are
//! `weft_userspace::fuzz_targets`.
//!
//! - `backend_data`: a peer's published backend-data, as each backend decodes it;
//! - `esp_store`: the ipsec epoch file and install record, as the agent loads them.

pub use weft_userspace::fuzz_targets::Target;

/// Every target, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus folders).
pub const TARGETS: &[(&str, Target)] = &[("backend_data", backend_data), ("esp_store", esp_store)];

/// The input as JSON, decoded as each backend's backend-data.
pub fn backend_data(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let _ = crate::plan::WireguardData::decode(Some(&value));
    let _ = crate::plan::ipsec::IpsecData::decode(Some(&value));
    let _ = crate::plan::vxlan_mac(Some(&value));
}

/// The input split at its first NUL: the epoch file, then the install record.
pub fn esp_store(data: &[u8]) {
    let (epoch, record) = match data.iter().position(|b| *b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let dir = std::env::temp_dir().join(format!("weft-fuzz-esp-{}", std::process::id()));
    let store = weft_crypto::esp::EspStore::new(&dir);
    if std::fs::create_dir_all(&dir).is_err()
        || std::fs::write(store.epoch_path(), epoch).is_err()
        || std::fs::write(store.record_path(), record).is_err()
    {
        return;
    }
    let _ = store.load();
}
