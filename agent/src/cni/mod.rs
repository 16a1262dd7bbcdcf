//! `weft-cni`: the CNI meta-plugin for flannel's CNI config (`"type": "flannel"` with a
//! `delegate`). It reads subnet.env, builds the delegate's config (`conf`) and runs the
//! delegate (`bridge` + `host-local` by default) for ADD and DEL, keeping the delegate
//! config per container for DEL (and CHECK, see `check`), as flannel's own plugin does; installed
//! as `/opt/cni/bin/flannel`, existing conflists keep working.
//!
//! Protocol (CNI spec 1.0): the command and container in `CNI_*` variables, the network
//! config on stdin, the result on stdout; a failure is a CNI error object on stdout
//! (`{"cniVersion", "code", "msg", "details"}`) and exit status 1.

pub mod conf;
pub mod delegate;

use std::io::Read;

use serde_json::{json, Value};

use conf::{delegate_conf, PluginConf, SubnetEnv};

pub const SUPPORTED_VERSIONS: &[&str] = &["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// A CNI error: the spec's well-known codes, plus whatever a delegate returned.
#[derive(Debug, Clone, PartialEq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }
    pub fn incompatible(msg: impl Into<String>) -> Self {
        Self::new(1, msg)
    }
    pub fn unknown_container(msg: impl Into<String>) -> Self {
        Self::new(3, msg)
    }
    pub fn env(msg: impl Into<String>) -> Self {
        Self::new(4, msg)
    }
    pub fn io(msg: impl Into<String>) -> Self {
        Self::new(5, msg)
    }
    pub fn decode(msg: impl Into<String>) -> Self {
        Self::new(6, msg)
    }
    pub fn config(msg: impl Into<String>) -> Self {
        Self::new(7, msg)
    }

    /// The error a failed delegate printed, or one saying it printed none.
    pub fn from_plugin(plugin: &str, stdout: &[u8], status: Option<i32>) -> Self {
        let parsed: Option<Value> = serde_json::from_slice(stdout).ok();
        match parsed
            .as_ref()
            .and_then(|v| v.get("code"))
            .and_then(Value::as_u64)
        {
            Some(code) => {
                let field = |k: &str| {
                    parsed
                        .as_ref()
                        .and_then(|v| v.get(k))
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string()
                };
                CniError {
                    code: code as u32,
                    msg: field("msg"),
                    details: field("details"),
                }
            }
            None => CniError {
                code: 999,
                msg: format!(
                    "delegate plugin {plugin} failed (exit status {status:?}) without a CNI error"
                ),
                details: String::from_utf8_lossy(stdout).into_owned(),
            },
        }
    }

    pub fn to_json(&self, cni_version: &str) -> Value {
        let version = if cni_version.is_empty() {
            "1.0.0"
        } else {
            cni_version
        };
        let mut v = json!({"cniVersion": version, "code": self.code, "msg": self.msg});
        if !self.details.is_empty() {
            v["details"] = json!(self.details);
        }
        v
    }
}

/// What the runtime passed in the environment.
pub struct Invocation {
    pub command: String,
    pub container_id: String,
    pub cni_path: String,
    pub stdin: Vec<u8>,
}

/// The longest `CNI_*` value taken: a path list or a netns path, at most PATH_MAX.
const MAX_ENV_BYTES: usize = 4096;

fn require(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<String, CniError> {
    let value = env(name)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| CniError::env(format!("required environment variable {name} is missing")))?;
    if value.len() > MAX_ENV_BYTES {
        return Err(CniError::env(format!(
            "{name} is {} bytes, more than {MAX_ENV_BYTES}",
            value.len()
        )));
    }
    Ok(value)
}

/// The CNI spec's container ID pattern, `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`: it names a file
/// in the data directory, so `.`, `..` and hidden names (which the temporary files of
/// `write_atomic` use) are refused.
fn valid_container_id(id: &str) -> bool {
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
            cni_path: String::new(),
            stdin,
        };
        if inv.command == "VERSION" {
            return Ok(inv);
        }
        inv.container_id = require(env, "CNI_CONTAINERID")?;
        if !valid_container_id(&inv.container_id) {
            return Err(CniError::env(format!(
                "CNI_CONTAINERID {:?} must start with a letter or digit and hold only letters, \
                 digits, '_', '.' and '-' (the CNI spec's pattern)",
                weft_backends::model::clip(&inv.container_id)
            )));
        }
        if inv.command != "DEL" {
            require(env, "CNI_NETNS")?;
        }
        require(env, "CNI_IFNAME")?;
        inv.cni_path = require(env, "CNI_PATH")?;
        Ok(inv)
    }
}

/// Runs one command; `Ok` holds what to print on stdout (possibly nothing).
pub fn handle(inv: &Invocation) -> Result<Vec<u8>, (CniError, String)> {
    if inv.command == "VERSION" {
        let v = json!({"cniVersion": "1.0.0", "supportedVersions": SUPPORTED_VERSIONS});
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
    match inv.command.as_str() {
        "ADD" => {
            let env = SubnetEnv::load(&conf.subnet_file).map_err(fail)?;
            let d = delegate_conf(&conf, &env).map_err(fail)?;
            delegate::save(&conf.data_dir, &inv.container_id, &d).map_err(fail)?;
            delegate::run("ADD", &d, &inv.cni_path).map_err(|e| {
                let _ = delegate::remove(&conf.data_dir, &inv.container_id);
                fail(e)
            })
        }
        "DEL" => match delegate::load(&conf.data_dir, &inv.container_id).map_err(fail)? {
            // Never added, or already deleted: DEL is idempotent.
            None => Ok(Vec::new()),
            Some(d) => {
                let out = delegate::run("DEL", &d, &inv.cni_path).map_err(fail)?;
                delegate::remove(&conf.data_dir, &inv.container_id).map_err(fail)?;
                Ok(out)
            }
        },
        "CHECK" => {
            let Some(d) = delegate::load(&conf.data_dir, &inv.container_id).map_err(fail)? else {
                return Err(fail(CniError::unknown_container(format!(
                    "container {} was not added by this plugin (no {})",
                    inv.container_id,
                    delegate::scratch_path(&conf.data_dir, &inv.container_id).display()
                ))));
            };
            check(&conf, &d).map_err(fail)?;
            Ok(Vec::new())
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
            cni_path: "/nonexistent".into(),
            stdin: stdin.to_string().into_bytes(),
        };
        let (e, _) = handle(&inv("CHECK", "c1")).unwrap_err();
        assert_eq!(e.code, 3, "{}", e.msg);
        // What ADD saves before it delegates.
        let conf = PluginConf::parse(stdin.to_string().as_bytes()).unwrap();
        let env = SubnetEnv::load(&env_file).unwrap();
        delegate::save(&conf.data_dir, "c1", &delegate_conf(&conf, &env).unwrap()).unwrap();
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
        assert!(!delegate::scratch_path(&conf.data_dir, "c3").exists());
    }

    #[test]
    fn an_unsupported_version_is_refused() {
        let inv = Invocation {
            command: "ADD".into(),
            container_id: "c1".into(),
            cni_path: "/nonexistent".into(),
            stdin: br#"{"cniVersion": "9.9.9", "name": "cbr0", "type": "flannel"}"#.to_vec(),
        };
        let (e, _) = handle(&inv).unwrap_err();
        assert_eq!(e.code, 1);
    }
}
