//! What the kube registry tests share: the lab's API server with a kubeconfig and
//! net-conf.json beside it (`Cluster`), a node's running registry and its plan (`Member`),
//! and the requests and keys the tests' nodes use.
#![allow(dead_code)] // each test binary uses its own part

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use weft::backoff::Backoff;
use weft::registry::kube::{self, KubeConfig, KubeRegistry};
use weft::registry::{self, AcquireRequest, LocalAttrs, Registry, RegistryHandle};
use weft_backends::model::{ClusterView, DesiredState};
use weft_backends::netconf::{BackendKind, NetConf};
use weft_backends::plan::{plan, wireguard_backend_data, PlanInput, PlanOptions};
use weft_crypto::PrivateKey;
use weft_lab::kube_api::KubeApi;

pub const PREFIX: &str = "flannel.alpha.coreos.com";
pub const CONFIG: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;

pub struct Cluster {
    pub api: KubeApi,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    pub fn new() -> Cluster {
        let api = KubeApi::start(None, IpAddr::V4(Ipv4Addr::LOCALHOST), 0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("net-conf.json"), CONFIG).unwrap();
        api.write_kubeconfig(&dir.path().join("kubeconfig"))
            .unwrap();
        Cluster { api, dir }
    }

    pub fn kubeconfig(&self) -> String {
        self.dir.path().join("kubeconfig").display().to_string()
    }

    pub fn config(&self, node: &str) -> KubeConfig {
        KubeConfig {
            node_name: node.into(),
            prefix: PREFIX.into(),
            net_config_path: self.dir.path().join("net-conf.json"),
            set_network_unavailable: true,
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(300)),
        }
    }

    pub async fn registry(&self, node: &str) -> KubeRegistry {
        let client = kube::client(&self.kubeconfig(), "").await.unwrap();
        KubeRegistry::new(client, self.config(node))
    }

    /// Node `name` joins: the kubelet registers it, its agent acquires and follows.
    pub async fn join(&self, name: &str, cidr: &str, ip: u8, seed: u8) -> Member {
        self.api.add_node(name, &[cidr]);
        self.start(name, request(ip, seed)).await
    }

    /// The agent of the already registered node `name` starts.
    pub async fn start(&self, name: &str, request: AcquireRequest) -> Member {
        let mut reg = self.registry(name).await;
        let net = reg.net_conf().await.unwrap();
        let lease = reg.acquire(&net, &request).await.unwrap();
        Member {
            handle: registry::spawn(reg, lease, Default::default()),
            net,
        }
    }
}

pub struct Member {
    pub handle: RegistryHandle,
    pub net: NetConf,
}

impl Member {
    /// Waits until the view satisfies `ok`; panics with the last view after 10 s.
    pub async fn wait_for(
        &mut self,
        what: &str,
        ok: impl Fn(&ClusterView) -> bool,
    ) -> Arc<ClusterView> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let view = self.handle.views.borrow_and_update().clone();
            if ok(&view) {
                return view;
            }
            if tokio::time::timeout_at(deadline, self.handle.views.changed())
                .await
                .is_err()
            {
                panic!("timed out waiting for {what}; view: {view:#?}");
            }
        }
    }

    pub fn plan(&self) -> DesiredState {
        let me = self.handle.local.borrow().clone();
        let view = self.handle.views.borrow().clone();
        plan(&PlanInput {
            path_mtus: &Default::default(),
            pair_psks: &Default::default(),
            observed: &Default::default(),
            local: &me,
            view: &view,
            config: &self.net,
            options: &PlanOptions {
                ip_masq: true,
                underlay_mtu: 1500,
                underlay_device: None,
                underlay_networks: vec![],
            },
            now: SystemTime::now(),
        })
        .unwrap()
    }
}

pub fn key_of(seed: u8) -> String {
    PrivateKey::from_bytes([seed; 32]).public_key().to_string()
}

pub fn request(ip: u8, seed: u8) -> AcquireRequest {
    AcquireRequest {
        attrs: LocalAttrs {
            public_ip: Some(Ipv4Addr::new(198, 51, 100, ip)),
            internal_ip: None,
            public_ipv6: None,
            backend: BackendKind::Wireguard,
            backend_data: Some(wireguard_backend_data(
                &PrivateKey::from_bytes([seed; 32]).public_key(),
                51820,
            )),
            backend_v6_data: None,
            next_key: None,
            key_proof: None,
            ml_kem_key: None,
            zone: None,
            gateway: None,
            also: Default::default(),
        },
        previous: None,
        previous_v6: None,
    }
}

/// `(node, endpoint, key)` of every WireGuard peer in `state`.
pub fn peers(state: &DesiredState) -> BTreeMap<String, (String, String)> {
    state
        .tunnels
        .iter()
        .flat_map(|t| &t.peers)
        .map(|p| {
            (
                p.node.clone(),
                (p.endpoint.to_string(), p.public_key.to_string()),
            )
        })
        .collect()
}

pub fn has(view: &ClusterView, node: &str) -> bool {
    view.get(node).is_some()
}
