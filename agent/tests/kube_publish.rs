//! The kube registry writing to its own Node, against the lab's API server (as
//! `kube_registry.rs`): publishing that retries on `409 Conflict` and puts removed
//! annotations back, NetworkUnavailable cleared by strategic merge, bad pod CIDRs, the
//! node found through the agent's pod, a refused token, zones choosing internal addresses.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use weft::registry::kube::{self, KubeError, KubeRegistry};
use weft::registry::{self, Registry};
use weft_backends::model::{ClusterView, Lease};
use weft_lab::wait::until_async;

mod kube_cluster;
use kube_cluster::*;

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
    until_async(
        "backend-data published again",
        Duration::from_secs(10),
        || !ann()[format!("{PREFIX}/backend-data")].is_null(),
    )
    .await;
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
    until_async(
        "NetworkUnavailable cleared",
        Duration::from_secs(10),
        || condition("NetworkUnavailable").is_some_and(|c| c["status"] == "False"),
    )
    .await;
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
