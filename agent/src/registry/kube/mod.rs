//! The Kubernetes registry: Node objects (docs/architecture.md). A node's subnets are its
//! `spec.podCIDRs` (assigned by the controller manager), what it publishes goes in
//! flannel's annotations, and the network config is the ConfigMap's `net-conf.json`,
//! mounted as a file. The API calls it makes, and so the RBAC it needs
//! (`deploy/kubernetes/rbac.yaml`): `nodes` get/list/watch, `nodes/status` patch, and `pods`
//! get when the node is found through the agent's own pod.

mod follow;
pub mod node;
mod publish;

use std::path::PathBuf;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use rustls::pki_types::ServerName;
use weft_backends::model::Lease;
use weft_backends::netconf::{self, ConfigErrors, NetConf};

pub use node::{BadNode, SlimNode};

use super::tls_link::{self, Link, Transport};
use super::{AcquireRequest, FollowLinks, Registry};
use crate::backoff::Backoff;

/// Every API call the registry makes, as `(verb, resource)`: what its ClusterRole must
/// allow. The manifest test holds `deploy/kubernetes/` against this list, and the protocol
/// tests hold this list (and [`POD_LOOKUP`]) against the calls the test API server saw.
pub const API_CALLS: &[(&str, &str)] = &[
    ("get", "nodes"),
    ("list", "nodes"),
    ("watch", "nodes"),
    ("patch", "nodes/status"),
];

/// The one call made only without a node name: flannel's way of finding the node through
/// the agent's own Pod (`POD_NAMESPACE/POD_NAME`). The shipped DaemonSet sets `NODE_NAME`
/// from the downward API, so its ClusterRole does not grant this.
pub const POD_LOOKUP: (&str, &str) = ("get", "pods");

#[derive(Debug, Clone)]
pub struct KubeConfig {
    /// This node's name.
    pub node_name: String,
    /// Annotation prefix (`--kube-annotation-prefix`).
    pub prefix: String,
    /// The mounted `net-conf.json`.
    pub net_config_path: PathBuf,
    /// Clear the node's `NetworkUnavailable` condition once the data plane is up.
    pub set_network_unavailable: bool,
    pub backoff: Backoff,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("Kubernetes API: {op} {what}: {source}")]
    Api {
        op: &'static str,
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("Kubernetes client configuration: {0}")]
    Config(String),
    #[error("no node name: set NODE_NAME (from the downward API's spec.nodeName) or --node-name, or POD_NAME and POD_NAMESPACE")]
    NoNodeName,
    #[error("pod {namespace}/{name} is not scheduled on a node (no spec.nodeName)")]
    PodUnscheduled { namespace: String, name: String },
    #[error("reading the network config {path}: {source}")]
    ReadConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the network config {path} is invalid: {errors}")]
    BadConfig { path: PathBuf, errors: ConfigErrors },
    #[error(transparent)]
    BadNode(#[from] node::BadNode),
    #[error("node {node} has no {family} pod CIDR (spec.podCIDRs) but the config enables {family}: is the controller manager running with --allocate-node-cidrs and a {family} --cluster-cidr?")]
    NoPodCidr { node: String, family: &'static str },
    #[error("node {node}: pod CIDR {cidr} lies outside the config's {field} {network}; the controller manager's --cluster-cidr and net-conf.json must agree")]
    OutsideNetwork {
        node: String,
        cidr: IpNet,
        field: &'static str,
        network: IpNet,
    },
    #[error("node {node}: gave up after {attempts} conflicting writes in a row (409 Conflict)")]
    Conflicts { node: String, attempts: u32 },
    #[error("this node holds no lease yet: acquire one first")]
    NotAcquired,
}

impl KubeError {
    fn api(op: &'static str, what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| KubeError::Api { op, what, source }
    }
}

/// A client from `--kubeconfig-file`, else the in-cluster service account (or the usual
/// kubeconfig search); `--kube-api-url` overrides the server address.
pub async fn client(kubeconfig_file: &str, api_url: &str) -> Result<Client, KubeError> {
    client_from(config(kubeconfig_file, api_url).await?)
}

/// The client's configuration, as [`client`] reads it.
pub async fn config(kubeconfig_file: &str, api_url: &str) -> Result<Config, KubeError> {
    let mut config = if kubeconfig_file.is_empty() {
        Config::infer()
            .await
            .map_err(|e| KubeError::Config(e.to_string()))?
    } else {
        let file = Kubeconfig::read_from(kubeconfig_file)
            .map_err(|e| KubeError::Config(format!("{kubeconfig_file}: {e}")))?;
        Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
            .await
            .map_err(|e| KubeError::Config(format!("{kubeconfig_file}: {e}")))?
    };
    if !api_url.is_empty() {
        config.cluster_url = api_url
            .parse()
            .map_err(|e| KubeError::Config(format!("--kube-api-url {api_url:?}: {e}")))?;
    }
    Ok(config)
}

/// A client from `config`, its TLS on the process's rustls provider (aws-lc-rs:
/// X25519MLKEM768 where the API server offers it).
pub fn client_from(config: Config) -> Result<Client, KubeError> {
    tls_link::provider();
    Client::try_from(config).map_err(|e| KubeError::Config(e.to_string()))
}

/// The link to the API server `config` names, with the TLS configuration kube's own
/// connector is built from, for [`tls_link::report`].
pub fn link(config: &Config) -> Result<Link, KubeError> {
    use kube::client::ConfigExt;
    let url = &config.cluster_url;
    let server = url.to_string();
    if let Some(proxy) = &config.proxy_url {
        let proxy = proxy.to_string();
        return Ok(Link {
            kind: "kubernetes",
            server,
            transport: Transport::Proxied { proxy },
        });
    }
    if url.scheme_str() != Some("https") {
        return Ok(Link {
            kind: "kubernetes",
            server,
            transport: Transport::Clear,
        });
    }
    let (host, port) = tls_link::host_port(&server, 443)
        .ok_or_else(|| KubeError::Config(format!("API server {server}: no host")))?;
    let name = config
        .tls_server_name
        .clone()
        .unwrap_or_else(|| host.clone());
    let server_name = ServerName::try_from(name.clone())
        .map_err(|e| KubeError::Config(format!("API server name {name:?}: {e}")))?;
    tls_link::provider();
    let tls = config
        .rustls_client_config()
        .map_err(|e| KubeError::Config(format!("TLS for {server}: {e}")))?;
    Ok(Link {
        kind: "kubernetes",
        server,
        transport: Transport::Tls {
            host,
            port,
            server_name,
            config: Arc::new(tls),
        },
    })
}

/// This node's name: `explicit` (`--node-name` / `NODE_NAME`), else the node the pod
/// `POD_NAMESPACE/POD_NAME` runs on.
pub async fn node_name(
    client: &Client,
    explicit: &str,
    pod: Option<(String, String)>,
) -> Result<String, KubeError> {
    if !explicit.is_empty() {
        return Ok(explicit.to_string());
    }
    let Some((namespace, name)) = pod else {
        return Err(KubeError::NoNodeName);
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod = pods
        .get(&name)
        .await
        .map_err(KubeError::api("getting pod", format!("{namespace}/{name}")))?;
    pod.spec
        .and_then(|s| s.node_name)
        .filter(|n| !n.is_empty())
        .ok_or(KubeError::PodUnscheduled { namespace, name })
}

pub struct KubeRegistry {
    cfg: KubeConfig,
    nodes: Api<SlimNode>,
    net: Option<NetConf>,
    /// Our lease and what it publishes, once acquired.
    held: Option<(Lease, AcquireRequest)>,
    /// The last rotation request passed on to the agent.
    last_rotate: Option<String>,
    /// This node's annotations that steer its traffic (`public-ip-overwrite`,
    /// `node-public-ip`) as last seen; `None` before the first look.
    steering: Option<Vec<(String, Option<String>)>>,
}

impl KubeRegistry {
    pub fn new(client: Client, cfg: KubeConfig) -> Self {
        KubeRegistry {
            cfg,
            nodes: Api::all(client),
            net: None,
            held: None,
            last_rotate: None,
            steering: None,
        }
    }

    pub fn config(&self) -> &KubeConfig {
        &self.cfg
    }
}

impl Registry for KubeRegistry {
    type Error = KubeError;

    async fn net_conf(&mut self) -> Result<NetConf, KubeError> {
        let path = self.cfg.net_config_path.clone();
        let text = std::fs::read_to_string(&path).map_err(|source| KubeError::ReadConfig {
            path: path.clone(),
            source,
        })?;
        let net = netconf::parse(&text).map_err(|errors| KubeError::BadConfig { path, errors })?;
        self.net = Some(net.clone());
        Ok(net)
    }

    async fn acquire(
        &mut self,
        net: &NetConf,
        request: &AcquireRequest,
    ) -> Result<Lease, KubeError> {
        let lease = self.acquire_lease(net, request).await?;
        self.held = Some((lease.clone(), request.clone()));
        Ok(lease)
    }

    async fn follow(self, links: FollowLinks) {
        follow::run(self, links).await
    }
}
