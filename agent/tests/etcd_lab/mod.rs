//! The etcd registry test's helpers: a node's attributes and config against a given
//! endpoint, a registry acquired and spawned, and waits on its views.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use serde_json::json;
use tokio::sync::watch;
use weft::registry::{
    self, AcquireRequest, EtcdConfig, EtcdRegistry, LocalAttrs, Registry, RegistryHandle,
};
use weft_backends::model::{ClusterView, Lease};
use weft_backends::netconf::{BackendKind, NetConf};
use weft_lab::Etcd;

pub const PREFIX: &str = "/coreos.com/network";
pub const CONFIG: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;

pub async fn put(endpoint: &str, key: &str, value: &str) {
    let mut c = Client::connect([endpoint], None).await.unwrap();
    c.put(key, value, None).await.unwrap();
}

pub fn attrs(ip: u8, key_tag: &str) -> LocalAttrs {
    LocalAttrs {
        public_ip: Some(Ipv4Addr::new(198, 51, 100, ip)),
        internal_ip: None,
        public_ipv6: None,
        backend: BackendKind::Wireguard,
        backend_data: Some(json!({ "PublicKey": key_tag, "Port": 51820 })),
        backend_v6_data: None,
        next_key: None,
        key_proof: None,
        ml_kem_key: None,
        zone: None,
        gateway: None,
        also: Default::default(),
    }
}

pub fn config(endpoint: &str) -> EtcdConfig {
    let mut cfg = EtcdConfig::new(vec![endpoint.to_string()], PREFIX);
    cfg.request_timeout = Duration::from_secs(3);
    cfg.backoff =
        weft::backoff::Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
    cfg
}

/// The registry's own log lines, kept with the test's output (shown when it fails; the
/// runtime's worker threads inherit the test's capture). `RUST_LOG` changes the filter.
pub fn log_to_test_output() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .with_ansi(false)
        .try_init();
}

pub async fn acquire(cfg: EtcdConfig, attrs: LocalAttrs) -> (EtcdRegistry, NetConf, Lease) {
    log_to_test_output();
    let mut reg = EtcdRegistry::connect(cfg).await.unwrap();
    let net = reg.net_conf().await.unwrap();
    let lease = reg
        .acquire(
            &net,
            &AcquireRequest {
                attrs,
                previous: None,
                previous_v6: None,
            },
        )
        .await
        .unwrap();
    (reg, net, lease)
}

pub async fn node(cfg: EtcdConfig, attrs: LocalAttrs) -> (RegistryHandle, Lease) {
    let (reg, _, lease) = acquire(cfg, attrs).await;
    (
        registry::spawn(reg, lease.clone(), Default::default()),
        lease,
    )
}

/// Waits (up to `secs`) for a view satisfying `ok`; fails with the last view seen.
pub async fn wait_view(
    rx: &mut watch::Receiver<Arc<ClusterView>>,
    secs: u64,
    what: &str,
    ok: impl Fn(&ClusterView) -> bool,
) {
    let done = tokio::time::timeout(Duration::from_secs(secs), rx.wait_for(|v| ok(v)))
        .await
        .is_ok();
    if !done {
        panic!(
            "timed out after {secs}s waiting for: {what}; last view: {:#?}",
            rx.borrow().leases.keys().collect::<Vec<_>>()
        );
    }
}

/// Panics if the view stops satisfying `ok` at any moment within `secs` (every view the
/// registry sends is judged, not only the last).
pub async fn holds_view(
    rx: &mut watch::Receiver<Arc<ClusterView>>,
    secs: u64,
    what: &str,
    ok: impl Fn(&ClusterView) -> bool,
) {
    let broke = tokio::time::timeout(Duration::from_secs(secs), rx.wait_for(|v| !ok(v))).await;
    if let Ok(Ok(view)) = broke {
        panic!(
            "within {secs}s, no longer true: {what}; view: {:#?}",
            view.leases.keys().collect::<Vec<_>>()
        );
    }
}

/// Why the registry refuses to go on with `net`'s secrets in clear (it must refuse).
pub async fn refusal(reg: &mut EtcdRegistry, net: &NetConf) -> String {
    match reg.secrets_in_clear(net).await.unwrap() {
        Some(refused) => refused.to_string(),
        None => panic!("a secret in clear was accepted"),
    }
}

/// A config in `etcd` and one node following it, which already sees itself.
pub async fn one_node(etcd: &Etcd) -> (RegistryHandle, Lease, watch::Receiver<Arc<ClusterView>>) {
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    let (a, lease) = node(config(&etcd.endpoint()), attrs(1, "ka")).await;
    let mut views = a.views.clone();
    wait_view(&mut views, 10, "a sees itself", |v| {
        v.get(&lease.node).is_some()
    })
    .await;
    (a, lease, views)
}

pub fn key_of(view: &ClusterView, node: &str) -> Option<String> {
    view.get(node)?
        .backend_data
        .as_ref()?
        .get("PublicKey")?
        .as_str()
        .map(str::to_string)
}
