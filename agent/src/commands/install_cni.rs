//! `weft install-cni`: what the DaemonSet's init container runs. Installs the CNI plugin
//! (`weft-cni`, under the name the conflist uses: `flannel`) into the CNI binary directory
//! and the conflist into the CNI config directory, each atomically (a temporary file in the
//! same directory, fsynced, then renamed), so the kubelet never reads half a file. The
//! conflist is validated first: it must be JSON with a `plugins` list naming the plugin.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::Value;

#[derive(Debug, Clone, clap::Args)]
pub struct InstallCniArgs {
    /// Directory of CNI plugin binaries.
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// Directory of CNI network configs.
    #[arg(long, default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// The conflist to install (the ConfigMap's cni-conf.json).
    #[arg(long, default_value = "/etc/kube-flannel/cni-conf.json")]
    pub conflist: PathBuf,
    /// File name of the installed conflist.
    #[arg(long, default_value = "10-flannel.conflist")]
    pub conf_name: String,
    /// The plugin binary to install; default: `weft-cni` next to this program.
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    /// The name the plugin is installed under (the conflist's `type`).
    #[arg(long, default_value = "flannel")]
    pub plugin_name: String,
}

/// Writes `bytes` to `dir/name` atomically with `mode`.
fn install(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> anyhow::Result<PathBuf> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(name);
    weft_crypto::atomic_file::write_atomic(&path, bytes, mode).context("installing")?;
    Ok(path)
}

pub fn run(args: &InstallCniArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    let text = fs::read_to_string(&args.conflist)
        .with_context(|| format!("reading the conflist {}", args.conflist.display()))?;
    let doc: Value = serde_json::from_str(&text)
        .with_context(|| format!("the conflist {} is not JSON", args.conflist.display()))?;
    let plugins = doc["plugins"].as_array().with_context(|| {
        format!(
            "the conflist {} has no `plugins` list",
            args.conflist.display()
        )
    })?;
    if !plugins
        .iter()
        .any(|p| p["type"] == args.plugin_name.as_str())
    {
        bail!(
            "the conflist {} has no plugin of type {:?}",
            args.conflist.display(),
            args.plugin_name
        );
    }
    let plugin = match &args.plugin {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("finding this program")?
            .with_file_name("weft-cni"),
    };
    let binary =
        fs::read(&plugin).with_context(|| format!("reading the plugin {}", plugin.display()))?;
    let bin = install(&args.cni_bin_dir, &args.plugin_name, &binary, 0o755)?;
    writeln!(out, "installed {} as {}", plugin.display(), bin.display())?;
    let conf = install(&args.cni_conf_dir, &args.conf_name, text.as_bytes(), 0o644)?;
    writeln!(
        out,
        "installed {} as {}",
        args.conflist.display(),
        conf.display()
    )?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn installs_both_files_atomically_and_refuses_a_bad_conflist() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = dir.path().join("weft-cni");
        fs::write(&plugin, b"\x7fELF plugin").unwrap();
        let conflist = dir.path().join("cni-conf.json");
        fs::write(
            &conflist,
            r#"{"name": "cbr0", "plugins": [{"type": "flannel"}]}"#,
        )
        .unwrap();
        let args = InstallCniArgs {
            cni_bin_dir: dir.path().join("bin"),
            cni_conf_dir: dir.path().join("net.d"),
            conflist: conflist.clone(),
            conf_name: "10-flannel.conflist".into(),
            plugin: Some(plugin),
            plugin_name: "flannel".into(),
        };
        let mut out = Vec::new();
        assert_eq!(run(&args, &mut out).unwrap(), 0);
        let bin = dir.path().join("bin/flannel");
        assert_eq!(fs::read(&bin).unwrap(), b"\x7fELF plugin");
        assert_eq!(
            fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
            0o755
        );
        assert!(
            fs::read_to_string(dir.path().join("net.d/10-flannel.conflist"))
                .unwrap()
                .contains("cbr0")
        );
        // No temporary files are left.
        assert_eq!(fs::read_dir(dir.path().join("bin")).unwrap().count(), 1);

        fs::write(
            &conflist,
            r#"{"name": "cbr0", "plugins": [{"type": "bridge"}]}"#,
        )
        .unwrap();
        let e = run(&args, &mut Vec::new()).unwrap_err();
        assert!(
            e.to_string().contains("no plugin of type \"flannel\""),
            "{e}"
        );
        fs::write(&conflist, "{").unwrap();
        assert!(run(&args, &mut Vec::new()).is_err());
        // The earlier, good conflist is still installed.
        assert!(
            fs::read_to_string(dir.path().join("net.d/10-flannel.conflist"))
                .unwrap()
                .contains("flannel")
        );
    }
}
