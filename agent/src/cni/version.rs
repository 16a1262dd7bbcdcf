//! CNI versions: what `weft-cni` accepts, and the version each delegate is called with.
//!
//! A delegate (bridge, and the IPAM plugin it calls) is called with the highest version
//! that the config, `weft-cni` and the delegate all support, so a 1.1.0 config works over
//! older plugin binaries such as Debian's (up to 1.0.0). What each binary supports is asked
//! with `VERSION` once and kept in the data directory, keyed by the binary's path, size and
//! modification time (a new binary is asked again). The delegate's result is then raised
//! to the config's version.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{json, Map, Value};

use super::CniError;

/// Every version `weft-cni` accepts in a config, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];
/// The newest: what `VERSION` answers with.
pub const CURRENT: &str = "1.1.0";
/// The first version with STATUS and GC.
pub const STATUS_AND_GC: &str = "1.1.0";

/// `major.minor.patch` as numbers; `None` for anything else.
pub fn parse(version: &str) -> Option<(u32, u32, u32)> {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(Some(a)), Some(Some(b)), Some(Some(c)), None) => Some((a, b, c)),
        _ => None,
    }
}

/// Whether `version` is `min` or later (an unparsable version is not).
pub fn at_least(version: &str, min: &str) -> bool {
    matches!((parse(version), parse(min)), (Some(v), Some(m)) if v >= m)
}

/// The highest version, at most `config`, that `weft-cni` and every list support.
pub fn negotiate(config: &str, plugins: &[Vec<String>]) -> Option<String> {
    let limit = parse(config)?;
    SUPPORTED_VERSIONS
        .iter()
        .rev()
        .filter(|v| parse(v).is_some_and(|v| v <= limit))
        .find(|v| plugins.iter().all(|list| list.iter().any(|s| s == *v)))
        .map(|v| v.to_string())
}

/// The file in the data directory that keeps each binary's answer to VERSION.
const CACHE: &str = ".weft/plugin-versions.json";

/// The versions `plugin` supports: from the cache when the binary is the one asked
/// before, else asked with VERSION (and kept). A cache that cannot be written costs a
/// VERSION call next time, nothing else.
pub fn plugin_versions(plugin: &Path, data_dir: &Path) -> Result<Vec<String>, CniError> {
    let meta = std::fs::metadata(plugin)
        .map_err(|e| CniError::io(format!("reading {}: {e}", plugin.display())))?;
    let identity = json!({"size": meta.size(), "mtime": meta.mtime(), "mtimeNs": meta.mtime_nsec(), "ino": meta.ino()});
    let key = plugin.display().to_string();
    let cache_path = data_dir.join(CACHE);
    let mut cache: Map<String, Value> = std::fs::read(&cache_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    if let Some(entry) = cache.get(&key) {
        if entry.get("binary") == Some(&identity) {
            if let Some(list) = string_list(entry.get("versions")) {
                return Ok(list);
            }
        }
    }
    let versions = ask(plugin)?;
    cache.insert(
        key,
        json!({"binary": identity, "versions": versions.clone()}),
    );
    if let Some(dir) = cache_path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = weft_crypto::atomic_file::write_atomic(
        &cache_path,
        Value::Object(cache).to_string().as_bytes(),
        0o600,
    );
    Ok(versions)
}

fn string_list(v: Option<&Value>) -> Option<Vec<String>> {
    v?.as_array()?
        .iter()
        .map(|s| s.as_str().map(str::to_string))
        .collect()
}

/// The plugin's answer to VERSION.
fn ask(plugin: &Path) -> Result<Vec<String>, CniError> {
    let mut child = Command::new(plugin)
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| CniError::io(format!("running {} VERSION: {e}", plugin.display())))?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write;
        let _ = stdin.write_all(json!({ "cniVersion": CURRENT }).to_string().as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| CniError::io(format!("waiting for {} VERSION: {e}", plugin.display())))?;
    let answer: Option<Value> = serde_json::from_slice(&out.stdout).ok();
    match string_list(answer.as_ref().and_then(|a| a.get("supportedVersions"))) {
        Some(list) if out.status.success() => Ok(list),
        _ => Err(CniError::incompatible(format!(
            "{} did not answer VERSION with its supported versions (exit status {:?}): {}",
            plugin.display(),
            out.status.code(),
            weft_backends::model::clip(&String::from_utf8_lossy(&out.stdout))
        ))),
    }
}

/// A delegate's result (at the version it was called with) as the config's version
/// `to`: 1.0.0 dropped each address's `version`; the rest of the shape is the same from
/// 0.3.0 on.
pub fn raise_result(mut result: Value, to: &str) -> Value {
    let Value::Object(doc) = &mut result else {
        return result;
    };
    if at_least(to, "1.0.0") {
        if let Some(Value::Array(ips)) = doc.get_mut("ips") {
            for ip in ips.iter_mut().filter_map(Value::as_object_mut) {
                ip.remove("version");
            }
        }
    }
    doc.insert("cniVersion".into(), json!(to));
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_highest_version_everyone_supports_is_chosen() {
        let debian = list(&["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0"]);
        assert_eq!(
            negotiate("1.1.0", std::slice::from_ref(&debian)).as_deref(),
            Some("1.0.0")
        );
        assert_eq!(
            negotiate("0.4.0", std::slice::from_ref(&debian)).as_deref(),
            Some("0.4.0")
        );
        let new = list(SUPPORTED_VERSIONS);
        assert_eq!(
            negotiate("1.1.0", std::slice::from_ref(&new)).as_deref(),
            Some("1.1.0")
        );
        // The IPAM plugin counts too.
        assert_eq!(negotiate("1.1.0", &[new, debian]).as_deref(), Some("1.0.0"));
        assert_eq!(negotiate("1.1.0", &[list(&["2.0.0"])]), None);
        assert_eq!(negotiate("bogus", &[]), None);
    }

    #[test]
    fn versions_compare_as_numbers() {
        assert!(at_least("1.10.0", "1.2.0"));
        assert!(at_least("1.1.0", STATUS_AND_GC));
        assert!(!at_least("1.0.0", STATUS_AND_GC));
        assert!(!at_least("1.1", "0.1.0"));
        assert_eq!(parse("0.3.1"), Some((0, 3, 1)));
        assert_eq!(parse("0.3.1.4"), None);
    }

    #[test]
    fn a_result_is_raised_to_the_configs_version() {
        let old = json!({"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.244.3.2/24", "gateway": "10.244.3.1"}], "routes": []});
        let raised = raise_result(old.clone(), "1.1.0");
        assert_eq!(
            raised,
            json!({"cniVersion": "1.1.0", "ips": [{"address": "10.244.3.2/24", "gateway": "10.244.3.1"}], "routes": []})
        );
        assert_eq!(raise_result(old.clone(), "0.4.0"), old);
    }

    #[test]
    fn a_binarys_answer_is_kept_until_the_binary_changes() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = dir.path().join("plugin");
        let calls = dir.path().join("calls");
        let script = |versions: &str| {
            format!(
                "#!/bin/sh\necho x >> {}\necho '{{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[{versions}]}}'\n",
                calls.display()
            )
        };
        std::fs::write(&plugin, script("\"1.0.0\"")).unwrap();
        std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let data = dir.path().join("data");
        for _ in 0..3 {
            assert_eq!(plugin_versions(&plugin, &data).unwrap(), list(&["1.0.0"]));
        }
        let count = || std::fs::read_to_string(&calls).unwrap().lines().count();
        assert_eq!(count(), 1);
        // A new binary (another size) is asked again.
        std::fs::write(&plugin, script("\"1.0.0\", \"1.1.0\"")).unwrap();
        assert_eq!(
            plugin_versions(&plugin, &data).unwrap(),
            list(&["1.0.0", "1.1.0"])
        );
        assert_eq!(count(), 2);
        // A plugin that does not answer is a clear error.
        std::fs::write(&plugin, "#!/bin/sh\necho nonsense\n").unwrap();
        let e = plugin_versions(&plugin, &data).unwrap_err();
        assert_eq!(e.code, 1);
        assert!(e.msg.contains("did not answer VERSION"), "{}", e.msg);
    }
}
