//! What `weft-cni` keeps per attachment in its data directory: the delegate's config under
//! the container ID (flannel's layout, which DEL needs and existing nodes already have),
//! and beside it in `.weft/` the attachment's interface, network namespace and the boot
//! it was made in (which GC and the release of earlier boots need). A config without
//! that record (written by flannel's plugin or an older `weft-cni`) is taken as this
//! boot's, interface unknown: nothing that may be live is ever released on a guess.

use std::io::ErrorKind;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::CniError;

/// The subdirectory for weft-cni's own records (a container ID cannot start with `.`).
pub const RECORDS: &str = ".weft";

/// Where the kernel says which boot this is.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// This boot's ID; empty if the kernel does not say (then no boot is told from another).
pub fn boot_id() -> String {
    std::fs::read_to_string(BOOT_ID)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// An attachment's record beside its delegate config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub ifname: String,
    #[serde(default)]
    pub netns: String,
    /// The boot ID when the attachment was made.
    pub boot: String,
}

/// One saved attachment.
#[derive(Debug, Clone)]
pub struct Saved {
    pub container_id: String,
    pub delegate: Value,
    /// `None`: saved without a record (flannel's plugin, an older weft-cni).
    pub record: Option<Record>,
}

impl Saved {
    /// The network the attachment belongs to (the delegate config's `name`).
    pub fn network(&self) -> &str {
        self.delegate
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// Whether it was made in an earlier boot than `boot` (unknown: no).
    pub fn from_earlier_boot(&self, boot: &str) -> bool {
        matches!(&self.record, Some(r) if !boot.is_empty() && !r.boot.is_empty() && r.boot != boot)
    }
}

pub fn scratch_path(data_dir: &Path, container_id: &str) -> PathBuf {
    data_dir.join(container_id)
}

fn record_path(data_dir: &Path, container_id: &str) -> PathBuf {
    data_dir.join(RECORDS).join(container_id)
}

fn create_dir(dir: &Path) -> Result<(), CniError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| CniError::io(format!("creating {}: {e}", dir.display())))
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), CniError> {
    weft_crypto::atomic_file::write_atomic(path, bytes, 0o600)
        .map_err(|e| CniError::io(format!("saving {}: {e}", path.display())))
}

/// Saves the delegate config and the record for this container (0600, in 0700
/// directories).
pub fn save(
    data_dir: &Path,
    container_id: &str,
    conf: &Value,
    record: &Record,
) -> Result<(), CniError> {
    create_dir(&data_dir.join(RECORDS))?;
    let record_json = serde_json::to_vec(record)
        .map_err(|e| CniError::io(format!("encoding the record of {container_id}: {e}")))?;
    write(&record_path(data_dir, container_id), &record_json)?;
    write(
        &scratch_path(data_dir, container_id),
        conf.to_string().as_bytes(),
    )
}

/// The saved delegate config, `None` if there is none (never added, or already deleted).
pub fn load(data_dir: &Path, container_id: &str) -> Result<Option<Value>, CniError> {
    let path = scratch_path(data_dir, container_id);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            CniError::decode(format!("failed to parse netconf {}: {e}", path.display()))
        }),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CniError::io(format!("reading {}: {e}", path.display()))),
    }
}

fn load_record(data_dir: &Path, container_id: &str) -> Option<Record> {
    let bytes = std::fs::read(record_path(data_dir, container_id)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Removes `path`; one already gone is fine.
pub(crate) fn remove_file(path: &Path) -> Result<(), CniError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CniError::io(format!("removing {}: {e}", path.display()))),
    }
}

/// Forgets the attachment: its delegate config, then its record.
pub fn remove(data_dir: &Path, container_id: &str) -> Result<(), CniError> {
    remove_file(&scratch_path(data_dir, container_id))?;
    remove_file(&record_path(data_dir, container_id))
}

/// Every attachment saved in `data_dir` (none if it does not exist). A file whose
/// config cannot be read is named in the error list and left where it is.
pub fn list(data_dir: &Path) -> (Vec<Saved>, Vec<String>) {
    let mut saved = Vec::new();
    let mut unreadable = Vec::new();
    let Ok(entries) = std::fs::read_dir(data_dir) else {
        return (saved, unreadable);
    };
    let mut ids: Vec<String> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| super::valid_container_id(name))
        .collect();
    ids.sort();
    for id in ids {
        match load(data_dir, &id) {
            Ok(Some(delegate)) => saved.push(Saved {
                record: load_record(data_dir, &id),
                container_id: id,
                delegate,
            }),
            Ok(None) => {}
            Err(e) => unreadable.push(e.msg),
        }
    }
    (saved, unreadable)
}

/// An exclusive lock on the data directory's records, held while attachments are
/// released (two runtimes' calls at once release each attachment once).
pub struct Lock(#[allow(dead_code)] std::fs::File);

pub fn lock(data_dir: &Path) -> Result<Lock, CniError> {
    let dir = data_dir.join(RECORDS);
    create_dir(&dir)?;
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| CniError::io(format!("opening {}: {e}", path.display())))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(CniError::io(format!(
            "locking {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(Lock(file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn attachments_are_saved_listed_and_forgotten_with_their_records() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let record = Record {
            ifname: "eth0".into(),
            netns: "/var/run/netns/p1".into(),
            boot: "b1".into(),
        };
        save(&data, "c1", &json!({"name": "cbr0"}), &record).unwrap();
        // As flannel's plugin leaves it: the config alone.
        std::fs::write(data.join("c2"), r#"{"name": "other"}"#).unwrap();
        std::fs::write(data.join("c3"), "not json").unwrap();
        let (saved, unreadable) = list(&data);
        let ids: Vec<&str> = saved.iter().map(|s| s.container_id.as_str()).collect();
        assert_eq!(ids, ["c1", "c2"]);
        assert_eq!(saved[0].record.as_ref(), Some(&record));
        assert_eq!(saved[0].network(), "cbr0");
        assert!(saved[0].from_earlier_boot("b2"));
        assert!(!saved[0].from_earlier_boot("b1"));
        // Without a record: never taken for an earlier boot's.
        assert!(saved[1].record.is_none());
        assert!(!saved[1].from_earlier_boot("b2"));
        assert_eq!(unreadable.len(), 1);
        assert!(unreadable[0].contains("c3"), "{unreadable:?}");
        remove(&data, "c1").unwrap();
        assert!(!data.join("c1").exists() && !data.join(RECORDS).join("c1").exists());
        remove(&data, "c1").unwrap();
        let _held = lock(&data).unwrap();
    }
}
