//! Registries: where leases live. One trait, two implementations (etcd, and Kubernetes
//! Node objects); nothing outside this module knows which one runs.
//!
//! A registry serves the network config, acquires this node's lease, and then, in
//! `follow`, keeps the lease alive and turns every change to any node's lease into a new
//! `ClusterView` on a watch channel (level-triggered: consumers want the latest view, not
//! every step).

pub mod etcd;
pub mod kube;
pub mod tls_link;

use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ipnet::IpNet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tracing::info;
use weft_backends::model::{ClusterView, Lease, LeaseAttrs, NextKey, ViewChange};
use weft_backends::netconf::{BackendKind, NetConf};

pub use etcd::{EtcdAccess, EtcdConfig, EtcdRegistry, RegistryError};
pub use kube::{KubeConfig, KubeError, KubeRegistry};

/// What this node publishes about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalAttrs {
    pub public_ip: Option<Ipv4Addr>,
    /// The node's own address when `public_ip` is an external one (published by the kube
    /// registry as `weft.dev/endpoints`, for peers in the same zone).
    pub internal_ip: Option<Ipv4Addr>,
    pub public_ipv6: Option<Ipv6Addr>,
    pub backend: BackendKind,
    pub backend_data: Option<Value>,
    pub backend_v6_data: Option<Value>,
    /// A key rotation this node announces (see docs/key-rotation.md).
    pub next_key: Option<NextKey>,
    /// Its proof of holding its key, for its name in the registry (base64;
    /// `weft_crypto::proof`).
    pub key_proof: Option<String>,
    /// Its ML-KEM-768 encapsulation key (base64), when post-quantum rounds are on.
    pub ml_kem_key: Option<String>,
    /// `--zone` (etcd; the kube registry reads the Node's zone label or annotation).
    pub zone: Option<String>,
    /// `--gateway`: the port of this node's relay.
    pub gateway: Option<u16>,
    /// The backends this node still speaks besides `backend` during a backend change,
    /// with their data (`Lease::also`; `node::also`).
    pub also: std::collections::BTreeMap<String, Value>,
}

impl LocalAttrs {
    pub fn to_lease_attrs(&self) -> LeaseAttrs {
        LeaseAttrs {
            public_ip: self.public_ip,
            public_ipv6: self.public_ipv6,
            backend_type: self.backend.as_str().to_string(),
            backend_data: self.backend_data.clone(),
            backend_v6_data: self.backend_v6_data.clone(),
            next_key: self.next_key.clone(),
            key_proof: self.key_proof.clone(),
            ml_kem_key: self.ml_kem_key.clone(),
            zone: self.zone.clone(),
            internal_ip: self.internal_ip.map(std::net::IpAddr::V4),
            gateway: self.gateway,
            also: self.also.clone(),
        }
    }
}

/// A lease request: the attributes, and the subnets this node held before (from the
/// subnet file) which it should get back if it can.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    pub attrs: LocalAttrs,
    pub previous: Option<IpNet>,
    pub previous_v6: Option<IpNet>,
}

impl AcquireRequest {
    /// The same request publishing new attributes (used by `follow`).
    pub fn with_attrs(&self, attrs: LocalAttrs) -> AcquireRequest {
        AcquireRequest {
            attrs,
            ..self.clone()
        }
    }
}

/// What the registry saw and warned about, counted for `/metrics` (the counters are
/// shared: a clone counts into the same series).
#[derive(Debug, Clone, Default)]
pub struct Alerts {
    /// Nodes that joined, changed or left, by `event` (`registry_events`): counted as each
    /// new view is made, from the diff that logs it.
    pub events: Family<Vec<(&'static str, String)>, Counter>,
    /// Changes to the annotations that steer this node's traffic (`public-ip-overwrite`,
    /// `node-public-ip` on its own Node), which only an operator should make.
    pub steering_changes: Counter,
    /// Foreign writes to this node's etcd lease, written back.
    pub leases_defended: Counter,
    /// Whether the registry answers; `follow` sets it, `/readyz` says it.
    pub registry: crate::observe::http::RegistryStatus,
}

impl Alerts {
    /// Counts each node that joined, changed or left.
    pub fn registry_changes(&self, changes: &[ViewChange]) {
        for c in changes {
            let event = match c {
                ViewChange::Added(_) => "joined",
                ViewChange::Changed(_) => "changed",
                ViewChange::Removed(_) => "left",
            };
            self.events
                .get_or_create(&vec![("event", event.to_string())])
                .inc();
        }
    }
}

/// The channels `follow` works with.
pub struct FollowLinks {
    /// Every new view of all nodes (ours included).
    pub views: watch::Sender<Arc<ClusterView>>,
    /// This node's lease, when it changes (re-acquired after loss, attributes updated).
    pub local: watch::Sender<Lease>,
    /// New attributes to publish (key rotation, address change).
    pub updates: mpsc::Receiver<LocalAttrs>,
    /// The PSK state the registry holds (etcd: `<prefix>/weft/psk`), raw; `None` if none.
    pub psk: watch::Sender<Option<String>>,
    /// Key-rotation requests an operator wrote for this node in the registry (their ids;
    /// the agent ignores one it has handled).
    pub rotate: mpsc::Sender<String>,
    /// True once this node's data plane is programmed (the kube registry then clears the
    /// node's `NetworkUnavailable` condition, if asked to).
    pub ready: watch::Receiver<bool>,
    pub shutdown: watch::Receiver<bool>,
    pub alerts: Alerts,
}

/// Makes `fresh` the current view: logs each node that joined, changed or left, and sends
/// the view if anything changed, or if `first` (the agent waits for a first listing, even
/// an empty one). The view sent is the one kept (shared, not copied: at 10,000 nodes a
/// copy per event was a copy of every lease's entry).
pub(crate) fn publish_view(
    view: &mut Arc<ClusterView>,
    fresh: ClusterView,
    links: &FollowLinks,
    first: bool,
) {
    let changes = view.diff(&fresh);
    for change in &changes {
        info!(change = %change, "cluster view");
    }
    links.alerts.registry_changes(&changes);
    *view = Arc::new(fresh);
    if first || !changes.is_empty() {
        links.views.send_replace(view.clone());
    }
}

pub trait Registry: Send + 'static {
    type Error: std::error::Error + Send + Sync + 'static;

    /// The network configuration this registry serves.
    fn net_conf(&mut self) -> impl Future<Output = Result<NetConf, Self::Error>> + Send;

    /// Acquires (or takes back) this node's lease and publishes its attributes.
    fn acquire(
        &mut self,
        net: &NetConf,
        request: &AcquireRequest,
    ) -> impl Future<Output = Result<Lease, Self::Error>> + Send;

    /// Whether a secret this registry holds would travel in clear (`net` as `net_conf`
    /// read it): `Ok(Some(_))` names it, and the agent must not go on. `Err` is the
    /// registry failing the request (retried).
    fn secrets_in_clear(
        &mut self,
        net: &NetConf,
    ) -> impl Future<Output = Result<Option<Self::Error>, Self::Error>> + Send {
        let _ = net;
        async { Ok(None) }
    }

    /// Keeps the lease and follows every node until shutdown. Errors inside are retried
    /// with backoff and logged; it returns only on shutdown.
    fn follow(self, links: FollowLinks) -> impl Future<Output = ()> + Send;
}

/// A running registry: the latest views and our lease, a way to publish new attributes,
/// and a clean stop.
pub struct RegistryHandle {
    pub views: watch::Receiver<Arc<ClusterView>>,
    pub local: watch::Receiver<Lease>,
    pub updates: mpsc::Sender<LocalAttrs>,
    pub ready: watch::Sender<bool>,
    /// Rotation requests from the registry (see `FollowLinks::rotate`).
    pub rotate_requests: mpsc::Receiver<String>,
    /// The PSK state from the registry (see `FollowLinks::psk`).
    pub psk: watch::Receiver<Option<String>>,
    /// What the registry warned about (see `FollowLinks::alerts`).
    pub alerts: Alerts,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl RegistryHandle {
    /// Stops following. The lease is left in the registry (it expires on its own, and a
    /// restarted agent takes it back).
    pub async fn stop(self) {
        self.shutdown.send_replace(true);
        let _ = self.task.await;
    }
}

/// The registry's name for a request to rotate node `node`'s key: the Node annotation
/// (kube), or `<prefix>/weft/rotate/<node>` (etcd).
pub const ROTATE_REQUEST: &str = "weft.dev/rotate-request";

/// Runs `registry.follow` on its own task, starting from the acquired `lease`, counting its
/// warnings into `alerts`.
pub fn spawn<R: Registry>(registry: R, lease: Lease, alerts: Alerts) -> RegistryHandle {
    let (views_tx, views) = watch::channel(Arc::new(ClusterView::default()));
    let (local_tx, local) = watch::channel(lease);
    let (updates, updates_rx) = mpsc::channel(4);
    let (shutdown, shutdown_rx) = watch::channel(false);
    let (ready, ready_rx) = watch::channel(false);
    let (rotate, rotate_requests) = mpsc::channel(4);
    let (psk_tx, psk) = watch::channel(None);
    let links = FollowLinks {
        rotate,
        psk: psk_tx,
        views: views_tx,
        local: local_tx,
        updates: updates_rx,
        ready: ready_rx,
        shutdown: shutdown_rx,
        alerts: alerts.clone(),
    };
    let task = tokio::spawn(registry.follow(links));
    RegistryHandle {
        views,
        local,
        updates,
        ready,
        rotate_requests,
        psk,
        alerts,
        shutdown,
        task,
    }
}
