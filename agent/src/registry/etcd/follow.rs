//! Following the cluster: list, then watch from the listed revision; on a broken or
//! compacted watch, list again and diff. Also renews the lease on schedule, takes it back
//! if it disappears, and publishes attribute updates. Every failure is logged and retried
//! with backoff; this returns only on shutdown.

use etcd_client::{EventType, WatchOptions};
use tokio::time::Instant;
use tracing::{info, warn};
use weft_backends::model::{ClusterView, LeaseAttrs};

use super::kv::lease_of;
use super::{EtcdRegistry, RegistryError};
use crate::backoff::sleep_or_shutdown;
use crate::registry::{publish_view, Alerts, FollowLinks};

enum Ended {
    Shutdown,
    /// Start over with a fresh listing, for this reason.
    Relist(&'static str),
}

pub(super) async fn run(mut reg: EtcdRegistry, mut links: FollowLinks) {
    let mut view = std::sync::Arc::new(ClusterView::default());
    let mut backoff = reg.cfg.backoff;
    let mut next_renew = Instant::now() + reg.cfg.renew_every();
    loop {
        match session(
            &mut reg,
            &mut links,
            &mut view,
            &mut next_renew,
            &mut backoff,
        )
        .await
        {
            Ok(Ended::Shutdown) => return,
            Ok(Ended::Relist(why)) => info!(reason = why, "re-listing leases"),
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(error = %e, retry_in = ?delay, "etcd registry");
                links.alerts.registry.lost(&e);
                if sleep_or_shutdown(delay, &mut links.shutdown).await {
                    return;
                }
            }
        }
    }
}

/// Reads `key` once, then watches it from the next revision: its value now, and the
/// stream of its changes.
async fn read_and_watch(
    reg: &EtcdRegistry,
    client: &mut etcd_client::Client,
    key: &str,
) -> Result<(Option<Vec<u8>>, etcd_client::WatchStream), RegistryError> {
    let resp = reg
        .call("reading", key, client.get(key.to_string(), None))
        .await?;
    let next = resp.header().map_or(0, |h| h.revision()) + 1;
    let options = WatchOptions::new().with_start_revision(next);
    let stream = reg
        .call(
            "watching",
            key,
            client.watch(key.to_string(), Some(options)),
        )
        .await?;
    Ok((resp.kvs().first().map(|kv| kv.value().to_vec()), stream))
}

/// An update whose write failed (etcd away, a connection cut by an address change) was
/// taken from the queue: if what is stored is not what this node means to publish, it is
/// published now. True if it was.
async fn publish_unpublished(
    reg: &mut EtcdRegistry,
    links: &FollowLinks,
    stored: &[super::acquire::Stored],
    ours: &str,
) -> Result<bool, RegistryError> {
    let (Some((held, request)), Some(stored)) = (
        reg.held.clone(),
        stored.iter().find(|s| s.lease.node == ours),
    ) else {
        return Ok(false);
    };
    if LeaseAttrs::from_lease(&held) == LeaseAttrs::from_lease(&stored.lease) {
        return Ok(false);
    }
    info!(lease = %ours, "publishing the attributes an earlier update could not");
    let lease = reg.republish(request.attrs).await?;
    links.local.send_replace(lease);
    Ok(true)
}

/// Passes a rotation request on to the agent, once per id.
fn forward_rotation(reg: &mut EtcdRegistry, links: &FollowLinks, value: &[u8]) {
    let id = String::from_utf8_lossy(value).into_owned();
    if reg.last_rotate.as_ref() != Some(&id) {
        reg.last_rotate = Some(id.clone());
        let _ = links.rotate.try_send(id);
    }
}

/// The PSK key's value (`None`: deleted) to the loop, if it changed.
fn publish_psk(links: &FollowLinks, value: Option<&[u8]>) {
    let value = value.map(|v| String::from_utf8_lossy(v).into_owned());
    links
        .psk
        .send_if_modified(|v| std::mem::replace(v, value.clone()) != value);
}

/// `view` after the watch's lease `events`; and whether this node's own lease (`ours`) was
/// deleted. An unreadable lease is logged and leaves the view.
fn apply_lease_events(
    view: &ClusterView,
    events: &[etcd_client::Event],
    dir: &str,
    ours: &str,
) -> (ClusterView, bool) {
    let mut next = view.clone();
    let mut lost_ours = false;
    for event in events {
        let Some(kv) = event.kv() else { continue };
        let name = String::from_utf8_lossy(kv.key())
            .trim_start_matches(dir)
            .to_string();
        match event.event_type() {
            EventType::Put => match lease_of(dir, kv) {
                Ok(lease) => {
                    next.insert(lease);
                }
                Err(e) => {
                    warn!(error = %e, "skipping unreadable lease");
                    next.remove(&name);
                }
            },
            EventType::Delete => {
                lost_ours |= name == ours;
                next.remove(&name);
            }
        }
    }
    (next, lost_ours)
}

/// Puts this node's lease back where the watch saw someone else write it (`ours`: its
/// key), counting each time in `alerts`.
async fn defend_ours(
    reg: &mut EtcdRegistry,
    events: &[etcd_client::Event],
    ours: &str,
    alerts: &Alerts,
) -> Result<(), RegistryError> {
    for event in events {
        if let (EventType::Put, Some(kv)) = (event.event_type(), event.kv()) {
            if kv.key() == ours.as_bytes() && reg.defend(kv).await? {
                alerts.leases_defended.inc();
            }
        }
    }
    Ok(())
}

/// Reads and watches the cluster's PSK, with an announced next one (keys::psk), passing it
/// on; never in clear (the agent refused to start if one was there, and one written later
/// is not read): then there is no watch.
async fn watch_psk(
    reg: &EtcdRegistry,
    client: &mut etcd_client::Client,
    links: &FollowLinks,
    key: &str,
) -> Result<Option<etcd_client::WatchStream>, RegistryError> {
    if !reg.secrets_allowed() {
        return Ok(None);
    }
    let (psk, stream) = read_and_watch(reg, client, key).await?;
    publish_psk(links, psk.as_deref());
    Ok(Some(stream))
}

/// The next message of a watch that may not exist (then never).
async fn next_message(
    stream: &mut Option<etcd_client::WatchStream>,
) -> Result<Option<etcd_client::WatchResponse>, etcd_client::Error> {
    match stream {
        Some(s) => s.message().await,
        None => std::future::pending().await,
    }
}

/// The value a put event writes; `None` for a delete.
fn put_value(event: &etcd_client::Event) -> Option<&[u8]> {
    match (event.event_type(), event.kv()) {
        (EventType::Put, Some(kv)) => Some(kv.value()),
        _ => None,
    }
}

/// Renews this node's etcd lease when due; one that expired is claimed again, and then the
/// session ends for a re-list.
async fn renew(
    reg: &mut EtcdRegistry,
    links: &mut FollowLinks,
    next_renew: &mut Instant,
) -> Result<Option<Ended>, RegistryError> {
    match reg.renew().await {
        Ok(()) => {
            *next_renew = Instant::now() + reg.cfg.renew_every();
            Ok(None)
        }
        Err(RegistryError::LeaseExpired { key, .. }) => {
            warn!(lease = %key, "etcd lease expired before renewal; claiming again");
            let lease = reg.reacquire().await?;
            links.local.send_replace(lease);
            *next_renew = Instant::now() + reg.cfg.renew_every();
            Ok(Some(Ended::Relist("lease re-acquired")))
        }
        Err(e) => Err(e),
    }
}

async fn session(
    reg: &mut EtcdRegistry,
    links: &mut FollowLinks,
    view: &mut std::sync::Arc<ClusterView>,
    next_renew: &mut Instant,
    backoff: &mut crate::backoff::Backoff,
) -> Result<Ended, RegistryError> {
    if *links.shutdown.borrow() {
        return Ok(Ended::Shutdown);
    }
    let listed = reg.list().await?;
    backoff.reset();
    links.alerts.registry.back();
    let ours = reg
        .held
        .as_ref()
        .map(|(l, _)| l.node.clone())
        .unwrap_or_default();
    if !listed.leases.iter().any(|s| s.lease.node == ours) {
        warn!(lease = %ours, "this node's lease is gone from etcd; claiming it again");
        let lease = reg.reacquire().await?;
        links.local.send_replace(lease);
        return Ok(Ended::Relist("lease re-acquired"));
    }
    if publish_unpublished(reg, links, &listed.leases, &ours).await? {
        return Ok(Ended::Relist("attributes published again"));
    }
    let mut fresh = ClusterView::default();
    for stored in listed.leases {
        fresh.insert(stored.lease);
    }
    publish_view(view, fresh, links, false);

    let dir = reg.cfg.subnets_dir();
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(listed.revision + 1);
    let mut client = reg.client.clone();
    let mut stream = reg
        .call("watching", &dir, client.watch(dir.clone(), Some(options)))
        .await?;
    let mut updates_open = true;
    // An operator's `weft keys rotate --all` writes <prefix>/weft/rotate/<node>: read it
    // once (a request written while this agent was down), then watch it.
    let rotate_key = super::kv::rotate_request_key(&reg.cfg.prefix, &ours);
    let (request, mut rotate_stream) = read_and_watch(reg, &mut client, &rotate_key).await?;
    if let Some(value) = request {
        forward_rotation(reg, links, &value);
    }
    let psk_key = reg.cfg.psk_key();
    let mut psk_stream = watch_psk(reg, &mut client, links, &psk_key).await?;
    loop {
        tokio::select! {
            _ = links.shutdown.changed() => return Ok(Ended::Shutdown),
            message = next_message(&mut psk_stream) => {
                let resp = message.map_err(reg.etcd_err("watching", &psk_key))?;
                let Some(resp) = resp else { return Ok(Ended::Relist("etcd closed the PSK watch")) };
                for event in resp.events() {
                    publish_psk(links, put_value(event));
                }
            },
            message = rotate_stream.message() => {
                let resp = message.map_err(reg.etcd_err("watching", &rotate_key))?;
                let Some(resp) = resp else { return Ok(Ended::Relist("etcd closed the rotation watch")) };
                for event in resp.events() {
                    if let (EventType::Put, Some(kv)) = (event.event_type(), event.kv()) {
                        forward_rotation(reg, links, kv.value());
                    }
                }
            },
            update = links.updates.recv(), if updates_open => match update {
                Some(attrs) => {
                    let lease = reg.republish(attrs).await?;
                    links.local.send_replace(lease);
                }
                None => updates_open = false,
            },
            () = tokio::time::sleep_until(*next_renew) => {
                if let Some(ended) = renew(reg, links, next_renew).await? {
                    return Ok(ended);
                }
            },
            message = stream.message() => {
                let resp = message.map_err(reg.etcd_err("watching", &dir))?;
                let Some(resp) = resp else { return Ok(Ended::Relist("etcd closed the watch")) };
                if resp.canceled() || resp.compact_revision() > 0 {
                    return Ok(Ended::Relist("the watch was compacted or cancelled"));
                }
                let (next, lost_ours) = apply_lease_events(view, resp.events(), &dir, &ours);
                publish_view(view, next, links, false);
                defend_ours(reg, resp.events(), &format!("{dir}{ours}"), &links.alerts).await?;
                if lost_ours {
                    return Ok(Ended::Relist("this node's lease was deleted"));
                }
            }
        }
    }
}
