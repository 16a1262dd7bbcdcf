//! A cluster changing backend node by node: every pair runs on a backend both of its ends
//! speak, so no pair is down while the change rolls out.
//!
//! A node publishes the backend of its config (flannel's `backend-type` and
//! `backend-data`) and, while the change goes on, the backends it still speaks besides it
//! with their data (`Lease::also`): the one it ran before, kept by the agent while some
//! peer still runs it. Each end reads both ends' published sets and picks the pair's
//! backend by the same rule (`pair_backend`), so the two agree without talking:
//! - the backend both ends' configs name, if it encrypts;
//! - otherwise a backend both speak that encrypts, WireGuard before ipsec;
//! - otherwise, only when one of the two publishes no encrypting backend at all, an
//!   unencrypted one both speak (the shared config's if both run it, else vxlan, host-gw,
//!   ipip in that order), unless this node's config refuses clear pairs (`RefuseClear`);
//! - otherwise none: the pair is left out with the reason (fail closed).
//!
//! Every backend this node speaks is planned with the peers whose pair runs on it, as if
//! it were the config's (the peers' data for it in place of their published one), and the
//! plans are merged: each peer's subnet routed into its pair's device, the old backend's
//! devices kept while the node publishes it, and gone once the agent stops publishing it.
//! The guard accepts a clear pair's pod addresses only from the device its pair runs on.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{LocalSubnets, PlanError, PlanInput};
use crate::model::{ClusterView, DesiredState, Lease, LeaveReason, LeftOut, PairBackend};
use crate::netconf::{Backend, BackendKind, NetConf, VxlanConf, WireguardConf};

/// The backends a node may keep speaking besides its config's during a change: the ones
/// whose only state is a device and this node's key or MAC. ipsec and ipip pairs are
/// planned with their own backend's config alone.
pub const KEPT_DURING_A_CHANGE: [BackendKind; 3] = [
    BackendKind::Wireguard,
    BackendKind::Vxlan,
    BackendKind::HostGw,
];

/// The order a pair takes among the backends both ends speak: encrypting ones first.
const PREFERENCE: [BackendKind; 5] = [
    BackendKind::Wireguard,
    BackendKind::Ipsec,
    BackendKind::Vxlan,
    BackendKind::HostGw,
    BackendKind::Ipip,
];

/// Whether planning `input` needs this module: this node speaks more than one backend, or
/// a peer publishes another than this node's.
pub(crate) fn involved(input: &PlanInput<'_>) -> bool {
    let ours = input.config.backend.kind().as_str();
    !input.local.also.is_empty()
        || input
            .view
            .leases
            .values()
            .any(|l| l.backend_type != ours && l.node != input.local.node)
}

/// The backends a lease publishes: its `backend-type` first, then its others (unknown
/// names are passed over).
pub fn speaks(primary: &str, also: &BTreeMap<String, Value>) -> Vec<BackendKind> {
    let mut kinds: Vec<BackendKind> = primary.parse().ok().into_iter().collect();
    for kind in also.keys().filter_map(|k| k.parse::<BackendKind>().ok()) {
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    kinds
}

/// The backend the pair of this node (running `ours`, also speaking `our_also`) and
/// `peer` runs on, or why it has none. Symmetric: the peer, reading this node's lease,
/// picks the same.
pub fn pair_backend(
    ours: BackendKind,
    our_also: &BTreeMap<String, Value>,
    peer: &Lease,
    refuse_clear: bool,
) -> Result<BackendKind, LeaveReason> {
    let mine = speaks(ours.as_str(), our_also);
    let theirs = speaks(&peer.backend_type, &peer.also);
    let wrong = || LeaveReason::WrongBackend {
        theirs: peer.backend_type.clone(),
        ours: ours.as_str(),
    };
    if theirs.is_empty() {
        return Err(wrong());
    }
    let common: Vec<BackendKind> = PREFERENCE
        .into_iter()
        .filter(|k| mine.contains(k) && theirs.contains(k))
        .collect();
    // Both ends' configs name the same encrypting backend: the pair is on it from the
    // moment the second end publishes it, and never moves again when an old backend is
    // retired (wireguard <-> ipsec moves each pair once, at its second end's restart).
    if peer.backend_type == ours.as_str() && ours.encrypts() {
        return Ok(ours);
    }
    if let Some(kind) = common.iter().copied().find(|k| k.encrypts()) {
        return Ok(kind);
    }
    let names = |kinds: &[BackendKind]| kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>();
    if mine.iter().any(|k| k.encrypts()) && theirs.iter().any(|k| k.encrypts()) {
        return Err(LeaveReason::NoCommonEncryption {
            theirs: names(&theirs).join(", "),
            ours: names(&mine).join(", "),
        });
    }
    let same = theirs.first().filter(|k| **k == ours && common.contains(k));
    let Some(kind) = same.or(common.first()).copied() else {
        return Err(wrong());
    };
    if refuse_clear {
        return Err(LeaveReason::ClearRefused {
            theirs: peer.backend_type.clone(),
        });
    }
    Ok(kind)
}

/// The backend a node running `ours` takes up besides its config's to reach `peer`, when
/// the two speak nothing the pair can run on and the peer could not take up `ours`: the
/// peer's own, if this node can speak it besides its config's (WireGuard always, vxlan
/// and host-gw unless `refuse_clear`). Only a node on ipsec or ipip takes one up: a
/// node leaving either (ipsec -> wireguard) does not keep it, so the nodes still on it
/// meet the moved node on its new backend.
pub fn to_take_up(
    ours: BackendKind,
    our_also: &BTreeMap<String, Value>,
    peer: &Lease,
    refuse_clear: bool,
) -> Option<BackendKind> {
    if KEPT_DURING_A_CHANGE.contains(&ours) {
        return None;
    }
    match pair_backend(ours, our_also, peer, refuse_clear) {
        Err(LeaveReason::NoCommonEncryption { .. } | LeaveReason::WrongBackend { .. }) => {}
        _ => return None,
    }
    let theirs: BackendKind = peer.backend_type.parse().ok()?;
    (KEPT_DURING_A_CHANGE.contains(&theirs) && (theirs.encrypts() || !refuse_clear))
        .then_some(theirs)
}

/// `lease` as if it published `kind` as its backend, with its data for it.
fn as_kind(lease: &Lease, kind: BackendKind) -> Lease {
    if lease.backend_type == kind.as_str() {
        return lease.clone();
    }
    Lease {
        backend_type: kind.as_str().to_string(),
        backend_data: lease.also.get(kind.as_str()).cloned(),
        // The other family's data is published for the config's backend alone.
        backend_v6_data: None,
        ..lease.clone()
    }
}

/// The config a backend this node speaks besides its config's is planned with: the
/// defaults, the port and VNI it published, the config's MTU.
fn config_for(config: &NetConf, kind: BackendKind, data: Option<&Value>) -> NetConf {
    let field = |name: &str| data.and_then(|d| d.get(name)).and_then(Value::as_u64);
    let mtu = config.backend.mtu();
    let backend = match kind {
        BackendKind::Wireguard => Backend::Wireguard(WireguardConf {
            listen_port: field("ListenPort")
                .and_then(|p| u16::try_from(p).ok())
                .unwrap_or(51820),
            mtu,
            post_quantum: false,
            ..WireguardConf::default()
        }),
        BackendKind::Vxlan => Backend::Vxlan(VxlanConf {
            vni: field("VNI")
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(1),
            mtu,
            ..VxlanConf::default()
        }),
        _ => Backend::HostGw,
    };
    NetConf {
        backend,
        // The config's other family is its backend's alone (`as_kind`).
        ipv6: None,
        ..config.clone()
    }
}

/// The backend part of the plan for a node in a mixed cluster (see the module doc):
/// every backend it speaks planned with its pairs, merged, plus each pair's backend.
pub(crate) fn plan(input: &PlanInput<'_>, ours: &LocalSubnets) -> Result<DesiredState, PlanError> {
    let primary = input.config.backend.kind();
    let refuse_clear = input.config.backend.refuses_clear();
    let mut groups: BTreeMap<BackendKind, ClusterView> = BTreeMap::new();
    let mut left_out = Vec::new();
    let mut pairs = Vec::new();
    let mut accepting = Vec::new();
    // The pairs follow what this node publishes: not the backends it retired a moment
    // ago, whose devices it keeps a little longer.
    let mut published = input.local.also.clone();
    published.retain(|kind, _| !input.observed.draining.contains(kind));
    for lease in input.view.leases.values() {
        if lease.node == input.local.node {
            continue;
        }
        match pair_backend(primary, &published, lease, refuse_clear) {
            Ok(kind) => {
                if kind.encrypts() {
                    accepting.extend(clear_source(input, lease));
                }
                groups.entry(kind).or_default().insert(as_kind(lease, kind));
                pairs.push(PairBackend {
                    node: lease.node.clone(),
                    backend: kind,
                    why_clear: (!kind.encrypts()).then(|| why_clear(lease)),
                });
            }
            Err(reason) => left_out.push(LeftOut {
                node: lease.node.clone(),
                reason,
            }),
        }
    }
    let mut state = DesiredState::default();
    let draining = input
        .observed
        .accept_clear_until
        .filter(|until| *until > input.now);
    for kind in speaks(primary.as_str(), &input.local.also) {
        if kind != primary && !KEPT_DURING_A_CHANGE.contains(&kind) {
            continue;
        }
        let view = groups.remove(&kind).unwrap_or_default();
        let local = as_kind(input.local, kind);
        let config = match kind == primary {
            true => input.config.clone(),
            false => config_for(input.config, kind, local.backend_data.as_ref()),
        };
        let subnets = match kind == primary {
            true => *ours,
            false => LocalSubnets {
                v4: ours.v4,
                v6: None,
            },
        };
        let part_input = PlanInput {
            local: &local,
            view: &view,
            config: &config,
            ..*input
        };
        let screened = super::peers::screen(&part_input, &subnets, kind, None);
        let part = super::backend_plan(&part_input, &subnets, screened, None)?;
        merge(&mut state, part, kind == primary);
    }
    state.left_out.extend(left_out);
    pairs.sort_by(|a, b| a.node.cmp(&b.node));
    state.pair_backends = pairs;
    if let Some(until) = draining {
        state.clear_draining = accepting;
        state.next_switch = Some(state.next_switch.map_or(until, |t| t.min(until)));
    }
    Ok(state)
}

/// The device and subnet an encrypted pair's peer sends its pods' packets in clear on
/// around a move (before it reads this node's move, or once it has retired its encrypting
/// backend first): an unencrypted backend both publish.
fn clear_source(input: &PlanInput<'_>, peer: &Lease) -> Option<(String, ipnet::IpNet)> {
    let subnet = peer.subnet?;
    let theirs = speaks(&peer.backend_type, &peer.also);
    let primary = input.config.backend.kind();
    let vni = match &input.config.backend {
        crate::netconf::Backend::Vxlan(v) => Some(v.vni),
        _ => input
            .local
            .also
            .get(BackendKind::Vxlan.as_str())
            .map(|data| {
                data.get("VNI")
                    .and_then(Value::as_u64)
                    .and_then(|v| u32::try_from(v).ok())
                    .unwrap_or(1)
            }),
    };
    if let Some(vni) = vni.filter(|_| theirs.contains(&BackendKind::Vxlan)) {
        return Some((super::vxlan_device(vni), subnet));
    }
    let host_gw = primary == BackendKind::HostGw
        || input.local.also.contains_key(BackendKind::HostGw.as_str());
    if host_gw && theirs.contains(&BackendKind::HostGw) {
        return Some((input.options.underlay_device.clone()?, subnet));
    }
    // ipip is never kept: only a node whose config runs it takes its peers' from it.
    if primary == BackendKind::Ipip && theirs.contains(&BackendKind::Ipip) {
        return Some((super::ipip::IPIP_DEVICE.to_string(), subnet));
    }
    None
}

/// Why a pair runs in clear: its peer publishes no encrypting backend.
fn why_clear(peer: &Lease) -> String {
    format!(
        "it publishes no encrypting backend (it runs {})",
        speaks(&peer.backend_type, &peer.also)
            .iter()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Adds one backend's plan to the node's.
fn merge(into: &mut DesiredState, part: DesiredState, primary: bool) {
    let DesiredState {
        tunnels,
        vxlan,
        ipip,
        ipsec,
        routes,
        fail_closed,
        guard: _,
        masquerade: _,
        subnet_env,
        left_out,
        next_switch,
        key_watch,
        switched_on_clock,
        esp_watch,
        planned_endpoints,
        paths,
        post_quantum,
        pair_backends: _,
        clear_draining: _,
    } = part;
    into.tunnels.extend(tunnels);
    into.vxlan.extend(vxlan);
    into.ipip = into.ipip.take().or(ipip);
    into.ipsec = into.ipsec.take().or(ipsec);
    into.routes.extend(routes);
    for network in fail_closed {
        if !into.fail_closed.contains(&network) {
            into.fail_closed.push(network);
        }
    }
    if primary {
        into.subnet_env = subnet_env;
    }
    into.left_out.extend(left_out);
    into.next_switch = match (into.next_switch, next_switch) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    into.key_watch = into.key_watch.take().or(key_watch);
    into.switched_on_clock.extend(switched_on_clock);
    into.esp_watch |= esp_watch;
    into.planned_endpoints.extend(planned_endpoints);
    into.paths.extend(paths);
    into.post_quantum.extend(post_quantum);
}
