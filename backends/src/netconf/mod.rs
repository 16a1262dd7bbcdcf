//! flannel's `net-conf.json`, parsed once into typed values (docs/architecture.md).
//!
//! `parse` reports every problem it finds, each naming the key and the bad value and saying
//! what is valid; `NetConf::to_json` prints the effective config with every default filled
//! in. Pure: no I/O.

mod backend;
mod error;
mod fields;
mod ipsec;
mod network;

use std::fmt;
use std::str::FromStr;

use serde_json::{json, Map, Value};

pub use self::backend::{
    Backend, BackendKind, EspAlgorithm, Implementation, IpipConf, IpsecConf, IpsecPsk,
    UnknownBackend, VxlanConf, WireguardConf, WireguardMode, POST_QUANTUM_DEFAULT,
};
pub use self::error::{ConfigError, ConfigErrors};
use self::fields::Fields;
pub use crate::model::PodNetwork;

const TOP_KEYS: &[&str] = &[
    "Network",
    "IPv6Network",
    "EnableIPv4",
    "EnableIPv6",
    "SubnetLen",
    "SubnetMin",
    "SubnetMax",
    "IPv6SubnetLen",
    "IPv6SubnetMin",
    "IPv6SubnetMax",
    "EnableNFTables",
    "Backend",
];

/// The effective network configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `Some` when `EnableIPv4` (default true).
    pub ipv4: Option<PodNetwork>,
    /// `Some` when `EnableIPv6`.
    pub ipv6: Option<PodNetwork>,
    pub enable_nftables: bool,
    pub backend: Backend,
}

impl NetConf {
    /// The pod network of the family of `addr`'s kind (`true` = IPv6).
    pub fn network(&self, v6: bool) -> Option<&PodNetwork> {
        if v6 {
            self.ipv6.as_ref()
        } else {
            self.ipv4.as_ref()
        }
    }

    /// The effective config in net-conf.json's own shape, defaults filled in. Secrets
    /// (`PSK`) are shown as a placeholder, never in the clear.
    pub fn to_json(&self) -> Value {
        let mut top = Map::new();
        top.insert("EnableIPv4".into(), json!(self.ipv4.is_some()));
        top.insert("EnableIPv6".into(), json!(self.ipv6.is_some()));
        if let Some(n) = &self.ipv4 {
            top.insert("Network".into(), json!(n.network.to_string()));
            top.insert("SubnetLen".into(), json!(n.subnet_len));
            top.insert("SubnetMin".into(), json!(n.subnet_min.to_string()));
            top.insert("SubnetMax".into(), json!(n.subnet_max.to_string()));
        }
        if let Some(n) = &self.ipv6 {
            top.insert("IPv6Network".into(), json!(n.network.to_string()));
            top.insert("IPv6SubnetLen".into(), json!(n.subnet_len));
            top.insert("IPv6SubnetMin".into(), json!(n.subnet_min.to_string()));
            top.insert("IPv6SubnetMax".into(), json!(n.subnet_max.to_string()));
        }
        top.insert("EnableNFTables".into(), json!(self.enable_nftables));
        top.insert("Backend".into(), self.backend.to_json());
        Value::Object(top)
    }
}

impl FromStr for NetConf {
    type Err = ConfigErrors;
    fn from_str(s: &str) -> Result<Self, ConfigErrors> {
        parse(s)
    }
}

impl fmt::Display for NetConf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = serde_json::to_string_pretty(&self.to_json()).map_err(|_| fmt::Error)?;
        f.write_str(&text)
    }
}

/// The largest net-conf.json read: a full one is under 1 KiB.
pub const MAX_CONF_BYTES: usize = 64 << 10;

/// Parses and validates net-conf.json text, returning every problem at once.
pub fn parse(text: &str) -> Result<NetConf, ConfigErrors> {
    if text.len() > MAX_CONF_BYTES {
        return Err(ConfigErrors(vec![ConfigError::invalid(
            "(top level)",
            format!("{} bytes", text.len()),
            format!("net-conf.json holds at most {MAX_CONF_BYTES} bytes"),
        )]));
    }
    let value: Value = serde_json::from_str(text).map_err(|e| {
        ConfigErrors(vec![ConfigError::Json {
            line: e.line(),
            column: e.column(),
            message: json_message(&e),
        }])
    })?;
    let Value::Object(map) = &value else {
        return Err(ConfigErrors(vec![ConfigError::invalid(
            "(top level)",
            short(&value),
            "net-conf.json must be a JSON object such as {\"Network\": \"10.244.0.0/16\", \"Backend\": {\"Type\": \"wireguard\"}}",
        )]));
    };
    let mut errors = Vec::new();
    let mut top = Fields::new("", map, TOP_KEYS, &mut errors);
    let enable_v4 = top.bool("EnableIPv4").unwrap_or(true);
    let enable_v6 = top.bool("EnableIPv6").unwrap_or(false);
    let enable_nftables = top.bool("EnableNFTables").unwrap_or(false);
    let ipv4 = network::family(&mut top, network::V4, enable_v4);
    let ipv6 = network::family(&mut top, network::V6, enable_v6);
    if !enable_v4 && !enable_v6 {
        top.push(ConfigError::invalid(
            "EnableIPv4",
            false,
            "with EnableIPv6 also false no family is left; enable at least one",
        ));
    }
    let backend = backend::parse(top.get("Backend"), enable_v6, &mut errors);
    for (kind, name) in [(BackendKind::Ipip, "ipip"), (BackendKind::Ipsec, "ipsec")] {
        if backend.as_ref().map(Backend::kind) == Some(kind) && (enable_v6 || !enable_v4) {
            errors.push(ConfigError::invalid(
                "Backend.Type",
                format!("{name:?}"),
                format!("{name} carries IPv4 only (as flannel's): with EnableIPv6, or EnableIPv4 false, use wireguard, vxlan or host-gw"),
            ));
        }
    }
    match (errors.is_empty(), backend) {
        (true, Some(backend)) => Ok(NetConf {
            ipv4,
            ipv6,
            enable_nftables,
            backend,
        }),
        _ => Err(ConfigErrors(errors)),
    }
}

/// serde_json's message without its trailing " at line L column C" (we say that ourselves).
fn json_message(e: &serde_json::Error) -> String {
    let full = crate::model::json_error(e);
    match full.rfind(" at line ") {
        Some(i) => full[..i].to_string(),
        None => full,
    }
}

/// A JSON value for an error message, cut short if long.
pub(crate) fn short(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() > 60 {
        format!("{}…", text.chars().take(60).collect::<String>())
    } else {
        text
    }
}

#[cfg(test)]
mod tests;
