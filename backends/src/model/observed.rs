//! What this node's devices have reported, handed to `plan()` as an input like the clock:
//! every decision made from it (a peer's announced key taking over when it handshakes, an
//! endpoint learned by roaming kept) is planner code with table tests. Kept by the agent
//! between passes; no I/O here.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use weft_crypto::PublicKey;

/// How long after a peer's announced moment its next key takes over even if it has not
/// handshaken (the rotating node is late, or down: it switches when it returns).
pub const SWITCH_GRACE: Duration = Duration::from_secs(2);
/// How often the device is read while a switch is near (by the agent's switch watcher, a
/// task of its own: the control loop's passes never delay it).
pub const HANDSHAKE_POLL: Duration = Duration::from_millis(5);
/// How long before an announced moment the watching starts.
pub const WATCH_BEFORE: Duration = Duration::from_millis(300);
/// An announced moment is taken as no earlier than this long after this node first saw
/// the announcement (the lead a rotating node announces with). A clock running ahead
/// (an hour, say) would otherwise find every moment past on sight and switch before the
/// rotating node does; a late one waits for the handshake or the new backend-data.
pub const SEEN_LEAD: Duration = Duration::from_secs(3);

/// The devices' reports that the plan depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Peers' announced next keys that have handshaken on this node's device: each is in
    /// use, so it takes over at once.
    pub next_keys_in_use: BTreeSet<PublicKey>,
    /// When this node first saw each announced next key, by its own clock (`SEEN_LEAD`).
    pub next_keys_seen: BTreeMap<PublicKey, SystemTime>,
    /// Each peer on this node's WireGuard devices, by device and key (with `Mode:
    /// separate` one node is a peer of both devices, under the same key): what the device
    /// holds, and what this agent did to it.
    pub peers: BTreeMap<DevicePeer, PeerObserved>,
    /// ipsec: the SPIs of this node's inbound states that have carried packets, as last
    /// read (a peer sending on a state shows it holds the state's keys).
    pub esp_heard: BTreeSet<u32>,
    /// Each cross-zone pair's path failures, by peer node, as the liveness watcher found
    /// them (`plan::relay`).
    pub paths: BTreeMap<String, PathHistory>,
    /// While the cluster changes backend: until this moment the guard still takes a pair's
    /// pods in clear from the unencrypted backend this node keeps, though the pair has
    /// moved to an encrypting one (set at the agent's start and whenever a pair leaves
    /// clear), so the packets its peer sends before it reads the move are not dropped
    /// (`plan::mixed`). Nothing is ever sent in clear for it.
    pub accept_clear_until: Option<SystemTime>,
    /// The backends this node retired a moment ago whose devices it still keeps (they are
    /// in the planned lease's `also`): no pair is planned on them any more, as the node's
    /// peers read from its published lease (`plan::mixed`).
    pub draining: BTreeSet<String>,
}

/// How a pair's paths have failed: the direct one, and the gateways that carried it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PathHistory {
    /// When the direct path was last found dead, and how many times in a row.
    pub direct_failed: Option<SystemTime>,
    pub direct_failures: u32,
    /// Each gateway (by node) that carried the pair and was found dead, and when.
    pub gateways_failed: BTreeMap<String, SystemTime>,
}

/// One peer of one WireGuard device: the device's name and the peer's key.
pub type DevicePeer = (super::IfName, PublicKey);

/// One peer as the device reports it, with the agent's memory of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerObserved {
    /// The endpoint the device holds: WireGuard learns it from the peer's own
    /// authenticated packets (roaming, a NAT rebinding the peer's port).
    pub endpoint: Option<SocketAddr>,
    /// The last handshake, as time since the Unix epoch; `None` or zero: never.
    pub last_handshake: Option<Duration>,
    /// The endpoint the previous plans named for this peer (before a roamed one was kept);
    /// `None` after a restart.
    pub planned_before: Option<SocketAddr>,
    /// When this agent last set the peer's endpoint (or first saw the peer); `None`: now.
    pub endpoint_set: Option<SystemTime>,
}

/// When the agent should read its device for announced keys' first handshakes: every
/// `HANDSHAKE_POLL` from `from` until `until`, looking for `keys` (after `until` the
/// clock switches them anyway), and what to change on the device when one has handshaken
/// (`moves`).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyWatch {
    pub from: SystemTime,
    pub until: SystemTime,
    pub moves: Vec<KeyMove>,
}

/// The switch to a peer's next key on one device, as one device update: the next key's
/// staged entry takes the current entry's AllowedIPs (a WireGuard device gives an address
/// to one entry only, so they leave the current entry in the same step).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyMove {
    pub device: String,
    /// The peer's staged entry, as it is once switched (its AllowedIPs included).
    pub next: crate::model::PeerSpec,
    /// The key being left.
    pub current: PublicKey,
    /// The moment the rotating node announced (for the log: how long the switch took).
    pub announced: SystemTime,
}

impl KeyWatch {
    /// The announced keys watched for, each once.
    pub fn keys(&self) -> Vec<PublicKey> {
        let mut keys: Vec<PublicKey> = Vec::new();
        for m in &self.moves {
            if !keys.contains(&m.next.public_key) {
                keys.push(m.next.public_key);
            }
        }
        keys
    }

    /// When to read the device next, after reading it at `last` (if at all); `None` once
    /// the watch is over at `now`.
    pub fn next_poll(&self, last: Option<SystemTime>, now: SystemTime) -> Option<SystemTime> {
        if now >= self.until {
            return None;
        }
        let after_last = last.map_or(self.from, |t| t + HANDSHAKE_POLL);
        Some(self.from.max(after_last))
    }

    /// Adds `key`'s watch, announced to switch at `announced` and switched by this node's
    /// clock at `until`, unless it is already over at `now`. The watch starts
    /// `WATCH_BEFORE` the announced moment, not the later one this node's clock keeps
    /// (`SEEN_LEAD`): the rotating node switches at its announced moment however late the
    /// announcement reached this node, and a handshake on its next key is proof enough.
    pub(crate) fn merge(
        watch: &mut Option<KeyWatch>,
        moved: KeyMove,
        announced: SystemTime,
        until: SystemTime,
        now: SystemTime,
    ) {
        if now >= until {
            return;
        }
        let from = announced.checked_sub(WATCH_BEFORE).unwrap_or(announced);
        let w = watch.get_or_insert_with(|| KeyWatch {
            from,
            until,
            moves: Vec::new(),
        });
        w.from = w.from.min(from);
        w.until = w.until.max(until);
        w.moves.push(moved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved(key: PublicKey) -> KeyMove {
        KeyMove {
            device: "flannel-wg".into(),
            next: crate::model::PeerSpec {
                node: "n2".into(),
                public_key: key,
                endpoint: "192.0.2.2:51820".parse().unwrap(),
                allowed_ips: vec!["10.5.2.0/24".parse().unwrap()],
                keepalive: 0,
                psk: None,
                via: Default::default(),
            },
            current: weft_crypto::PrivateKey::from_bytes([8; 32]).public_key(),
            announced: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000),
        }
    }

    #[test]
    fn a_watch_polls_from_its_start_every_poll_until_its_end() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let key = weft_crypto::PrivateKey::from_bytes([9; 32]).public_key();
        let mut w = None;
        KeyWatch::merge(
            &mut w,
            moved(key),
            t,
            t + SWITCH_GRACE,
            t - Duration::from_secs(10),
        );
        let w = w.unwrap();
        assert_eq!((w.from, w.until), (t - WATCH_BEFORE, t + SWITCH_GRACE));
        assert_eq!((w.keys(), w.moves.clone()), (vec![key], vec![moved(key)]));
        assert_eq!(
            w.next_poll(None, t - Duration::from_secs(10)),
            Some(t - WATCH_BEFORE)
        );
        assert_eq!(w.next_poll(Some(t), t), Some(t + HANDSHAKE_POLL));
        assert_eq!(w.next_poll(Some(t), t + SWITCH_GRACE), None);
        let mut over = None;
        KeyWatch::merge(&mut over, moved(key), t, t + SWITCH_GRACE, t + SWITCH_GRACE);
        assert_eq!(over, None, "past the grace: the clock decides");
    }
}
