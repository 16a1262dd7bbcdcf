//! The PSKs of completed post-quantum rounds, kept across restarts (`pq-pairs.json` in
//! the state directory, 0600): an agent that restarts puts its pairs' PSKs back as they
//! were, so its peers, which kept theirs, can still handshake with it.
//!
//! One line of JSON per pair would do; one object holds them all:
//! `{"own": "<this node's public key>", "pairs": {"<peer key>": {"round": ms, "psk": "…"}}}`.
//! A file for another own key (the node's key changed) holds nothing of use and is ignored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use weft_crypto::pq::Installed;
use weft_crypto::{PresharedKey, PublicKey};

pub const FILE: &str = "pq-pairs.json";
/// The largest file read: about 120 bytes a pair, for 100,000 pairs.
const MAX_BYTES: u64 = 12 << 20;

#[derive(Serialize, Deserialize)]
struct File {
    own: String,
    pairs: BTreeMap<String, Pair>,
}

#[derive(Serialize, Deserialize)]
struct Pair {
    round: u64,
    psk: String,
}

/// Where the pairs are kept.
pub struct Saved {
    path: PathBuf,
}

impl Saved {
    pub fn in_dir(dir: &Path) -> Saved {
        Saved {
            path: dir.join(FILE),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pairs saved for `own`; nothing (logged) if the file is missing, unreadable or
    /// for another key. A bad entry is skipped, the others kept.
    pub fn load(&self, own: &PublicKey) -> BTreeMap<PublicKey, Installed> {
        let text = match weft_crypto::atomic_file::read_bounded(&self.path, MAX_BYTES) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "post-quantum pairs not restored: every pair starts classical");
                return BTreeMap::new();
            }
        };
        let file: File = match serde_json::from_str(&text) {
            Ok(file) => file,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "post-quantum pairs not restored (not the JSON weft writes): every pair starts classical");
                return BTreeMap::new();
            }
        };
        if file.own != own.to_base64() {
            tracing::info!(path = %self.path.display(), "post-quantum pairs saved for another key of this node: not restored");
            return BTreeMap::new();
        }
        file.pairs
            .into_iter()
            .filter_map(|(peer, pair)| {
                let parsed = peer.parse::<PublicKey>().ok().zip(pair.psk.parse::<PresharedKey>().ok());
                if parsed.is_none() {
                    tracing::warn!(path = %self.path.display(), peer = %weft_backends::model::clip(&peer), "a saved post-quantum pair does not parse: that pair starts classical");
                }
                let (key, psk) = parsed?;
                Some((
                    key,
                    Installed {
                        round: pair.round,
                        psk,
                        at_ms: pair.round,
                    },
                ))
            })
            .collect()
    }

    /// Writes `pairs` (the PSKs in force) for `own`, replacing the file in one rename.
    pub fn store(
        &self,
        own: &PublicKey,
        pairs: &BTreeMap<PublicKey, Installed>,
    ) -> Result<(), weft_crypto::atomic_file::AtomicWriteError> {
        let file = File {
            own: own.to_base64(),
            pairs: pairs
                .iter()
                .map(|(k, i)| {
                    (
                        k.to_base64(),
                        Pair {
                            round: i.round,
                            psk: i.psk.to_base64_secret(),
                        },
                    )
                })
                .collect(),
        };
        let mut text = serde_json::to_string(&file).unwrap_or_default();
        let written = weft_crypto::atomic_file::write_atomic(&self.path, text.as_bytes(), 0o600);
        zeroize::Zeroize::zeroize(&mut text);
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use weft_crypto::PrivateKey;

    fn installed(round: u64, fill: u8) -> Installed {
        Installed {
            round,
            psk: PresharedKey::from_bytes([fill; 32]),
            at_ms: round,
        }
    }

    #[test]
    fn pairs_come_back_for_the_same_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let saved = Saved::in_dir(dir.path());
        let (own, other) = (
            PrivateKey::generate().unwrap().public_key(),
            PrivateKey::generate().unwrap().public_key(),
        );
        let peer = PrivateKey::generate().unwrap().public_key();
        assert!(saved.load(&own).is_empty(), "no file: nothing");
        let pairs = BTreeMap::from([(peer, installed(1_000, 7))]);
        saved.store(&own, &pairs).unwrap();
        assert_eq!(
            std::fs::metadata(saved.path()).unwrap().mode() & 0o777,
            0o600
        );
        assert_eq!(saved.load(&own), pairs);
        assert!(saved.load(&other).is_empty(), "another own key: nothing");
    }

    #[test]
    fn a_bad_file_or_entry_costs_only_itself() {
        let dir = tempfile::tempdir().unwrap();
        let saved = Saved::in_dir(dir.path());
        let own = PrivateKey::generate().unwrap().public_key();
        std::fs::write(saved.path(), "{not json").unwrap();
        assert!(saved.load(&own).is_empty());
        let good = PrivateKey::generate().unwrap().public_key();
        let text = format!(
            r#"{{"own":"{}","pairs":{{"{}":{{"round":5,"psk":"{}"}},"garbage":{{"round":6,"psk":"x"}}}}}}"#,
            own.to_base64(),
            good.to_base64(),
            PresharedKey::from_bytes([1; 32]).to_base64_secret()
        );
        std::fs::write(saved.path(), text).unwrap();
        let loaded = saved.load(&own);
        assert_eq!(loaded.keys().collect::<Vec<_>>(), [&good]);
    }
}
