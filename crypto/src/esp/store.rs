//! The ipsec backend's persisted state: this node's epoch (`ipsec-epoch`) and the record of
//! every SA it installed under that epoch (`ipsec-installed`, fingerprints only), so that no
//! (key, SPI) pair is installed twice, across restarts and reboots.
//!
//! Order of writes: a bump writes the new epoch first, then starts a new record whose first
//! line names it; a record whose first line names another epoch is empty for this one. A
//! fingerprint is appended and synced to disk before its SA is installed.

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;

use super::{Epoch, FINGERPRINT_LEN, NONCE_LEN};
use crate::atomic_file::{read_bounded, write_atomic};

pub const EPOCH_FILE: &str = "ipsec-epoch";
pub const RECORD_FILE: &str = "ipsec-installed";
/// A record past this size is not read (a runaway file); the epoch is bumped instead.
const RECORD_LIMIT: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Write(#[from] crate::atomic_file::AtomicWriteError),
    #[error("choosing a new epoch nonce: {0}")]
    Random(#[from] crate::KeyError),
}

/// What the store held at start.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub epoch: Epoch,
    /// Fingerprints of the SAs installed under `epoch`.
    pub installed: HashSet<String>,
    /// Why the epoch was bumped while loading (no file, an unreadable one), if it was.
    pub bumped: Option<String>,
}

/// The two files in one directory (`/var/lib/weft` by default).
#[derive(Debug, Clone)]
pub struct EspStore {
    dir: PathBuf,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn header(epoch: &Epoch) -> String {
    format!("{} {}", epoch.number, STANDARD.encode(epoch.nonce))
}

fn parse_header(line: &str) -> Option<Epoch> {
    let (number, nonce) = line.trim().split_once(' ')?;
    let nonce = STANDARD.decode(nonce).ok()?;
    Some(Epoch {
        number: number.parse().ok()?,
        nonce: <[u8; NONCE_LEN]>::try_from(nonce.as_slice()).ok()?,
    })
}

impl EspStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        EspStore { dir: dir.into() }
    }

    pub fn epoch_path(&self) -> PathBuf {
        self.dir.join(EPOCH_FILE)
    }

    pub fn record_path(&self) -> PathBuf {
        self.dir.join(RECORD_FILE)
    }

    /// The epoch and its record; a missing or unreadable epoch file gives a new epoch
    /// (written), and so does a record that is missing or cannot be read (what it held is
    /// unknown).
    pub fn load(&self) -> Result<Loaded, StoreError> {
        let path = self.epoch_path();
        let epoch = match read_bounded(&path, 4096) {
            Ok(text) => match parse_header(&text) {
                Some(epoch) => epoch,
                None => return self.bump_from(None, "the epoch file is unreadable"),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return self.bump_from(None, "no epoch yet")
            }
            Err(e) => return Err(io_err("reading", &path)(e)),
        };
        let record = self.record_path();
        let installed = match read_bounded(&record, RECORD_LIMIT) {
            Ok(text) => {
                let mut lines = text.lines();
                let hex = |l: &&str| l.bytes().all(|b| b.is_ascii_hexdigit());
                let fingerprint = |l: &&str| l.len() == FINGERPRINT_LEN && hex(l);
                let first = lines.next().and_then(parse_header);
                // A rotation appends its epoch's header to the record it continues.
                let names_this = first == Some(epoch)
                    || lines
                        .clone()
                        .filter(|l| !fingerprint(l))
                        .any(|l| parse_header(l) == Some(epoch));
                // An older weft recorded (key, SPI, address): which keys it installed is
                // unknown to the key-only record.
                let older = |l: &&str| l.len() == 32 && hex(l);
                match first {
                    Some(_) if names_this && lines.clone().any(|l| older(&l)) => {
                        return self.bump_from(
                            Some(epoch),
                            "the install record is from an older weft (by key, SPI and address)",
                        )
                    }
                    Some(_) if names_this => {
                        lines.filter(fingerprint).map(str::to_string).collect()
                    }
                    // Left by an earlier epoch: nothing is recorded for this one.
                    Some(_) => HashSet::new(),
                    None => return self.bump_from(Some(epoch), "the install record is unreadable"),
                }
            }
            // What was installed under this epoch is unknown.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return self.bump_from(Some(epoch), "the install record is missing")
            }
            Err(_) => return self.bump_from(Some(epoch), "the install record is unreadable"),
        };
        Ok(Loaded {
            epoch,
            installed,
            bumped: None,
        })
    }

    fn bump_from(&self, from: Option<Epoch>, why: &str) -> Result<Loaded, StoreError> {
        let from = from.unwrap_or(Epoch {
            number: 0,
            nonce: [0; NONCE_LEN],
        });
        Ok(Loaded {
            epoch: self.bump(&from)?,
            installed: HashSet::new(),
            bumped: Some(why.to_string()),
        })
    }

    /// Persists the epoch after `current` (fresh nonce) and starts its empty record.
    pub fn bump(&self, current: &Epoch) -> Result<Epoch, StoreError> {
        let next = current.next()?;
        std::fs::create_dir_all(&self.dir).map_err(io_err("creating", &self.dir))?;
        write_atomic(
            &self.epoch_path(),
            format!("{}\n", header(&next)).as_bytes(),
            0o600,
        )?;
        write_atomic(
            &self.record_path(),
            format!("{}\n", header(&next)).as_bytes(),
            0o600,
        )?;
        Ok(next)
    }

    /// Persists the epoch after `current` for a rotation: the record goes on (the keys of
    /// `current` still stand beside the new epoch's, and none of either may be installed
    /// twice), with a line naming the new epoch.
    pub fn advance(&self, current: &Epoch) -> Result<Epoch, StoreError> {
        let next = current.next()?;
        write_atomic(
            &self.epoch_path(),
            format!("{}\n", header(&next)).as_bytes(),
            0o600,
        )?;
        self.append(&next, &[header(&next)])?;
        Ok(next)
    }

    /// Appends fingerprints to the record of `epoch` and syncs them to disk: call before
    /// installing the SAs they name.
    pub fn record(&self, epoch: &Epoch, fingerprints: &[String]) -> Result<(), StoreError> {
        if fingerprints.is_empty() {
            return Ok(());
        }
        self.append(epoch, fingerprints)
    }

    /// Appends `lines` to the record (started with `epoch`'s header if there is none) and
    /// syncs them to disk.
    fn append(&self, epoch: &Epoch, lines: &[String]) -> Result<(), StoreError> {
        let path = self.record_path();
        let fresh = !path.exists();
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_err("opening", &path))?;
        let mut text = String::new();
        if fresh {
            text.push_str(&header(epoch));
            text.push('\n');
        }
        for line in lines {
            text.push_str(line);
            text.push('\n');
        }
        file.write_all(text.as_bytes())
            .and_then(|()| file.sync_data())
            .map_err(io_err("appending to", &path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_epoch_survives_a_reload_and_a_bump_empties_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = EspStore::new(dir.path());
        let first = store.load().unwrap();
        assert_eq!(first.epoch.number, 1);
        assert!(first.bumped.is_some());
        let again = store.load().unwrap();
        assert_eq!(again.epoch, first.epoch);
        assert!(again.bumped.is_none() && again.installed.is_empty());

        let f = "0123456789abcdef0123456789abcdef01234567".to_string();
        store
            .record(&again.epoch, std::slice::from_ref(&f))
            .unwrap();
        assert!(store.load().unwrap().installed.contains(&f));

        let next = store.bump(&again.epoch).unwrap();
        assert_eq!(next.number, 2);
        assert_ne!(next.nonce, again.epoch.nonce);
        let after = store.load().unwrap();
        assert_eq!(after.epoch, next);
        assert!(after.installed.is_empty());
    }

    #[test]
    fn a_garbled_epoch_or_record_gives_a_new_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let store = EspStore::new(dir.path());
        let first = store.load().unwrap().epoch;
        std::fs::write(store.record_path(), "garbage\n").unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.epoch.number, first.number + 1);
        assert_eq!(
            loaded.bumped.as_deref(),
            Some("the install record is unreadable")
        );
        std::fs::remove_file(store.record_path()).unwrap();
        let again = store.load().unwrap();
        assert_eq!(again.epoch.number, loaded.epoch.number + 1);
        assert_eq!(
            again.bumped.as_deref(),
            Some("the install record is missing")
        );
        std::fs::write(store.epoch_path(), "x\n").unwrap();
        let loaded = store.load().unwrap();
        assert_ne!(loaded.epoch, first);
        assert_eq!(
            loaded.bumped.as_deref(),
            Some("the epoch file is unreadable")
        );
    }

    #[test]
    fn a_record_left_by_another_epoch_counts_for_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = EspStore::new(dir.path());
        let epoch = store.load().unwrap().epoch;
        let old = Epoch {
            number: 0,
            nonce: [7; NONCE_LEN],
        };
        std::fs::write(
            store.record_path(),
            format!("{}\n0123456789abcdef0123456789abcdef\n", header(&old)),
        )
        .unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.epoch, epoch);
        assert!(loaded.installed.is_empty());
    }

    #[test]
    fn a_rotation_continues_the_record_and_a_reload_keeps_both_epochs_installs() {
        let dir = tempfile::tempdir().unwrap();
        let store = EspStore::new(dir.path());
        let first = store.load().unwrap().epoch;
        let (old, new) = (
            "0123456789abcdef0123456789abcdef01234567".to_string(),
            "fedcba9876543210fedcba9876543210fedcba98".to_string(),
        );
        store.record(&first, std::slice::from_ref(&old)).unwrap();
        let next = store.advance(&first).unwrap();
        assert_eq!(next.number, first.number + 1);
        assert_ne!(next.nonce, first.nonce);
        store.record(&next, std::slice::from_ref(&new)).unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.epoch, next);
        assert!(loaded.bumped.is_none());
        assert_eq!(loaded.installed, HashSet::from([old, new]));
        // A bump (lost state) starts over.
        let bumped = store.bump(&next).unwrap();
        assert!(store.load().unwrap().installed.is_empty());
        assert_eq!(bumped.number, next.number + 1);
    }

    /// A record an older weft wrote (fingerprints of key, SPI and address, 32 digits)
    /// cannot say which keys went in: its epoch is left for a new one.
    #[test]
    fn a_record_by_key_spi_and_address_gives_a_new_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let store = EspStore::new(dir.path());
        let epoch = store.load().unwrap().epoch;
        std::fs::write(
            store.record_path(),
            format!("{}\n0123456789abcdef0123456789abcdef\n", header(&epoch)),
        )
        .unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.epoch.number, epoch.number + 1);
        assert_ne!(loaded.epoch.nonce, epoch.nonce);
        assert!(loaded.bumped.unwrap().contains("older weft"));
        assert!(loaded.installed.is_empty());
    }
}
