//! Pure per-peer diff of a planned device (`TunnelSpec`) against what the device holds:
//! add, update only the fields that differ, remove. Never a whole-peer-set replace: an
//! untouched peer keeps its session.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;

use ipnet::IpNet;
use weft_crypto::{PresharedKey, PublicKey};

use super::{WgDevice, WgPeer};
use crate::model::{PeerSpec, TunnelSpec};

/// Fields of an existing peer that must change (`None` = leave as is).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PeerFields {
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: Option<Vec<IpNet>>,
    pub keepalive: Option<u16>,
    /// `Some(None)` removes the PSK.
    pub psk: Option<Option<PresharedKey>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PeerChange {
    Add(PeerSpec),
    /// `spec` is the whole desired peer (a device that cannot update in place re-adds it).
    Update {
        spec: PeerSpec,
        fields: PeerFields,
    },
    Remove {
        key: PublicKey,
    },
}

/// Everything to change on one device; empty when it already matches.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceChange {
    pub set_private_key: bool,
    pub listen_port: Option<u16>,
    pub peers: Vec<PeerChange>,
}

impl DeviceChange {
    pub fn is_empty(&self) -> bool {
        !self.set_private_key && self.listen_port.is_none() && self.peers.is_empty()
    }
}

fn sorted(mut ips: Vec<IpNet>) -> Vec<IpNet> {
    ips.sort();
    ips
}

/// What must change on a device holding `observed` so it matches `spec`, with `own` as the
/// public key of the private key it must carry.
pub fn diff_device(spec: &TunnelSpec, own: &PublicKey, observed: &WgDevice) -> DeviceChange {
    diff_device_keeping(spec, own, observed, &|_, _| false)
}

/// As `diff_device`, except that a peer's endpoint is left as the device has it when
/// `keep_endpoint(planned, observed)` says so: an endpoint WireGuard learned from the peer
/// itself (roaming, a NAT that rebound the peer's port) while its session is fresh.
pub fn diff_device_keeping(
    spec: &TunnelSpec,
    own: &PublicKey,
    observed: &WgDevice,
    keep_endpoint: &dyn Fn(&PeerSpec, &WgPeer) -> bool,
) -> DeviceChange {
    let mut change = device_fields(spec, own, observed);
    for want in &spec.peers {
        change
            .peers
            .extend(peer_change(want, observed, keep_endpoint));
    }
    let wanted: BTreeSet<&PublicKey> = spec.peers.iter().map(|p| &p.public_key).collect();
    for key in observed.peers.keys() {
        if !wanted.contains(key) {
            change.peers.push(PeerChange::Remove { key: *key });
        }
    }
    change
}

/// As `diff_device`, for a device that holds every peer of `spec` as planned except, at
/// most, the peers keyed in `keys`: those of the nodes a patched plan re-planned, before
/// and after. Only those are compared, so a pass that changed a few nodes of thousands does
/// not look at every peer. On such a device the result is `diff_device`'s, in its order.
pub fn diff_device_peers(
    spec: &TunnelSpec,
    own: &PublicKey,
    observed: &WgDevice,
    keys: &BTreeSet<PublicKey>,
) -> DeviceChange {
    let mut change = device_fields(spec, own, observed);
    if keys.is_empty() {
        return change;
    }
    let mut wanted = BTreeSet::new();
    for want in spec.peers.iter().filter(|p| keys.contains(&p.public_key)) {
        wanted.insert(want.public_key);
        change
            .peers
            .extend(peer_change(want, observed, &|_, _| false));
    }
    for key in keys.difference(&wanted) {
        if observed.peers.contains_key(key) {
            change.peers.push(PeerChange::Remove { key: *key });
        }
    }
    change
}

/// The device's own fields: its private key (by its public key, `own`) and listen port.
fn device_fields(spec: &TunnelSpec, own: &PublicKey, observed: &WgDevice) -> DeviceChange {
    DeviceChange {
        set_private_key: observed.public_key.as_ref() != Some(own),
        listen_port: (observed.listen_port != spec.listen_port).then_some(spec.listen_port),
        peers: Vec::new(),
    }
}

/// What peer `want` needs on a device holding `observed`: added, the fields that differ
/// updated, or nothing.
fn peer_change(
    want: &PeerSpec,
    observed: &WgDevice,
    keep_endpoint: &dyn Fn(&PeerSpec, &WgPeer) -> bool,
) -> Option<PeerChange> {
    let Some(have) = observed.peers.get(&want.public_key) else {
        return Some(PeerChange::Add(want.clone()));
    };
    let allowed = sorted(want.allowed_ips.clone());
    let fields = PeerFields {
        endpoint: (have.endpoint != Some(want.endpoint) && !keep_endpoint(want, have))
            .then_some(want.endpoint),
        allowed_ips: (have.allowed_ips != allowed).then_some(allowed),
        keepalive: (have.keepalive != want.keepalive).then_some(want.keepalive),
        psk: (have.psk != want.psk).then(|| want.psk.clone()),
    };
    (fields != PeerFields::default()).then(|| PeerChange::Update {
        spec: want.clone(),
        fields,
    })
}

/// `observed` as it is after `change` was applied: what a fresh read would return for the
/// fields the diff compares. Lets a pass that only follows registry events skip re-reading
/// a large device (a periodic full pass still reads it, catching outside changes).
pub fn apply_to(observed: &mut WgDevice, change: &DeviceChange, own: &PublicKey) {
    if change.set_private_key {
        observed.public_key = Some(*own);
    }
    if let Some(port) = change.listen_port {
        observed.listen_port = port;
    }
    for c in &change.peers {
        match c {
            PeerChange::Add(p) | PeerChange::Update { spec: p, .. } => {
                let peer = observed.peers.entry(p.public_key).or_default();
                peer.endpoint = Some(p.endpoint);
                peer.allowed_ips = sorted(p.allowed_ips.clone());
                peer.keepalive = p.keepalive;
                peer.psk = p.psk.clone();
            }
            PeerChange::Remove { key } => {
                observed.peers.remove(key);
            }
        }
    }
}

impl fmt::Display for PeerChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ips = |v: &[IpNet]| {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            PeerChange::Add(p) => write!(
                f,
                "add peer {} ({}) endpoint {} allowed {}",
                p.node,
                p.public_key,
                p.endpoint,
                ips(&p.allowed_ips)
            ),
            PeerChange::Update { spec, fields } => {
                write!(f, "update peer {} ({}):", spec.node, spec.public_key)?;
                if let Some(e) = fields.endpoint {
                    write!(f, " endpoint {e}")?;
                }
                if let Some(a) = &fields.allowed_ips {
                    write!(f, " allowed {}", ips(a))?;
                }
                if let Some(k) = fields.keepalive {
                    write!(f, " keepalive {k}s")?;
                }
                match &fields.psk {
                    Some(Some(_)) => write!(f, " psk (new)")?,
                    Some(None) => write!(f, " psk removed")?,
                    None => {}
                }
                Ok(())
            }
            PeerChange::Remove { key } => write!(f, "remove peer {key}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::wireguard::WgPeer;
    use crate::model::fixtures::{key, tunnel};

    fn spec_peer(node: &str, seed: u8, endpoint: &str, allowed: &str) -> PeerSpec {
        PeerSpec {
            node: node.into(),
            public_key: key(seed),
            endpoint: endpoint.parse().unwrap(),
            allowed_ips: vec![allowed.parse().unwrap()],
            keepalive: 0,
            psk: None,
            via: Default::default(),
        }
    }

    fn seen(spec: &PeerSpec) -> WgPeer {
        WgPeer {
            endpoint: Some(spec.endpoint),
            allowed_ips: spec.allowed_ips.clone(),
            keepalive: spec.keepalive,
            psk: spec.psk.clone(),
            ..WgPeer::default()
        }
    }

    #[test]
    fn per_peer_changes_only() {
        let b = spec_peer("node-b", 2, "198.51.100.2:51820", "10.244.2.0/24");
        let c = spec_peer("node-c", 3, "198.51.100.3:51820", "10.244.3.0/24");
        let d = spec_peer("node-d", 4, "198.51.100.4:51820", "10.244.4.0/24");
        let mut observed = WgDevice {
            public_key: Some(key(1)),
            listen_port: 51820,
            ..WgDevice::default()
        };
        observed.peers.insert(b.public_key, seen(&b)); // unchanged
        let mut moved = seen(&c);
        moved.endpoint = Some("203.0.113.3:51820".parse().unwrap());
        moved.last_handshake = Some(std::time::Duration::from_secs(5)); // stats never count as a change
        observed.peers.insert(c.public_key, moved);
        observed.peers.insert(key(9), WgPeer::default()); // a node that left
        let got: Vec<String> = diff_device(
            &tunnel(vec![b.clone(), c.clone(), d.clone()]),
            &key(1),
            &observed,
        )
        .peers
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            got,
            [
                format!(
                    "update peer node-c ({}): endpoint 198.51.100.3:51820",
                    key(3)
                ),
                format!(
                    "add peer node-d ({}) endpoint 198.51.100.4:51820 allowed 10.244.4.0/24",
                    key(4)
                ),
                format!("remove peer {}", key(9)),
            ]
        );
    }

    #[test]
    fn steady_state_is_empty_and_key_or_port_changes_show() {
        let b = spec_peer("node-b", 2, "198.51.100.2:51820", "10.244.2.0/24");
        let mut observed = WgDevice {
            public_key: Some(key(1)),
            listen_port: 51820,
            ..WgDevice::default()
        };
        observed.peers.insert(b.public_key, seen(&b));
        assert!(diff_device(&tunnel(vec![b.clone()]), &key(1), &observed).is_empty());
        let rotated = diff_device(&tunnel(vec![b.clone()]), &key(7), &observed);
        assert!(rotated.set_private_key && rotated.peers.is_empty());
        let mut moved_port = tunnel(vec![b]);
        moved_port.listen_port = 51999;
        assert_eq!(
            diff_device(&moved_port, &key(1), &observed).listen_port,
            Some(51999)
        );
        let fresh = diff_device(&tunnel(vec![]), &key(1), &WgDevice::default());
        assert!(fresh.set_private_key && fresh.listen_port == Some(51820));
    }

    #[test]
    fn psk_and_allowed_ips_order() {
        let mut b = spec_peer("node-b", 2, "198.51.100.2:51820", "10.244.2.0/24");
        b.allowed_ips
            .insert(0, "fd00:10:244:2::/64".parse().unwrap());
        let mut observed = WgDevice {
            public_key: Some(key(1)),
            listen_port: 51820,
            ..WgDevice::default()
        };
        let mut have = seen(&b);
        have.allowed_ips.sort();
        observed.peers.insert(b.public_key, have);
        assert!(
            diff_device(&tunnel(vec![b.clone()]), &key(1), &observed).is_empty(),
            "order of AllowedIPs does not matter"
        );
        let psk = PresharedKey::generate().unwrap();
        b.psk = Some(psk.clone());
        let change = diff_device(&tunnel(vec![b]), &key(1), &observed);
        assert!(
            matches!(&change.peers[0], PeerChange::Update { fields, .. } if fields.psk.as_ref().is_some_and(Option::is_some))
        );
        let line = change.peers[0].to_string();
        assert!(
            line.ends_with("psk (new)") && !line.contains(&psk.to_base64_secret()),
            "{line}"
        );
    }

    #[test]
    fn a_change_applied_to_the_cached_device_leaves_nothing_to_do() {
        let b = spec_peer("node-b", 2, "198.51.100.2:51820", "10.244.2.0/24");
        let mut c = spec_peer("node-c", 3, "198.51.100.3:51820", "10.244.3.0/24");
        let mut observed = WgDevice::default();
        observed.peers.insert(c.public_key, seen(&c));
        observed.peers.insert(key(9), WgPeer::default());
        c.endpoint = "203.0.113.3:51820".parse().unwrap();
        c.psk = Some(weft_crypto::PresharedKey::from_bytes([5; 32]));
        let spec = tunnel(vec![b, c]);
        let change = diff_device(&spec, &key(1), &observed);
        assert!(!change.is_empty());
        apply_to(&mut observed, &change, &key(1));
        assert!(diff_device(&spec, &key(1), &observed).is_empty());
        assert_eq!(observed.peers.len(), 2, "the stale peer is gone");
    }

    /// A random peer of node `n`: one of a few keys, endpoints, AllowedIPs, keepalives
    /// and PSKs, so that random changes often leave a field as it was.
    fn random_peer(rng: &mut crate::test_rng::Rng, n: u8) -> PeerSpec {
        let mut p = spec_peer(
            &format!("node-{n}"),
            n * 4 + 1 + rng.below(3) as u8,
            &format!("198.51.100.{}:5182{}", n, rng.below(2)),
            &format!("10.244.{n}.0/24"),
        );
        if rng.below(2) == 0 {
            p.allowed_ips
                .insert(0, format!("fd00:10:244:{n}::/64").parse().unwrap());
        }
        p.keepalive = [0, 25][rng.below(2) as usize];
        p.psk = (rng.below(2) == 0).then(|| PresharedKey::from_bytes([n; 32]));
        p
    }

    /// A device that holds plan `old` and is then given plan `new`, which differs from it
    /// in some nodes' peers: comparing the peers of those nodes alone gives the whole
    /// diff's answer, in its order, whatever they changed (added, removed, re-keyed, moved).
    #[test]
    fn comparing_the_changed_peers_alone_gives_the_whole_diff() {
        let mut rng = crate::test_rng::Rng(0x5eed_d1ff);
        for case in 0..500 {
            let mut old = Vec::new();
            for n in 1..=12 {
                if rng.below(4) != 0 {
                    old.push(random_peer(&mut rng, n));
                }
            }
            let mut device = WgDevice::default();
            let fill = diff_device(&tunnel(old.clone()), &key(1), &device);
            apply_to(&mut device, &fill, &key(1));
            let mut new = old.clone();
            let mut keys = BTreeSet::new();
            for _ in 0..rng.below(4) {
                let n = 1 + rng.below(14) as u8;
                let name = format!("node-{n}");
                keys.extend(new.iter().filter(|p| p.node == name).map(|p| p.public_key));
                new.retain(|p| p.node != name);
                if rng.below(3) != 0 {
                    let peer = random_peer(&mut rng, n);
                    keys.insert(peer.public_key);
                    // A changed node goes where the planner puts the newest: last.
                    new.push(peer);
                }
            }
            let spec = tunnel(new);
            assert_eq!(
                diff_device_peers(&spec, &key(1), &device, &keys),
                diff_device(&spec, &key(1), &device),
                "case {case}: keys {keys:?}"
            );
        }
    }
}
