//! Each cross-zone WireGuard pair's path: direct, or through a gateway's relay; and, on a
//! gateway, the nodes its relay may carry datagrams to. Pure: the liveness watcher's
//! findings come in `Observed::paths`, the path-MTU prober's answers in
//! `PlanInput::path_mtus`, the clock as `now`.
//!
//! A pair goes direct when both nodes share a zone (or either has none), when either is
//! a gateway (a gateway is reachable at its published address), and when at least one
//! of them is not private. A node is private when it is in a zone, not a gateway, and
//! publishes no address of its own beside its interface's (no `--public-ip` naming
//! another, no `public-ip-overwrite`): nodes of other zones cannot reach it. Two private
//! nodes of two zones go through a gateway from the start, unless the direct path answers
//! path-MTU probes. A pair whose direct path the watcher found dead goes through a
//! gateway too, and back to direct once the direct path answers probes again, after a
//! hold that doubles with each failure (so a path that answers probes but not WireGuard
//! does not flap).
//!
//! The gateway: of the gateways of the two nodes' zones, the first by rendezvous hash of
//! the pair and the gateway, so both ends choose the same one without talking; gateways
//! the watcher found dead for this pair are skipped for `GATEWAY_HOLD` (when every one
//! is, the one that failed longest ago is tried). A gateway in this node's zone is
//! reached on its internal address, one in the peer's zone on its published address.
//! When the two zones have no gateway the pair stays on its direct endpoint, and is
//! named: `NoPath`.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, SystemTime};

use crate::model::{ClusterView, Lease, PathHistory};

/// How long a gateway found dead for a pair is skipped for it.
pub const GATEWAY_HOLD: Duration = Duration::from_secs(300);
/// How long a pair whose direct path was found dead stays relayed before the direct path
/// may take it back (doubling with each failure in a row, up to `DIRECT_HOLD_MAX`).
pub const DIRECT_HOLD: Duration = Duration::from_secs(30);
pub const DIRECT_HOLD_MAX: Duration = Duration::from_secs(1800);
/// A relayed pair's keepalive when the config sets none: its NAT mappings and the relay's
/// routes must not go idle (the shortest cloud NAT UDP timeouts are 30 s).
pub const RELAYED_KEEPALIVE: u16 = 25;

/// The path a pair takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Path {
    Direct,
    /// Through `gateway`'s relay at `endpoint`.
    Relay {
        gateway: String,
        endpoint: SocketAddr,
    },
    /// The two nodes cannot reach each other and their zones have no gateway (`why`):
    /// the direct endpoint is kept, which works only if the verdict was wrong.
    NoPath {
        why: String,
    },
}

/// How recent a handshake must be for an endpoint WireGuard learned to say the peer came
/// that way (`Facts::roamed`).
pub const CAME_FRESH: Duration = Duration::from_secs(30);

/// Whether `at` is some gateway's relay, at its internal or its published address.
fn is_relay(view: &ClusterView, at: SocketAddr) -> bool {
    view.leases.values().any(|g| {
        g.reach.gateway == Some(at.port())
            && (g.public_ip.map(IpAddr::V4) == Some(at.ip())
                || g.reach.internal_ip == Some(at.ip()))
    })
}

/// Whether `lease` is private: nodes of other zones cannot reach it.
pub fn private(lease: &Lease) -> bool {
    lease.reach.zone.is_some() && lease.reach.gateway.is_none() && lease.reach.internal_ip.is_none()
}

/// Whether the pair crosses zones (both nodes have one, and they differ).
fn cross_zone(a: &Lease, b: &Lease) -> bool {
    matches!((&a.reach.zone, &b.reach.zone), (Some(x), Some(y)) if x != y)
}

/// How long a direct path that failed `failures` times in a row is held off.
pub fn direct_hold(failures: u32) -> Duration {
    let doubled = DIRECT_HOLD.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    doubled.min(DIRECT_HOLD_MAX)
}

/// FNV-1a, 64 bits: the same everywhere, no seed.
fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// What a pair's path is chosen from, beside the two leases and the view.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// The watcher's findings for the pair.
    pub history: Option<&'a PathHistory>,
    /// The peer's direct endpoint.
    pub direct: SocketAddr,
    /// Whether the direct endpoint's address answers path-MTU probes.
    pub direct_answers: bool,
    /// The endpoint the device holds for the peer now (the gateway the pair is on, by
    /// our plan or by the peer's choice, which WireGuard roamed to).
    pub current: Option<SocketAddr>,
    /// The device learned `current` from the peer's own packets, with a handshake in
    /// the last `CAME_FRESH`: where it is no gateway's relay, the peer reached this node
    /// directly.
    pub roamed: bool,
    pub now: SystemTime,
}

/// The pair's path, from `local`'s side.
pub fn choose(local: &Lease, peer: &Lease, view: &ClusterView, facts: Facts<'_>) -> Path {
    let Facts {
        history,
        direct,
        direct_answers,
        current,
        roamed,
        now,
    } = facts;
    if !cross_zone(local, peer) || local.reach.gateway.is_some() || peer.reach.gateway.is_some() {
        return Path::Direct;
    }
    let since = |t: SystemTime| now.duration_since(t).unwrap_or_default();
    let direct_held = history
        .and_then(|h| Some((h.direct_failed?, h.direct_failures)))
        .is_some_and(|(at, n)| since(at) < direct_hold(n));
    let direct_failed = history.is_some_and(|h| h.direct_failed.is_some());
    // An address another node of this zone has too (private ranges overlap across VPCs)
    // answers probes for that node, not for the peer.
    let direct_answers = direct_answers
        && !view.leases.values().any(|l| {
            l.node != peer.node
                && l.reach.zone == local.reach.zone
                && (l.reach.internal_ip == Some(direct.ip())
                    || l.public_ip.map(IpAddr::V4) == Some(direct.ip()))
        });
    let go_direct = match (direct_failed, direct_held) {
        (_, true) => false,
        (true, false) => direct_answers,
        (false, _) => !(private(local) && private(peer)) || direct_answers,
    };
    if go_direct || !direct.is_ipv4() {
        return Path::Direct;
    }
    // The peer's handshake came straight from its published address (not through a
    // relay): the direct path works, whatever the probes say yet; this end follows.
    if roamed && current.is_some_and(|c| c.ip() == direct.ip() && !is_relay(view, c)) {
        return Path::Direct;
    }
    let zones = [local.reach.zone.as_deref(), peer.reach.zone.as_deref()];
    let (first, second) = match local.node <= peer.node {
        true => (&local.node, &peer.node),
        false => (&peer.node, &local.node),
    };
    // Each gateway of the two zones, where this node reaches its relay: on its internal
    // address in this node's zone, on its published one in the other.
    let mut gateways: Vec<(&Lease, SocketAddr, u64)> = view
        .leases
        .values()
        .filter(|g| g.node != local.node && g.node != peer.node)
        .filter(|g| zones.contains(&g.reach.zone.as_deref()))
        .filter_map(|g| {
            let port = g.reach.gateway?;
            let ip = match g.reach.zone == local.reach.zone {
                true => g
                    .reach
                    .internal_ip
                    .filter(IpAddr::is_ipv4)
                    .or(g.public_ip.map(IpAddr::V4)),
                false => g.public_ip.map(IpAddr::V4),
            }?;
            Some((
                &**g,
                SocketAddr::new(ip, port),
                fnv(&[first, second, &g.node]),
            ))
        })
        .collect();
    if gateways.is_empty() {
        let why = format!(
            "{} and {} cannot reach each other (both private, in zones {} and {}) and neither zone has a gateway with an IPv4 address",
            local.node,
            peer.node,
            zones[0].unwrap_or("?"),
            zones[1].unwrap_or("?")
        );
        return Path::NoPath { why };
    }
    gateways.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.node.cmp(&b.0.node)));
    let failed_at = |g: &Lease| history.and_then(|h| h.gateways_failed.get(&g.node).copied());
    let usable = |g: &Lease| failed_at(g).is_none_or(|t| since(t) >= GATEWAY_HOLD);
    // The gateway the pair is on stays while it is not found dead: a gateway that comes
    // back takes no pair from another, and when the peer chose another gateway (its
    // handshake came through it, and WireGuard roamed), this end follows.
    let on = current.and_then(|c| gateways.iter().find(|(g, at, _)| *at == c && usable(g)));
    let pick = on
        .or_else(|| gateways.iter().find(|(g, ..)| usable(g)))
        .or_else(|| gateways.iter().min_by_key(|(g, ..)| failed_at(g)));
    match pick {
        Some((g, endpoint, _)) => Path::Relay {
            gateway: g.node.clone(),
            endpoint: *endpoint,
        },
        None => Path::Direct,
    }
}

/// A node a gateway's relay may carry datagrams to (see `weft_userspace::relay`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayMember {
    pub node: String,
    pub key: weft_crypto::PublicKey,
    /// Its internal address and WireGuard port, for a node of the gateway's zone.
    pub home: Option<SocketAddr>,
}

/// The members of `local`'s relay, when it is a gateway: every wireguard node of the view
/// with a key that decodes, nodes of its zone with their address on the zone's segment.
pub fn relay_members(local: &Lease, view: &ClusterView, listen_port: u16) -> Vec<RelayMember> {
    if local.reach.gateway.is_none() {
        return Vec::new();
    }
    view.leases
        .values()
        .filter(|l| l.node != local.node)
        .filter_map(|l| {
            let data = super::WireguardData::decode(l.backend_data.as_ref()).ok()?;
            let same_zone = l.reach.zone.is_some() && l.reach.zone == local.reach.zone;
            let ip = l.reach.internal_ip.or(l.public_ip.map(IpAddr::V4));
            let home = ip
                .filter(|_| same_zone)
                .map(|ip| SocketAddr::new(ip, data.port.unwrap_or(listen_port)));
            Some(RelayMember {
                node: l.node.clone(),
                key: data.public_key,
                home,
            })
        })
        .collect()
}

#[cfg(test)]
#[path = "relay_tests.rs"]
mod tests;
