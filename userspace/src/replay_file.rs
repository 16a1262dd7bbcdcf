//! The peers' newest initiation timestamps, kept in a file beside the device's UAPI
//! socket (tmpfs: it lives as long as the boot), so a device process that restarts still
//! refuses an initiation recorded before it: kernel WireGuard and wireguard-go forget
//! them with the device, and a recorded initiation would be answered again. Written
//! atomically (temp file and rename) by the timer thread when a handshake was consumed
//! since the last write; read once at start. Records of 44 bytes: the peer's public key,
//! then its TAI64N timestamp; a short tail is ignored.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

pub type Key = [u8; 32];
const RECORD: usize = 32 + 12;

/// The timestamps in `path` (none if it is missing or unreadable).
pub fn load(path: &Path) -> HashMap<Key, [u8; 12]> {
    let Ok(bytes) = std::fs::read(path) else {
        return HashMap::new();
    };
    bytes
        .chunks_exact(RECORD)
        .filter_map(|r| Some((r[..32].try_into().ok()?, r[32..].try_into().ok()?)))
        .collect()
}

/// Writes `entries` to `path` atomically, readable by its owner only.
pub fn save(path: &Path, entries: &[(Key, [u8; 12])]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(entries.len() * RECORD);
    for (key, stamp) in entries {
        buf.extend_from_slice(key);
        buf.extend_from_slice(stamp);
    }
    write_private(path, &buf)
}

/// Writes `bytes` to `path` atomically (a temporary file beside it, then a rename),
/// readable by its owner only: the device's and the relay's tmpfs state.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_saved_loads_back_and_a_torn_tail_is_ignored() {
        let dir = std::env::temp_dir().join(format!("weft-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("wg0.replay");
        assert!(load(&path).is_empty(), "a missing file is no memory");
        let entries = [([1u8; 32], [2u8; 12]), ([3u8; 32], [4u8; 12])];
        save(&path, &entries).unwrap();
        let back = load(&path);
        assert_eq!(back.len(), 2);
        assert_eq!(back[&[3u8; 32]], [4u8; 12]);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[9; 10]);
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(load(&path).len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
