//! The control loop: registry → plan → data plane, level-triggered. Whatever wakes it (a
//! new view, a change to our own lease, a deletion the kernel reports, the resync timer)
//! re-plans the whole node from the latest state; a pass woken by the registry or a
//! deletion is incremental, the periodic resync is full.

use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::watch;
use tracing::{error, info, warn, Instrument};
use weft_backends::apply::{Dataplane, DataplaneReport};
use weft_backends::model::{ClusterView, DesiredState, Lease};
use weft_backends::netconf::NetConf;
use weft_backends::plan::{plan, PlanInput, PlanOptions};

use crate::cli::AgentArgs;
use crate::health::{Health, Readiness};
use crate::metrics::Metrics;
use crate::psk::{effective_net, PskSources};
use crate::rotation::{KeyState, RotateRequest};
use crate::switchover::Switchover;
use crate::{status, subnet_file};

/// Everything that can wake the control loop.
pub(crate) struct LoopInputs {
    pub(crate) views: watch::Receiver<Arc<ClusterView>>,
    pub(crate) local: watch::Receiver<Lease>,
    pub(crate) deletions: tokio::sync::mpsc::Receiver<()>,
    pub(crate) shutdown: watch::Receiver<bool>,
    /// Told once the data plane is first programmed (the registry may announce it).
    pub(crate) ready: watch::Sender<bool>,
    pub(crate) health: Health,
    pub(crate) snapshot: status::Shared,
    pub(crate) metrics: Metrics,
    pub(crate) rotate: tokio::sync::mpsc::Receiver<RotateRequest>,
    /// Rotation requests an operator wrote in the registry (their ids).
    pub(crate) registry_rotations: tokio::sync::mpsc::Receiver<String>,
    pub(crate) psk: PskSources,
}

/// Sleeps until `at`, or forever.
async fn sleep_until(at: Option<SystemTime>) {
    match at {
        Some(at) => {
            let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
            tokio::time::sleep(wait).await
        }
        None => std::future::pending().await,
    }
}

/// How often the nftables tables are checked: deleting one raises no netlink event.
const NFT_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

fn log_report(report: &DataplaneReport) {
    for change in &report.changes {
        info!(change = %change, "data plane");
    }
    for error in &report.errors {
        warn!(error = %error, "data plane");
    }
}

pub(crate) async fn control_loop(
    args: &AgentArgs,
    net: &NetConf,
    options: &PlanOptions,
    keys: &mut KeyState,
    dataplane: &mut Dataplane,
    mut inputs: LoopInputs,
) {
    let mut resync = tokio::time::interval(args.resync_period);
    let mut nft_check = tokio::time::interval(NFT_CHECK);
    let mut psk_check = tokio::time::interval(std::time::Duration::from_secs(1));
    inputs.psk.refresh();
    let mut last: Option<DesiredState> = None;
    let mut pass: u64 = 0;
    // A pass woken by the registry or a deletion trusts what the last passes read of the
    // WireGuard devices (no event reports their peers changing); the first pass and the
    // periodic resync read everything.
    let mut full = true;
    // Nothing is planned before the registry's first full listing: a plan made from the
    // empty view would remove every peer that a previous run left in place, dropping
    // traffic that the restart should not touch.
    loop {
        tokio::select! {
            listed = inputs.views.changed() => match listed {
                Ok(()) => break,
                Err(_) => return,
            },
            // Waiting for the registry (which retries on its own) is not being wedged.
            _ = nft_check.tick() => inputs.health.beat(),
            _ = inputs.shutdown.changed() => return,
        }
    }
    info!(
        nodes = inputs.views.borrow().leases.len(),
        "first full listing"
    );
    let mut seen_view = Arc::new(ClusterView::default());
    let mut switchover = Switchover::default();
    loop {
        inputs.health.beat();
        let me = inputs.local.borrow_and_update().clone();
        let raw_view = inputs.views.borrow_and_update().clone();
        if !Arc::ptr_eq(&seen_view, &raw_view) {
            inputs.metrics.registry_changes(&seen_view.diff(&raw_view));
            seen_view = raw_view.clone();
        }
        // Peers' announced keys take over when they are in use (see `switchover`).
        let view = switchover.view(&raw_view, &me.node);
        let t_plan = std::time::Instant::now();
        let now = SystemTime::now();
        let config = effective_net(net, inputs.psk.state.as_ref(), now);
        match plan(&PlanInput {
            local: &me,
            view: &view,
            config: &config,
            options,
            now,
        }) {
            Ok(state) => {
                let plan_ms = t_plan.elapsed().as_secs_f64() * 1e3;
                report(last.as_ref(), &state);
                inputs.snapshot.update(|s| {
                    status::from_plan(&me, &view, &state, s);
                    s.key_generation = keys.rotation.generation();
                    s.rotating = keys.rotation.pending().cloned();
                });
                let peer_keys: Vec<(String, String)> = state
                    .tunnels
                    .iter()
                    .flat_map(|t| &t.peers)
                    .map(|p| (p.node.clone(), p.public_key.to_string()))
                    .collect();
                inputs
                    .metrics
                    .peer_keys(peer_keys.iter().map(|(n, k)| (n.as_str(), k.as_str())));
                match subnet_file::write(&args.subnet_file, &state.subnet_env) {
                    Ok(written) => {
                        if written {
                            info!(path = %args.subnet_file.display(), "wrote subnet file");
                        }
                        inputs.health.set(Readiness::SubnetFileWritten);
                    }
                    Err(e) => {
                        inputs.health.unset(Readiness::SubnetFileWritten);
                        error!(error = %e, "writing the subnet file");
                    }
                }
                pass += 1;
                let span = tracing::info_span!("reconcile", pass);
                let (started, writes) = (std::time::Instant::now(), dataplane.writes());
                let result = if full {
                    dataplane
                        .reconcile(&state, &keys.key)
                        .instrument(span)
                        .await
                } else {
                    dataplane
                        .reconcile_incremental(&state, &keys.key)
                        .instrument(span)
                        .await
                };
                match result {
                    Ok(r) => {
                        log_report(&r);
                        keys.published_after_switch().await;
                        inputs
                            .metrics
                            .pass(started.elapsed().as_secs_f64(), !r.errors.is_empty());
                        inputs.snapshot.update(|s| {
                            s.passes += 1;
                            s.pass_errors += u64::from(!r.errors.is_empty());
                            s.last_errors = r.errors.clone();
                        });
                        inputs.health.set(Readiness::DataplaneProgrammed);
                        inputs
                            .ready
                            .send_if_modified(|ready| !std::mem::replace(ready, true));
                        info!(
                            pass,
                            full,
                            changes = r.changes.len(),
                            errors = r.errors.len(),
                            writes = dataplane.writes() - writes,
                            took_ms = started.elapsed().as_secs_f64() * 1e3,
                            plan_ms,
                            parts = ?r.timings,
                            "reconciled"
                        );
                    }
                    Err(e) => {
                        inputs.metrics.pass(started.elapsed().as_secs_f64(), true);
                        inputs.snapshot.update(|s| {
                            s.passes += 1;
                            s.pass_errors += 1;
                            s.last_errors = vec![e.to_string()];
                        });
                        inputs.health.unset(Readiness::DataplaneProgrammed);
                        warn!(error = %e, "reconcile failed; retrying on the next event or resync")
                    }
                }
                last = Some(state);
            }
            Err(e) => error!(error = %e, "cannot plan this node"),
        }
        loop {
            tokio::select! {
                _ = inputs.views.changed() => {
                    full = false;
                    break;
                }
                _ = inputs.local.changed() => {
                    full = false;
                    break;
                }
                _ = resync.tick() => {
                    full = true;
                    break;
                }
                // Links, addresses, routes and neighbours are read in every pass, and a
                // deleted device is recreated and read afresh; so a deletion (often one of
                // the agent's own) needs no full pass.
                Some(()) = inputs.deletions.recv() => {
                    full = false;
                    break;
                }
                _ = nft_check.tick() => {
                    inputs.health.beat();
                    if let Some(state) = &last {
                        match dataplane.reconcile_nft(state).await {
                            Ok(r) => log_report(&r),
                            Err(e) => warn!(error = %e, "nftables check failed"),
                        }
                    }
                }
                Some(request) = inputs.rotate.recv() => {
                    let started = keys.start().await;
                    inputs.snapshot.update(|s| s.rotating = keys.rotation.pending().cloned());
                    if let Err(e) = &started {
                        warn!(error = %e, "cannot rotate the key");
                    }
                    if let Some(reply) = request.reply {
                        let _ = reply.send(started);
                    }
                }
                Some(id) = inputs.registry_rotations.recv() => {
                    if keys.takes_request(&id) {
                        info!(request = %id, "key rotation requested through the registry");
                        if let Err(e) = keys.start().await {
                            warn!(error = %e, "cannot rotate the key");
                        }
                        inputs.snapshot.update(|s| s.rotating = keys.rotation.pending().cloned());
                    }
                }
                // This node's announced switch.
                () = sleep_until(keys.due()) => {
                    let published = inputs.local.borrow().next_key.clone();
                    if keys.switch(published.as_ref()).await {
                        full = true;
                        break;
                    }
                }
                // The PSK sources: the registry's key, or the mounted Secret (read every
                // second; a Secret's files change without an event we could wait on).
                changed = inputs.psk.registry.changed(), if inputs.psk.dir.is_none() => {
                    if changed.is_ok() && inputs.psk.refresh() {
                        full = false;
                        break;
                    }
                }
                _ = psk_check.tick(), if inputs.psk.dir.is_some() => {
                    if inputs.psk.refresh() {
                        full = false;
                        break;
                    }
                }
                // The announced PSK takes over.
                () = sleep_until(inputs.psk.state.as_ref().and_then(|p| p.next_switch(SystemTime::now()))) => {
                    full = false;
                    break;
                }
                // A peer's announced switch is near: is its next key in use yet?
                () = sleep_until(switchover.poll_at(&raw_view, &me.node, SystemTime::now())) => {
                    let device = last.as_ref().and_then(|s| s.tunnels.first()).map(|t| t.device.clone());
                    if let Some(device) = device {
                        match dataplane.handshakes(&device).await {
                            Ok(h) if switchover.observe(&raw_view, &me.node, &h) => {
                                full = false;
                                break;
                            }
                            Ok(_) => {}
                            Err(e) => warn!(error = %e, "reading handshakes for a key switch"),
                        }
                    }
                }
                // A peer's announced switch, at the latest: its new key takes over now.
                () = sleep_until(last.as_ref().and_then(|s| s.next_switch)) => {
                    full = false;
                    break;
                }
                _ = inputs.shutdown.changed() => return,
            }
        }
    }
}

/// Logs what changed in the plan: peers in and out, and each newly left-out peer's reason.
fn report(before: Option<&DesiredState>, after: &DesiredState) {
    if before == Some(after) {
        return;
    }
    let peers = |s: Option<&DesiredState>| -> std::collections::BTreeSet<String> {
        s.map(|s| {
            let tunnels = s
                .tunnels
                .iter()
                .flat_map(|t| t.peers.iter().map(|p| format!("{} {}", t.device, p.node)));
            let vxlan = s
                .vxlan
                .iter()
                .flat_map(|v| v.peers.iter().map(|p| format!("{} {}", v.device, p.node)));
            tunnels.chain(vxlan).collect()
        })
        .unwrap_or_default()
    };
    let (old, new) = (peers(before), peers(Some(after)));
    for p in new.difference(&old) {
        info!(peer = %p, "peer planned");
    }
    for p in old.difference(&new) {
        info!(peer = %p, "peer removed from plan");
    }
    for l in &after.left_out {
        if !before.is_some_and(|b| b.left_out.contains(l)) {
            warn!(node = %l.node, reason = %l.reason, "peer left out");
        }
    }
    info!(
        tunnels = after.tunnels.len(),
        peers = new.len(),
        routes = after.routes.len(),
        left_out = after.left_out.len(),
        "plan updated"
    );
}
