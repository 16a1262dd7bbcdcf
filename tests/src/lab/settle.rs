//! A lab at rest: with `Backend.PostQuantum` on, each agent's first rounds complete a
//! second or two after it starts, and the pass that puts their PSKs on the device makes
//! every pair handshake anew. A test of what happens to a settled mesh (a fault, an
//! outage, a count of data-plane writes) begins after that, not across it: a handshake
//! still under way would, say, put back an endpoint the test just set wrong (the peer's
//! message roams it), and the fault would never be seen.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use weft_backends::apply::wireguard::uapi::parse_get;

use super::{Lab, Node};
use crate::bench::log_time;

/// An agent with post-quantum rounds logs this once, at start.
const KEM_KEY: &str = "ML-KEM-768 key";
/// Logged as each pair's PSK takes over, with `peer=<node>`.
const IN_FORCE: &str = "post-quantum PSK in force";
/// Logged at the end of every pass.
const PASS: &str = " reconciled ";

/// What one agent's log says of its pairs' first rounds.
#[derive(Debug, PartialEq)]
pub struct Rounds {
    /// The peers with a PSK in force.
    pub protected: BTreeSet<String>,
    /// A pass ran after the last PSK took over (it put the PSK on the device).
    pub applied: bool,
}

/// Reads `log`: `None` if the agent runs no post-quantum rounds.
pub fn rounds(log: &str) -> Option<Rounds> {
    if !log.contains(KEM_KEY) {
        return None;
    }
    let lines: Vec<&str> = log.lines().collect();
    let last = lines.iter().rposition(|l| l.contains(IN_FORCE));
    let protected = (lines.iter())
        .filter(|l| l.contains(IN_FORCE))
        .filter_map(|l| l.split(" peer=").nth(1)?.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let applied = last.is_none_or(|at| lines[at..].iter().any(|l| l.contains(PASS)));
    Some(Rounds { protected, applied })
}

/// When each peer (`(device, public key)`) last got a new PSK (or keepalive: either makes
/// the userspace device handshake anew) on the device, from the agent's `data plane
/// change=<device>: update peer <node> (<key>): … psk (new)` lines. A pass logs its changes
/// as it ends, and the device may have handshaken under the new PSK before that: the
/// moment given is the agent's line before the pass's changes (`plan updated`, say), which
/// the pass followed; the device's own lines (boringtun's, when its log is on) come from
/// its threads meanwhile and are passed over.
pub fn psk_changes(log: &str) -> BTreeMap<(String, String), SystemTime> {
    let anew = |l: &str| {
        [" psk (new)", " psk removed", " keepalive "]
            .iter()
            .any(|c| l.contains(c))
    };
    let mut at = BTreeMap::new();
    let mut before_pass = None;
    for line in log.lines() {
        let Some(change) = line.split(" data plane change=").nth(1) else {
            if !line.contains(" boringtun::") {
                before_pass = log_time(line).or(before_pass);
            }
            continue;
        };
        let Some((device, rest)) = change.split_once(": update peer ") else {
            continue;
        };
        let key = rest.split_once(" (").and_then(|(_, k)| k.split_once(')'));
        if let (true, Some((key, _)), Some(t)) = (anew(rest), key, before_pass.or(log_time(line))) {
            at.insert((device.to_string(), key.to_string()), t);
        }
    }
    at
}

/// The last handshake of each peer of `node`'s userspace device `device`, to the
/// nanosecond (`wg show` gives whole seconds), from its UAPI socket.
fn handshakes(node: &Node, device: &str) -> anyhow::Result<BTreeMap<String, SystemTime>> {
    let path = node.dir.join(format!("run/wireguard/{device}.sock"));
    let mut stream =
        UnixStream::connect(&path).with_context(|| format!("connecting {}", path.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"get=1\n\n")?;
    let mut answer = String::new();
    let mut reader = BufReader::new(stream);
    while !answer.lines().any(|l| l.starts_with("errno=")) {
        if reader.read_line(&mut answer)? == 0 {
            bail!("{} closed before its answer ended", path.display());
        }
    }
    let device = parse_get(&answer).with_context(|| format!("the answer of {}", path.display()))?;
    Ok((device.peers.into_iter())
        .filter_map(|(key, peer)| {
            Some((
                key.to_string(),
                SystemTime::UNIX_EPOCH + peer.last_handshake?,
            ))
        })
        .collect())
}

impl Lab {
    /// Waits until every agent with post-quantum rounds has a PSK in force with every
    /// other such agent, and has applied it. Labs whose agents run none return at once.
    pub fn settle_post_quantum(&self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        let (mut peers, mut unsettled) = (0, Vec::new());
        let settled = crate::wait::holds_within(within, || {
            let logs: Vec<Option<Rounds>> = (self.nodes.iter())
                .map(|n| rounds(&std::fs::read_to_string(n.agent_log()).unwrap_or_default()))
                .collect();
            peers = logs.iter().flatten().count().saturating_sub(1);
            unsettled = (logs.iter().enumerate())
                .filter_map(|(i, r)| Some((i, r.as_ref()?)))
                .filter(|(_, r)| r.protected.len() < peers || !r.applied)
                .map(|(i, r)| format!("node {}: {r:?}", i + 1))
                .collect();
            unsettled.is_empty()
        });
        if !settled {
            bail!(
                "post-quantum pairs not protected within {within:?} of the agents' start \
                 ({peers} peers each): {unsettled:?}\n{}",
                self.logs()
            );
        }
        self.settle_handshakes(deadline, within)
    }
}

impl Lab {
    /// Waits until every peer of a userspace device that got a new PSK has handshaken
    /// under it (its new session is the one in use). Kernel WireGuard keeps its session
    /// and uses a new PSK from the next handshake on: nothing to wait for there.
    fn settle_handshakes(&self, deadline: Instant, within: Duration) -> anyhow::Result<()> {
        let mut pending = Vec::new();
        let left = deadline.saturating_duration_since(Instant::now());
        let settled = crate::wait::holds_within(left, || {
            pending.clear();
            for (i, node) in self.nodes.iter().enumerate() {
                if self.implementation(i) != Some("userspace") {
                    continue;
                }
                let log = std::fs::read_to_string(node.agent_log()).unwrap_or_default();
                // A device that cannot be read now (being made again, say) is asked again
                // until the deadline.
                let mut devices: BTreeMap<String, Result<_, String>> = BTreeMap::new();
                for ((device, key), changed) in psk_changes(&log) {
                    let read = (devices.entry(device.clone()))
                        .or_insert_with(|| handshakes(node, &device).map_err(|e| format!("{e:#}")));
                    match read.as_ref().map(|peers| peers.get(&key)) {
                        Ok(Some(hs)) if *hs >= changed => {}
                        hs => pending.push(format!(
                            "node {}: {device} peer {key}: PSK at {changed:?}, handshake {hs:?}",
                            i + 1
                        )),
                    }
                }
            }
            pending.is_empty()
        });
        if !settled {
            bail!(
                "peers not handshaken under their new PSK within {within:?} of the agents' \
                 start: {pending:?}\n{}",
                self.logs()
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_says_which_pairs_are_protected_and_whether_the_psk_is_applied() {
        assert_eq!(rounds("INFO weft::node::start: WireGuard key"), None);
        let log = "\
INFO weft::pq: ML-KEM-768 key path=/var/lib/weft/mlkem.key
INFO weft::pq::manager::publish: post-quantum PSK in force peer=10.244.69.0-24 round=1 rounds=1
INFO weft::node::error_policy: reconciled pass=6 writes=1
INFO weft::pq::manager::publish: post-quantum PSK in force peer=10.244.8.0-24 round=2 rounds=1";
        let r = rounds(log).unwrap();
        assert_eq!(
            r.protected.into_iter().collect::<Vec<_>>(),
            ["10.244.69.0-24", "10.244.8.0-24"]
        );
        assert!(!r.applied, "no pass after the second PSK");
        let r = rounds(&format!("{log}\nINFO x: reconciled pass=7 writes=1")).unwrap();
        assert!(r.applied);
    }

    #[test]
    fn each_peers_last_psk_change_is_read_with_its_device() {
        let log = "\
2026-11-28T06:28:11.100000Z  INFO weft::node::error_policy: plan updated tunnels=1 peers=2 routes=3 left_out=0
2026-11-28T06:28:11.204952Z  INFO weft::node::error_policy: data plane change=flannel-wg: update peer 10.244.71.0-24 (QcaS=): psk (new)
2026-11-28T06:28:11.300000Z  INFO weft::node::error_policy: data plane change=flannel-wg: add peer 10.244.8.0-24 (AAAA=) endpoint 198.51.100.3:51820 allowed 10.244.8.0/24
2026-11-28T06:28:12.400000Z  INFO weft::pq::manager::publish: post-quantum PSK in force peer=10.244.71.0-24
2026-11-28T06:28:12.500000Z  INFO weft::node::error_policy: data plane change=flannel-wg: update peer 10.244.71.0-24 (QcaS=): psk (new)
2026-11-28T06:28:12.600000Z  INFO weft::node::error_policy: data plane change=flannel-wg-v6: update peer 10.244.9.0-24 (BBBB=): endpoint 198.51.100.4:51820 psk (new)";
        let at = psk_changes(log);
        let keys: Vec<_> = at.keys().map(|(d, k)| format!("{d} {k}")).collect();
        assert_eq!(keys, ["flannel-wg QcaS=", "flannel-wg-v6 BBBB="]);
        let t = at[&("flannel-wg".to_string(), "QcaS=".to_string())];
        assert_eq!(
            Some(t),
            log_time("2026-11-28T06:28:12.400000Z x"),
            "the line before the pass's changes"
        );
    }
}
