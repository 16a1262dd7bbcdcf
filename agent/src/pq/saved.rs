//! The PSKs of completed post-quantum rounds, kept across restarts (`pq-pairs.json` in
//! the state directory, 0600): an agent that restarts puts its pairs' PSKs back as they
//! were, so its peers, which kept theirs, can still handshake with it.
//!
//! One line of JSON per pair would do; one object holds them all:
//! `{"own": "<this node's public key>", "pairs": {"<peer key>": {"round": ms, "psk": "…",
//! "next": {"round": ms, "psk": "…", "at": ms}}}}`. `next` is a PSK committed and not yet
//! in force at `at` (absent without one); `round` and `psk` are absent while the pair has
//! only that one. A file for another own key (the node's key changed) holds nothing of use
//! and is ignored.

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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    round: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    psk: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next: Option<Next>,
}

#[derive(Serialize, Deserialize)]
struct Next {
    round: u64,
    psk: String,
    at: u64,
}

/// What is kept of one pair: the PSK in force and the one committed to follow it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Kept {
    pub current: Option<Installed>,
    pub next: Option<Installed>,
}

impl Kept {
    /// The PSK in force at `now_ms`: the committed one once its moment has come.
    pub fn in_force(&self, now_ms: u64) -> Option<&Installed> {
        match &self.next {
            Some(next) if next.at_ms <= now_ms => Some(next),
            _ => self.current.as_ref(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.current.is_none() && self.next.is_none()
    }
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
    pub fn load(&self, own: &PublicKey) -> BTreeMap<PublicKey, Kept> {
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
                let kept = peer.parse::<PublicKey>().ok().zip(pair.kept());
                if kept.is_none() {
                    tracing::warn!(path = %self.path.display(), peer = %weft_backends::model::clip(&peer), "a saved post-quantum pair does not parse: that pair starts classical");
                }
                kept
            })
            .collect()
    }

    /// Writes `pairs` for `own`, replacing the file in one rename.
    pub fn store(
        &self,
        own: &PublicKey,
        pairs: &BTreeMap<PublicKey, Kept>,
    ) -> Result<(), weft_crypto::atomic_file::AtomicWriteError> {
        let file = File {
            own: own.to_base64(),
            pairs: pairs
                .iter()
                .map(|(k, kept)| (k.to_base64(), Pair::of(kept)))
                .collect(),
        };
        let mut text = serde_json::to_string(&file).unwrap_or_default();
        let written = weft_crypto::atomic_file::write_atomic(&self.path, text.as_bytes(), 0o600);
        zeroize::Zeroize::zeroize(&mut text);
        written
    }
}

impl Pair {
    fn of(kept: &Kept) -> Pair {
        Pair {
            round: kept.current.as_ref().map(|c| c.round),
            psk: (kept.current.as_ref()).map(|c| c.psk.to_base64_secret()),
            next: kept.next.as_ref().map(|n| Next {
                round: n.round,
                psk: n.psk.to_base64_secret(),
                at: n.at_ms,
            }),
        }
    }

    /// What the entry holds; `None` if any part of it does not parse, or it holds nothing.
    fn kept(&self) -> Option<Kept> {
        let current = match (self.round, &self.psk) {
            (Some(round), Some(psk)) => Some(Installed {
                round,
                psk: psk.parse::<PresharedKey>().ok()?,
                at_ms: round,
            }),
            (None, None) => None,
            _ => return None,
        };
        let next = match &self.next {
            Some(n) => Some(Installed {
                round: n.round,
                psk: n.psk.parse::<PresharedKey>().ok()?,
                at_ms: n.at,
            }),
            None => None,
        };
        let kept = Kept { current, next };
        (!kept.is_empty()).then_some(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use weft_crypto::PrivateKey;

    fn key() -> PublicKey {
        PrivateKey::generate().unwrap().public_key()
    }

    /// A `Saved` in a directory of its own (kept while the test holds it).
    fn in_temp() -> (tempfile::TempDir, Saved) {
        let dir = tempfile::tempdir().unwrap();
        let saved = Saved::in_dir(dir.path());
        (dir, saved)
    }

    fn installed(round: u64, fill: u8) -> Installed {
        Installed {
            round,
            psk: PresharedKey::from_bytes([fill; 32]),
            at_ms: round,
        }
    }

    #[test]
    fn pairs_come_back_for_the_same_key_only() {
        let (_dir, saved) = in_temp();
        let (own, other, peer) = (key(), key(), key());
        assert!(saved.load(&own).is_empty(), "no file: nothing");
        let committed = key();
        let mut next = installed(2_000, 8);
        next.at_ms = 2_500;
        let pairs = BTreeMap::from([
            (
                peer,
                Kept {
                    current: Some(installed(1_000, 7)),
                    next: Some(next.clone()),
                },
            ),
            (
                committed,
                Kept {
                    current: None,
                    next: Some(next.clone()),
                },
            ),
        ]);
        saved.store(&own, &pairs).unwrap();
        assert_eq!(
            std::fs::metadata(saved.path()).unwrap().mode() & 0o777,
            0o600
        );
        assert_eq!(saved.load(&own), pairs);
        assert!(saved.load(&other).is_empty(), "another own key: nothing");
        let kept = &pairs[&peer];
        assert_eq!(kept.in_force(2_499), Some(&installed(1_000, 7)));
        assert_eq!(
            kept.in_force(2_500),
            Some(&next),
            "the committed PSK at its moment"
        );
        assert_eq!(pairs[&committed].in_force(2_499), None);
    }

    #[test]
    fn a_file_of_the_last_version_comes_back() {
        let (_dir, saved) = in_temp();
        let (own, peer) = (key(), key());
        let text = format!(
            r#"{{"own":"{}","pairs":{{"{}":{{"round":5,"psk":"{}"}}}}}}"#,
            own.to_base64(),
            peer.to_base64(),
            PresharedKey::from_bytes([5; 32]).to_base64_secret()
        );
        std::fs::write(saved.path(), text).unwrap();
        let loaded = saved.load(&own);
        assert_eq!(
            loaded[&peer],
            Kept {
                current: Some(installed(5, 5)),
                next: None
            }
        );
    }

    #[test]
    fn a_bad_file_or_entry_costs_only_itself() {
        let (_dir, saved) = in_temp();
        let own = key();
        std::fs::write(saved.path(), "{not json").unwrap();
        assert!(saved.load(&own).is_empty());
        let good = key();
        let (bad_next, half) = (key(), key());
        let psk = PresharedKey::from_bytes([1; 32]).to_base64_secret();
        let text = format!(
            r#"{{"own":"{}","pairs":{{"{}":{{"round":5,"psk":"{psk}"}},"garbage":{{"round":6,"psk":"x"}},"{}":{{"round":5,"psk":"{psk}","next":{{"round":7,"psk":"x","at":9}}}},"{}":{{"round":5}}}}}}"#,
            own.to_base64(),
            good.to_base64(),
            bad_next.to_base64(),
            half.to_base64(),
        );
        std::fs::write(saved.path(), text).unwrap();
        let loaded = saved.load(&own);
        assert_eq!(loaded.keys().collect::<Vec<_>>(), [&good]);
    }
}
