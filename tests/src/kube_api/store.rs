//! The API server's state: Nodes (and the Pods the agent may look itself up by) with one
//! cluster-wide resourceVersion, the event history watches resume from, and the point
//! before which that history is gone (a resume from there gets `410 Gone`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::broadcast;

/// One watch event, as the server streams it.
#[derive(Debug, Clone)]
pub enum Event {
    Node {
        rv: u64,
        kind: &'static str,
        object: Arc<Value>,
    },
    /// Every open watch ends here (the server "restarted" them; see `expire_watches`).
    EndWatches,
}

pub struct Store {
    pub rv: u64,
    pub nodes: BTreeMap<String, Value>,
    /// `(namespace, name)` → Pod.
    pub pods: BTreeMap<(String, String), Value>,
    pub history: VecDeque<(u64, &'static str, Arc<Value>)>,
    /// A watch may resume from any resourceVersion ≥ this; older ones get 410.
    pub oldest_watchable: u64,
    /// The next this many PATCHes carrying a resourceVersion meet a concurrent writer first.
    pub conflicts_to_inject: u32,
    pub events: broadcast::Sender<Event>,
}

impl Default for Store {
    fn default() -> Self {
        Store {
            rv: 1,
            nodes: BTreeMap::new(),
            pods: BTreeMap::new(),
            history: VecDeque::new(),
            oldest_watchable: 0,
            conflicts_to_inject: 0,
            events: broadcast::channel(4096).0,
        }
    }
}

impl Store {
    /// Stores `node` (new or changed) under a new resourceVersion and tells the watches.
    pub fn put_node(&mut self, mut node: Value) -> Value {
        self.rv += 1;
        let name = node["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let kind = if self.nodes.contains_key(&name) {
            "MODIFIED"
        } else {
            node["metadata"]["uid"] = json!(format!("uid-{name}-{}", self.rv));
            // Seconds apart, in the order of creation, as a real API server's would be.
            let t = self.rv % 86_400;
            node["metadata"]["creationTimestamp"] = json!(format!(
                "2026-11-21T{:02}:{:02}:{:02}Z",
                t / 3600,
                t / 60 % 60,
                t % 60
            ));
            "ADDED"
        };
        node["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        node["kind"] = json!("Node");
        node["apiVersion"] = json!("v1");
        self.nodes.insert(name, node.clone());
        self.record(kind, node.clone());
        node
    }

    pub fn delete_node(&mut self, name: &str) -> Option<Value> {
        let mut node = self.nodes.remove(name)?;
        self.rv += 1;
        node["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.record("DELETED", node.clone());
        Some(node)
    }

    fn record(&mut self, kind: &'static str, object: Value) {
        let object = Arc::new(object);
        self.history.push_back((self.rv, kind, object.clone()));
        if self.history.len() > 10_000 {
            if let Some((rv, ..)) = self.history.pop_front() {
                self.oldest_watchable = self.oldest_watchable.max(rv);
            }
        }
        let _ = self.events.send(Event::Node {
            rv: self.rv,
            kind,
            object,
        });
    }

    /// Events after `rv`, or `None` if that history is gone.
    pub fn since(&self, rv: u64) -> Option<Vec<Event>> {
        if rv < self.oldest_watchable {
            return None;
        }
        Some(
            self.history
                .iter()
                .filter(|(r, ..)| *r > rv)
                .map(|(r, kind, object)| Event::Node {
                    rv: *r,
                    kind,
                    object: object.clone(),
                })
                .collect(),
        )
    }
}

/// A Node as a kubelet registers it, with a status as large as a real one (images,
/// conditions), which a client that keeps only what it needs must not hold on to.
pub fn new_node(
    name: &str,
    pod_cidrs: &[&str],
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> Value {
    let images: Vec<Value> = (0..40)
        .map(|i| {
            json!({"names": [format!("registry.example/image-{i}@sha256:{:064x}", i)], "sizeBytes": 1_000_000 + i})
        })
        .collect();
    json!({
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "podCIDR": pod_cidrs.first(),
            "podCIDRs": pod_cidrs,
            "providerID": format!("lab://{name}")
        },
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady"},
                {"type": "NetworkUnavailable", "status": "True", "reason": "NoRouteCreated"}
            ],
            "addresses": [{"type": "Hostname", "address": name}],
            "images": images,
            "nodeInfo": {"kubeletVersion": "v1.33.0", "architecture": "amd64"}
        }
    })
}

/// A `metav1.Status` failure, as the API server sends it.
pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code
    })
}
