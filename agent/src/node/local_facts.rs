//! What this node knows of itself at start: an interrupted key rotation resumed (or
//! finished, if its moment passed while the agent was down), what it publishes on its
//! lease, and the node-local facts the plan needs (the external interface, its MTU).

use std::net::IpAddr;
use std::path::Path;

use anyhow::Context;
use tracing::{info, warn};
use weft_backends::apply::Dataplane;
use weft_backends::plan::PlanOptions;
use weft_crypto::PrivateKey;

use crate::cli::AgentArgs;
use crate::keys::rotation::Rotation;
use crate::node::backend_setup;
use crate::registry::LocalAttrs;

/// A rotation a previous run left unfinished goes on: its key was announced, so peers may
/// already use it; if its moment has passed, the switch happens now.
pub(super) fn resume_rotation(
    key: PrivateKey,
    key_path: &Path,
) -> anyhow::Result<(PrivateKey, Rotation)> {
    let mut rotation = Rotation::load(key_path);
    let mut key = key;
    if let Some(next) = rotation.pending().cloned() {
        if std::time::SystemTime::now() >= next.switch_at() {
            key = rotation
                .promote()
                .context("finishing an interrupted key rotation")?;
            info!(public_key = %key.public_key(), "an interrupted key rotation was due: switched to its key");
        } else {
            info!(next = %next.public_key, switch_at_ms = next.switch_at_ms, "resuming an interrupted key rotation");
        }
    }
    Ok((key, rotation))
}

/// What this node publishes.
pub(super) fn local_attrs(
    args: &AgentArgs,
    net: &weft_backends::netconf::NetConf,
    public_ip: std::net::Ipv4Addr,
    setup: &backend_setup::BackendSetup,
    rotation: &Rotation,
) -> LocalAttrs {
    // With --public-ip naming another (external) address, the interface's own one is
    // the internal address peers in our zone use.
    let internal_ip = match args.public_ip {
        Some(_) => crate::node::iface::local_ip(args)
            .ok()
            .filter(|ip| *ip != public_ip),
        None => None,
    };
    // With IPv6 enabled, the node's IPv6 address is published beside the IPv4 one.
    let public_ipv6 = match net.ipv6 {
        Some(_) => crate::node::iface::local_ip(args)
            .and_then(|local| crate::node::iface::public_ipv6(args, local))
            .unwrap_or_else(|e| {
                warn!(error = %format!("{e:#}"), "finding this node's IPv6 address");
                args.public_ipv6
            }),
        None => None,
    };
    if net.ipv6.is_some() && public_ipv6.is_none() {
        warn!("EnableIPv6 is set but this node has no global IPv6 address on its interface and no --public-ipv6: peers cannot reach it over IPv6");
    }
    LocalAttrs {
        public_ip: Some(public_ip),
        internal_ip,
        public_ipv6,
        backend: net.backend.kind(),
        backend_data: setup.backend_data.clone(),
        backend_v6_data: setup.backend_v6_data.clone(),
        next_key: rotation.pending().cloned(),
        // Made once the registry has named this node's entry (`KeyState::prove`).
        key_proof: None,
        ml_kem_key: None,
        zone: args.zone.clone().filter(|z| !z.is_empty()),
        gateway: args.gateway.then_some(args.relay_port),
        also: setup.also.clone(),
    }
}

/// The node-local facts the plan needs: the external interface (the one holding the
/// public IP), its MTU and networks.
pub(super) async fn plan_options(
    args: &AgentArgs,
    setup: &backend_setup::BackendSetup,
    dataplane: &mut Dataplane,
    public_ip: std::net::Ipv4Addr,
) -> anyhow::Result<PlanOptions> {
    let underlay = dataplane
        .underlay_of(IpAddr::V4(public_ip))
        .await
        .context("finding the external interface")?;
    match &underlay {
        Some(u) => {
            info!(device = %u.device, mtu = u.mtu, networks = ?u.networks, "external interface")
        }
        None => {
            warn!(%public_ip, "no interface holds the public IP: host-gw and DirectRouting cannot tell on-link peers, and the underlay MTU is taken as 1500")
        }
    }
    let underlay_mtu = setup
        .config_mtu
        .or(underlay.as_ref().map(|u| u.mtu))
        .unwrap_or(1500);
    Ok(PlanOptions {
        ip_masq: args.ip_masq,
        underlay_mtu,
        underlay_device: underlay.as_ref().map(|u| u.device.clone()),
        underlay_networks: underlay.map(|u| u.networks).unwrap_or_default(),
    })
}
