//! The wireguard backend's share of the plan: devices (`flannel-wg`, and `flannel-wg-v6` in
//! `separate` mode), one peer per node, the covering route per family (fail closed) and one
//! route per peer subnet; and the `backend-data` this node publishes.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use serde_json::{json, Value};
use weft_crypto::PublicKey;

use super::peers::{Candidate, Screened};
use super::wg_rotation::{follow_switch, rotated, STAGED};
use super::{subnet_env, LocalSubnets, PlanError, PlanInput};
use crate::model::backend_data;
use crate::model::{
    BackendDataError, DesiredState, Family, LeaveReason, LeftOut, PeerSpec, RouteRole, RouteSpec,
    TunnelSpec, Via,
};
use crate::netconf::{WireguardConf, WireguardMode};

pub const DEVICE: &str = "flannel-wg";
pub const DEVICE_V6: &str = "flannel-wg-v6";
/// WireGuard's worst-case encapsulation overhead (IPv6 outer header): docs/architecture.md.
const OVERHEAD: u32 = 80;

/// `backend-data` of the wireguard backend: `{"PublicKey":"<base64>","Port":51820}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireguardData {
    pub public_key: PublicKey,
    /// flannel itself publishes no port; then the peer listens on our configured one.
    pub port: Option<u16>,
}

/// What this node publishes as `backend-data` (or `backend-v6-data`).
pub fn backend_data(key: &PublicKey, port: u16) -> Value {
    json!({ "PublicKey": key.to_base64(), "Port": port })
}

impl WireguardData {
    /// Decodes a peer's published data; the error says what is wrong, for the reason.
    pub fn decode(value: Option<&Value>) -> Result<Self, BackendDataError> {
        let obj = backend_data::object(value, r#"{"PublicKey":"…","Port":51820}"#)?;
        let key = backend_data::public_key(obj)?;
        let port = match obj.get("Port") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(p @ 1..=65535) => Some(p as u16),
                _ => {
                    return Err(BackendDataError::bad(
                        "Port",
                        v,
                        "is not a UDP port (1–65535)",
                    ))
                }
            },
        };
        Ok(WireguardData {
            public_key: key,
            port,
        })
    }
}

/// One device to build: which family's subnets it carries and how peers are reached.
pub(super) struct DevicePlan {
    pub(super) name: &'static str,
    listen_port: u16,
    pub(super) carries_v4: bool,
    pub(super) carries_v6: bool,
    /// Which published data holds the key: `backend-data` or `backend-v6-data`.
    pub(super) v6_data: bool,
    endpoint: EndpointChoice,
}

#[derive(Clone, Copy)]
enum EndpointChoice {
    V4,
    V6,
    /// IPv4 when both ends have it, else IPv6.
    Auto {
        local_has_v4: bool,
    },
}

pub(super) fn devices(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    wg: &WireguardConf,
) -> Vec<DevicePlan> {
    let (v4, v6) = (ours.v4.is_some(), ours.v6.is_some());
    let single = |endpoint| DevicePlan {
        name: DEVICE,
        listen_port: wg.listen_port,
        carries_v4: v4,
        carries_v6: v6,
        v6_data: false,
        endpoint,
    };
    match wg.mode {
        WireguardMode::Separate => {
            let mut out = Vec::new();
            if v4 {
                out.push(DevicePlan {
                    name: DEVICE,
                    listen_port: wg.listen_port,
                    carries_v4: true,
                    carries_v6: false,
                    v6_data: false,
                    endpoint: EndpointChoice::V4,
                });
            }
            if v6 {
                out.push(DevicePlan {
                    name: DEVICE_V6,
                    listen_port: wg.listen_port_v6,
                    carries_v4: false,
                    carries_v6: true,
                    v6_data: true,
                    endpoint: EndpointChoice::V6,
                });
            }
            out
        }
        WireguardMode::Ipv4 => vec![single(EndpointChoice::V4)],
        WireguardMode::Ipv6 => vec![single(EndpointChoice::V6)],
        WireguardMode::Auto => vec![single(EndpointChoice::Auto {
            local_has_v4: input.local.public_ip.is_some(),
        })],
    }
}

pub(super) fn local_key(input: &PlanInput<'_>, v6_data: bool) -> Result<PublicKey, PlanError> {
    let data = if v6_data {
        input
            .local
            .backend_v6_data
            .as_ref()
            .or(input.local.backend_data.as_ref())
    } else {
        input.local.backend_data.as_ref()
    };
    WireguardData::decode(data)
        .map(|d| d.public_key)
        .map_err(|detail| PlanError::LocalBackendData {
            node: input.local.node.clone(),
            detail,
        })
}

/// The wireguard plan; with `claims`, each device's entries are noted there before
/// duplicate keys are left out.
pub(crate) fn plan(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    wg: &WireguardConf,
    screened: Screened<'_>,
    mut claims: Option<&mut super::incremental::Claims>,
) -> Result<DesiredState, PlanError> {
    let mtu = wg
        .mtu
        .unwrap_or(input.options.underlay_mtu)
        .saturating_sub(OVERHEAD);
    let Screened {
        candidates,
        mut left_out,
    } = screened;
    let mut state = DesiredState::default();
    for dev in devices(input, ours, wg) {
        let own_key = local_key(input, dev.v6_data)?;
        // Sized once: at 10,000 peers, growing by doubling left as much again freed
        // behind it in the heap.
        let mut peers = Vec::with_capacity(candidates.len());
        for c in &candidates {
            let allowed = allowed_ips(c, &dev);
            if allowed.is_empty() {
                continue;
            }
            match peer(input, c, &dev, wg, own_key, allowed) {
                Ok(p) => {
                    // A rotation announced by the peer: before its moment the next key is
                    // staged (a peer entry without AllowedIPs, so the handshake is ready);
                    // from then on it is the peer's key.
                    let (p, switch) = rotated(p, c.lease, own_key, input, wg);
                    peers.extend(follow_switch(&mut state, dev.name, &p, switch, input.now));
                    peers.push(p);
                }
                Err(reason) => left_out.push(LeftOut {
                    node: c.lease.node.clone(),
                    reason,
                }),
            }
        }
        super::roaming::keep_roamed(
            dev.name,
            &mut peers,
            input.observed,
            input.now,
            &mut state.planned_endpoints,
        );
        if let Some(claims) = claims.as_deref_mut() {
            claims.keys.push(
                peers
                    .iter()
                    .map(|p| (p.public_key, base_node(&p.node).to_string()))
                    .collect(),
            );
        }
        let leases = candidates
            .iter()
            .map(|c| (c.lease.node.as_str(), c.lease))
            .collect();
        drop_duplicate_keys(&mut peers, &mut left_out, &leases);
        let addresses = device_addresses(input, ours, &dev, &mut state);
        state
            .routes
            .reserve(peers.iter().map(|p| p.allowed_ips.len()).sum());
        for p in &peers {
            state.routes.extend(routes_of(dev.name, p));
        }
        state.tunnels.push(TunnelSpec {
            device: dev.name.into(),
            listen_port: dev.listen_port,
            mtu,
            addresses,
            peers,
        });
    }
    state.subnet_env = subnet_env(input.config, ours, mtu, input.options.ip_masq);
    state.left_out = left_out;
    Ok(state)
}

/// What a candidate's entry on `dev` routes: its subnets of the families `dev` carries.
pub(super) fn allowed_ips(c: &Candidate<'_>, dev: &DevicePlan) -> Vec<IpNet> {
    c.v4.filter(|_| dev.carries_v4)
        .into_iter()
        .chain(c.v6.filter(|_| dev.carries_v6))
        .collect()
}

/// One route into `device` per subnet the entry `p` routes.
pub(super) fn routes_of<'a>(
    device: &'a str,
    p: &'a PeerSpec,
) -> impl Iterator<Item = RouteSpec> + 'a {
    p.allowed_ips.iter().map(move |dst| RouteSpec {
        dst: *dst,
        device: device.into(),
        via: Default::default(),
        onlink: false,
        role: RouteRole::Peer(p.node.clone()),
        mtu: None,
    })
}

/// The device's own addresses (this node's subnet network addresses, one per family it
/// carries), with the covering route and fail-closed blackhole of each pod network.
fn device_addresses(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    dev: &DevicePlan,
    state: &mut DesiredState,
) -> Vec<IpNet> {
    let mut addresses = Vec::new();
    for (carries, subnet, network) in [
        (
            dev.carries_v4,
            ours.v4,
            input.config.ipv4.map(|n| n.network),
        ),
        (
            dev.carries_v6,
            ours.v6,
            input.config.ipv6.map(|n| n.network),
        ),
    ] {
        let (true, Some(subnet), Some(network)) = (carries, subnet, network) else {
            continue;
        };
        addresses.push(IpNet::new(subnet.network(), subnet.max_prefix_len()).unwrap_or(subnet));
        state.routes.push(RouteSpec {
            dst: network,
            device: dev.name.into(),
            via: Default::default(),
            onlink: false,
            role: RouteRole::Covering,
            mtu: None,
        });
        if !state.fail_closed.contains(&network) {
            state.fail_closed.push(network);
        }
    }
    addresses
}

pub(super) fn peer(
    input: &PlanInput<'_>,
    c: &Candidate<'_>,
    dev: &DevicePlan,
    wg: &WireguardConf,
    own_key: PublicKey,
    allowed_ips: Vec<IpNet>,
) -> Result<PeerSpec, LeaveReason> {
    let (local, lease) = (input.local, c.lease);
    let (field, raw) = if dev.v6_data {
        (
            "backend-v6-data",
            lease
                .backend_v6_data
                .as_ref()
                .or(lease.backend_data.as_ref()),
        )
    } else {
        ("backend-data", lease.backend_data.as_ref())
    };
    let data = WireguardData::decode(raw)
        .map_err(|detail| LeaveReason::BadBackendData { field, detail })?;
    if data.public_key == own_key {
        return Err(LeaveReason::KeyIsOurs {
            key: data.public_key,
        });
    }
    // Announcing this node's key as its next one: as anywhere else, the holder keeps it.
    if let Some(key) = lease
        .next_key
        .as_ref()
        .and_then(|n| n.public_key.parse().ok())
    {
        if key == own_key {
            return Err(LeaveReason::NextKeyTaken {
                key,
                other: local.node.clone(),
            });
        }
    }
    // A peer in our zone is reached on its internal address, others on the published one
    // (which an operator's public-ip-overwrite has already replaced).
    let same_zone = local.reach.zone.is_some() && local.reach.zone == lease.reach.zone;
    let internal = lease.reach.internal_ip.filter(|_| same_zone);
    let v4 = internal
        .filter(IpAddr::is_ipv4)
        .or(lease.public_ip.map(IpAddr::V4));
    let v6 = internal
        .filter(IpAddr::is_ipv6)
        .or(lease.public_ipv6.map(IpAddr::V6));
    let (ip, family) = match dev.endpoint {
        EndpointChoice::V4 => (v4, Family::Ipv4),
        EndpointChoice::V6 => (v6, Family::Ipv6),
        EndpointChoice::Auto { local_has_v4: true } if v4.is_some() => (v4, Family::Ipv4),
        EndpointChoice::Auto { .. } => (v6, Family::Ipv6),
    };
    let ip = ip.ok_or(LeaveReason::NoPublicIp { family })?;
    let direct = SocketAddr::new(ip, data.port.unwrap_or(dev.listen_port));
    let seen = input
        .observed
        .peers
        .get(&(dev.name.into(), data.public_key));
    let current = seen.and_then(|o| o.endpoint);
    // Learned from the peer's packets (not what this node set), on a fresh handshake.
    let roamed = seen.is_some_and(|o| {
        let fresh = o.last_handshake.is_some_and(|t| {
            input
                .now
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .is_ok_and(|n| !t.is_zero() && n.saturating_sub(t) <= super::relay::CAME_FRESH)
        });
        fresh
            && o.endpoint.is_some()
            && o.planned_before.is_some()
            && o.endpoint != o.planned_before
    });
    let facts = super::relay::Facts {
        history: input.observed.paths.get(&lease.node),
        direct,
        direct_answers: input.path_mtus.contains_key(&ip),
        current,
        roamed,
        now: input.now,
    };
    let path = super::relay::choose(local, lease, input.view, facts);
    let (endpoint, keepalive, via) = match path {
        super::relay::Path::Direct => (direct, wg.persistent_keepalive, Via::Direct),
        super::relay::Path::NoPath { why } => (direct, wg.persistent_keepalive, Via::NoPath(why)),
        super::relay::Path::Relay { gateway, endpoint } => {
            let keepalive = match wg.persistent_keepalive {
                0 => super::relay::RELAYED_KEEPALIVE,
                k => k.min(super::relay::RELAYED_KEEPALIVE),
            };
            (endpoint, keepalive, Via::Gateway(gateway))
        }
    };
    Ok(PeerSpec {
        node: lease.node.clone(),
        public_key: data.public_key,
        endpoint,
        allowed_ips,
        keepalive,
        psk: super::post_quantum::peer_psk(input, wg, &data.public_key),
        via,
    })
}

/// The node an entry is of: a staged next key's entry carries its node's name.
pub(super) fn base_node(entry: &str) -> &str {
    entry.strip_suffix(STAGED).unwrap_or(entry)
}

/// One key, one peer: two entries with one key cannot be told apart on the wire, so the
/// key stays with its incumbent and every other node claiming it is left out, all of its
/// entries. A node's current key comes before any announced next key (announcing another
/// node's key takes nothing from it); then an entry that proves holding the key
/// (`peers::proves`) over one that does not; among equals, the older entry keeps it:
/// `peers` are in the candidates' order, oldest first (`peers::seniority`).
fn drop_duplicate_keys(
    peers: &mut Vec<PeerSpec>,
    left_out: &mut Vec<LeftOut>,
    leases: &BTreeMap<&str, &crate::model::Lease>,
) {
    let mut claims: BTreeMap<PublicKey, usize> = BTreeMap::new();
    for p in peers.iter() {
        *claims.entry(p.public_key).or_default() += 1;
    }
    let mut holder: BTreeMap<PublicKey, (bool, bool, usize, &str)> = BTreeMap::new();
    for (place, p) in peers.iter().enumerate() {
        let (base, staged) = match p.node.strip_suffix(STAGED) {
            Some(node) => (node, true),
            None => (p.node.as_str(), false),
        };
        // Where entries contend for a key, a current key the entry proves holding comes
        // first, whichever entry is older (the proof is checked only there).
        let proven = !staged
            && claims[&p.public_key] > 1
            && leases
                .get(base)
                .is_some_and(|l| super::peers::proves(l, &p.public_key));
        let rank = (staged, !proven, place, base);
        let e = holder.entry(p.public_key).or_insert(rank);
        if rank < *e {
            *e = rank;
        }
    }
    let mut losers: BTreeMap<String, LeaveReason> = BTreeMap::new();
    for p in peers.iter() {
        let base = p.node.strip_suffix(STAGED).unwrap_or(&p.node);
        let (_, _, _, winner) = holder[&p.public_key];
        if winner == base {
            continue;
        }
        let (key, other) = (p.public_key, winner.to_string());
        let reason = if p.node.ends_with(STAGED) {
            LeaveReason::NextKeyTaken { key, other }
        } else {
            LeaveReason::DuplicateKey { key, other }
        };
        losers.entry(base.to_string()).or_insert(reason);
    }
    peers.retain(|p| !losers.contains_key(p.node.strip_suffix(STAGED).unwrap_or(&p.node)));
    left_out.extend(
        losers
            .into_iter()
            .map(|(node, reason)| LeftOut { node, reason }),
    );
}
