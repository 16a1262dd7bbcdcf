//! flannel's CNI config and the delegate config built from it and subnet.env, exactly as
//! flannel's plugin builds it: `name` from the network, `type` `bridge` unless given,
//! `ipMasq` the opposite of `FLANNEL_IPMASQ` (masquerade in the bridge only when the agent
//! does not), `mtu` from `FLANNEL_MTU`, `isGateway` for bridge, and a `host-local` IPAM
//! with one range per family (this node's subnet) and a route to each pod network.

use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde_json::{json, Map, Value};

use super::CniError;

pub const DEFAULT_SUBNET_FILE: &str = "/run/flannel/subnet.env";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/flannel";

/// The plugin's own config (one entry of the conflist, as the runtime hands it over).
#[derive(Debug, Clone)]
pub struct PluginConf {
    pub cni_version: String,
    pub name: String,
    pub subnet_file: PathBuf,
    pub data_dir: PathBuf,
    /// The agent's control socket, which STATUS asks (`agentSocket`).
    pub agent_socket: PathBuf,
    pub delegate: Map<String, Value>,
    pub ipam: Map<String, Value>,
    pub runtime_config: Option<Value>,
}

fn string_field(doc: &Map<String, Value>, key: &str) -> Result<Option<String>, CniError> {
    match doc.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(CniError::config(format!(
            "`{key}` must be a string, not {other}"
        ))),
    }
}

fn object_field(doc: &Map<String, Value>, key: &str) -> Result<Map<String, Value>, CniError> {
    match doc.get(key) {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(m)) => Ok(m.clone()),
        Some(other) => Err(CniError::config(format!(
            "`{key}` must be an object, not {other}"
        ))),
    }
}

/// The largest network config read from stdin: a conflist's entry with a runtime's
/// `prevResult` and capabilities is a few KiB.
pub const MAX_STDIN_BYTES: usize = 256 << 10;

impl PluginConf {
    pub fn parse(stdin: &[u8]) -> Result<PluginConf, CniError> {
        if stdin.len() > MAX_STDIN_BYTES {
            return Err(CniError::decode(format!(
                "the network config on stdin is {} bytes, more than {MAX_STDIN_BYTES}",
                stdin.len()
            )));
        }
        let doc: Value = serde_json::from_slice(stdin).map_err(|e| {
            CniError::decode(format!("the network config on stdin is not JSON: {e}"))
        })?;
        let Value::Object(doc) = doc else {
            return Err(CniError::decode(
                "the network config on stdin must be a JSON object",
            ));
        };
        let delegate = object_field(&doc, "delegate")?;
        match delegate.get("type") {
            None | Some(Value::String(_)) => {}
            Some(_) => {
                return Err(CniError::config(
                    "'delegate' dictionary, if present, must have (string) 'type' field",
                ))
            }
        }
        for reserved in ["name", "ipam"] {
            if delegate.contains_key(reserved) {
                return Err(CniError::config(format!(
                    "'delegate' dictionary must not have '{reserved}' field, it'll be set by flannel"
                )));
            }
        }
        Ok(PluginConf {
            cni_version: string_field(&doc, "cniVersion")?.unwrap_or_default(),
            name: string_field(&doc, "name")?.unwrap_or_default(),
            subnet_file: string_field(&doc, "subnetFile")?
                .map_or_else(|| PathBuf::from(DEFAULT_SUBNET_FILE), PathBuf::from),
            data_dir: string_field(&doc, "dataDir")?
                .map_or_else(|| PathBuf::from(DEFAULT_DATA_DIR), PathBuf::from),
            agent_socket: string_field(&doc, "agentSocket")?.map_or_else(
                || PathBuf::from(super::status::DEFAULT_AGENT_SOCKET),
                PathBuf::from,
            ),
            delegate,
            ipam: object_field(&doc, "ipam")?,
            runtime_config: doc.get("runtimeConfig").filter(|v| !v.is_null()).cloned(),
        })
    }
}

/// What subnet.env says.
#[derive(Debug, Clone, PartialEq)]
pub struct SubnetEnv {
    pub networks: Vec<IpNet>,
    pub subnet: Option<IpNet>,
    pub ipv6_networks: Vec<IpNet>,
    pub ipv6_subnet: Option<IpNet>,
    pub mtu: u32,
    pub ipmasq: bool,
}

impl SubnetEnv {
    pub fn load(path: &Path) -> Result<SubnetEnv, CniError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            CniError::io(format!(
                "failed to load flannel 'subnet.env' file: {}: {e}. Check the weft pod log for this node.",
                path.display()
            ))
        })?;
        Self::parse(&text).map_err(|e| CniError::config(format!("{}: {e}", path.display())))
    }

    pub fn parse(text: &str) -> Result<SubnetEnv, SubnetEnvError> {
        if text.len() > MAX_SUBNET_ENV_BYTES {
            return Err(SubnetEnvError::TooLarge { size: text.len() });
        }
        let mut env = SubnetEnv {
            networks: vec![],
            subnet: None,
            ipv6_networks: vec![],
            ipv6_subnet: None,
            mtu: 0,
            ipmasq: false,
        };
        let nets = |k: &str, v: &str| -> Result<Vec<IpNet>, SubnetEnvError> {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(|s| {
                    s.trim()
                        .parse()
                        .map_err(|_| SubnetEnvError::bad(k, v, "a CIDR list"))
                })
                .collect()
        };
        let net = |k: &str, v: &str| -> Result<IpNet, SubnetEnvError> {
            v.trim()
                .parse()
                .map_err(|_| SubnetEnvError::bad(k, v, "a CIDR"))
        };
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            match k.trim() {
                "FLANNEL_NETWORK" => env.networks = nets(k, v)?,
                "FLANNEL_SUBNET" => env.subnet = Some(net(k, v)?),
                "FLANNEL_IPV6_NETWORK" => env.ipv6_networks = nets(k, v)?,
                "FLANNEL_IPV6_SUBNET" => env.ipv6_subnet = Some(net(k, v)?),
                "FLANNEL_MTU" => {
                    env.mtu = v
                        .trim()
                        .parse()
                        .map_err(|_| SubnetEnvError::bad(k, v, "a number"))?
                }
                "FLANNEL_IPMASQ" => {
                    env.ipmasq = v
                        .trim()
                        .parse()
                        .map_err(|_| SubnetEnvError::bad(k, v, "true or false"))?
                }
                _ => {}
            }
        }
        if env.subnet.is_none() && env.ipv6_subnet.is_none() {
            return Err(SubnetEnvError::NoSubnet);
        }
        if env.subnet.is_some() && env.networks.is_empty() {
            return Err(SubnetEnvError::SubnetWithoutNetwork);
        }
        if env.mtu == 0 {
            return Err(SubnetEnvError::NoMtu);
        }
        Ok(env)
    }
}

/// The largest subnet.env read: the agent writes about 150 bytes.
pub const MAX_SUBNET_ENV_BYTES: usize = 16 << 10;

/// What is wrong with `subnet.env`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubnetEnvError {
    #[error("{key}={:?} is not {expected}", weft_backends::model::clip(value))]
    BadValue {
        key: String,
        value: String,
        expected: &'static str,
    },
    #[error("no FLANNEL_SUBNET or FLANNEL_IPV6_SUBNET")]
    NoSubnet,
    #[error("subnet.env is {size} bytes, more than {MAX_SUBNET_ENV_BYTES}")]
    TooLarge { size: usize },
    #[error("FLANNEL_SUBNET without FLANNEL_NETWORK")]
    SubnetWithoutNetwork,
    #[error("no FLANNEL_MTU")]
    NoMtu,
}

impl SubnetEnvError {
    fn bad(key: &str, value: &str, expected: &'static str) -> Self {
        SubnetEnvError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected,
        }
    }
}

/// The delegate's config for ADD.
pub fn delegate_conf(conf: &PluginConf, env: &SubnetEnv) -> Result<Value, CniError> {
    let mut d = conf.delegate.clone();
    d.insert("name".into(), json!(conf.name));
    d.entry("type").or_insert_with(|| json!("bridge"));
    d.entry("ipMasq").or_insert_with(|| json!(!env.ipmasq));
    d.entry("mtu").or_insert_with(|| json!(env.mtu));
    if d.get("type") == Some(&json!("bridge")) {
        d.entry("isGateway").or_insert(json!(true));
    }
    if !conf.cni_version.is_empty() {
        d.insert("cniVersion".into(), json!(conf.cni_version));
    }
    if let Some(rc) = &conf.runtime_config {
        d.insert("runtimeConfig".into(), rc.clone());
    }
    let mut ipam = conf.ipam.clone();
    ipam.entry("type").or_insert_with(|| json!("host-local"));
    let ranges: Vec<Value> = [env.subnet, env.ipv6_subnet]
        .into_iter()
        .flatten()
        .map(|s| json!([{"subnet": s.trunc().to_string()}]))
        .collect();
    ipam.insert("ranges".into(), json!(ranges));
    let mut routes = match ipam.get("routes") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(r)) => r.clone(),
        Some(other) => {
            return Err(CniError::config(format!(
                "`ipam.routes` must be a list, not {other}"
            )))
        }
    };
    for net in env.networks.iter().chain(&env.ipv6_networks) {
        routes.push(json!({"dst": net.to_string()}));
    }
    ipam.insert("routes".into(), json!(routes));
    d.insert("ipam".into(), Value::Object(ipam));
    Ok(Value::Object(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENV: &str = "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.3.1/24\nFLANNEL_MTU=1420\nFLANNEL_IPMASQ=true\n";

    #[test]
    fn builds_flannels_bridge_and_host_local_delegate() {
        let conf = PluginConf::parse(
            br#"{"cniVersion": "1.0.0", "name": "cbr0", "type": "flannel",
                 "delegate": {"hairpinMode": true, "isDefaultGateway": true}}"#,
        )
        .unwrap();
        let env = SubnetEnv::parse(ENV).unwrap();
        assert_eq!(
            delegate_conf(&conf, &env).unwrap(),
            json!({
                "hairpinMode": true, "isDefaultGateway": true,
                "name": "cbr0", "type": "bridge", "ipMasq": false, "mtu": 1420,
                "isGateway": true, "cniVersion": "1.0.0",
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "10.244.3.0/24"}]],
                    "routes": [{"dst": "10.244.0.0/16"}]
                }
            })
        );
    }

    #[test]
    fn given_delegate_fields_win_and_dual_stack_gets_two_ranges() {
        let conf = PluginConf::parse(
            br#"{"name": "n", "delegate": {"type": "ptp", "mtu": 1300, "ipMasq": true},
                 "ipam": {"routes": [{"dst": "192.0.2.0/24"}]}}"#,
        )
        .unwrap();
        let env = SubnetEnv::parse(&format!(
            "{ENV}FLANNEL_IPV6_NETWORK=fd00:10:244::/56\nFLANNEL_IPV6_SUBNET=fd00:10:244:3::1/64\n"
        ))
        .unwrap();
        let d = delegate_conf(&conf, &env).unwrap();
        assert_eq!(d["type"], "ptp");
        assert_eq!(d["mtu"], 1300);
        assert_eq!(d["ipMasq"], true);
        assert!(d.get("isGateway").is_none());
        assert_eq!(
            d["ipam"]["ranges"],
            json!([[{"subnet": "10.244.3.0/24"}], [{"subnet": "fd00:10:244:3::/64"}]])
        );
        assert_eq!(
            d["ipam"]["routes"],
            json!([{"dst": "192.0.2.0/24"}, {"dst": "10.244.0.0/16"}, {"dst": "fd00:10:244::/56"}])
        );
    }

    #[test]
    fn bad_configs_are_named() {
        for (input, expect) in [
            (
                &br#"{"delegate": {"name": "x"}}"#[..],
                "must not have 'name'",
            ),
            (br#"{"delegate": {"ipam": {}}}"#, "must not have 'ipam'"),
            (br#"{"delegate": {"type": 3}}"#, "(string) 'type'"),
            (br#"{"delegate": []}"#, "`delegate` must be an object"),
            (br#"{"name": "#, "not JSON"),
        ] {
            let e = PluginConf::parse(input).unwrap_err();
            assert!(e.msg.contains(expect), "{}", e.msg);
        }
        for (text, expect) in [
            (
                "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_MTU=1420\n",
                "no FLANNEL_SUBNET",
            ),
            (
                "FLANNEL_SUBNET=10.244.3.1/24\nFLANNEL_NETWORK=x\nFLANNEL_MTU=1\n",
                "FLANNEL_NETWORK=\"x\"",
            ),
            (
                "FLANNEL_SUBNET=10.244.3.1/24\nFLANNEL_NETWORK=10.244.0.0/16\n",
                "no FLANNEL_MTU",
            ),
        ] {
            let e = SubnetEnv::parse(text).unwrap_err().to_string();
            assert!(e.contains(expect), "{e}");
        }
    }
}
