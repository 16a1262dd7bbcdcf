//! Re-planning the changed nodes of a wireguard plan in place: each changed node's
//! entries, routes, paths and reasons left out come out, and its new ones go in where the
//! full plan puts them (peers and routes oldest first, paths and reasons by node name).
//! Every search is a binary search in the plan's own order, so a node costs a few
//! searches and moves, not a pass over the cluster.

use std::ops::Range;
use std::sync::Arc;

use weft_crypto::PublicKey;

use super::claims::{KeyIndex, SubnetIndex};
use super::{Memo, PatchedNode, MOST_PATCHED};
use crate::model::{ClusterView, DesiredState, Lease, LeftOut, PeerPath, RouteRole, RouteSpec};
use crate::netconf::{Backend, BackendKind, WireguardConf};
use crate::plan::peers::{check, seniority};
use crate::plan::wireguard::{self, base_node, DevicePlan};
use crate::plan::{path_mtu, post_quantum, roaming, LocalSubnets, PlanInput};

/// Why a pass is planned in full instead.
type Full = &'static str;

/// Re-plans the nodes that changed since `memo`'s plan, in place; which, with their peers
/// before and after, or why the pass must be planned in full.
pub(super) fn patch(
    memo: &mut Memo,
    input: &PlanInput<'_>,
    view: &Arc<ClusterView>,
) -> Result<Vec<PatchedNode>, Full> {
    if let Some(why) = memo.stale(input) {
        return Err(why);
    }
    let Backend::Wireguard(wg) = &input.config.backend else {
        return Err("backend");
    };
    let ours = LocalSubnets::of(input.local, input.config).map_err(|_| "own lease")?;
    let devices = wireguard::devices(input, &ours, wg);
    let names: Vec<&str> = devices.iter().map(|d| d.name).collect();
    if names.len() != memo.keys.len() || names.len() != memo.state.tunnels.len() {
        return Err("devices");
    }
    let (mut nodes, reports) = memo.changed_nodes(input, view, &names);
    nodes.remove(&input.local.node);
    if nodes.len() > MOST_PATCHED {
        return Err("many changes");
    }
    let old_view = memo.view.clone();
    if nodes
        .iter()
        .any(|n| rotates(&old_view, n) || rotates(view, n))
    {
        return Err("a changed node rotates");
    }
    // A gateway carries other nodes' pairs: which one carries which turns on all of them.
    if nodes
        .iter()
        .any(|n| is_gateway(&old_view, n) || is_gateway(view, n))
    {
        return Err("a gateway changed");
    }
    let own_keys = devices
        .iter()
        .map(|d| wireguard::local_key(input, d.v6_data))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "own key")?;
    let mut patcher = Patcher {
        input,
        wg,
        ours,
        kind: input.config.backend.kind(),
        devices,
        own_keys,
        state: Arc::make_mut(&mut memo.state),
        subnets: &mut memo.subnets,
        keys: &mut memo.keys,
    };
    patcher.make_room(nodes.len());
    // Out with every changed node's old entries first: the new ones are then checked
    // against the claims of the others alone.
    let mut patched: Vec<PatchedNode> = nodes
        .iter()
        .map(|node| PatchedNode {
            node: node.clone(),
            ..Default::default()
        })
        .collect();
    for (node, record) in nodes.iter().zip(&mut patched) {
        if let Some(old) = old_view.get(node) {
            patcher.remove(old, &old_view, &mut record.before)?;
        }
    }
    for (node, record) in nodes.iter().zip(&mut patched) {
        if let Some(new) = view.get(node) {
            patcher.add(new, view, &mut record.after)?;
        }
    }
    memo.view = view.clone();
    for key in reports {
        match input.observed.peers.get(&key) {
            Some(have) => {
                memo.roams_until(have, input.now);
                memo.observed.peers.insert(key, have.clone());
            }
            None => {
                memo.observed.peers.remove(&key);
            }
        }
    }
    for node in &nodes {
        if let Some(lease) = view.get(node) {
            memo.expires_at(lease, input.now);
        }
    }
    memo.planned_at = input.now;
    Ok(patched)
}

struct Patcher<'a, 'i> {
    input: &'a PlanInput<'i>,
    wg: &'a WireguardConf,
    ours: LocalSubnets,
    kind: BackendKind,
    devices: Vec<DevicePlan>,
    /// This node's key on each device.
    own_keys: Vec<PublicKey>,
    state: &'a mut DesiredState,
    subnets: &'a mut [SubnetIndex; 2],
    keys: &'a mut [KeyIndex],
}

impl Patcher<'_, '_> {
    /// Room in the plan's lists for the new entries of `nodes` changed nodes, made once:
    /// a plan cloned from the one the last pass shares has none to spare, and each
    /// insertion past it doubled the list (at 10,000 peers, megabytes more held for a pass).
    fn make_room(&mut self, nodes: usize) {
        let devices = self.devices.len();
        for tunnel in &mut self.state.tunnels {
            tunnel.peers.reserve_exact(nodes);
        }
        // A node has at most a subnet of each family: as many routes and paths.
        self.state.routes.reserve_exact(2 * nodes * devices);
        self.state.paths.reserve_exact(2 * nodes * devices);
        self.state.post_quantum.reserve_exact(nodes);
        self.state.left_out.reserve_exact(nodes * (devices + 1));
    }

    /// Takes out everything `lease` (as planned from `view`) put in the plan, noting its
    /// peers taken out in `taken`. A claim of it another node contends for means the other
    /// node's fate turns on it: planned in full.
    fn remove(
        &mut self,
        lease: &Lease,
        view: &ClusterView,
        taken: &mut Vec<(usize, PublicKey)>,
    ) -> Result<(), Full> {
        let node = lease.node.as_str();
        remove_run(&mut self.state.left_out, node, |l| &l.node);
        remove_run(&mut self.state.paths, node, |p| &p.node);
        remove_run(&mut self.state.post_quantum, node, |p| &p.node);
        let Ok(c) = check(self.input, &self.ours, self.kind, lease) else {
            return Ok(());
        };
        for (family, net) in [(0, c.v4), (1, c.v6)] {
            if let Some(net) = net {
                if self.subnets[family].contended(node, net) {
                    return Err("a changed node's subnet is contended");
                }
                self.subnets[family].remove(node, net);
            }
        }
        let place = seniority(lease);
        for (d, dev) in self.devices.iter().enumerate() {
            let allowed = wireguard::allowed_ips(&c, dev);
            if allowed.is_empty() {
                continue;
            }
            let Ok(p) = wireguard::peer(self.input, &c, dev, self.wg, self.own_keys[d], allowed)
            else {
                continue;
            };
            if self.keys[d].contended(&p.public_key, node) {
                return Err("a changed node's key is contended");
            }
            self.keys[d].remove(&p.public_key, node);
            self.state
                .planned_endpoints
                .remove(&(dev.name.into(), p.public_key));
            let peers = &mut self.state.tunnels[d].peers;
            let at = peers.partition_point(|e| entry_place(view, &e.node) < Some(place));
            let end = at + peers[at..].iter().take_while(|e| e.node == node).count();
            taken.extend(peers.drain(at..end).map(|e| (d, e.public_key)));
            let block = peer_routes(&self.state.routes, dev.name)?;
            let routes = &self.state.routes[block.clone()];
            let at = block.start + routes.partition_point(|r| route_place(view, r) < Some(place));
            let end = at
                + self.state.routes[at..block.end]
                    .iter()
                    .take_while(|r| matches!(&r.role, RouteRole::Peer(n) if n == node))
                    .count();
            self.state.routes.drain(at..end);
        }
        Ok(())
    }

    /// Puts in what `lease` (of `view`) makes of its node, where the full plan puts it,
    /// noting its peers put in in `put`.
    fn add(
        &mut self,
        lease: &Lease,
        view: &ClusterView,
        put: &mut Vec<(usize, PublicKey)>,
    ) -> Result<(), Full> {
        let node = lease.node.as_str();
        let mut left_out = Vec::new();
        let mut paths: Vec<PeerPath> = Vec::new();
        let mut pq: Option<post_quantum::PqParts> = None;
        match check(self.input, &self.ours, self.kind, lease) {
            Err(reason) => left_out.push(LeftOut {
                node: node.to_string(),
                reason,
            }),
            Ok(c) => {
                for (family, net) in [(0, c.v4), (1, c.v6)] {
                    if let Some(net) = net {
                        if self.subnets[family].contended(node, net) {
                            return Err("a changed node's subnet is contended");
                        }
                        self.subnets[family].insert(node, net);
                    }
                }
                let place = seniority(lease);
                for d in 0..self.devices.len() {
                    let dev = &self.devices[d];
                    let allowed = wireguard::allowed_ips(&c, dev);
                    if allowed.is_empty() {
                        continue;
                    }
                    let own = self.own_keys[d];
                    let mut p = match wireguard::peer(self.input, &c, dev, self.wg, own, allowed) {
                        Ok(p) => p,
                        Err(reason) => {
                            left_out.push(LeftOut {
                                node: node.to_string(),
                                reason,
                            });
                            continue;
                        }
                    };
                    if self.keys[d].contended(&p.public_key, node) {
                        return Err("a changed node's key is contended");
                    }
                    self.keys[d].insert(p.public_key, node);
                    roaming::keep_roamed(
                        dev.name,
                        std::slice::from_mut(&mut p),
                        self.input.observed,
                        self.input.now,
                        &mut self.state.planned_endpoints,
                    );
                    let block = peer_routes(&self.state.routes, dev.name)?;
                    let routes = &self.state.routes[block.clone()];
                    let at = block.start
                        + routes.partition_point(|r| route_place(view, r) < Some(place));
                    let mut new: Vec<RouteSpec> = wireguard::routes_of(dev.name, &p).collect();
                    let pod_mtu = self.state.subnet_env.mtu;
                    let endpoint = p.endpoint.ip();
                    path_mtu::entry_routes(
                        self.input, pod_mtu, node, &mut new, endpoint, &mut paths,
                    );
                    self.state.routes.splice(at..at, new);
                    if let Some(part) = post_quantum::wg_part(self.state, dev.name, &p) {
                        post_quantum::merge(pq.get_or_insert(part), part);
                    }
                    let peers = &mut self.state.tunnels[d].peers;
                    let at = peers.partition_point(|e| entry_place(view, &e.node) < Some(place));
                    put.push((d, p.public_key));
                    peers.insert(at, p);
                }
            }
        }
        if let Some(parts) = pq.filter(|_| post_quantum::enabled(self.input.config)) {
            let peer = post_quantum::pq_peer(self.input, node, parts);
            insert_run(&mut self.state.post_quantum, node, |p| &p.node, vec![peer]);
        }
        paths.sort_by_key(|p| p.address);
        insert_run(&mut self.state.paths, node, |p| &p.node, paths);
        insert_run(&mut self.state.left_out, node, |l| &l.node, left_out);
        Ok(())
    }
}

/// Whether `node` is a gateway in `view`.
fn is_gateway(view: &ClusterView, node: &str) -> bool {
    view.get(node).is_some_and(|l| l.reach.gateway.is_some())
}

/// Whether `node` announces a rotation in `view`.
fn rotates(view: &ClusterView, node: &str) -> bool {
    view.get(node).is_some_and(|l| l.next_key.is_some())
}

/// Where an entry of the plan's peers stands in line (`peers::seniority`): its node's.
fn entry_place<'v>(view: &'v ClusterView, entry: &str) -> Option<(i64, &'v str)> {
    view.get(base_node(entry)).map(seniority)
}

fn route_place<'v>(view: &'v ClusterView, route: &RouteSpec) -> Option<(i64, &'v str)> {
    match &route.role {
        RouteRole::Peer(node) => view.get(node).map(seniority),
        _ => None,
    }
}

/// The peers' routes into `device`: after its covering routes, before the next device's.
fn peer_routes(routes: &[RouteSpec], device: &str) -> Result<Range<usize>, Full> {
    let first = routes
        .iter()
        .position(|r| r.device == device)
        .ok_or("no covering route")?;
    let start = first
        + routes[first..]
            .iter()
            .take_while(|r| r.device == device && r.role == RouteRole::Covering)
            .count();
    let end = start
        + routes[start..]
            .iter()
            .take_while(|r| r.device == device)
            .count();
    Ok(start..end)
}

/// Removes the entries of `node` from `items`, which are sorted by node.
fn remove_run<T>(items: &mut Vec<T>, node: &str, of: impl Fn(&T) -> &String) {
    let at = items.partition_point(|i| of(i).as_str() < node);
    let end = at + items[at..].iter().take_while(|i| of(i) == node).count();
    items.drain(at..end);
}

/// Inserts `run`, the entries of `node`, into `items`, which are sorted by node.
fn insert_run<T>(items: &mut Vec<T>, node: &str, of: impl Fn(&T) -> &String, run: Vec<T>) {
    let at = items.partition_point(|i| of(i).as_str() < node);
    items.splice(at..at, run);
}
