//! What a failure in a pass means (as kube-runtime's `error_policy` is to its
//! reconciler): what the operator's views say, whether the node stays ready, what is
//! logged. Every failure is logged here, once; nothing is retried here: the next event or
//! the periodic resync runs the next pass, which re-reads everything.

use std::time::Instant;

use tracing::{error, info, warn};
use weft_backends::apply::{ApplyError, DataplaneReport};
use weft_backends::model::DesiredState;
use weft_backends::plan::{PatchedNode, PlanError};

use super::run_loop::LoopInputs;
use super::subnet_file::SubnetFileError;
use crate::observe::http::Readiness;

/// A reconcile's bookkeeping, for its log line and metrics.
pub(super) struct Outcome {
    pub(super) pass: u64,
    pub(super) full: bool,
    pub(super) started: Instant,
    pub(super) writes: u64,
    pub(super) plan_ms: f64,
    /// How the plan was made: in full (and why) or patched for the nodes that changed.
    pub(super) planned: weft_backends::plan::PlanKind,
}

/// Records a reconcile's result; returns whether the data plane is programmed (errors on
/// single objects, which the report lists, still count as programmed: the rest is in
/// place and the next pass retries them).
pub(super) fn reconciled(
    inputs: &LoopInputs,
    result: Result<DataplaneReport, ApplyError>,
    o: &Outcome,
) -> bool {
    let took = o.started.elapsed().as_secs_f64();
    match result {
        Ok(r) => {
            let before = inputs
                .snapshot
                .facts(|s| s.last_errors.clone())
                .unwrap_or_default();
            log_changes(&r);
            log_new_errors(&before, &r.errors);
            inputs.metrics.pass(took, !r.errors.is_empty());
            inputs.snapshot.update(|s| {
                s.passes += 1;
                s.pass_errors += u64::from(!r.errors.is_empty());
                s.last_errors = r.errors.clone();
                // The device this pass configured (CNI STATUS tells a successor from it).
                s.device_index = s
                    .device
                    .as_deref()
                    .and_then(weft_backends::userspace::ifindex);
            });
            inputs.health.set(Readiness::DataplaneProgrammed);
            inputs
                .ready
                .send_if_modified(|ready| !std::mem::replace(ready, true));
            info!(
                pass = o.pass,
                full = o.full,
                changes = r.changes.len(),
                errors = r.errors.len(),
                writes = o.writes,
                took_ms = took * 1e3,
                plan_ms = o.plan_ms,
                planned = ?o.planned,
                parts = ?r.timings,
                "reconciled"
            );
            true
        }
        Err(e) => {
            inputs.metrics.pass(took, true);
            inputs.snapshot.update(|s| {
                s.passes += 1;
                s.pass_errors += 1;
                s.last_errors = vec![e.to_string()];
            });
            inputs.health.unset(Readiness::DataplaneProgrammed);
            warn!(error = %e, "reconcile failed; retrying on the next event or resync");
            false
        }
    }
}

/// This node cannot be planned (its own lease or the config is unusable): the data plane
/// stays as it is.
pub(super) fn unplannable(e: &PlanError) {
    error!(error = %e, "cannot plan this node");
}

/// subnet.env could not be written: the node is not ready (the CNI plugin reads it).
pub(super) fn subnet_file_failed(e: &SubnetFileError) {
    error!(error = %e, "writing the subnet file");
}

pub(super) fn log_report(report: &DataplaneReport) {
    log_changes(report);
    for error in &report.errors {
        warn!(error = %error, "data plane");
    }
}

fn log_changes(report: &DataplaneReport) {
    for change in &report.changes {
        info!(change = %change, "data plane");
    }
}

/// A pass's errors, each logged once: an error the previous pass had too (a port still
/// taken, a route the kernel still refuses) is not repeated at every pass; `weft status`,
/// `weft doctor` and `/metrics` show it meanwhile. Their end is logged too.
fn log_new_errors(before: &[String], now: &[String]) {
    for error in now.iter().filter(|e| !before.contains(e)) {
        warn!(error = %error, "data plane");
    }
    if now.is_empty() && !before.is_empty() {
        info!(errors = before.len(), "data plane errors resolved");
    }
}

/// A plan's (device, node) pairs, borrowed from it, sorted and each once: the plan
/// mostly lists them in that order already, so this is one vector, not a tree of every
/// peer (nor, as once, 20,000 strings a pass at 10,000 peers).
fn planned_peers(s: Option<&DesiredState>) -> Vec<(&str, &str)> {
    let Some(s) = s else { return Vec::new() };
    let tunnels = s
        .tunnels
        .iter()
        .flat_map(|t| t.peers.iter().map(|p| (t.device.as_str(), p.node.as_str())));
    let vxlan = s
        .vxlan
        .iter()
        .flat_map(|v| v.peers.iter().map(|p| (v.device.as_str(), p.node.as_str())));
    let mut pairs: Vec<_> = tunnels.chain(vxlan).collect();
    if !pairs.is_sorted() {
        pairs.sort_unstable();
    }
    pairs.dedup();
    pairs
}

/// The pairs of `a` not in `b` (both sorted).
fn missing_from<'a>(a: &[(&'a str, &'a str)], b: &[(&str, &str)]) -> Vec<(&'a str, &'a str)> {
    let mut rest = b;
    a.iter()
        .filter(|x| {
            let at = rest.partition_point(|y| y < *x);
            rest = &rest[at..];
            rest.first() != Some(*x)
        })
        .copied()
        .collect()
}

/// Logs what changed in the plan: peers in and out, and each newly left-out peer's reason.
/// `patched` is what the planner re-planned to make `after` from `before`, when it patched
/// it (every other peer is as it was): then only those nodes are compared.
pub(super) fn report_plan(
    before: Option<&DesiredState>,
    after: &DesiredState,
    patched: Option<&[PatchedNode]>,
) {
    let peers = match (before, patched) {
        (Some(_), Some([])) => return,
        (Some(_), Some(nodes)) => {
            report_patched(after, nodes);
            after.tunnels.iter().map(|t| t.peers.len()).sum()
        }
        _ if before == Some(after) => return,
        _ => {
            let (old, new) = (planned_peers(before), planned_peers(Some(after)));
            for (device, node) in missing_from(&new, &old) {
                planned_in(device, node);
            }
            for (device, node) in missing_from(&old, &new) {
                removed_from(device, node);
            }
            new.len()
        }
    };
    // Both lists are sorted by node (the plan's order): a node's entries are one run.
    let was_left_out = |b: &DesiredState, l: &weft_backends::model::LeftOut| {
        let at = b.left_out.partition_point(|o| o.node < l.node);
        b.left_out[at..]
            .iter()
            .take_while(|o| o.node == l.node)
            .any(|o| o == l)
    };
    for l in &after.left_out {
        if !before.is_some_and(|b| was_left_out(b, l)) {
            warn!(node = ?l.node, reason = %l.reason, "peer left out");
        }
    }
    info!(
        tunnels = after.tunnels.len(),
        peers,
        routes = after.routes.len(),
        left_out = after.left_out.len(),
        "plan updated"
    );
}

fn planned_in(device: &str, node: &str) {
    info!(peer = %format!("{device} {node}"), "peer planned");
}

fn removed_from(device: &str, node: &str) {
    info!(peer = %format!("{device} {node}"), "peer removed from plan");
}

/// The re-planned nodes' devices in and out, by the planner's account of each (a patched
/// plan has the tunnels of the one before, in the same order: an index is one device).
fn report_patched(after: &DesiredState, nodes: &[PatchedNode]) {
    let tunnels = |peers: &[(usize, weft_crypto::PublicKey)]| {
        let mut at: Vec<usize> = peers.iter().map(|(d, _)| *d).collect();
        at.dedup();
        at
    };
    let name = |d: &usize| after.tunnels.get(*d).map(|t| t.device.as_str());
    for n in nodes {
        let (was, is) = (tunnels(&n.before), tunnels(&n.after));
        for device in is.iter().filter(|d| !was.contains(d)).filter_map(name) {
            planned_in(device, &n.node);
        }
        for device in was.iter().filter(|d| !is.contains(d)).filter_map(name) {
            removed_from(device, &n.node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::missing_from;

    #[test]
    fn missing_from_names_the_pairs_only_one_side_has() {
        let old = [("flannel-wg", "a"), ("flannel-wg", "b"), ("flannel.1", "a")];
        let new = [("flannel-wg", "b"), ("flannel-wg", "c"), ("flannel.1", "a")];
        assert_eq!(missing_from(&new, &old), [("flannel-wg", "c")]);
        assert_eq!(missing_from(&old, &new), [("flannel-wg", "a")]);
        assert!(missing_from(&old, &old).is_empty());
        assert_eq!(missing_from(&old, &[]), old);
    }
}
