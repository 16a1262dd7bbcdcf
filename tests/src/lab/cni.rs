//! The lab's container runtime, as far as networking goes: it runs a CNI conflist the way
//! libcni does (each plugin in order for ADD with the previous result, in reverse for DEL,
//! CHECK with the cached result) against the real plugins: `weft-cni` installed as
//! `flannel`, and Debian's `containernetworking-plugins` (bridge, host-local, portmap).
//! The plugins run as the node: in its network namespace, with its private `/run` (for
//! subnet.env) and `/var/lib/cni` (host-local's and weft-cni's state).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use serde_json::{json, Value};

/// flannel's `cni-conf.json` (kube-flannel.yml), which weft's ConfigMap ships unchanged;
/// the manifest test holds `deploy/kubernetes/` to this.
pub const CONFLIST: &str = r#"{
  "name": "cbr0",
  "cniVersion": "1.0.0",
  "plugins": [
    {
      "type": "flannel",
      "delegate": {
        "hairpinMode": true,
        "isDefaultGateway": true
      }
    },
    {
      "type": "portmap",
      "capabilities": {
        "portMappings": true
      }
    }
  ]
}"#;

/// Where Debian's containernetworking-plugins live.
pub const DEBIAN_PLUGINS: &str = "/usr/lib/cni";

/// The networks a multus-style top-level config (`{"cniVersion": "1.1.0", "type":
/// "multus", "delegates": [conflist, ...]}`) delegates to, as multus takes them: each must
/// be a conflist of CNI 0.4.0 or later (multus refuses older ones; the error names the
/// version found). Each is then run as a conflist of its own version.
pub fn multus_delegates(top: &Value) -> anyhow::Result<Vec<Value>> {
    let delegates = top["delegates"]
        .as_array()
        .context("a multus config without delegates")?;
    delegates
        .iter()
        .map(|d| {
            let version = d["cniVersion"].as_str().unwrap_or_default();
            let numbers: Vec<u32> = version.split('.').filter_map(|p| p.parse().ok()).collect();
            if numbers.len() != 3 || numbers < vec![0, 4, 0] {
                bail!(
                    "multus refuses the delegate {}: cniVersion {version:?} is older than 0.4.0",
                    d["name"]
                );
            }
            Ok(d.clone())
        })
        .collect()
}

/// A multus-style top-level config at CNI 1.1.0 delegating to `conflist`.
pub fn multus_over(conflist: &Value) -> Value {
    json!({"cniVersion": "1.1.0", "name": "multus-cni-network", "type": "multus", "delegates": [conflist]})
}

/// The plugin directory for the lab: `flannel` → the weft-cni binary next to `weft`.
pub fn plugin_dir(lab_dir: &Path, weft: &Path) -> anyhow::Result<PathBuf> {
    let cni = weft.with_file_name("weft-cni");
    if !cni.exists() {
        bail!(
            "the weft-cni binary {} does not exist; build it first (cargo build --bins)",
            cni.display()
        );
    }
    if !Path::new(DEBIAN_PLUGINS).join("bridge").exists() {
        bail!("{DEBIAN_PLUGINS}/bridge is missing: install Debian's containernetworking-plugins (scripts/install-deps)");
    }
    let dir = lab_dir.join("cni-bin");
    std::fs::create_dir_all(&dir)?;
    let link = dir.join("flannel");
    if !link.exists() {
        std::os::unix::fs::symlink(&cni, &link).context("linking weft-cni as flannel")?;
    }
    Ok(dir)
}

/// One pod's network attachment.
#[derive(Debug, Clone)]
pub struct Attachment {
    pub container_id: String,
    /// `/var/run/netns/<name>` of the pod.
    pub netns: String,
    pub ifname: String,
}

/// Runs plugins as a node: `wrap(script)` gives the command that runs `script` there.
pub struct Runtime<'a> {
    pub conflist: Value,
    pub cni_path: String,
    pub wrap: Box<dyn Fn(&str) -> Command + 'a>,
}

impl Runtime<'_> {
    fn plugins(&self) -> anyhow::Result<Vec<Value>> {
        let list = self.conflist["plugins"]
            .as_array()
            .context("the conflist has no plugins")?;
        Ok(list
            .iter()
            .map(|p| {
                let mut p = p.clone();
                p["name"] = self.conflist["name"].clone();
                p["cniVersion"] = self.conflist["cniVersion"].clone();
                p
            })
            .collect())
    }

    /// Runs `plugin` with `command`, `conf` on stdin, the attachment's variables if one is
    /// given (STATUS and GC name none); exit status and stdout.
    fn exec(
        &self,
        command: &str,
        conf: &Value,
        a: Option<&Attachment>,
    ) -> anyhow::Result<(bool, String, String)> {
        let plugin = conf["type"].as_str().context("plugin without a type")?;
        let path = self
            .cni_path
            .split(':')
            .map(|d| Path::new(d).join(plugin))
            .find(|p| p.exists())
            .with_context(|| format!("plugin {plugin} not on {}", self.cni_path))?;
        let mut cmd = (self.wrap)(&format!("exec {}", path.display()));
        cmd.env("CNI_COMMAND", command)
            .env("CNI_PATH", &self.cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(a) = a {
            cmd.env("CNI_CONTAINERID", &a.container_id)
                .env("CNI_NETNS", &a.netns)
                .env("CNI_IFNAME", &a.ifname);
        }
        let mut child = cmd.spawn().with_context(|| format!("running {plugin}"))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(conf.to_string().as_bytes())?;
        }
        let out = child.wait_with_output()?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }

    /// One plugin call; the parsed result (`Null` for an empty stdout).
    pub fn call(&self, command: &str, conf: &Value, a: &Attachment) -> anyhow::Result<Value> {
        let plugin = conf["type"].as_str().unwrap_or_default();
        let (ok, stdout, stderr) = self.exec(command, conf, Some(a))?;
        if !ok {
            bail!("CNI {command} {plugin} failed: {stdout} {stderr}");
        }
        if stdout.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&stdout).with_context(|| format!("{plugin} printed {stdout:?}"))
    }

    /// One plugin call whose failure is an answer too: `Err` holds the CNI error object
    /// the plugin printed.
    pub fn try_call(
        &self,
        command: &str,
        conf: &Value,
        a: Option<&Attachment>,
    ) -> anyhow::Result<Result<Value, Value>> {
        let (ok, stdout, stderr) = self.exec(command, conf, a)?;
        let parsed = || -> anyhow::Result<Value> {
            if stdout.trim().is_empty() {
                return Ok(Value::Null);
            }
            serde_json::from_str(&stdout)
                .with_context(|| format!("printed {stdout:?} (stderr {stderr:?})"))
        };
        Ok(if ok { Ok(parsed()?) } else { Err(parsed()?) })
    }

    /// A network-wide command of CNI 1.1 (STATUS, or GC with `cni.dev/valid-attachments`
    /// from `valid`) on each plugin of the list in order, as libcni runs it: the first
    /// plugin's error ends it.
    pub fn network(
        &self,
        command: &str,
        valid: &[&Attachment],
    ) -> anyhow::Result<Result<(), Value>> {
        for mut conf in self.plugins()? {
            if command == "GC" {
                conf["cni.dev/valid-attachments"] = valid
                    .iter()
                    .map(|a| json!({"containerID": a.container_id, "ifname": a.ifname}))
                    .collect();
            }
            if let Err(e) = self.try_call(command, &conf, None)? {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// ADD through the whole list; the final result.
    pub fn add(&self, a: &Attachment) -> anyhow::Result<Value> {
        let mut prev = Value::Null;
        for mut conf in self.plugins()? {
            if !prev.is_null() {
                conf["prevResult"] = prev.clone();
            }
            prev = self.call("ADD", &conf, a)?;
        }
        Ok(prev)
    }

    /// CHECK every plugin against the ADD result.
    pub fn check(&self, a: &Attachment, result: &Value) -> anyhow::Result<()> {
        for mut conf in self.plugins()? {
            conf["prevResult"] = result.clone();
            self.call("CHECK", &conf, a)?;
        }
        Ok(())
    }

    /// DEL in reverse order.
    pub fn del(&self, a: &Attachment, result: &Value) -> anyhow::Result<()> {
        for mut conf in self.plugins()?.into_iter().rev() {
            if !result.is_null() {
                conf["prevResult"] = result.clone();
            }
            self.call("DEL", &conf, a)?;
        }
        Ok(())
    }
}

/// The first IPv4 address (with prefix) in a CNI result.
pub fn result_ipv4(result: &Value) -> anyhow::Result<ipnet::Ipv4Net> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str())
        .find_map(|a| a.parse().ok())
        .with_context(|| format!("no IPv4 address in the CNI result {result}"))
}

/// The first IPv6 address in a CNI result, if any.
pub fn result_ipv6(result: &Value) -> Option<std::net::Ipv6Addr> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str())
        .find_map(|a| a.parse::<ipnet::Ipv6Net>().ok())
        .map(|n| n.addr())
}

/// `json!` of the conflist, for callers that want to change it.
pub fn conflist() -> Value {
    serde_json::from_str(CONFLIST).unwrap_or_else(|_| json!({}))
}
