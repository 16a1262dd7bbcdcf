//! A node's lease (its subnets and published attributes) and the view of all of them.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::SystemTime;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One node's lease as the registry reports it. Peer-published fields are kept raw
/// (`backend_type`, `backend_data`): the planner decodes them and leaves out a peer whose
/// data is bad, with a reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    /// Node name (kube), or the subnet key (`10.244.3.0-24`) in etcd mode.
    pub node: String,
    pub subnet: Option<IpNet>,
    pub subnet_v6: Option<IpNet>,
    pub public_ip: Option<Ipv4Addr>,
    pub public_ipv6: Option<Ipv6Addr>,
    pub backend_type: String,
    pub backend_data: Option<Value>,
    pub backend_v6_data: Option<Value>,
    /// When the registry will drop the lease unless renewed; `None` = no expiry.
    pub expires: Option<SystemTime>,
    /// How the node prefers to be reached, beyond its published address.
    pub reach: Reach,
    /// A key rotation the node has announced: peers stage this key and switch to it at
    /// `switch_at_ms` (docs/key-rotation.md).
    pub next_key: Option<NextKey>,
    /// When the registry created the entry, as an order (etcd: its create revision;
    /// Kubernetes: the Node's creationTimestamp in seconds): of two entries that claim one
    /// key, VTEP MAC or subnet, the older keeps it. `None` (not known) counts as newest.
    pub created: Option<i64>,
    /// Its proof of holding the private key of the key it publishes, for its own name
    /// (`weft_crypto::proof`; etcd: the `WeftKeyProof` field, Kubernetes: the
    /// `weft.dev/key-proof` annotation). Of two entries claiming one key, a proven one
    /// keeps it over one that is not, whichever is older.
    pub key_proof: Option<[u8; weft_crypto::proof::PROOF_LEN]>,
    /// Its ML-KEM-768 encapsulation key as published (base64; etcd: the `WeftMlKemKey`
    /// field, Kubernetes: the `weft.dev/ml-kem-key` annotation): peers run post-quantum
    /// rounds to it. Raw, as `backend_data`: the planner decodes it, and one that does not
    /// decode leaves the pair classical, never down.
    pub ml_kem_key: Option<String>,
    /// The backends it still speaks besides `backend_type` while the cluster changes
    /// backend, each with its `backend-data` (etcd: the `WeftAlso` field, Kubernetes: the
    /// `weft.dev/also-backends` annotation): a peer on one of them keeps its pair there
    /// until it moves too (`plan::mixed`).
    pub also: BTreeMap<String, Value>,
}

/// An announced key rotation: weft's addition to a lease (etcd: the `WeftNextKey` field,
/// which flannel ignores; Kubernetes: the `weft.dev/next-key` annotation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextKey {
    #[serde(rename = "PublicKey")]
    pub public_key: String,
    /// When every node switches to it: milliseconds since the Unix epoch.
    #[serde(rename = "SwitchAt")]
    pub switch_at_ms: u64,
    /// The key's generation (the node's first key is 1).
    #[serde(rename = "Generation")]
    pub generation: u64,
}

impl NextKey {
    pub fn switch_at(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(self.switch_at_ms)
    }
}

/// A node's zone and its internal address (weft's additions, docs/architecture.md: `weft.dev/…`
/// annotations; the kube registry reads them). `public_ip` stays the address nodes in other
/// zones use (an operator's `public-ip-overwrite` included); a peer in the same zone uses
/// `internal_ip` when there is one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reach {
    /// `topology.kubernetes.io/zone`, or the `weft.dev/zone` annotation; etcd: `--zone`
    /// (the `WeftZone` field).
    pub zone: Option<String>,
    pub internal_ip: Option<IpAddr>,
    /// A gateway of its zone (`--gateway`, the `weft.dev/gateway: "true"` annotation):
    /// the UDP port its relay listens on, at its published address (and at its internal
    /// one, for nodes of its zone).
    pub gateway: Option<u16>,
}

/// The relay's UDP port unless a gateway publishes another.
pub const DEFAULT_RELAY_PORT: u16 = 51824;

impl Lease {
    pub fn subnets(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.subnet.iter().chain(self.subnet_v6.iter()).copied()
    }
}

/// flannel's lease attributes, exactly as stored in etcd under `<prefix>/subnets/<key>`:
/// `{"PublicIP":"…","PublicIPv6":null,"BackendType":"wireguard","BackendData":{…}}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeaseAttrs {
    #[serde(rename = "PublicIP", default)]
    pub public_ip: Option<Ipv4Addr>,
    #[serde(rename = "PublicIPv6", default)]
    pub public_ipv6: Option<Ipv6Addr>,
    #[serde(rename = "BackendType", default)]
    pub backend_type: String,
    #[serde(
        rename = "BackendData",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub backend_data: Option<Value>,
    #[serde(
        rename = "BackendV6Data",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub backend_v6_data: Option<Value>,
    /// weft's own field, present only while a key rotation is announced.
    #[serde(
        rename = "WeftNextKey",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub next_key: Option<NextKey>,
    /// weft's own field: the node's key proof (base64), for its lease key as name.
    #[serde(
        rename = "WeftKeyProof",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub key_proof: Option<String>,
    /// weft's own field: the node's ML-KEM-768 encapsulation key (base64).
    #[serde(
        rename = "WeftMlKemKey",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub ml_kem_key: Option<String>,
    /// weft's own fields (etcd; the kube registry has labels and annotations for them):
    /// the node's zone, its internal address when it publishes another, and the port of
    /// its relay when it is a gateway.
    #[serde(rename = "WeftZone", default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(
        rename = "WeftInternalIP",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub internal_ip: Option<IpAddr>,
    #[serde(
        rename = "WeftGateway",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub gateway: Option<u16>,
    /// weft's own field: the backends the node still speaks during a backend change, each
    /// with its backend data (`Lease::also`).
    #[serde(
        rename = "WeftAlso",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub also: BTreeMap<String, Value>,
}

impl LeaseAttrs {
    /// The lease for `node` holding `subnet` with these attributes. flannel writes
    /// `0.0.0.0` for "no address"; that reads as none.
    pub fn into_lease(
        self,
        node: String,
        subnet: Option<IpNet>,
        subnet_v6: Option<IpNet>,
    ) -> Lease {
        Lease {
            node,
            subnet,
            subnet_v6,
            public_ip: self.public_ip.filter(|ip| !ip.is_unspecified()),
            public_ipv6: self.public_ipv6.filter(|ip| !ip.is_unspecified()),
            backend_type: self.backend_type,
            backend_data: self.backend_data.filter(|v| !v.is_null()),
            backend_v6_data: self.backend_v6_data.filter(|v| !v.is_null()),
            expires: None,
            reach: Reach {
                zone: self.zone.filter(|z| !z.is_empty()),
                internal_ip: self.internal_ip,
                gateway: self.gateway.filter(|p| *p != 0),
            },
            next_key: self.next_key,
            created: None,
            key_proof: self
                .key_proof
                .as_deref()
                .and_then(weft_crypto::proof::from_text),
            ml_kem_key: self.ml_kem_key,
            also: self.also,
        }
    }

    pub fn from_lease(lease: &Lease) -> Self {
        LeaseAttrs {
            public_ip: lease.public_ip,
            public_ipv6: lease.public_ipv6,
            backend_type: lease.backend_type.clone(),
            backend_data: lease.backend_data.clone(),
            backend_v6_data: lease.backend_v6_data.clone(),
            next_key: lease.next_key.clone(),
            key_proof: lease.key_proof.as_ref().map(weft_crypto::proof::to_text),
            ml_kem_key: lease.ml_kem_key.clone(),
            zone: lease.reach.zone.clone(),
            internal_ip: lease.reach.internal_ip,
            gateway: lease.reach.gateway,
            also: lease.also.clone(),
        }
    }
}

/// Every node's lease, ours included, keyed by node name. Each lease is shared: a view
/// made from another by a registry event copies the map's pointers, not the leases, and
/// `diff` passes over the leases the two views share without comparing them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterView {
    /// Keyed by shared names: a registry event's copy of the view (and its drop) bumps
    /// counts, where owned names cost an allocation and a free per node per event.
    pub leases: BTreeMap<Arc<str>, Arc<Lease>>,
}

/// How one node's lease differs between two views.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewChange {
    Added(String),
    Changed(String),
    Removed(String),
}

impl fmt::Display for ViewChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ViewChange::Added(n) => write!(f, "node {n} joined"),
            ViewChange::Changed(n) => write!(f, "node {n} changed"),
            ViewChange::Removed(n) => write!(f, "node {n} left"),
        }
    }
}

impl ClusterView {
    pub fn insert(&mut self, lease: Lease) -> Option<Arc<Lease>> {
        self.leases
            .insert(Arc::from(lease.node.as_str()), Arc::new(lease))
    }

    pub fn remove(&mut self, node: &str) -> Option<Arc<Lease>> {
        self.leases.remove(node)
    }

    pub fn get(&self, node: &str) -> Option<&Lease> {
        self.leases.get(node).map(|l| &**l)
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// What changed from `self` to `newer`: joined and changed nodes in name order, then
    /// the nodes that left. One merge of the two sorted maps; a lease the two views share
    /// is not compared.
    pub fn diff(&self, newer: &ClusterView) -> Vec<ViewChange> {
        use super::sorted::{walk, Side};
        let mut changes = Vec::new();
        let mut removed = Vec::new();
        walk(&self.leases, &newer.leases, |side| match side {
            Side::Gone(name, _) => removed.push(ViewChange::Removed(name.to_string())),
            Side::New(name, _) => changes.push(ViewChange::Added(name.to_string())),
            Side::Both(name, was, is) => {
                if !Arc::ptr_eq(was, is) && was != is {
                    changes.push(ViewChange::Changed(name.to_string()));
                }
            }
        });
        changes.extend(removed);
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flannel_etcd_value_round_trips() {
        let text = r#"{"PublicIP":"198.51.100.3","PublicIPv6":null,"BackendType":"wireguard","BackendData":{"PublicKey":"hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=","Port":51820}}"#;
        let attrs: LeaseAttrs = serde_json::from_str(text).unwrap();
        assert_eq!(attrs.public_ip, Some(Ipv4Addr::new(198, 51, 100, 3)));
        assert_eq!(serde_json::to_string(&attrs).unwrap(), text);
    }

    #[test]
    fn diff_names_each_change() {
        let lease = |node: &str, ip: u8| Lease {
            node: node.into(),
            subnet: None,
            subnet_v6: None,
            public_ip: Some(Ipv4Addr::new(198, 51, 100, ip)),
            public_ipv6: None,
            backend_type: "wireguard".into(),
            backend_data: None,
            backend_v6_data: None,
            expires: None,
            reach: Default::default(),
            next_key: None,
            created: None,
            key_proof: None,
            ml_kem_key: None,
            also: Default::default(),
        };
        let mut old = ClusterView::default();
        old.insert(lease("a", 1));
        old.insert(lease("b", 2));
        let mut new = old.clone();
        new.remove("a");
        new.insert(lease("b", 9));
        new.insert(lease("c", 3));
        assert_eq!(
            old.diff(&new),
            vec![
                ViewChange::Changed("b".into()),
                ViewChange::Added("c".into()),
                ViewChange::Removed("a".into())
            ]
        );
        assert!(new.diff(&new).is_empty());
    }
}
