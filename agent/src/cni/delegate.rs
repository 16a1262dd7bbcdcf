//! Running the delegate plugin, found on `CNI_PATH` as runtimes find plugins: for the
//! runtime's own attachment (its `CNI_*` passed on), or to release another one.

use std::io::Write;
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

/// The plugin `conf` names (`type`) on `cni_path`.
pub fn plugin_of(conf: &Value, cni_path: &str) -> Result<PathBuf, CniError> {
    find_plugin(
        conf.get("type").and_then(Value::as_str).unwrap_or_default(),
        cni_path,
    )
}

/// Runs the delegate with `command` and `conf` on stdin, our CNI_* environment passed on.
/// Its stdout is the result; a failure comes back as the delegate's own CNI error.
pub fn run(command: &str, conf: &Value, cni_path: &str) -> Result<Vec<u8>, CniError> {
    let mut cmd = Command::new(plugin_of(conf, cni_path)?);
    cmd.env("CNI_COMMAND", command);
    exec(cmd, conf)
}

/// DEL of another attachment than the runtime's (one GC or an earlier boot left): its
/// container and interface, no network namespace (the delegate then releases what it
/// holds outside the pod: its IPAM reservation).
pub fn release(
    conf: &Value,
    cni_path: &str,
    container_id: &str,
    ifname: &str,
) -> Result<Vec<u8>, CniError> {
    let mut cmd = Command::new(plugin_of(conf, cni_path)?);
    cmd.env("CNI_COMMAND", "DEL")
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_IFNAME", ifname)
        .env("CNI_PATH", cni_path)
        .env_remove("CNI_NETNS")
        .env_remove("CNI_ARGS");
    exec(cmd, conf)
}

fn exec(mut cmd: Command, conf: &Value) -> Result<Vec<u8>, CniError> {
    let plugin_type = conf.get("type").and_then(Value::as_str).unwrap_or_default();
    let plugin = PathBuf::from(cmd.get_program());
    let mut child = cmd
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
