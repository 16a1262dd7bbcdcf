//! The kube registry against the lab's API server (`weft_lab::kube_api`), which speaks the
//! Kubernetes wire protocol for Nodes: LIST with resourceVersion, streaming WATCH with
//! bookmarks, `410 Gone` after the watch history is expired, merge and strategic-merge
//! PATCH on `nodes/status`, `409 Conflict` for a stale resourceVersion. Each test plans
//! from the views the registries produce, so "reaches the plan" means the plan.
//!
//! This file: following the cluster (joins, changes, deletions, an expired watch, bad and
//! duplicate entries). `kube_publish.rs`: what a node writes to its own Node.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::json;
use weft::registry::kube::{self, API_CALLS};
use weft_lab::wait::until_async;

mod kube_cluster;
use kube_cluster::*;

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
    until_async("a steering warning", Duration::from_secs(5), || {
        steering.get() > 0
    })
    .await;
    c.api.annotate(
        "node-b",
        &format!("{PREFIX}/node-public-ip"),
        Some("198.51.100.22"),
    );
    until_async("a second steering warning", Duration::from_secs(5), || {
        steering.get() > 1
    })
    .await;
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
            format!("its public key {} is also published by node node-z, which keeps it (it proves holding the key, or is the older entry); left out until it changes", key_of(26))
        )]
    );
}
