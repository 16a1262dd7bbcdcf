//! `weft-cni`: the CNI meta-plugin for flannel's CNI config (`"type": "flannel"` with a
//! `delegate`). It reads subnet.env, builds the delegate's config (`conf`) and runs the
//! delegate (`bridge` + `host-local` by default) for ADD and DEL, keeping the delegate
//! config per container for DEL (and CHECK, see `check`), as flannel's own plugin does;
//! installed as `/opt/cni/bin/flannel`, existing conflists keep working.
//!
//! Protocol (CNI spec 1.1): the command and attachment in `CNI_*` variables, the network
//! config on stdin, the result on stdout; a failure is a CNI error object on stdout
//! (`{"cniVersion", "code", "msg", "details"}`) and exit status 1. Beyond 1.0: STATUS asks
//! this node's agent whether pods can be added (`status`), GC releases what the runtime no
//! longer holds (`gc`), and delegates are called with the highest version they support
//! (`version`).

pub mod attachments;
pub mod conf;
pub mod delegate;
pub mod error;
pub mod gc;
pub mod leaks;
pub mod release;
pub mod status;
pub mod version;

use std::io::Read;
use std::path::PathBuf;

use serde_json::{json, Value};

use attachments::Record;
use conf::{delegate_conf, PluginConf, SubnetEnv};
pub use error::CniError;
pub use version::SUPPORTED_VERSIONS;

/// What the runtime passed in the environment.
pub struct Invocation {
    pub command: String,
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    pub cni_path: String,
    pub stdin: Vec<u8>,
}

/// The longest `CNI_*` value taken: a path list or a netns path, at most PATH_MAX.
const MAX_ENV_BYTES: usize = 4096;

fn optional(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<String, CniError> {
    let value = env(name).unwrap_or_default();
    if value.len() > MAX_ENV_BYTES {
        return Err(CniError::env(format!(
            "{name} is {} bytes, more than {MAX_ENV_BYTES}",
            value.len()
        )));
    }
    Ok(value)
}

fn require(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<String, CniError> {
    let value = optional(env, name)?;
    if value.is_empty() {
        return Err(CniError::env(format!(
            "required environment variable {name} is missing"
        )));
    }
    Ok(value)
}

/// The CNI spec's container ID pattern, `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`: it names a file
/// in the data directory, so `.`, `..` and hidden names (which the temporary files of
/// `write_atomic` and weft-cni's own records use) are refused.
pub(crate) fn valid_container_id(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
}

impl Invocation {
    pub fn from_env(
        env: &dyn Fn(&str) -> Option<String>,
        stdin: Vec<u8>,
    ) -> Result<Self, CniError> {
        let command = require(env, "CNI_COMMAND")?;
        let mut inv = Invocation {
            command,
            container_id: String::new(),
            ifname: String::new(),
            netns: String::new(),
            cni_path: String::new(),
            stdin,
        };
        match inv.command.as_str() {
            "VERSION" => return Ok(inv),
            // Network-wide: no attachment named.
            "STATUS" => {
                inv.cni_path = optional(env, "CNI_PATH")?;
                return Ok(inv);
            }
            "GC" => {
                inv.cni_path = require(env, "CNI_PATH")?;
                return Ok(inv);
            }
            _ => {}
        }
        inv.container_id = require(env, "CNI_CONTAINERID")?;
        if !valid_container_id(&inv.container_id) {
            return Err(CniError::env(format!(
                "CNI_CONTAINERID {:?} must start with a letter or digit and hold only letters, \
                 digits, '_', '.' and '-' (the CNI spec's pattern)",
                weft_backends::model::clip(&inv.container_id)
            )));
        }
        inv.netns = if inv.command == "DEL" {
            optional(env, "CNI_NETNS")?
        } else {
            require(env, "CNI_NETNS")?
        };
        inv.ifname = require(env, "CNI_IFNAME")?;
        inv.cni_path = require(env, "CNI_PATH")?;
        Ok(inv)
    }
}

/// The plugin binaries a delegate config runs: the delegate, and the IPAM plugin it
/// calls when that is on `cni_path` too.
pub(crate) fn delegate_plugins(d: &Value, cni_path: &str) -> Result<Vec<PathBuf>, CniError> {
    let mut plugins = vec![delegate::plugin_of(d, cni_path)?];
    if let Some(ipam) = d.get("ipam").filter(|i| i.get("type").is_some()) {
        if let Ok(path) = delegate::plugin_of(ipam, cni_path) {
            plugins.push(path);
        }
    }
    Ok(plugins)
}

/// Sets the delegate config's version: the highest the config, weft-cni, the delegate
/// and its IPAM plugin all support. A config without a version leaves it unset, as
/// flannel's plugin does.
fn negotiated(conf: &PluginConf, d: &mut Value, cni_path: &str) -> Result<(), CniError> {
    if conf.cni_version.is_empty() {
        return Ok(());
    }
    let plugins = delegate_plugins(d, cni_path)?;
    let mut lists = Vec::new();
    for plugin in &plugins {
        lists.push(version::plugin_versions(plugin, &conf.data_dir)?);
    }
    let Some(chosen) = version::negotiate(&conf.cni_version, &lists) else {
        let names: Vec<String> = plugins.iter().map(|p| p.display().to_string()).collect();
        return Err(CniError::incompatible(format!(
            "incompatible CNI versions: the config is {}, and no version up to it is supported \
             by weft-cni and {} ({lists:?})",
            conf.cni_version,
            names.join(" and ")
        )));
    };
    d["cniVersion"] = json!(chosen);
    Ok(())
}

/// ADD: the delegate's result at the config's version. Attachments of earlier boots are
/// released first, so their addresses are free again.
fn add(conf: &PluginConf, inv: &Invocation) -> Result<Vec<u8>, CniError> {
    match gc::release_earlier_boots(conf, &inv.cni_path) {
        Ok(done) => {
            for e in &done.failed {
                eprintln!("weft-cni: {}", e.msg);
            }
        }
        Err(e) => eprintln!("weft-cni: releasing earlier boots' attachments: {}", e.msg),
    }
    let env = SubnetEnv::load(&conf.subnet_file)?;
    let mut d = delegate_conf(conf, &env)?;
    negotiated(conf, &mut d, &inv.cni_path)?;
    let record = Record {
        ifname: inv.ifname.clone(),
        netns: inv.netns.clone(),
        boot: attachments::boot_id(),
    };
    attachments::save(&conf.data_dir, &inv.container_id, &d, &record)?;
    let out = delegate::run("ADD", &d, &inv.cni_path).inspect_err(|_| {
        let _ = attachments::remove(&conf.data_dir, &inv.container_id);
    })?;
    if d["cniVersion"] == json!(conf.cni_version) {
        return Ok(out);
    }
    let result: Value = serde_json::from_slice(&out).map_err(|e| {
        CniError::decode(format!(
            "the delegate's result is not JSON ({e}): {}",
            weft_backends::model::clip(&String::from_utf8_lossy(&out))
        ))
    })?;
    Ok(version::raise_result(result, &conf.cni_version)
        .to_string()
        .into_bytes())
}

/// Runs one command; `Ok` holds what to print on stdout (possibly nothing).
pub fn handle(inv: &Invocation) -> Result<Vec<u8>, (CniError, String)> {
    if inv.command == "VERSION" {
        let v = json!({"cniVersion": version::CURRENT, "supportedVersions": SUPPORTED_VERSIONS});
        return Ok(v.to_string().into_bytes());
    }
    let conf = PluginConf::parse(&inv.stdin).map_err(|e| (e, String::new()))?;
    let version = conf.cni_version.clone();
    let fail = |e: CniError| (e, version.clone());
    if !version.is_empty() && !SUPPORTED_VERSIONS.contains(&version.as_str()) {
        return Err(fail(CniError::incompatible(format!(
            "incompatible CNI versions: config is {version:?}, plugin supports {SUPPORTED_VERSIONS:?}"
        ))));
    }
    if matches!(inv.command.as_str(), "STATUS" | "GC")
        && !version::at_least(&version, version::STATUS_AND_GC)
    {
        return Err(fail(CniError::incompatible(format!(
            "incompatible CNI versions: {} needs a config of cniVersion {} or later, not {version:?}",
            inv.command,
            version::STATUS_AND_GC
        ))));
    }
    match inv.command.as_str() {
        "ADD" => add(&conf, inv).map_err(fail),
        "DEL" => match attachments::load(&conf.data_dir, &inv.container_id).map_err(fail)? {
            // Never added, or already deleted: DEL is idempotent.
            None => Ok(Vec::new()),
            Some(d) => {
                let out = delegate::run("DEL", &d, &inv.cni_path).map_err(fail)?;
                attachments::remove(&conf.data_dir, &inv.container_id).map_err(fail)?;
                Ok(out)
            }
        },
        "CHECK" => {
            let Some(d) = attachments::load(&conf.data_dir, &inv.container_id).map_err(fail)?
            else {
                return Err(fail(CniError::unknown_container(format!(
                    "container {} was not added by this plugin (no {})",
                    inv.container_id,
                    attachments::scratch_path(&conf.data_dir, &inv.container_id).display()
                ))));
            };
            check(&conf, &d).map_err(fail)?;
            Ok(Vec::new())
        }
        "STATUS" => status::status(&conf.agent_socket)
            .map(|()| Vec::new())
            .map_err(fail),
        "GC" => {
            let doc: Value = serde_json::from_slice(&inv.stdin).unwrap_or_default();
            let done = gc::gc(&conf, &doc, &inv.cni_path).map_err(fail)?;
            match done.failed.into_iter().next() {
                Some(e) => Err(fail(e)),
                None => Ok(Vec::new()),
            }
        }
        other => Err(fail(CniError::env(format!(
            "unknown CNI_COMMAND {:?}",
            weft_backends::model::clip(other)
        )))),
    }
}

/// CHECK: the container was added by us and its delegate config still matches this
/// node: subnet.env is there and names the subnet the pod's address came from (a node
/// whose subnet changed leaves pods that must be recreated). Like flannel's plugin, the
/// delegate's own CHECK is not run: bridge's CHECK expects the pod routes host-local hands
/// out without a gateway, but they are installed via the gateway, so it fails on every
/// healthy pod.
fn check(conf: &PluginConf, saved: &Value) -> Result<(), CniError> {
    let env = SubnetEnv::load(&conf.subnet_file)?;
    let fresh = delegate_conf(conf, &env)?;
    let ranges = |d: &Value| d["ipam"]["ranges"].clone();
    if ranges(saved) != ranges(&fresh) {
        return Err(CniError::new(
            100,
            format!(
                "the pod's address came from {}, but this node's subnet is now {} ({}): recreate the pod",
                ranges(saved),
                ranges(&fresh),
                conf.subnet_file.display()
            ),
        ));
    }
    Ok(())
}

/// The plugin's `main`: returns the exit status.
pub fn main() -> i32 {
    let mut stdin = Vec::new();
    let env = |k: &str| std::env::var(k).ok();
    let command = env("CNI_COMMAND").unwrap_or_default();
    if command != "VERSION" {
        if let Err(e) = std::io::stdin().read_to_end(&mut stdin) {
            return print_error(&CniError::io(format!("reading stdin: {e}")), "");
        }
    }
    let result = Invocation::from_env(&env, stdin)
        .map_err(|e| (e, String::new()))
        .and_then(|inv| handle(&inv));
    match result {
        Ok(out) => {
            use std::io::Write;
            let mut stdout = std::io::stdout();
            let _ = stdout.write_all(&out);
            let _ = stdout.flush();
            0
        }
        Err((e, version)) => print_error(&e, &version),
    }
}

fn print_error(e: &CniError, version: &str) -> i32 {
    println!("{}", e.to_json(version));
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_errors_name_the_variable() {
        let env = |k: &str| match k {
            "CNI_COMMAND" => Some("ADD".to_string()),
            "CNI_CONTAINERID" => Some("../etc".to_string()),
            _ => None,
        };
        let e = Invocation::from_env(&env, vec![]).err().unwrap();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("CNI_CONTAINERID"), "{}", e.msg);
        let env = |k: &str| (k == "CNI_COMMAND").then(|| "DEL".to_string());
        let e = Invocation::from_env(&env, vec![]).err().unwrap();
        assert!(e.msg.contains("CNI_CONTAINERID is missing"), "{}", e.msg);
    }

    #[test]
    fn container_ids_follow_the_spec_and_cannot_leave_the_data_directory() {
        for bad in [
            ".",
            "..",
            ".hidden",
            "-x",
            "_x",
            "a/b",
            "",
            "x\n",
            ".c1.tmp.42",
        ] {
            assert!(!valid_container_id(bad), "{bad:?} accepted");
            let env = |k: &str| match k {
                "CNI_COMMAND" => Some("DEL".to_string()),
                "CNI_CONTAINERID" => Some(bad.to_string()),
                _ => None,
            };
            let e = Invocation::from_env(&env, vec![]).err().unwrap();
            assert_eq!(e.code, 4, "{bad:?}");
        }
        for good in ["c1", "0a.b-c_d", "f3b0c44298fc1c149afbf4c8996fb924"] {
            assert!(valid_container_id(good), "{good:?} refused");
        }
    }

    #[test]
    fn a_delegates_error_is_passed_on() {
        let e = CniError::from_plugin(
            "bridge",
            br#"{"code": 11, "msg": "try again", "details": "d"}"#,
            Some(1),
        );
        assert_eq!(
            (e.code, e.msg.as_str(), e.details.as_str()),
            (11, "try again", "d")
        );
        let e = CniError::from_plugin("bridge", b"panic: oops", Some(2));
        assert_eq!(e.code, 999);
        assert_eq!(
            e.to_json("0.4.0"),
            json!({"cniVersion": "0.4.0", "code": 999, "msg": e.msg, "details": "panic: oops"})
        );
    }

    #[test]
    fn check_knows_its_containers_and_notices_a_changed_subnet() {
        let dir = tempfile::tempdir().unwrap();
        let env_file = dir.path().join("subnet.env");
        let write_env = |subnet: &str| {
            std::fs::write(
                &env_file,
                format!("FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET={subnet}\nFLANNEL_MTU=1420\nFLANNEL_IPMASQ=true\n"),
            )
            .unwrap()
        };
        write_env("10.244.3.1/24");
        let stdin = json!({"cniVersion": "1.0.0", "name": "cbr0", "type": "flannel",
            "subnetFile": env_file, "dataDir": dir.path().join("data")});
        let inv = |command: &str, id: &str| Invocation {
            command: command.into(),
            container_id: id.into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/p1".into(),
            cni_path: "/nonexistent".into(),
            stdin: stdin.to_string().into_bytes(),
        };
        let (e, _) = handle(&inv("CHECK", "c1")).unwrap_err();
        assert_eq!(e.code, 3, "{}", e.msg);
        // What ADD saves before it delegates.
        let conf = PluginConf::parse(stdin.to_string().as_bytes()).unwrap();
        let env = SubnetEnv::load(&env_file).unwrap();
        let record = Record {
            ifname: "eth0".into(),
            netns: "/var/run/netns/p1".into(),
            boot: attachments::boot_id(),
        };
        attachments::save(
            &conf.data_dir,
            "c1",
            &delegate_conf(&conf, &env).unwrap(),
            &record,
        )
        .unwrap();
        assert_eq!(handle(&inv("CHECK", "c1")).unwrap(), b"");
        write_env("10.244.9.1/24");
        let (e, _) = handle(&inv("CHECK", "c1")).unwrap_err();
        assert_eq!(e.code, 100);
        assert!(e.msg.contains("10.244.9.0/24"), "{}", e.msg);
        // DEL of a container never added is fine; ADD without the delegate is a clear error
        // and leaves nothing behind.
        assert_eq!(handle(&inv("DEL", "c2")).unwrap(), b"");
        let (e, _) = handle(&inv("ADD", "c3")).unwrap_err();
        assert!(
            e.msg.contains("failed to find plugin \"bridge\""),
            "{}",
            e.msg
        );
        assert!(!attachments::scratch_path(&conf.data_dir, "c3").exists());
    }

    #[test]
    fn an_unsupported_version_is_refused() {
        let inv = Invocation {
            command: "ADD".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/p1".into(),
            cni_path: "/nonexistent".into(),
            stdin: br#"{"cniVersion": "9.9.9", "name": "cbr0", "type": "flannel"}"#.to_vec(),
        };
        let (e, _) = handle(&inv).unwrap_err();
        assert_eq!(e.code, 1);
    }
}
