//! Roaming: whether a WireGuard peer keeps the endpoint its device learned. WireGuard
//! learns a peer's endpoint from the peer's own authenticated packets (the peer moved, a
//! NAT rebound its port); putting the registry's endpoint back would break the path. Pure:
//! the device's report and the agent's memory come in `Observed`, the clock as `now`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use crate::model::{DevicePeer, Observed, PeerObserved, PeerSpec};

/// How long after its last handshake a peer's session counts as alive (WireGuard's
/// REJECT_AFTER_TIME: past it, the session is dropped).
pub const SESSION_FRESH: Duration = Duration::from_secs(180);

/// Whether the peer keeps the endpoint its device holds instead of `planned`. It does
/// while the plan still names the endpoint it named before (an operator or the peer moving
/// it is followed at once) and either its session is fresh or this agent set the endpoint
/// less than a session's lifetime ago: a peer behind a NAT is learned from its handshake
/// initiation, before that handshake completes, and must not be put back then. After a
/// restart there is no "before": a fresh session keeps its endpoint.
pub fn keeps_roamed(have: &PeerObserved, planned: SocketAddr, now: SystemTime) -> bool {
    let plan_unchanged = have.planned_before.is_none_or(|before| before == planned);
    let fresh = have.last_handshake.is_some_and(|t| {
        !t.is_zero()
            && now
                .duration_since(SystemTime::UNIX_EPOCH)
                .is_ok_and(|n| n.saturating_sub(t) <= SESSION_FRESH)
    });
    let since_set = have.endpoint_set.map_or(Duration::ZERO, |t| {
        now.duration_since(t).unwrap_or_default()
    });
    have.endpoint.is_some() && (fresh || since_set < SESSION_FRESH) && plan_unchanged
}

/// Records the planned endpoint of each peer of `device` in `planned`, and gives it the
/// endpoint the device learned where `keeps_roamed` says so.
pub(crate) fn keep_roamed(
    device: &str,
    peers: &mut [PeerSpec],
    observed: &Observed,
    now: SystemTime,
    planned: &mut BTreeMap<DevicePeer, SocketAddr>,
) {
    for p in peers {
        let id = (device.into(), p.public_key);
        planned.insert(id, p.endpoint);
        let Some(have) = observed.peers.get(&id) else {
            continue;
        };
        if let Some(roamed) = have
            .endpoint
            .filter(|_| keeps_roamed(have, p.endpoint, now))
        {
            p.endpoint = roamed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roamed_endpoint_is_kept_while_fresh_and_the_plan_is_unchanged() {
        let planned: SocketAddr = "198.51.100.253:51820".parse().unwrap();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(100_000);
        let long_ago = Some(now - Duration::from_secs(3600));
        let roamed = PeerObserved {
            endpoint: "198.51.100.253:40123".parse().ok(),
            last_handshake: Some(Duration::from_secs(100_000 - 30)),
            planned_before: Some(planned),
            endpoint_set: long_ago,
        };
        let moved: SocketAddr = "203.0.113.9:51820".parse().unwrap();
        let cases = [
            ("fresh session, plan unchanged", roamed.clone(), true),
            (
                "after a restart (nothing planned before)",
                PeerObserved {
                    planned_before: None,
                    ..roamed.clone()
                },
                true,
            ),
            (
                "stale session",
                PeerObserved {
                    last_handshake: Some(Duration::from_secs(100_000 - 200)),
                    ..roamed.clone()
                },
                false,
            ),
            (
                "never handshaken, set long ago",
                PeerObserved {
                    last_handshake: None,
                    ..roamed.clone()
                },
                false,
            ),
            (
                "learned from a handshake initiation just after the peer was added",
                PeerObserved {
                    last_handshake: None,
                    endpoint_set: Some(now - Duration::from_millis(70)),
                    ..roamed.clone()
                },
                true,
            ),
            (
                "first seen now",
                PeerObserved {
                    last_handshake: None,
                    endpoint_set: None,
                    ..roamed.clone()
                },
                true,
            ),
            (
                "the plan moved it",
                PeerObserved {
                    planned_before: Some(moved),
                    ..roamed.clone()
                },
                false,
            ),
            (
                "the device has no endpoint",
                PeerObserved {
                    endpoint: None,
                    ..roamed.clone()
                },
                false,
            ),
        ];
        for (what, have, keep) in cases {
            assert_eq!(keeps_roamed(&have, planned, now), keep, "{what}");
        }
    }

    #[test]
    fn the_plan_carries_the_kept_endpoint_and_remembers_the_planned_one() {
        let key = |seed: u8| weft_crypto::PrivateKey::from_bytes([seed; 32]).public_key();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(100_000);
        let spec = |seed: u8, endpoint: &str| PeerSpec {
            node: format!("n{seed}"),
            public_key: key(seed),
            endpoint: endpoint.parse().unwrap(),
            allowed_ips: vec![],
            keepalive: 25,
            psk: None,
            via: Default::default(),
        };
        let mut peers = vec![spec(2, "198.51.100.2:51820"), spec(3, "198.51.100.3:51820")];
        let roamed = |endpoint: &str, before: &str| PeerObserved {
            endpoint: endpoint.parse().ok(),
            last_handshake: Some(Duration::from_secs(100_000 - 5)),
            planned_before: before.parse().ok(),
            endpoint_set: None,
        };
        let (v4, v6) = ("flannel-wg", "flannel-wg-v6");
        let observed = Observed {
            peers: [
                (
                    (v4.into(), key(2)),
                    roamed("198.51.100.2:40000", "198.51.100.2:51820"),
                ),
                // The same node on the IPv6 device (`Mode: separate`, one key): its
                // endpoint there is no business of the IPv4 device's.
                (
                    (v6.into(), key(3)),
                    roamed("[fd77::3]:51821", "[fd77::3]:51821"),
                ),
            ]
            .into(),
            ..Observed::default()
        };
        let mut planned = BTreeMap::new();
        keep_roamed(v4, &mut peers, &observed, now, &mut planned);
        assert_eq!(peers[0].endpoint.to_string(), "198.51.100.2:40000");
        assert_eq!(peers[1].endpoint.to_string(), "198.51.100.3:51820");
        assert_eq!(
            planned[&(v4.into(), key(2))].to_string(),
            "198.51.100.2:51820"
        );
        assert_eq!(planned.len(), 2);
    }
}
