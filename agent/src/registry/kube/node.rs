//! The part of a Node weft reads: its metadata (name, labels, annotations) and pod CIDRs.
//! Nodes are decoded into this type directly, so a Node's status (conditions, addresses,
//! the image list that grows to hundreds of entries) is never held in memory; and each
//! event is turned into a `Lease` at once.

use std::borrow::Cow;
use std::collections::BTreeMap;

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::ClusterResourceScope;
use serde::Deserialize;
use tracing::warn;
use weft_backends::model::{annotations, Lease};

/// weft's endpoint candidates: `{"internal": "10.0.1.5", "external": "203.0.113.5"}`.
pub const ENDPOINTS_ANNOTATION: &str = "weft.dev/endpoints";
/// A node's zone, overriding the label below.
pub const ZONE_ANNOTATION: &str = "weft.dev/zone";
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// A Node whose data weft cannot use; it names the node and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadNode {
    #[error(
        "node {node}: {field} {:?} is not a CIDR",
        weft_backends::model::clip(value)
    )]
    PodCidr {
        node: String,
        field: &'static str,
        value: String,
    },
    #[error(transparent)]
    Annotation(#[from] annotations::BadAnnotation),
}

#[derive(Debug, Clone, Deserialize)]
pub struct SlimNode {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: SlimSpec,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct SlimSpec {
    #[serde(default, rename = "podCIDR")]
    pub pod_cidr: Option<String>,
    #[serde(default, rename = "podCIDRs")]
    pub pod_cidrs: Option<Vec<String>>,
}

impl kube::Resource for SlimNode {
    type DynamicType = ();
    type Scope = ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Node".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "nodes".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl SlimNode {
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    pub fn annotations(&self) -> Cow<'_, BTreeMap<String, String>> {
        match &self.metadata.annotations {
            Some(a) => Cow::Borrowed(a),
            None => Cow::Owned(BTreeMap::new()),
        }
    }

    /// `spec.podCIDRs`, falling back to `spec.podCIDR`; an error names the node and the
    /// value that is not a CIDR.
    pub fn pod_cidrs(&self) -> Result<Vec<IpNet>, BadNode> {
        let (field, values): (&str, Vec<&String>) = match &self.spec.pod_cidrs {
            Some(list) if !list.is_empty() => ("spec.podCIDRs", list.iter().collect()),
            _ => ("spec.podCIDR", self.spec.pod_cidr.iter().collect()),
        };
        values
            .into_iter()
            .map(|v| {
                v.parse::<IpNet>()
                    .map(|n| n.trunc())
                    .map_err(|_| BadNode::PodCidr {
                        node: self.name().to_string(),
                        field,
                        value: v.clone(),
                    })
            })
            .collect()
    }

    /// The node's lease as a peer sees it: `Ok(None)` for a node weft/flannel does not
    /// manage (no `kube-subnet-manager: "true"`), an error naming the node and the field
    /// that is bad.
    pub fn lease(&self, prefix: &str) -> Result<Option<Lease>, BadNode> {
        let annotations = self.annotations();
        if annotations
            .get(&format!("{prefix}/kube-subnet-manager"))
            .map(String::as_str)
            != Some("true")
        {
            return Ok(None);
        }
        let cidrs = self.pod_cidrs()?;
        let Some(mut lease) = annotations::read(prefix, self.name(), &cidrs, &annotations)? else {
            return Ok(None);
        };
        lease.reach.zone = self.zone();
        lease.reach.internal_ip = self.internal_ip(prefix, &annotations);
        lease.reach.gateway = weft_backends::model::annotations::gateway(&annotations);
        // Of two Nodes claiming one key or MAC, the one created first keeps it.
        lease.created = self
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second());
        Ok(Some(lease))
    }

    /// The node's zone: `weft.dev/zone`, else the `topology.kubernetes.io/zone` label.
    pub fn zone(&self) -> Option<String> {
        let annotations = self.metadata.annotations.as_ref();
        let labels = self.metadata.labels.as_ref();
        annotations
            .and_then(|a| a.get(ZONE_ANNOTATION))
            .or_else(|| labels.and_then(|l| l.get(ZONE_LABEL)))
            .filter(|z| !z.is_empty())
            .cloned()
    }

    /// The node's internal address: `internal` of `weft.dev/endpoints`; else, when an
    /// operator's `public-ip-overwrite` replaces the published address, that published
    /// `public-ip` (the node's own). A bad value is logged, naming the node, and ignored:
    /// the node stays reachable on its published address.
    fn internal_ip(&self, prefix: &str, annotations: &BTreeMap<String, String>) -> Option<IpAddr> {
        if let Some(text) = annotations.get(ENDPOINTS_ANNOTATION) {
            let parsed = serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| v.get("internal")?.as_str()?.parse::<IpAddr>().ok());
            match parsed {
                Some(ip) => return Some(ip),
                None => {
                    warn!(node = %self.name(), annotation = ENDPOINTS_ANNOTATION, value = ?text, "expected {{\"internal\": \"<address>\", …}}; ignored")
                }
            }
        }
        annotations
            .get(&format!("{prefix}/public-ip-overwrite"))
            .and_then(|_| annotations.get(&format!("{prefix}/public-ip")))
            .and_then(|ip| ip.parse().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// What a `fmt` subscriber writes, kept in memory.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_newline_in_an_annotation_cannot_forge_a_log_line() {
        let prefix = weft_backends::model::annotations::DEFAULT_PREFIX;
        let node: SlimNode = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "n2",
                "annotations": {
                    format!("{prefix}/kube-subnet-manager"): "true",
                    format!("{prefix}/backend-type"): "wireguard",
                    format!("{prefix}/public-ip"): "198.51.100.2",
                    ENDPOINTS_ANNOTATION: "junk\n2026-11-22T00:00:00Z  WARN weft: FORGED",
                }
            },
            "spec": {"podCIDR": "10.244.2.0/24"}
        }))
        .unwrap();
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            assert!(
                node.lease(prefix).unwrap().is_some(),
                "the node stays a peer"
            );
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains("FORGED"),
            "the warning names the value: {text}"
        );
        assert_eq!(text.lines().count(), 1, "one warning, on one line: {text}");
        assert!(
            !text.lines().any(|l| l.starts_with("2026-11-22T00:00:00Z")),
            "{text}"
        );
    }
}
