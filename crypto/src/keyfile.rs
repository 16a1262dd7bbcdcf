//! The node's private key on disk: `/var/lib/weft/wireguard.key` unless `WIREGUARD_KEY_FILE`
//! names another path; its ML-KEM seed (`mlkem.key`) in the same directory.
//!
//! Load-or-create: an existing file is used as it is (a reboot must not change the key);
//! a missing one is created atomically (temp file, fsync, `link` into place so a concurrent
//! creator is never overwritten) with mode 0600 in a 0700 directory. A file that others can
//! read or that does not hold a key is refused, with the fix in the message.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::keys::{KeyError, PrivateKey};

pub const DEFAULT_KEY_FILE: &str = "/var/lib/weft/wireguard.key";
pub const KEY_FILE_ENV: &str = "WIREGUARD_KEY_FILE";
/// The ML-KEM seed's file name, in the WireGuard key's directory.
pub const KEM_SEED_FILE: &str = "mlkem.key";

/// A secret kept in a key file as one line of base64.
pub trait StoredSecret: Sized {
    /// What the file holds, for messages.
    const WHAT: &'static str;
    /// How to restore it, for messages about a file that does not hold one.
    const RESTORE: &'static str;
    /// The longest file worth reading.
    const MAX_FILE: u64;
    fn generate() -> Result<Self, KeyError>;
    fn from_text(text: &str) -> Result<Self, KeyError>;
    /// The line to store (secret).
    fn to_text_secret(&self) -> String;
}

impl StoredSecret for PrivateKey {
    const WHAT: &'static str = "a WireGuard private key";
    const RESTORE: &'static str = "restore the node's key (one base64 line, as `wg genkey` prints), or delete the file to generate a new key (peers then learn a new public key)";
    const MAX_FILE: u64 = 1024;
    fn generate() -> Result<Self, KeyError> {
        PrivateKey::generate()
    }
    fn from_text(text: &str) -> Result<Self, KeyError> {
        text.parse()
    }
    fn to_text_secret(&self) -> String {
        self.to_base64_secret()
    }
}

impl StoredSecret for crate::pq::KemKeyPair {
    const WHAT: &'static str = "an ML-KEM-768 seed";
    const RESTORE: &'static str = "delete the file to generate a new ML-KEM key pair (peers then learn its new key, and every pair runs a new round)";
    const MAX_FILE: u64 = 1024;
    fn generate() -> Result<Self, KeyError> {
        crate::pq::KemKeyPair::generate()
    }
    fn from_text(text: &str) -> Result<Self, KeyError> {
        crate::pq::seed_from_base64(text).map(crate::pq::KemKeyPair::from_seed)
    }
    fn to_text_secret(&self) -> String {
        crate::pq::seed_to_base64(self.seed())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("key file {} has mode {mode:04o}: group or others may read it; fix: `chmod 600 {}` (and treat the key as exposed: rotate it)", path.display(), path.display())]
    TooOpen { path: PathBuf, mode: u32 },
    #[error("key directory {} has mode {mode:04o}: group or others may write to it and replace the key; fix: `chmod 700 {}`", path.display(), path.display())]
    DirTooOpen { path: PathBuf, mode: u32 },
    #[error("key file {} is not a regular file; fix: remove it so weft can create the key", path.display())]
    NotAFile { path: PathBuf },
    #[error("key file {} does not hold {what}: {source}; fix: {restore}", path.display())]
    Malformed {
        path: PathBuf,
        what: &'static str,
        restore: &'static str,
        #[source]
        source: KeyError,
    },
    #[error("generating a key for {}: {source}", path.display())]
    Generate {
        path: PathBuf,
        #[source]
        source: KeyError,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> KeyFileError + 'a {
    move |source| KeyFileError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Whether `load_or_create` found the key or made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Loaded,
    Created,
}

/// Loads the key at `path`, creating it if there is none.
pub fn load_or_create(path: &Path) -> Result<(PrivateKey, Origin), KeyFileError> {
    load_or_create_secret(path)
}

/// Loads the secret at `path`, creating it if there is none.
pub fn load_or_create_secret<T: StoredSecret>(path: &Path) -> Result<(T, Origin), KeyFileError> {
    match load(path)? {
        Some(key) => Ok((key, Origin::Loaded)),
        None => create(path),
    }
}

fn load<T: StoredSecret>(path: &Path) -> Result<Option<T>, KeyFileError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("inspecting key file", path)(e)),
    };
    if !meta.file_type().is_file() {
        return Err(KeyFileError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyFileError::TooOpen {
            path: path.to_path_buf(),
            mode,
        });
    }
    // A key is 44 characters (a seed 88); the file holds one line.
    let mut text = crate::atomic_file::read_bounded(path, T::MAX_FILE).map_err(|e| {
        if e.kind() == io::ErrorKind::InvalidData {
            KeyFileError::Malformed {
                path: path.to_path_buf(),
                what: T::WHAT,
                restore: T::RESTORE,
                // Too large (read_bounded's own message), or not UTF-8.
                source: KeyError::Base64(match e.get_ref() {
                    Some(why) if why.to_string().contains("bytes") => why.to_string(),
                    _ => "the file is not text".into(),
                }),
            }
        } else {
            io_err("reading key file", path)(e)
        }
    })?;
    let key = T::from_text(&text).map_err(|source| KeyFileError::Malformed {
        path: path.to_path_buf(),
        what: T::WHAT,
        restore: T::RESTORE,
        source,
    });
    zeroize::Zeroize::zeroize(&mut text);
    key.map(Some)
}

/// The key in `path`, `None` if there is no such file.
pub fn read_key(path: &Path) -> Result<Option<PrivateKey>, KeyFileError> {
    load(path)
}

/// A new key written to `path` (0600, in a 0700 directory), replacing whatever was there
/// in one rename: a reader sees the old file or the new one. For a rotation's next key.
pub fn write_new_key(path: &Path) -> Result<PrivateKey, KeyFileError> {
    write_new_secret(path)
}

/// A new secret written to `path`, as `write_new_key`.
pub fn write_new_secret<T: StoredSecret>(path: &Path) -> Result<T, KeyFileError> {
    let (key, tmp) = new_key_beside::<T>(path)?;
    let written = write_secret(&tmp, &key).and_then(|()| {
        crate::atomic_file::rename_durably(&tmp, path).map_err(|e| KeyFileError::Io {
            op: e.op,
            path: e.path,
            source: e.source,
        })
    });
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written.map(|()| key)
}

/// A new key, and the temporary file name beside `path` (in its 0700 directory) to write
/// it to before it is moved into place.
fn new_key_beside<T: StoredSecret>(path: &Path) -> Result<(T, PathBuf), KeyFileError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    ensure_private_dir(&dir)?;
    let key = T::generate().map_err(|source| KeyFileError::Generate {
        path: path.to_path_buf(),
        source,
    })?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("key"),
        std::process::id()
    ));
    Ok((key, tmp))
}

fn create<T: StoredSecret>(path: &Path) -> Result<(T, Origin), KeyFileError> {
    let (key, tmp) = new_key_beside::<T>(path)?;
    let _ = fs::remove_file(&tmp);
    let written = write_secret(&tmp, &key);
    let linked = written.and_then(|()| match fs::hard_link(&tmp, path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io_err("moving new key into place at", path)(e)),
    });
    let _ = fs::remove_file(&tmp);
    if !linked? {
        // Another process created the key between our look and our link: theirs wins.
        return load(path)?
            .map(|k| (k, Origin::Loaded))
            .ok_or_else(|| KeyFileError::NotAFile {
                path: path.to_path_buf(),
            });
    }
    let dir = tmp.parent().unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing key directory", dir))?;
    Ok((key, Origin::Created))
}

fn write_secret<T: StoredSecret>(tmp: &Path, key: &T) -> Result<(), KeyFileError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(tmp)
        .map_err(io_err("creating temporary key file", tmp))?;
    let mut line = key.to_text_secret();
    line.push('\n');
    let result = file
        .write_all(line.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io_err("writing temporary key file", tmp));
    zeroize::Zeroize::zeroize(&mut line);
    result
}

fn ensure_private_dir(dir: &Path) -> Result<(), KeyFileError> {
    match fs::metadata(dir) {
        Ok(meta) => {
            let mode = meta.permissions().mode() & 0o7777;
            // Others reading the directory listing is harmless; writing to it is not.
            if mode & 0o022 != 0 && mode & 0o1000 == 0 {
                return Err(KeyFileError::DirTooOpen {
                    path: dir.to_path_buf(),
                    mode,
                });
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err("creating key directory", dir)),
        Err(e) => Err(io_err("inspecting key directory", dir)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_once_then_loads_the_same_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lib/weft/wireguard.key");
        let (created, origin) = load_or_create(&path).unwrap();
        assert_eq!(origin, Origin::Created);
        let file_mode = fs::metadata(&path).unwrap().mode() & 0o777;
        let dir_mode = fs::metadata(path.parent().unwrap()).unwrap().mode() & 0o777;
        assert_eq!((file_mode, dir_mode), (0o600, 0o700));
        let (loaded, origin) = load_or_create(&path).unwrap();
        assert_eq!(origin, Origin::Loaded);
        assert_eq!(loaded, created);
        let leftovers: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, vec![std::ffi::OsString::from("wireguard.key")]);
    }

    #[test]
    fn readable_by_others_is_refused_with_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wireguard.key");
        load_or_create(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_or_create(&path).unwrap_err();
        assert!(
            matches!(err, KeyFileError::TooOpen { mode: 0o644, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("chmod 600"), "{err}");
    }

    #[test]
    fn malformed_file_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wireguard.key");
        fs::write(&path, "hello\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        let err = load_or_create(&path).unwrap_err();
        assert!(matches!(err, KeyFileError::Malformed { .. }), "{err:?}");
        assert!(err.to_string().contains("delete the file"), "{err}");
        assert_eq!(fs::read_to_string(&path).unwrap(), "hello\n");
    }

    #[test]
    fn an_ml_kem_seed_is_kept_like_the_key() {
        use crate::pq::KemKeyPair;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lib/weft").join(KEM_SEED_FILE);
        let (created, origin) = load_or_create_secret::<KemKeyPair>(&path).unwrap();
        assert_eq!(origin, Origin::Created);
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let (loaded, origin) = load_or_create_secret::<KemKeyPair>(&path).unwrap();
        assert_eq!(origin, Origin::Loaded);
        assert_eq!(loaded.encaps_key(), created.encaps_key());
        let rotated = write_new_secret::<KemKeyPair>(&path).unwrap();
        assert_ne!(rotated.encaps_key(), created.encaps_key());
        let (loaded, _) = load_or_create_secret::<KemKeyPair>(&path).unwrap();
        assert_eq!(loaded.encaps_key(), rotated.encaps_key());

        // A WireGuard key where a seed belongs: named, and the file left alone.
        let (wg, _) = load_or_create(&dir.path().join("wireguard.key")).unwrap();
        fs::write(&path, wg.to_base64_secret()).unwrap();
        let err = load_or_create_secret::<KemKeyPair>(&path).unwrap_err();
        assert!(err.to_string().contains("ML-KEM-768 seed"), "{err}");
        assert!(err.to_string().contains("32 bytes"), "{err}");
        assert!(!err.to_string().contains(&wg.to_base64_secret()), "{err}");
    }

    #[test]
    fn group_writable_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let err = load_or_create(&dir.path().join("k")).unwrap_err();
        assert!(matches!(err, KeyFileError::DirTooOpen { .. }), "{err:?}");
    }
}
