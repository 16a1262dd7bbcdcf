//! Following every Node with kube's watcher: a LIST, then a WATCH from its
//! resourceVersion; on `410 Gone` (the API server no longer has that history) it lists
//! again, and the listing replaces the view, so a node deleted while the watch was down
//! leaves it too. Connection errors are retried with the agent's own backoff (250 ms
//! doubling to 10 s, `WatchBackoff`): kube's default grows to 30 s, which after an outage
//! kept the watch down past one resync of the API server's return.
//!
//! Also: publishing new attributes (and re-publishing when someone removes or changes this
//! node's annotations), and clearing `NetworkUnavailable` once the data plane is up.

use futures::StreamExt;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use tokio::time::Instant;
use tracing::{info, warn};
use weft_backends::model::ClusterView;

use super::{KubeRegistry, SlimNode};
use crate::registry::{publish_view, Alerts, FollowLinks, LocalAttrs};

/// Work that failed and is retried on a timer.
#[derive(Default)]
struct Pending {
    attrs: Option<LocalAttrs>,
    network_available: bool,
    retry_at: Option<Instant>,
}

/// The node watch's retry delays: the registry's `Backoff`.
struct WatchBackoff(crate::backoff::Backoff);

impl Iterator for WatchBackoff {
    type Item = std::time::Duration;

    fn next(&mut self) -> Option<Self::Item> {
        Some(self.0.next_delay())
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.0.reset();
    }
}

/// A LIST and WATCH of every Node from scratch.
fn watch_nodes(
    reg: &KubeRegistry,
) -> std::pin::Pin<Box<impl futures::Stream<Item = watcher::Result<Event<SlimNode>>>>> {
    Box::pin(
        watcher::watcher(reg.nodes.clone(), watcher::Config::default())
            .backoff(WatchBackoff(reg.cfg.backoff)),
    )
}

/// How often a failing API server is asked again for this node (`GET`), besides the
/// watch's own retries: the first answer starts a fresh watch at once, instead of at the
/// end of the watch's backoff.
const PROBE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

pub(super) async fn run(mut reg: KubeRegistry, mut links: FollowLinks) {
    let mut stream = watch_nodes(&reg);
    let mut probe = tokio::time::interval(PROBE_EVERY);
    let mut view = std::sync::Arc::new(ClusterView::default());
    let mut listing: Option<ClusterView> = None;
    let mut listed_once = false;
    let mut pending = Pending::default();
    let mut backoff = reg.cfg.backoff;
    let mut updates_open = true;
    let mut ready_open = true;
    loop {
        let retry_at = pending.retry_at;
        tokio::select! {
            _ = links.shutdown.changed() => return,
            update = links.updates.recv(), if updates_open => match update {
                Some(attrs) => {
                    pending.attrs = Some(attrs);
                    pending.retry_at = Some(Instant::now());
                }
                None => updates_open = false,
            },
            changed = links.ready.changed(), if ready_open => match changed {
                Ok(()) if *links.ready.borrow_and_update() && reg.cfg.set_network_unavailable => {
                    pending.network_available = true;
                    pending.retry_at = Some(Instant::now());
                }
                Ok(()) => {}
                Err(_) => ready_open = false,
            },
            () = sleep_until(retry_at), if retry_at.is_some() => {
                pending.retry_at = None;
                if let Err(e) = work(&mut reg, &mut pending, &links).await {
                    let delay = backoff.next_delay();
                    warn!(error = %e, retry_in = ?delay, "Kubernetes registry");
                    pending.retry_at = Some(Instant::now() + delay);
                } else {
                    backoff.reset();
                }
            },
            _ = probe.tick(), if links.alerts.registry.is_lost() => {
                // Bounded: a hanging server must not hold the loop (shutdown, updates).
                let asked = tokio::time::timeout(PROBE_EVERY, reg.nodes.get(&reg.cfg.node_name));
                if matches!(asked.await, Ok(Ok(_))) {
                    info!("the API server answers again; watching the nodes afresh");
                    stream = watch_nodes(&reg);
                }
            },
            event = stream.next() => match event {
                Some(Ok(Event::Init)) => listing = Some(ClusterView::default()),
                Some(Ok(Event::InitApply(node))) => {
                    if let Some(l) = listing.as_mut() {
                        apply(&reg, l, &node);
                    }
                    own_node(&mut reg, &node, &mut pending, &links);
                }
                Some(Ok(Event::InitDone)) => {
                    links.alerts.registry.back();
                    if let Some(fresh) = listing.take() {
                        info!(nodes = fresh.len(), "listed nodes");
                        publish_view(&mut view, fresh, &links, !listed_once);
                        listed_once = true;
                    }
                }
                Some(Ok(Event::Apply(node))) => {
                    links.alerts.registry.back();
                    let mut next = ClusterView::clone(&view);
                    apply(&reg, &mut next, &node);
                    publish_view(&mut view, next, &links, false);
                    own_node(&mut reg, &node, &mut pending, &links);
                }
                Some(Ok(Event::Delete(node))) => {
                    let mut next = ClusterView::clone(&view);
                    next.remove(node.name());
                    publish_view(&mut view, next, &links, false);
                }
                Some(Err(e)) => {
                    warn!(error = %e, "watching nodes (retried with backoff; a 410 Gone lists again)");
                    links.alerts.registry.lost(format!("the API server: {e}"));
                }
                None => {
                    warn!("the node watch ended");
                    return;
                }
            },
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Puts `node`'s lease into `view`, or takes the node out if it is not managed or its
/// data is unreadable (which is logged, naming the node and the field).
fn apply(reg: &KubeRegistry, view: &mut ClusterView, node: &SlimNode) {
    match node.lease(&reg.cfg.prefix) {
        Ok(Some(lease)) => {
            view.insert(lease);
        }
        Ok(None) => {
            view.remove(node.name());
        }
        Err(e) => {
            warn!(error = %e, "skipping node");
            view.remove(node.name());
        }
    }
}

/// The annotations that steer this node's traffic, which only an operator should set
/// (anyone allowed to patch Nodes can): a change is logged as a warning with the old and
/// new values, escaped, and counted in `alerts`. weft follows them; it cannot tell an
/// operator from an attacker.
fn steering_changes(reg: &mut KubeRegistry, node: &SlimNode, alerts: &Alerts) {
    let annotations = node.annotations();
    let now: Vec<(String, Option<String>)> = ["public-ip-overwrite", "node-public-ip"]
        .iter()
        .map(|name| {
            let key = format!("{}/{name}", reg.cfg.prefix);
            let value = annotations.get(&key).cloned();
            (key, value)
        })
        .collect();
    if let Some(before) = reg.steering.replace(now.clone()) {
        for ((key, old), (_, new)) in before.iter().zip(&now) {
            if old != new {
                alerts.steering_changes.inc();
                warn!(
                    node = %node.name(),
                    annotation = %key,
                    old = ?old,
                    new = ?new,
                    "an annotation that steers this node's traffic changed"
                );
            }
        }
    }
}

/// The relay port `--gateway` asks for, from the held request.
fn request_gateway(
    held: &Option<(weft_backends::model::Lease, crate::registry::AcquireRequest)>,
) -> Option<u16> {
    held.as_ref().and_then(|(_, r)| r.attrs.gateway)
}

/// Our own Node changed: if its annotations no longer say what we published (removed by
/// hand, the Node re-created), publish them again.
fn own_node(reg: &mut KubeRegistry, node: &SlimNode, pending: &mut Pending, links: &FollowLinks) {
    if node.name() != reg.cfg.node_name {
        return;
    }
    // The zone is the node's label (or annotation): follow it.
    let gateway = request_gateway(&reg.held)
        .or_else(|| weft_backends::model::annotations::gateway(&node.annotations()));
    if let Some((lease, _)) = reg.held.as_mut() {
        let zone = node.zone();
        if lease.reach.zone != zone || lease.reach.gateway != gateway {
            info!(node = %node.name(), zone = ?zone, gateway = ?gateway, "this node's zone or gateway role changed");
            lease.reach.zone = zone;
            lease.reach.gateway = gateway;
            links.local.send_replace(lease.clone());
        }
    }
    steering_changes(reg, node, &links.alerts);
    // An operator's `weft keys rotate --all` asks through this annotation.
    if let Some(id) = node.annotations().get(crate::registry::ROTATE_REQUEST) {
        if reg.last_rotate.as_ref() != Some(id) {
            reg.last_rotate = Some(id.clone());
            let _ = links.rotate.try_send(id.clone());
        }
    }
    if pending.attrs.is_some() {
        return;
    }
    let Some((_, request)) = &reg.held else {
        return;
    };
    let attrs = reg.effective_attrs(node, &request.attrs);
    if !super::publish::up_to_date(node, &reg.wanted(&attrs)) {
        warn!(node = %node.name(), "this node's annotations differ from what it publishes; publishing again");
        pending.attrs = Some(request.attrs.clone());
        pending.retry_at = Some(Instant::now());
    }
}

async fn work(
    reg: &mut KubeRegistry,
    pending: &mut Pending,
    links: &FollowLinks,
) -> Result<(), super::KubeError> {
    if let Some(attrs) = pending.attrs.clone() {
        let Some((lease, request)) = reg.held.clone() else {
            return Err(super::KubeError::NotAcquired);
        };
        let node = reg.get_node().await?;
        let effective = reg.effective_attrs(&node, &attrs);
        reg.publish(&effective).await?;
        let reach = lease.reach.clone();
        let mut lease = effective.to_lease_attrs().into_lease(
            lease.node.clone(),
            lease.subnet,
            lease.subnet_v6,
        );
        lease.reach = weft_backends::model::Reach {
            internal_ip: effective.internal_ip.map(std::net::IpAddr::V4),
            ..reach
        };
        reg.held = Some((lease.clone(), request.with_attrs(attrs)));
        links.local.send_if_modified(|l| {
            let changed = *l != lease;
            *l = lease;
            changed
        });
        pending.attrs = None;
    }
    if pending.network_available {
        reg.set_network_available().await?;
        pending.network_available = false;
    }
    Ok(())
}
