//! Files replaced in one step: the new content goes to a temporary file beside the target,
//! is synced, and is renamed over the target; then the directory is synced. A reader sees
//! the old content or the new, never a mix, and after a crash one of the two is on disk.
//! It lives in this crate because every weft crate depends on it (the key file is one of
//! its users); it is plain file I/O, nothing cryptographic.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// What failed, on which file.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub struct AtomicWriteError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

fn fail(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> AtomicWriteError {
    let path = path.to_path_buf();
    move |source| AtomicWriteError { op, path, source }
}

fn parent(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// The temporary name beside `path` that `write_atomic` uses: hidden, and unique to this
/// process.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    parent(path).join(format!(".{name}.tmp.{}", std::process::id()))
}

/// Replaces `path` with `bytes`, the file getting exactly `mode` (whatever the umask). The
/// directory must exist.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), AtomicWriteError> {
    let tmp = temp_path(path);
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| {
            f.set_permissions(fs::Permissions::from_mode(mode))?;
            f.write_all(bytes)?;
            f.sync_all()
        })
        .map_err(fail("writing", &tmp))
        .and_then(|()| rename_durably(&tmp, path));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Renames `from` onto `to` (in the same directory) and syncs the directory, so the rename
/// survives a crash. `from` should already be synced.
pub fn rename_durably(from: &Path, to: &Path) -> Result<(), AtomicWriteError> {
    fs::rename(from, to).map_err(fail("renaming a temporary file onto", to))?;
    let dir = parent(to);
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(fail("syncing directory", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_with_the_exact_mode_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnet.env");
        fs::write(&path, "old").unwrap();
        write_atomic(&path, b"new", 0o640).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new");
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn a_failure_names_the_file_and_keeps_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("file");
        let err = write_atomic(&path, b"x", 0o600).unwrap_err();
        assert_eq!(err.op, "writing");
        assert!(err.to_string().contains("missing-dir"), "{err}");
    }
}

/// Reads a small text file weft or an operator wrote (a key, a PSK, rotation state), at
/// most `limit` bytes: a larger file is refused by its size (`InvalidData`, naming both)
/// before it is read, so a runaway or hostile file costs no memory.
pub fn read_bounded(path: &Path, limit: u64) -> io::Result<String> {
    use std::io::Read;
    let file = File::open(path)?;
    let mut text = String::new();
    file.take(limit + 1).read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        text.clear();
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("more than {limit} bytes: too large for what it should hold"),
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod bounded_tests {
    #[test]
    fn a_file_over_the_limit_is_refused_by_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "x".repeat(65)).unwrap();
        let e = super::read_bounded(&path, 64).unwrap_err();
        assert!(e.to_string().contains("more than 64 bytes"), "{e}");
        assert_eq!(super::read_bounded(&path, 65).unwrap().len(), 65);
    }
}
