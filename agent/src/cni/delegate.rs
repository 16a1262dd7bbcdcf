//! Running the delegate plugin (found on `CNI_PATH`, as runtimes find plugins) and the
//! scratch copy of its config that DEL and CHECK need: written before ADD delegates,
//! removed when DEL succeeds.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use super::CniError;

/// The plugin `name` on the colon-separated `cni_path`.
pub fn find_plugin(name: &str, cni_path: &str) -> Result<PathBuf, CniError> {
    if name.is_empty() || name.contains('/') {
        return Err(CniError::config(format!(
            "invalid delegate plugin type {name:?}"
        )));
    }
    cni_path
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            CniError::config(format!(
                "failed to find plugin {name:?} in path [{cni_path}]"
            ))
        })
}

/// Runs the delegate with `command` and `conf` on stdin, our CNI_* environment passed on.
/// Its stdout is the result; a failure comes back as the delegate's own CNI error.
pub fn run(command: &str, conf: &Value, cni_path: &str) -> Result<Vec<u8>, CniError> {
    let plugin_type = conf.get("type").and_then(Value::as_str).unwrap_or_default();
    let plugin = find_plugin(plugin_type, cni_path)?;
    let mut child = Command::new(&plugin)
        .env("CNI_COMMAND", command)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| CniError::io(format!("running {}: {e}", plugin.display())))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(conf.to_string().as_bytes()).map_err(|e| {
            CniError::io(format!("writing the config to {}: {e}", plugin.display()))
        })?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| CniError::io(format!("waiting for {}: {e}", plugin.display())))?;
    if out.status.success() {
        return Ok(out.stdout);
    }
    Err(CniError::from_plugin(
        plugin_type,
        &out.stdout,
        out.status.code(),
    ))
}

pub fn scratch_path(data_dir: &Path, container_id: &str) -> PathBuf {
    data_dir.join(container_id)
}

/// Saves the delegate config for this container (0600, in a 0700 directory).
pub fn save(data_dir: &Path, container_id: &str, conf: &Value) -> Result<(), CniError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(|e| CniError::io(format!("creating {}: {e}", data_dir.display())))?;
    let path = scratch_path(data_dir, container_id);
    weft_crypto::atomic_file::write_atomic(&path, conf.to_string().as_bytes(), 0o600)
        .map_err(|e| CniError::io(format!("saving {}: {e}", path.display())))
}

/// The saved delegate config, `None` if there is none (never added, or already deleted).
pub fn load(data_dir: &Path, container_id: &str) -> Result<Option<Value>, CniError> {
    let path = scratch_path(data_dir, container_id);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            CniError::decode(format!("failed to parse netconf {}: {e}", path.display()))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CniError::io(format!("reading {}: {e}", path.display()))),
    }
}

pub fn remove(data_dir: &Path, container_id: &str) -> Result<(), CniError> {
    let path = scratch_path(data_dir, container_id);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CniError::io(format!("removing {}: {e}", path.display()))),
    }
}
