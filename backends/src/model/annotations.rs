//! flannel's Node annotations (docs/architecture.md): what a node publishes, and reading a peer's.
//! The kube registry builds on these; the shapes are checked against golden fixtures of
//! what flannel itself writes (`tests/fixtures/flannel/`).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde_json::Value;

use super::{Lease, LeaseAttrs};

pub const DEFAULT_PREFIX: &str = "flannel.alpha.coreos.com";
/// weft's announced next key (`NextKey` as JSON), beside flannel's unchanged backend-data.
pub const NEXT_KEY: &str = "weft.dev/next-key";
/// weft's proof that the node holds its key (`weft_crypto::proof`, base64), for its name.
pub const KEY_PROOF: &str = "weft.dev/key-proof";
/// weft's ML-KEM-768 encapsulation key (base64), for post-quantum pair secrets.
pub const ML_KEM_KEY: &str = "weft.dev/ml-kem-key";
/// The backends a node still speaks during a backend change, with their data
/// (`Lease::also`): `{"vxlan":{"VNI":1,"VtepMAC":"…"}}`.
pub const ALSO_BACKENDS: &str = "weft.dev/also-backends";
/// A gateway of its zone: `"true"` (set by an operator, or by an agent run with
/// `--gateway`).
pub const GATEWAY: &str = "weft.dev/gateway";
/// The port of a gateway's relay, when not `DEFAULT_RELAY_PORT`.
pub const RELAY_PORT: &str = "weft.dev/relay-port";

/// The relay port of a node whose annotations make it a gateway; `None` otherwise (a
/// `weft.dev/gateway` other than `"true"`, or a relay port that is no port, is no
/// gateway).
pub fn gateway(annotations: &BTreeMap<String, String>) -> Option<u16> {
    if annotations.get(GATEWAY).map(|v| v.trim()) != Some("true") {
        return None;
    }
    match annotations.get(RELAY_PORT) {
        None => Some(super::DEFAULT_RELAY_PORT),
        Some(p) => p.trim().parse::<u16>().ok().filter(|p| *p != 0),
    }
}

/// The annotations a node running `attrs` publishes under `prefix`. Values are strings;
/// backend data is its JSON text (`null` for host-gw, as flannel writes it).
pub fn publish(prefix: &str, attrs: &LeaseAttrs) -> BTreeMap<String, String> {
    let key = |name: &str| format!("{prefix}/{name}");
    let json = |v: &Option<Value>| v.as_ref().unwrap_or(&Value::Null).to_string();
    let mut out = BTreeMap::new();
    out.insert(key("kube-subnet-manager"), "true".into());
    out.insert(key("backend-type"), attrs.backend_type.clone());
    if let Some(ip) = attrs.public_ip {
        out.insert(key("public-ip"), ip.to_string());
        out.insert(key("backend-data"), json(&attrs.backend_data));
    }
    if let Some(ip) = attrs.public_ipv6 {
        out.insert(key("public-ipv6"), ip.to_string());
        out.insert(key("backend-v6-data"), json(&attrs.backend_v6_data));
    }
    out
}

/// The largest annotation value weft reads (bytes). flannel's largest, backend-data, is
/// under 100; a larger one is refused before it is parsed, logged or kept.
pub const MAX_VALUE_BYTES: usize = 4096;

/// A Node annotation weft cannot read: names the node, the annotation and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadAnnotation {
    #[error("node {node}: annotation {annotation} is not JSON: {detail}")]
    NotJson {
        node: String,
        annotation: String,
        detail: String,
    },
    #[error(
        "node {node}: annotation {annotation} {:?} is not an {family} address",
        super::clip(value)
    )]
    NotAnAddress {
        node: String,
        annotation: String,
        value: String,
        family: &'static str,
    },
    #[error("node {node}: annotation {annotation} is {size} bytes, more than {MAX_VALUE_BYTES}")]
    TooLarge {
        node: String,
        annotation: String,
        size: usize,
    },
}

/// A peer's lease from its Node: `Ok(None)` if it is not managed by flannel/weft (no
/// `kube-subnet-manager: "true"`); an error naming the node and the annotation otherwise.
/// `public-ip-overwrite` wins over `public-ip`.
pub fn read(
    prefix: &str,
    node: &str,
    pod_cidrs: &[IpNet],
    annotations: &BTreeMap<String, String>,
) -> Result<Option<Lease>, BadAnnotation> {
    let get = |name: &str| annotations.get(&format!("{prefix}/{name}"));
    if get("kube-subnet-manager").map(String::as_str) != Some("true") {
        return Ok(None);
    }
    let own = format!("{prefix}/");
    if let Some((name, value)) = annotations
        .iter()
        .filter(|(k, _)| k.starts_with(&own) || k.starts_with("weft.dev/"))
        .find(|(_, v)| v.len() > MAX_VALUE_BYTES)
    {
        return Err(BadAnnotation::TooLarge {
            node: node.to_string(),
            annotation: name.clone(),
            size: value.len(),
        });
    }
    let parse_json = |name: &str| -> Result<Option<Value>, BadAnnotation> {
        match get(name) {
            None => Ok(None),
            Some(text) => serde_json::from_str::<Value>(text)
                .map(|v| (!v.is_null()).then_some(v))
                .map_err(|e| BadAnnotation::NotJson {
                    node: node.to_string(),
                    annotation: format!("{prefix}/{name}"),
                    detail: super::json_error(&e),
                }),
        }
    };
    let ip4 = |name: &str| address::<Ipv4Addr>(prefix, node, name, get(name), "IPv4");
    let ip6 = |name: &str| address::<Ipv6Addr>(prefix, node, name, get(name), "IPv6");
    let public_ip = match ip4("public-ip-overwrite")? {
        Some(ip) => Some(ip),
        None => ip4("public-ip")?,
    };
    let public_ipv6 = match ip6("public-ipv6-overwrite")? {
        Some(ip) => Some(ip),
        None => ip6("public-ipv6")?,
    };
    let attrs = LeaseAttrs {
        public_ip,
        public_ipv6,
        backend_type: get("backend-type").cloned().unwrap_or_default(),
        backend_data: parse_json("backend-data")?,
        backend_v6_data: parse_json("backend-v6-data")?,
        // An announced rotation that does not parse is ignored: the node keeps being
        // reached with its current key.
        next_key: annotations
            .get(NEXT_KEY)
            .and_then(|t| serde_json::from_str(t).ok()),
        // A proof that does not decode is no proof: the node is only not proven.
        key_proof: annotations.get(KEY_PROOF).cloned(),
        // Decoded by the planner: a bad one leaves only this node's pairs classical.
        ml_kem_key: annotations.get(ML_KEM_KEY).cloned(),
        zone: None,
        internal_ip: None,
        gateway: None,
        // What does not parse as an object of backend data is no other backend: the node
        // is reached on its published one alone.
        also: annotations
            .get(ALSO_BACKENDS)
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or_default(),
    };
    let v4 = pod_cidrs
        .iter()
        .find(|n| matches!(n, IpNet::V4(_)))
        .copied();
    let v6 = pod_cidrs
        .iter()
        .find(|n| matches!(n, IpNet::V6(_)))
        .copied();
    Ok(Some(attrs.into_lease(node.to_string(), v4, v6)))
}

/// An address annotation's value, or an error naming the node and the annotation.
fn address<T: std::str::FromStr>(
    prefix: &str,
    node: &str,
    name: &str,
    value: Option<&String>,
    family: &'static str,
) -> Result<Option<T>, BadAnnotation> {
    value
        .map(|t| {
            t.parse().map_err(|_| BadAnnotation::NotAnAddress {
                node: node.to_string(),
                annotation: format!("{prefix}/{name}"),
                value: t.clone(),
                family,
            })
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_annotation_is_refused_by_size_without_echoing_it() {
        let mut annotations = BTreeMap::new();
        annotations.insert(
            format!("{DEFAULT_PREFIX}/kube-subnet-manager"),
            "true".into(),
        );
        annotations.insert(format!("{DEFAULT_PREFIX}/backend-type"), "wireguard".into());
        annotations.insert(format!("{DEFAULT_PREFIX}/public-ip"), "198.51.100.2".into());
        let big = format!(r#"{{"PublicKey":"{}"}}"#, "A".repeat(1 << 20));
        annotations.insert(format!("{DEFAULT_PREFIX}/backend-data"), big.clone());
        let err = read(DEFAULT_PREFIX, "n2", &[], &annotations).unwrap_err();
        let text = err.to_string();
        assert_eq!(
            text,
            format!(
                "node n2: annotation {DEFAULT_PREFIX}/backend-data is {} bytes, more than 4096",
                big.len()
            )
        );
        // weft's own annotations are held to the same bound; others' are not read at all.
        annotations.insert(
            format!("{DEFAULT_PREFIX}/backend-data"),
            r#"{"PublicKey":"x"}"#.into(),
        );
        annotations.insert(NEXT_KEY.into(), "x".repeat(5000));
        assert!(matches!(
            read(DEFAULT_PREFIX, "n2", &[], &annotations),
            Err(BadAnnotation::TooLarge { .. })
        ));
        annotations.remove(NEXT_KEY);
        annotations.insert("example.com/notes".into(), "x".repeat(5000));
        assert!(read(DEFAULT_PREFIX, "n2", &[], &annotations).is_ok());
    }
}
