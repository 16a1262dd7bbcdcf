//! The kube registry against the lab's API server (`weft_lab::kube_api`), which speaks the
//! Kubernetes wire protocol for Nodes: LIST with resourceVersion, streaming WATCH with
//! bookmarks, `410 Gone` after the watch history is expired, merge and strategic-merge
//! PATCH on `nodes/status`, `409 Conflict` for a stale resourceVersion. Each test plans
//! from the views the registries produce, so "reaches the plan" means the plan.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::json;
use weft::backoff::Backoff;
use weft::registry::kube::{self, KubeConfig, KubeError, KubeRegistry, API_CALLS};
use weft::registry::{self, AcquireRequest, LocalAttrs, Registry, RegistryHandle};
use weft_backends::model::{ClusterView, DesiredState, Lease};
use weft_backends::netconf::{BackendKind, NetConf};
use weft_backends::plan::{plan, wireguard_backend_data, PlanInput, PlanOptions};
use weft_crypto::PrivateKey;
use weft_lab::kube_api::KubeApi;

const PREFIX: &str = "flannel.alpha.coreos.com";
const CONFIG: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;

struct Cluster {
    api: KubeApi,
    dir: tempfile::TempDir,
}

impl Cluster {
    fn new() -> Cluster {
        let api = KubeApi::start(None, IpAddr::V4(Ipv4Addr::LOCALHOST), 0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("net-conf.json"), CONFIG).unwrap();
        api.write_kubeconfig(&dir.path().join("kubeconfig"))
            .unwrap();
        Cluster { api, dir }
    }

    fn kubeconfig(&self) -> String {
        self.dir.path().join("kubeconfig").display().to_string()
    }

    fn config(&self, node: &str) -> KubeConfig {
        KubeConfig {
            node_name: node.into(),
            prefix: PREFIX.into(),
            net_config_path: self.dir.path().join("net-conf.json"),
            set_network_unavailable: true,
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(300)),
        }
    }

    async fn registry(&self, node: &str) -> KubeRegistry {
        let client = kube::client(&self.kubeconfig(), "").await.unwrap();
        KubeRegistry::new(client, self.config(node))
    }

    /// Node `name` joins: the kubelet registers it, its agent acquires and follows.
    async fn join(&self, name: &str, cidr: &str, ip: u8, seed: u8) -> Member {
        self.api.add_node(name, &[cidr]);
        self.start(name, request(ip, seed)).await
    }

    /// The agent of the already registered node `name` starts.
    async fn start(&self, name: &str, request: AcquireRequest) -> Member {
        let mut reg = self.registry(name).await;
        let net = reg.net_conf().await.unwrap();
        let lease = reg.acquire(&net, &request).await.unwrap();
        Member {
            handle: registry::spawn(reg, lease, Default::default()),
            net,
        }
    }
}

struct Member {
    handle: RegistryHandle,
    net: NetConf,
}

impl Member {
    /// Waits until the view satisfies `ok`; panics with the last view after 10 s.
    async fn wait_for(
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

    fn plan(&self) -> DesiredState {
        let me = self.handle.local.borrow().clone();
        let view = self.handle.views.borrow().clone();
        plan(&PlanInput {
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

fn key_of(seed: u8) -> String {
    PrivateKey::from_bytes([seed; 32]).public_key().to_string()
}

fn request(ip: u8, seed: u8) -> AcquireRequest {
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
        },
        previous: None,
        previous_v6: None,
    }
}

/// `(node, endpoint, key)` of every WireGuard peer in `state`.
fn peers(state: &DesiredState) -> BTreeMap<String, (String, String)> {
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

fn has(view: &ClusterView, node: &str) -> bool {
    view.get(node).is_some()
}

#[tokio::test]
async fn two_nodes_join_and_each_plans_the_other() {
    let c = Cluster::new();
    let mut a = c.join("node-a", "10.244.1.0/24", 1, 1).await;
    let mut b = c.join("node-b", "10.244.2.0/24", 2, 2).await;
    a.wait_for("node-b", |v| has(v, "node-b")).await;
    b.wait_for("node-a", |v| has(v, "node-a")).await;
    assert_eq!(
        peers(&a.plan()),
        BTreeMap::from([(
            "node-b".to_string(),
            ("198.51.100.2:51820".to_string(), key_of(2))
        )])
    );
    assert_eq!(
        peers(&b.plan()),
        BTreeMap::from([(
            "node-a".to_string(),
            ("198.51.100.1:51820".to_string(), key_of(1))
        )])
    );
    // Published exactly in flannel's shapes.
    let node = c.api.node("node-a").unwrap();
    let ann = &node["metadata"]["annotations"];
    assert_eq!(ann[format!("{PREFIX}/kube-subnet-manager")], "true");
    assert_eq!(ann[format!("{PREFIX}/backend-type")], "wireguard");
    assert_eq!(ann[format!("{PREFIX}/public-ip")], "198.51.100.1");
    let data: serde_json::Value =
        serde_json::from_str(ann[format!("{PREFIX}/backend-data")].as_str().unwrap()).unwrap();
    assert_eq!(data, json!({"PublicKey": key_of(1), "Port": 51820}));
    // Only calls the ClusterRole allows were made.
    for (verb, resource) in c.api.requests().keys() {
        assert!(
            API_CALLS.contains(&(verb.as_str(), resource.as_str()))
                || (verb.as_str(), resource.as_str()) == kube::POD_LOOKUP,
            "the registry made a call not in API_CALLS: {verb} {resource}"
        );
    }
    a.handle.stop().await;
    b.handle.stop().await;
}

#[tokio::test]
async fn annotation_changes_and_public_ip_overwrite_reach_the_plan() {
    let c = Cluster::new();
    let mut a = c.join("node-a", "10.244.1.0/24", 1, 1).await;
    let b = c.join("node-b", "10.244.2.0/24", 2, 2).await;
    a.wait_for("node-b", |v| has(v, "node-b")).await;

    // Node b's key changes (as an agent with a new key would publish it).
    let new_data = json!({"PublicKey": key_of(9), "Port": 51820}).to_string();
    c.api
        .annotate("node-b", &format!("{PREFIX}/backend-data"), Some(&new_data));
    a.wait_for("node-b's new key", |v| {
        v.get("node-b")
            .and_then(|l| l.backend_data.as_ref())
            .is_some_and(|d| d["PublicKey"] == key_of(9))
    })
    .await;
    assert_eq!(peers(&a.plan())["node-b"].1, key_of(9));

    // An operator puts node b behind a NAT: its endpoint becomes the overwrite.
    c.api.annotate(
        "node-b",
        &format!("{PREFIX}/public-ip-overwrite"),
        Some("203.0.113.9"),
    );
    a.wait_for("node-b's overwritten IP", |v| {
        v.get("node-b")
            .is_some_and(|l| l.public_ip == Some(Ipv4Addr::new(203, 0, 113, 9)))
    })
    .await;
    assert_eq!(peers(&a.plan())["node-b"].0, "203.0.113.9:51820");
    // b's own public-ip annotation is unchanged: the overwrite is the operator's.
    assert_eq!(
        c.api.node("node-b").unwrap()["metadata"]["annotations"][format!("{PREFIX}/public-ip")],
        "198.51.100.2"
    );
    // Node b's agent follows it but counts it as a warning (anyone who may patch Nodes can
    // set it); the key change did not count, nor does node a, whose own Node is untouched.
    let steering = &b.handle.alerts.steering_changes;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while steering.get() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no steering warning"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.api.annotate(
        "node-b",
        &format!("{PREFIX}/node-public-ip"),
        Some("198.51.100.22"),
    );
    while steering.get() == 1 {
        assert!(tokio::time::Instant::now() < deadline, "no second warning");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(steering.get(), 2);
    assert_eq!(a.handle.alerts.steering_changes.get(), 0);
}

#[tokio::test]
async fn a_deleted_node_leaves_the_plan_and_unmanaged_nodes_are_ignored() {
    let c = Cluster::new();
    let mut a = c.join("node-a", "10.244.1.0/24", 1, 1).await;
    let _b = c.join("node-b", "10.244.2.0/24", 2, 2).await;
    // A node with no flannel/weft agent (no kube-subnet-manager) is not a peer.
    c.api.add_node("plain", &["10.244.7.0/24"]);
    a.wait_for("node-b", |v| has(v, "node-b")).await;
    assert!(!has(&a.handle.views.borrow(), "plain"));
    assert!(c.api.delete_node("node-b"));
    a.wait_for("node-b to leave", |v| !has(v, "node-b")).await;
    assert!(peers(&a.plan()).is_empty());
}

#[tokio::test]
async fn an_expired_watch_lists_again_and_loses_nothing() {
    let c = Cluster::new();
    let mut a = c.join("node-a", "10.244.1.0/24", 1, 1).await;
    let _b = c.join("node-b", "10.244.2.0/24", 2, 2).await;
    let _x = c.join("node-x", "10.244.3.0/24", 3, 3).await;
    a.wait_for("b and x", |v| has(v, "node-b") && has(v, "node-x"))
        .await;
    let lists_before = c.api.requests()[&("list".to_string(), "nodes".to_string())];

    // While a's watch is down, x is deleted, c joins and b is moved: none of it is streamed.
    let (managed, data) = (
        format!("{PREFIX}/kube-subnet-manager"),
        json!({"PublicKey": key_of(4), "Port": 51820}).to_string(),
    );
    c.api.expire_watches(|store| {
        let x = store.nodes.get("node-x").cloned();
        if x.is_some() {
            store.delete_node("node-x");
        }
        let mut ann = BTreeMap::new();
        ann.insert(managed.clone(), "true".to_string());
        ann.insert(format!("{PREFIX}/backend-type"), "wireguard".into());
        ann.insert(format!("{PREFIX}/public-ip"), "198.51.100.4".into());
        ann.insert(format!("{PREFIX}/backend-data"), data.clone());
        store.put_node(json!({
            "metadata": {"name": "node-c", "annotations": ann},
            "spec": {"podCIDRs": ["10.244.4.0/24"]}
        }));
        // An operator moves node-b (its own agent would put back a change to the
        // annotations it publishes, so this is the operator's overwrite).
        if let Some(mut b) = store.nodes.get("node-b").cloned() {
            b["metadata"]["annotations"][format!("{PREFIX}/public-ip-overwrite")] =
                json!("198.51.100.22");
            store.put_node(b);
        }
    });
    a.wait_for("the relisted view", |v| {
        !has(v, "node-x")
            && has(v, "node-c")
            && v.get("node-b")
                .is_some_and(|l| l.public_ip == Some(Ipv4Addr::new(198, 51, 100, 22)))
    })
    .await;
    let lists_after = c.api.requests()[&("list".to_string(), "nodes".to_string())];
    assert!(
        lists_after > lists_before,
        "the 410 should have forced a re-list ({lists_before} → {lists_after})"
    );
    let planned = peers(&a.plan());
    assert_eq!(
        planned.keys().collect::<Vec<_>>(),
        ["node-b", "node-c"],
        "{planned:?}"
    );
    assert_eq!(planned["node-b"].0, "198.51.100.22:51820");
}

#[tokio::test]
async fn a_malformed_node_is_skipped_and_the_others_stay() {
    let c = Cluster::new();
    let mut a = c.join("node-a", "10.244.1.0/24", 1, 1).await;
    let _b = c.join("node-b", "10.244.2.0/24", 2, 2).await;
    a.wait_for("node-b", |v| has(v, "node-b")).await;
    let managed = |extra: &[(&str, &str)]| {
        let mut ann: BTreeMap<String, String> = [
            ("kube-subnet-manager", "true"),
            ("backend-type", "wireguard"),
            ("public-ip", "198.51.100.5"),
        ]
        .iter()
        .chain(extra)
        .map(|(k, v)| (format!("{PREFIX}/{k}"), v.to_string()))
        .collect();
        ann.retain(|_, v| !v.is_empty());
        ann
    };
    // Not JSON at all: the registry skips the node, naming it.
    c.api.add_node_with(
        "broken-json",
        &["10.244.5.0/24"],
        &BTreeMap::new(),
        &managed(&[("backend-data", "{\"PublicKey\": ")]),
    );
    // JSON with a key that is not one: the planner leaves it out, naming it.
    c.api.add_node_with(
        "bad-key",
        &["10.244.6.0/24"],
        &BTreeMap::new(),
        &managed(&[(
            "backend-data",
            r#"{"PublicKey": "not-base64!", "Port": 51820}"#,
        )]),
    );
    // A pod CIDR that is not one.
    c.api.add_node_with(
        "bad-cidr",
        &["10.244.300.0/24"],
        &BTreeMap::new(),
        &managed(&[(
            "backend-data",
            &json!({"PublicKey": key_of(7), "Port": 51820}).to_string(),
        )]),
    );
    let _d = c.join("node-d", "10.244.8.0/24", 8, 8).await;
    let view = a.wait_for("node-d", |v| has(v, "node-d")).await;
    assert!(!has(&view, "broken-json") && !has(&view, "bad-cidr"));
    let state = a.plan();
    assert_eq!(
        peers(&state).keys().collect::<Vec<_>>(),
        ["node-b", "node-d"]
    );
    let left: Vec<_> = state.left_out.iter().map(|l| l.node.as_str()).collect();
    assert_eq!(left, ["bad-key"], "{:?}", state.left_out);
}

#[tokio::test]
async fn a_node_created_later_with_another_nodes_key_is_the_one_left_out() {
    let c = Cluster::new();
    let mut a = c.join("node-a", "10.244.1.0/24", 1, 1).await;
    // The incumbent sorts after the newcomer by name: only the Nodes' creationTimestamps
    // can tell them apart.
    let _z = c.join("node-z", "10.244.2.0/24", 2, 26).await;
    a.wait_for("node-z", |v| has(v, "node-z")).await;
    let copied: BTreeMap<String, String> = [
        ("kube-subnet-manager", "true".to_string()),
        ("backend-type", "wireguard".to_string()),
        ("public-ip", "198.51.100.3".to_string()),
        (
            "backend-data",
            json!({"PublicKey": key_of(26), "Port": 51820}).to_string(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (format!("{PREFIX}/{k}"), v))
    .collect();
    c.api
        .add_node_with("node-c", &["10.244.3.0/24"], &BTreeMap::new(), &copied);
    a.wait_for("node-c", |v| has(v, "node-c")).await;
    let state = a.plan();
    assert_eq!(peers(&state).keys().collect::<Vec<_>>(), ["node-z"]);
    let left: Vec<_> = state
        .left_out
        .iter()
        .map(|l| (l.node.as_str(), l.reason.to_string()))
        .collect();
    assert_eq!(
        left,
        [(
            "node-c",
            format!("its public key {} is also published by node node-z, which keeps it (the older entry); left out until it changes", key_of(26))
        )]
    );
}

#[tokio::test]
async fn publishing_retries_on_conflict_and_republishes_removed_annotations() {
    let c = Cluster::new();
    c.api.add_node("node-a", &["10.244.1.0/24"]);
    c.api.inject_conflicts(3);
    let mut reg = c.registry("node-a").await;
    let net = reg.net_conf().await.unwrap();
    let lease = reg.acquire(&net, &request(1, 1)).await.unwrap();
    assert_eq!(lease.subnet, "10.244.1.0/24".parse().ok());
    assert!(c.api.conflicts_sent() >= 3, "{}", c.api.conflicts_sent());
    let ann = || c.api.node("node-a").unwrap()["metadata"]["annotations"].clone();
    assert_eq!(ann()[format!("{PREFIX}/public-ip")], "198.51.100.1");

    // Someone strips the annotations: the registry writes them back.
    let mut a = Member {
        handle: registry::spawn(reg, lease, Default::default()),
        net,
    };
    a.wait_for("own lease", |v| has(v, "node-a")).await;
    c.api
        .annotate("node-a", &format!("{PREFIX}/backend-data"), None);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ann()[format!("{PREFIX}/backend-data")].is_null() {
        assert!(
            std::time::Instant::now() < deadline,
            "backend-data was not published again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn network_unavailable_is_cleared_once_ready_by_strategic_merge() {
    let c = Cluster::new();
    let mut a = c.join("node-a", "10.244.1.0/24", 1, 1).await;
    a.wait_for("own lease", |v| has(v, "node-a")).await;
    let condition = |t: &str| {
        c.api.node("node-a").unwrap()["status"]["conditions"]
            .as_array()
            .and_then(|l| l.iter().find(|x| x["type"] == t).cloned())
    };
    assert_eq!(condition("NetworkUnavailable").unwrap()["status"], "True");
    a.handle.ready.send_replace(true);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while condition("NetworkUnavailable").unwrap()["status"] != "False" {
        assert!(
            std::time::Instant::now() < deadline,
            "NetworkUnavailable stayed True"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let nu = condition("NetworkUnavailable").unwrap();
    assert_eq!(nu["reason"], "WeftIsUp");
    assert!(nu["lastTransitionTime"]
        .as_str()
        .is_some_and(|t| t.ends_with('Z')));
    // The kubelet's conditions are untouched: merged by type, not replaced.
    assert_eq!(condition("Ready").unwrap()["status"], "True");
    let strategic = c.api.requests()[&("patch".to_string(), "nodes/status".to_string())];
    assert!(strategic >= 2);
}

#[tokio::test]
async fn bad_pod_cidrs_are_clear_errors() {
    let c = Cluster::new();
    c.api.add_node("outside", &["10.9.0.0/24"]);
    c.api.add_node("none", &[]);
    c.api.add_node("garbage", &["ten.244.1.0/24"]);
    for (node, expect) in [
        (
            "outside",
            "node outside: pod CIDR 10.9.0.0/24 lies outside the config's Network 10.244.0.0/16",
        ),
        ("none", "node none has no IPv4 pod CIDR"),
        (
            "garbage",
            "node garbage: spec.podCIDRs \"ten.244.1.0/24\" is not a CIDR",
        ),
    ] {
        let mut reg = c.registry(node).await;
        let net = reg.net_conf().await.unwrap();
        let err = reg.acquire(&net, &request(1, 1)).await.unwrap_err();
        assert!(err.to_string().contains(expect), "{node}: {err}");
    }
    // A node that does not exist: the API's 404, with the node named.
    let mut reg = c.registry("ghost").await;
    let net = reg.net_conf().await.unwrap();
    let err = reg.acquire(&net, &request(1, 1)).await.unwrap_err();
    assert!(matches!(err, KubeError::Api { .. }), "{err}");
    assert!(err.to_string().contains("getting node ghost"), "{err}");
}

#[tokio::test]
async fn the_node_is_found_through_the_agents_pod_and_node_public_ip_is_honoured() {
    let c = Cluster::new();
    c.api.add_node("node-a", &["10.244.1.0/24"]);
    c.api.annotate(
        "node-a",
        &format!("{PREFIX}/node-public-ip"),
        Some("198.51.100.77"),
    );
    c.api.add_pod("kube-flannel", "weft-abcde", "node-a");
    let client = kube::client(&c.kubeconfig(), "").await.unwrap();
    let pod = Some(("kube-flannel".to_string(), "weft-abcde".to_string()));
    let name = kube::node_name(&client, "", pod).await.unwrap();
    assert_eq!(name, "node-a");
    let missing = Some(("kube-flannel".to_string(), "nope".to_string()));
    assert!(kube::node_name(&client, "", missing).await.is_err());
    assert!(matches!(
        kube::node_name(&client, "", None).await,
        Err(KubeError::NoNodeName)
    ));
    let mut reg = KubeRegistry::new(client, c.config(&name));
    let net = reg.net_conf().await.unwrap();
    let lease: Lease = reg.acquire(&net, &request(1, 1)).await.unwrap();
    assert_eq!(lease.public_ip, Some(Ipv4Addr::new(198, 51, 100, 77)));
    assert_eq!(
        c.api.node("node-a").unwrap()["metadata"]["annotations"][format!("{PREFIX}/public-ip")],
        "198.51.100.77"
    );
}

#[tokio::test]
async fn a_wrong_token_is_refused_with_the_apis_error() {
    let c = Cluster::new();
    let path: PathBuf = c.dir.path().join("bad-kubeconfig");
    let text = std::fs::read_to_string(c.kubeconfig())
        .unwrap()
        .replace("weft-lab-token", "wrong");
    std::fs::write(&path, text).unwrap();
    c.api.add_node("node-a", &["10.244.1.0/24"]);
    let client = kube::client(&path.display().to_string(), "").await.unwrap();
    let mut reg = KubeRegistry::new(client, c.config("node-a"));
    let net = reg.net_conf().await.unwrap();
    let err = reg.acquire(&net, &request(1, 1)).await.unwrap_err();
    assert!(err.to_string().contains("Unauthorized"), "{err}");
}

#[tokio::test]
async fn zones_choose_internal_addresses_and_candidates_are_published() {
    let c = Cluster::new();
    let zone =
        |z: &str| BTreeMap::from([("topology.kubernetes.io/zone".to_string(), z.to_string())]);
    let none = BTreeMap::new();
    c.api
        .add_node_with("node-a", &["10.244.1.0/24"], &zone("zone-a"), &none);
    c.api
        .add_node_with("node-b", &["10.244.2.0/24"], &zone("zone-a"), &none);
    c.api
        .add_node_with("node-x", &["10.244.3.0/24"], &zone("zone-b"), &none);
    // node-x sits behind a NAT: the operator gives its outside address.
    c.api.annotate(
        "node-x",
        &format!("{PREFIX}/public-ip-overwrite"),
        Some("203.0.113.30"),
    );
    let mut a = c.start("node-a", request(1, 1)).await;
    // node-b advertises an external address and knows its internal one.
    let mut b_request = request(2, 2);
    b_request.attrs.internal_ip = Some(Ipv4Addr::new(192, 0, 2, 2));
    let _b = c.start("node-b", b_request).await;
    let mut x_request = request(30, 3);
    x_request.attrs.public_ip = Some(Ipv4Addr::new(192, 0, 2, 30));
    let mut x = c.start("node-x", x_request).await;

    let b_endpoints =
        &c.api.node("node-b").unwrap()["metadata"]["annotations"]["weft.dev/endpoints"];
    let b_endpoints: serde_json::Value =
        serde_json::from_str(b_endpoints.as_str().unwrap()).unwrap();
    assert_eq!(
        b_endpoints,
        json!({"internal": "192.0.2.2", "external": "198.51.100.2"})
    );
    // A node without an internal address publishes no candidates.
    assert!(
        c.api.node("node-a").unwrap()["metadata"]["annotations"]["weft.dev/endpoints"].is_null()
    );

    let all = |v: &ClusterView| ["node-a", "node-b", "node-x"].iter().all(|n| has(v, n));
    a.wait_for("all nodes", all).await;
    x.wait_for("all nodes", all).await;
    // Same zone: internal. Other zone: the published (or overwritten) address.
    let planned = peers(&a.plan());
    assert_eq!(planned["node-b"].0, "192.0.2.2:51820");
    assert_eq!(planned["node-x"].0, "203.0.113.30:51820");
    assert_eq!(peers(&x.plan())["node-b"].0, "198.51.100.2:51820");

    // node-a moves to zone-b: now node-x is near (its own address behind the NAT) and
    // node-b far.
    c.api.update_node("node-a", |n| {
        n["metadata"]["labels"]["topology.kubernetes.io/zone"] = json!("zone-b");
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(200), a.handle.local.changed()).await;
        let planned = peers(&a.plan());
        if planned["node-x"].0 == "192.0.2.30:51820" {
            assert_eq!(planned["node-b"].0, "198.51.100.2:51820");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{planned:?}");
    }
}
