//! The WireGuard part of a data-plane pass that is not I/O on the device: what a device
//! needs against what it holds (`device_change`), what an applied change reports and which
//! peers it starts handshakes with (`applied`), and starting those handshakes.

use weft_crypto::PrivateKey;

use std::collections::BTreeSet;

use super::diff::{diff_device, diff_device_peers, DeviceChange, PeerChange};
use super::WgDevice;
use crate::apply::DataplaneReport;
use crate::model::{PeerSpec, TunnelSpec};

/// A peer just added to a device gets one empty datagram into the tunnel, to its device
/// address (its subnet's network address), so the device handshakes now. This matters
/// after a device (re)starts: its peers still hold sessions with the device that is gone,
/// keep encrypting with keys nobody has, and would wait for WireGuard's rekey timers (15 s
/// or more) before handshaking again. Every peer of a fresh device is an added peer. Runs
/// after the routing pass, so the peer's route exists.
/// Returns one line per datagram that could not be sent.
pub(crate) fn prime_handshakes(added: &[PeerSpec]) -> Vec<String> {
    let mut errors = Vec::new();
    if added.is_empty() {
        return errors;
    }
    let Ok(v4) = std::net::UdpSocket::bind("0.0.0.0:0") else {
        return errors;
    };
    let v6 = std::net::UdpSocket::bind("[::]:0").ok();
    for peer in added {
        for net in &peer.allowed_ips {
            let target = std::net::SocketAddr::new(net.network(), DISCARD_PORT);
            let sent = match target {
                std::net::SocketAddr::V4(_) => v4.send_to(&[], target),
                std::net::SocketAddr::V6(_) => {
                    v6.as_ref().map_or(Ok(0), |s| s.send_to(&[], target))
                }
            };
            if let Err(e) = sent {
                errors.push(format!(
                    "priming a handshake with {} via {target}: {e}",
                    peer.node
                ));
            }
        }
    }
    errors
}

/// The discard port: the datagram only exists to start a handshake.
const DISCARD_PORT: u16 = 9;

/// What device `t` needs, against `observed`, comparing only the peers `keys` when given
/// (the device holds every other peer as planned: `diff_device_peers`); notes in `report`
/// the peers whose endpoint it sets.
pub(crate) fn device_change(
    t: &TunnelSpec,
    key: &PrivateKey,
    observed: &WgDevice,
    keys: Option<&BTreeSet<weft_crypto::PublicKey>>,
    report: &mut DataplaneReport,
) -> DeviceChange {
    let own = key.public_key();
    let change = match keys {
        Some(keys) => diff_device_peers(t, &own, observed, keys),
        None => diff_device(t, &own, observed),
    };
    for c in &change.peers {
        match c {
            PeerChange::Add(p) => report
                .endpoints_set
                .push((t.device.as_str().into(), p.public_key)),
            PeerChange::Update { spec, fields } if fields.endpoint.is_some() => report
                .endpoints_set
                .push((t.device.as_str().into(), spec.public_key)),
            _ => {}
        }
    }
    // A new private key keeps the peers as they are. Each device handshakes with every
    // peer under the new key at once (kernel WireGuard holds what it sends until then,
    // one round trip; the userspace device sends on the session it has) and keeps
    // receiving on the sessions it has. Removing and adding the peers again instead (what
    // this once did) lost those sessions and, worse, sent each peer a second initiation
    // a few milliseconds after the first, which the peer drops as a flood or a replay (one
    // within 20 ms of another): that pair then waited for WireGuard's retry, 5 s later.
    change
}

/// Reports an applied `change` to device `t`; returns the peers that get a handshake
/// started at once: added peers, peers whose AllowedIPs or PSK changed (a rotated peer's
/// key taking over; a new PSK is used from the next handshake on), and after a new private
/// key every peer (each handshakes anew under it).
pub(crate) fn applied(
    t: &TunnelSpec,
    change: &DeviceChange,
    report: &mut DataplaneReport,
) -> Vec<PeerSpec> {
    if change.set_private_key {
        report
            .changes
            .push(format!("{}: private key set", t.device));
    }
    if let Some(port) = change.listen_port {
        report
            .changes
            .push(format!("{}: listen port {port}", t.device));
    }
    report
        .changes
        .extend(change.peers.iter().map(|p| format!("{}: {p}", t.device)));
    if change.set_private_key {
        return t
            .peers
            .iter()
            .filter(|p| !p.allowed_ips.is_empty())
            .cloned()
            .collect();
    }
    change
        .peers
        .iter()
        .filter_map(|c| match c {
            PeerChange::Add(p) => Some(p.clone()),
            PeerChange::Update { spec, fields }
                if fields.allowed_ips.is_some() || fields.psk.is_some() =>
            {
                Some(spec.clone())
            }
            _ => None,
        })
        .collect()
}
