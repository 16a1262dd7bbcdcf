//! A Kubernetes API server for Nodes, for tests: no API server can run on this machine,
//! so the kube registry is tested against this one, which speaks the real wire protocol
//! (see `server`) rather than answering a happy path. It serves plain HTTP with a bearer
//! token, on an address of the caller's choosing, optionally inside a lab namespace, and
//! lets the test act as the rest of the cluster: kubelets registering Nodes, an operator
//! annotating them, the API server expiring watches, a concurrent writer causing conflicts.

mod patch;
mod server;
mod store;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Context;
use serde_json::{json, Value};
use tokio::sync::oneshot;

pub use store::Store;
use store::{new_node, Event};

/// The bearer token clients must present.
pub const TOKEN: &str = "weft-lab-token";

/// How the test API server misbehaves, as real ones do under load or in an outage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    #[default]
    None,
    /// Every request answered `500 InternalError`.
    Errors,
    /// Every request accepted and left unanswered while the fault lasts (then failed
    /// with 503, as a stalled server that recovers does).
    Hang,
    /// Watches served, each closed after this long (a load balancer's idle cut).
    ShortWatches(std::time::Duration),
}

pub struct Shared {
    store: Mutex<Store>,
    fault: Mutex<Fault>,
    requests: Mutex<BTreeMap<(String, String), u64>>,
    conflicts: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, verb: &str, resource: &str) {
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((verb.to_string(), resource.to_string()))
            .and_modify(|n| *n += 1)
            .or_insert(1);
    }

    fn fault(&self) -> Fault {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count_conflict(&self) {
        self.conflicts.fetch_add(1, Ordering::Relaxed);
    }
}

pub struct KubeApi {
    shared: Arc<Shared>,
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KubeApi {
    /// Serves on `ip:port` (0 = any free port), inside network namespace `netns` if given.
    pub fn start(netns: Option<&str>, ip: IpAddr, port: u16) -> anyhow::Result<KubeApi> {
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            fault: Mutex::new(Fault::None),
            requests: Mutex::new(BTreeMap::new()),
            conflicts: AtomicU64::new(0),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let netns = netns.map(str::to_string);
        let app = server::router(shared.clone());
        let thread = std::thread::spawn(move || {
            let bound = (|| -> anyhow::Result<std::net::TcpListener> {
                if let Some(ns) = &netns {
                    enter_netns(ns)?;
                }
                let listener = std::net::TcpListener::bind((ip, port))
                    .with_context(|| format!("binding the test API server to {ip}:{port}"))?;
                listener.set_nonblocking(true)?;
                Ok(listener)
            })();
            let listener = match bound {
                Ok(l) => l,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.into()));
                    return;
                }
            };
            runtime.block_on(async move {
                let addr = listener.local_addr();
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                let _ = ready_tx.send(addr.map_err(Into::into));
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        let addr = ready_rx
            .recv()
            .context("the test API server's thread ended before it listened")??;
        Ok(KubeApi {
            shared,
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// From now on, misbehave as `fault` says (`Fault::None`: serve again).
    /// `Errors` and `Hang` also end every open watch (the server went down and came back
    /// failing), so clients meet the fault at once, not at their watch's timeout.
    pub fn set_fault(&self, fault: Fault) {
        *self.shared.fault.lock().unwrap_or_else(|p| p.into_inner()) = fault;
        if matches!(fault, Fault::Errors | Fault::Hang) {
            let _ = self.store().events.send(Event::EndWatches);
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server (plain HTTP, bearer token), as kubectl would read it.
    pub fn write_kubeconfig(&self, path: &Path) -> anyhow::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: {url}\nusers:\n- name: lab\n  user:\n    token: {TOKEN}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: lab\ncurrent-context: lab\n",
            url = self.url()
        );
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        self.shared.lock()
    }

    /// A kubelet registers node `name` with these pod CIDRs (`spec.podCIDRs`).
    pub fn add_node(&self, name: &str, pod_cidrs: &[&str]) {
        self.add_node_with(name, pod_cidrs, &BTreeMap::new(), &BTreeMap::new());
    }

    pub fn add_node_with(
        &self,
        name: &str,
        pod_cidrs: &[&str],
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) {
        self.store()
            .put_node(new_node(name, pod_cidrs, labels, annotations));
    }

    /// Changes node `name` as another client would (one new resourceVersion). False if
    /// there is no such node.
    pub fn update_node(&self, name: &str, change: impl FnOnce(&mut Value)) -> bool {
        let mut store = self.store();
        let Some(mut node) = store.nodes.get(name).cloned() else {
            return false;
        };
        change(&mut node);
        store.put_node(node);
        true
    }

    /// Sets (or with `None` removes) an annotation, as `kubectl annotate` would.
    pub fn annotate(&self, name: &str, key: &str, value: Option<&str>) -> bool {
        self.update_node(name, |n| {
            let annotations = &mut n["metadata"]["annotations"];
            if !annotations.is_object() {
                *annotations = json!({});
            }
            if let Some(map) = annotations.as_object_mut() {
                match value {
                    Some(v) => map.insert(key.to_string(), json!(v)),
                    None => map.remove(key),
                };
            }
        })
    }

    pub fn delete_node(&self, name: &str) -> bool {
        self.store().delete_node(name).is_some()
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        self.store().nodes.get(name).cloned()
    }

    /// A pod `namespace/name` scheduled on `node` (for agents that find their node through
    /// POD_NAME / POD_NAMESPACE).
    pub fn add_pod(&self, namespace: &str, name: &str, node: &str) {
        let pod = json!({
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodeName": node, "hostNetwork": true}
        });
        self.store()
            .pods
            .insert((namespace.to_string(), name.to_string()), pod);
    }

    /// Ends every open watch and forgets the history up to now, as an API server does after
    /// a restart or a compaction; `during` runs in between, so its changes are not
    /// streamed to anyone: a client sees them only if it lists again after its `410 Gone`.
    pub fn expire_watches(&self, during: impl FnOnce(&mut Store)) {
        let mut store = self.store();
        let _ = store.events.send(Event::EndWatches);
        during(&mut store);
        store.oldest_watchable = store.rv + 1;
    }

    /// The next `n` PATCHes that carry a resourceVersion meet a concurrent write first,
    /// and so a `409 Conflict`.
    pub fn inject_conflicts(&self, n: u32) {
        self.store().conflicts_to_inject = n;
    }

    /// How many `409 Conflict`s the server has sent.
    pub fn conflicts_sent(&self) -> u64 {
        self.shared.conflicts.load(Ordering::Relaxed)
    }

    /// Every `(verb, resource)` served so far, e.g. `("patch", "nodes/status")`, and how
    /// often.
    pub fn requests(&self) -> BTreeMap<(String, String), u64> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // End the watches, too: graceful shutdown waits for open connections. The thread
        // is not joined: a client holding a connection open must not hang the test.
        let _ = self.store().events.send(Event::EndWatches);
        drop(self.thread.take());
    }
}

/// Moves the calling thread into network namespace `name` (as made by `ip netns add`).
fn enter_netns(name: &str) -> anyhow::Result<()> {
    let path = format!("/var/run/netns/{name}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: setns(2) on a valid fd changes only this thread's network namespace.
    let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("entering {name}"));
    }
    Ok(())
}
