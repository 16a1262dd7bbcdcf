//! Drift: what a device holds that the plan did not put there, as the liveness watcher
//! reads it between passes (a `wg set` by hand, another tool, a device that lost state).
//! Endpoints are not drift: WireGuard moves them itself when a peer roams (a roamed
//! endpoint that stops answering is the liveness watcher's to repair). Pure.

use std::fmt;

use ipnet::IpNet;
use weft_crypto::PublicKey;

use super::diff::{diff_device_keeping, PeerChange};
use super::WgDevice;
use crate::model::TunnelSpec;

/// One difference between a device and its plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drift {
    PrivateKey,
    ListenPort {
        have: u16,
        want: u16,
    },
    /// A planned peer whose key is not on the device (replaced, or removed).
    MissingPeer {
        node: String,
        key: PublicKey,
    },
    AllowedIps {
        node: String,
        have: Vec<IpNet>,
        want: Vec<IpNet>,
    },
    Keepalive {
        node: String,
    },
    Psk {
        node: String,
    },
    /// A peer on the device that the plan does not have.
    UnknownPeer {
        key: PublicKey,
    },
}

impl Drift {
    /// The cause `/metrics` counts a repair of it under.
    pub fn cause(&self) -> &'static str {
        match self {
            Drift::PrivateKey | Drift::MissingPeer { .. } | Drift::UnknownPeer { .. } => {
                "key mismatch"
            }
            Drift::ListenPort { .. } => "listen port changed",
            Drift::AllowedIps { .. } => "allowed ips changed",
            Drift::Keepalive { .. } | Drift::Psk { .. } => "peer settings changed",
        }
    }
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ips = |v: &[IpNet]| {
            let s: Vec<String> = v.iter().map(ToString::to_string).collect();
            if s.is_empty() {
                "(none)".to_string()
            } else {
                s.join(",")
            }
        };
        match self {
            Drift::PrivateKey => write!(f, "the device's private key is not this node's"),
            Drift::ListenPort { have, want } => {
                write!(f, "listen port {have}, planned {want}")
            }
            Drift::MissingPeer { node, key } => {
                write!(f, "peer {node} (key {key}) is not on the device")
            }
            Drift::AllowedIps { node, have, want } => write!(
                f,
                "peer {node}'s AllowedIPs are {}, planned {}",
                ips(have),
                ips(want)
            ),
            Drift::Keepalive { node } => write!(f, "peer {node}'s keepalive changed"),
            Drift::Psk { node } => write!(f, "peer {node}'s pre-shared key changed"),
            Drift::UnknownPeer { key } => write!(f, "a peer the plan does not have (key {key})"),
        }
    }
}

/// How `observed` differs from `spec` (`own`: the public key of the key it must carry),
/// endpoints aside; empty when it matches.
pub fn drift(spec: &TunnelSpec, own: &PublicKey, observed: &WgDevice) -> Vec<Drift> {
    let change = diff_device_keeping(spec, own, observed, &|_, _| true);
    let mut out = Vec::new();
    if change.set_private_key {
        out.push(Drift::PrivateKey);
    }
    if let Some(want) = change.listen_port {
        out.push(Drift::ListenPort {
            have: observed.listen_port,
            want,
        });
    }
    for c in change.peers {
        match c {
            PeerChange::Add(p) => out.push(Drift::MissingPeer {
                node: p.node,
                key: p.public_key,
            }),
            PeerChange::Remove { key } => out.push(Drift::UnknownPeer { key }),
            PeerChange::Update { spec, fields } => {
                if let Some(want) = fields.allowed_ips {
                    let have = observed
                        .peers
                        .get(&spec.public_key)
                        .map(|p| p.allowed_ips.clone())
                        .unwrap_or_default();
                    out.push(Drift::AllowedIps {
                        node: spec.node.clone(),
                        have,
                        want,
                    });
                }
                if fields.keepalive.is_some() {
                    out.push(Drift::Keepalive {
                        node: spec.node.clone(),
                    });
                }
                if fields.psk.is_some() {
                    out.push(Drift::Psk { node: spec.node });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::wireguard::WgPeer;
    use crate::model::fixtures::{key, tunnel};
    use crate::model::PeerSpec;

    fn peer(node: &str, seed: u8, allowed: &str) -> PeerSpec {
        PeerSpec {
            node: node.into(),
            public_key: key(seed),
            endpoint: "198.51.100.2:51820".parse().unwrap(),
            allowed_ips: vec![allowed.parse().unwrap()],
            keepalive: 0,
            psk: None,
            via: Default::default(),
        }
    }

    fn device(spec: &TunnelSpec) -> WgDevice {
        WgDevice {
            public_key: Some(key(1)),
            listen_port: spec.listen_port,
            peers: spec
                .peers
                .iter()
                .map(|p| {
                    (
                        p.public_key,
                        WgPeer {
                            endpoint: Some(p.endpoint),
                            allowed_ips: p.allowed_ips.clone(),
                            ..WgPeer::default()
                        },
                    )
                })
                .collect(),
        }
    }

    fn spec() -> TunnelSpec {
        tunnel(vec![
            peer("node-b", 2, "10.244.2.0/24"),
            peer("node-c", 3, "10.244.3.0/24"),
        ])
    }

    #[test]
    fn a_device_as_planned_has_none_and_a_roamed_endpoint_is_not_drift() {
        let spec = spec();
        let mut have = device(&spec);
        assert_eq!(drift(&spec, &key(1), &have), vec![]);
        if let Some(p) = have.peers.get_mut(&key(2)) {
            p.endpoint = "203.0.113.7:40000".parse().ok();
            p.rx_bytes = 1000;
        }
        assert_eq!(drift(&spec, &key(1), &have), vec![]);
    }

    #[test]
    fn each_change_by_hand_is_named() {
        let spec = spec();
        let mut have = device(&spec);
        have.listen_port = 51999;
        if let Some(p) = have.peers.get_mut(&key(2)) {
            p.allowed_ips = vec!["10.244.9.0/24".parse().unwrap()];
        }
        // node-c's key replaced by another.
        if let Some(p) = have.peers.remove(&key(3)) {
            have.peers.insert(key(7), p);
        }
        let found = drift(&spec, &key(1), &have);
        let text: Vec<String> = found.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            vec![
                "listen port 51999, planned 51820".to_string(),
                "peer node-b's AllowedIPs are 10.244.9.0/24, planned 10.244.2.0/24".into(),
                format!("peer node-c (key {}) is not on the device", key(3)),
                format!("a peer the plan does not have (key {})", key(7)),
            ]
        );
        let causes: Vec<&str> = found.iter().map(Drift::cause).collect();
        assert_eq!(
            causes,
            [
                "listen port changed",
                "allowed ips changed",
                "key mismatch",
                "key mismatch"
            ]
        );
        have.public_key = Some(key(8));
        assert_eq!(drift(&spec, &key(1), &have)[0], Drift::PrivateKey);
    }
}
