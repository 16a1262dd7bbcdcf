//! Liveness of every WireGuard pair, and what to do about a dead one. Pure: the agent's
//! watcher reads the devices every `POLL` and hands each read here with the plan and the
//! time; what comes back is what to do (probe a pair, repair it, say it is alive again)
//! and each pair's state for `weft status`, `/metrics` and `weft doctor`.
//!
//! `track`: one pair's verdict from its counters; `repair`: the escalation for a dead one.

pub mod repair;
pub mod track;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use weft_crypto::PublicKey;

use crate::model::{PeerSpec, TunnelSpec};
pub use repair::{Action, Repairs, Step};
pub use track::{poll_period, Counters, Track, Verdict, DEAD_AFTER, POLL};

/// A peer as one read of its device gave it: the endpoint WireGuard sends to, and the
/// counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRead {
    pub endpoint: Option<SocketAddr>,
    pub counters: Counters,
}

/// Why a pair is dead, as far as this node can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// Sent to `endpoint` and nothing authenticated came back. `planned`: the registry's
    /// endpoint when WireGuard holds another (learned by roaming).
    Unanswered {
        endpoint: Option<SocketAddr>,
        planned: SocketAddr,
    },
    /// The device does not answer reads (a stopped or wedged device process).
    DeviceNotAnswering,
}

impl Cause {
    /// The label `/metrics` counts it under.
    pub fn label(&self) -> &'static str {
        match self {
            Cause::Unanswered { endpoint, planned } if *endpoint != Some(*planned) => {
                "roamed endpoint unanswered"
            }
            Cause::Unanswered { .. } => "endpoint unanswered",
            Cause::DeviceNotAnswering => "device not answering",
        }
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::Unanswered { endpoint, planned } => match endpoint {
                Some(e) if e != planned => write!(
                    f,
                    "nothing authenticated comes back from {e}, an endpoint learned by roaming \
                     or set by hand (the registry's is {planned})"
                ),
                Some(e) => write!(f, "nothing authenticated comes back from {e}"),
                None => write!(f, "no endpoint to send to (the registry's is {planned})"),
            },
            Cause::DeviceNotAnswering => write!(f, "the device does not answer"),
        }
    }
}

/// A pair's state as shown to the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PairState {
    /// Not read yet, or nothing sent since the last answer.
    Idle,
    Alive,
    /// Sent and not answered yet (probing).
    Waiting,
    Dead {
        cause: Cause,
    },
}

/// What the watcher must do after a read.
#[derive(Debug, Clone, PartialEq)]
pub enum Todo {
    /// An ICMP echo through the tunnel to the peer's tunnel address.
    Probe {
        device: String,
        node: String,
        key: PublicKey,
        to: IpAddr,
    },
    /// The pair just turned dead.
    Dead {
        device: String,
        node: String,
        cause: Cause,
        unanswered: Duration,
    },
    Repair {
        device: String,
        peer: PeerSpec,
        step: Step,
        cause: Cause,
    },
    BackOff {
        device: String,
        node: String,
        pause: Duration,
        cause: Cause,
    },
    /// The device is at fault: every pair that carries traffic is dead, or it does not
    /// answer.
    RecreateDevice { device: String, cause: Cause },
    /// The device was re-created and is still at fault: nothing more until the pause ends.
    DeviceBackOff { device: String, pause: Duration },
    /// A dead pair answers again: `repaired_by` the last step taken, if any.
    Alive {
        device: String,
        node: String,
        dead_for: Duration,
        repaired_by: Option<Step>,
    },
}

/// One pair's memory.
#[derive(Debug, Clone)]
struct Pair {
    node: String,
    track: Track,
    state: PairState,
    dead_since: Option<Instant>,
    repairs: Repairs,
}

/// Every pair this node has, by device and key.
#[derive(Debug, Default)]
pub struct Book {
    /// By device, then key.
    pairs: HashMap<String, HashMap<PublicKey, Pair>>,
    /// Repairs of devices that do not answer, by name.
    devices: HashMap<String, Repairs>,
    /// The underlay addresses that answer path-MTU probes (the agent's prober): a planned
    /// endpoint there is known to be reachable. A pair whose device learned another
    /// endpoint by roaming (a peer behind a NAT) is put back on its planned endpoint, and
    /// its sessions dropped, only when the planned one is known reachable: otherwise it is
    /// repaired by what the peer's own packets show (its keepalive, its handshake), which
    /// reach this node only on a session it still holds.
    pub answering: std::collections::HashSet<IpAddr>,
}

/// The address a probe goes to: the peer's tunnel address (its subnet's network address,
/// which weft and flannel put on the peer's device), IPv4 first.
pub fn probe_target(peer: &PeerSpec) -> Option<IpAddr> {
    let first = |v4: bool| {
        peer.allowed_ips
            .iter()
            .find(|n| n.addr().is_ipv4() == v4)
            .map(|n| n.network())
    };
    first(true).or_else(|| first(false))
}

/// Whether a peer entry carries a pair: a key being staged for a rotation has no AllowedIPs
/// and carries nothing.
fn carries(peer: &PeerSpec) -> bool {
    !peer.allowed_ips.is_empty()
}

impl Book {
    /// Takes one read of `device` (as the plan `spec` wants it) at `now`; returns what to do.
    pub fn observe(
        &mut self,
        spec: &TunnelSpec,
        read: &HashMap<PublicKey, PeerRead>,
        now: Instant,
    ) -> Vec<Todo> {
        let dev = spec.device.as_str();
        self.device_answered(dev);
        let planned: std::collections::HashSet<&PublicKey> =
            spec.peers.iter().map(|p| &p.public_key).collect();
        let pairs = self.pairs.entry(dev.to_string()).or_default();
        pairs.retain(|k, _| planned.contains(k));
        let mut verdicts = Vec::new();
        for peer in spec.peers.iter().filter(|p| carries(p)) {
            let Some(have) = read.get(&peer.public_key) else {
                continue; // drift: the pass puts it back
            };
            let pair = pairs.entry(peer.public_key).or_insert_with(|| Pair {
                node: peer.node.clone(),
                track: Track::default(),
                state: PairState::Idle,
                dead_since: None,
                repairs: Repairs::default(),
            });
            let verdict = match peer.via {
                crate::model::Via::Gateway(_) => pair.track.observe_watched(have.counters, now),
                _ => pair.track.observe(have.counters, now),
            };
            let cause = Cause::Unanswered {
                endpoint: have.endpoint,
                planned: peer.endpoint,
            };
            verdicts.push((peer, verdict, cause));
        }
        // The device is at fault when every pair that carries traffic is dead, and there
        // are at least two: one dead pair alone says nothing of the others.
        // A pair under repair is still dead while its fresh evidence builds up.
        let dead_already = |peer: &PeerSpec| {
            pairs
                .get(&peer.public_key)
                .is_some_and(|p| p.dead_since.is_some())
        };
        // Only a pair that has answered on this device since the watch began is evidence
        // against the device: one that never did is a node that is down or not up yet
        // (every added peer is sent a handshake at once), whatever the device's health.
        // Counting those, a node whose other nodes are mostly down re-made its device,
        // and the healthy pairs' sessions with it, over and over.
        let answered_before = |peer: &PeerSpec| {
            pairs
                .get(&peer.public_key)
                .is_some_and(|p| p.track.answered_at().is_some())
        };
        let (mut busy, mut dead) = (0, 0);
        for (peer, v, _) in verdicts.iter().filter(|(p, _, _)| answered_before(p)) {
            let is_dead = v.is_dead() || (*v != Verdict::Alive && dead_already(peer));
            busy += usize::from(is_dead || *v != Verdict::Idle);
            dead += usize::from(is_dead);
        }
        let device_wide = busy >= 2 && dead == busy;
        let mut todo = Vec::new();
        for (peer, verdict, cause) in verdicts {
            let planned_answers = self.answering.contains(&peer.endpoint.ip());
            if let Some(pair) = pairs.get_mut(&peer.public_key) {
                pair.step(
                    dev,
                    peer,
                    verdict,
                    cause,
                    device_wide,
                    planned_answers,
                    now,
                    &mut todo,
                );
            }
        }
        // The pairs that reached the last step together re-create the device once.
        let mut recreate = None;
        todo.retain(|t| match t {
            Todo::Repair {
                step: Step::RecreateDevice,
                cause,
                ..
            } => {
                recreate.get_or_insert_with(|| cause.clone());
                false
            }
            _ => true,
        });
        if let Some(cause) = recreate {
            todo.push(Todo::RecreateDevice {
                device: dev.into(),
                cause,
            });
        }
        todo
    }

    /// The device did not answer a read at `now` (nor any since `since`): once that lasts
    /// `DEAD_AFTER`, every pair of it that carries traffic is dead and the device is
    /// re-created, then left a doubling pause like any repair.
    pub fn unanswered(&mut self, spec: &TunnelSpec, since: Instant, now: Instant) -> Vec<Todo> {
        let dev = spec.device.as_str();
        let mut todo = Vec::new();
        if now.saturating_duration_since(since) < DEAD_AFTER {
            return todo;
        }
        let cause = Cause::DeviceNotAnswering;
        let pairs = self.pairs.entry(dev.to_string()).or_default();
        for peer in spec.peers.iter().filter(|p| carries(p)) {
            if let Some(pair) = pairs.get_mut(&peer.public_key) {
                pair.dead_since.get_or_insert(since);
                pair.turn_dead(
                    dev,
                    cause.clone(),
                    now.saturating_duration_since(since),
                    &mut todo,
                );
            }
        }
        let repairs = self.devices.entry(dev.to_string()).or_default();
        match repairs.next_device(now) {
            Action::Do(_) => todo.push(Todo::RecreateDevice {
                device: dev.into(),
                cause,
            }),
            Action::BackOff { pause, .. } => todo.push(Todo::DeviceBackOff {
                device: dev.into(),
                pause,
            }),
            Action::Wait => {}
        }
        todo
    }

    /// The device answered a read: its own repairs start over, and its pairs are judged
    /// afresh (dead only for want of the device, they may well be idle now).
    fn device_answered(&mut self, device: &str) {
        if self.devices.remove(device).is_none() {
            return;
        }
        for pair in self
            .pairs
            .get_mut(device)
            .into_iter()
            .flat_map(|p| p.values_mut())
        {
            if pair.state
                == (PairState::Dead {
                    cause: Cause::DeviceNotAnswering,
                })
            {
                pair.state = PairState::Idle;
                pair.dead_since = None;
                pair.repairs = Repairs::default();
            }
        }
    }

    /// The shell probed `node`'s pair on `device`, or repaired it, at `now`.
    pub fn probed(&mut self, device: &str, key: &PublicKey, now: Instant) {
        if let Some(p) = self.pairs.get_mut(device).and_then(|d| d.get_mut(key)) {
            p.track.probed(now);
        }
    }

    /// Each pair's state, by device and key.
    pub fn states(&self) -> impl Iterator<Item = (&str, &PublicKey, &str, &PairState)> {
        self.pairs.iter().flat_map(|(d, pairs)| {
            pairs
                .iter()
                .map(move |(k, p)| (d.as_str(), k, p.node.as_str(), &p.state))
        })
    }

    /// How long `node`'s pair on `device` has been dead, if it is.
    pub fn dead_for(&self, device: &str, key: &PublicKey, now: Instant) -> Option<Duration> {
        let p = self.pairs.get(device)?.get(key)?;
        p.dead_since.map(|s| now.saturating_duration_since(s))
    }
}

impl Pair {
    /// The pair is dead of `cause`; says so once, when it turns.
    fn turn_dead(&mut self, dev: &str, cause: Cause, unanswered: Duration, todo: &mut Vec<Todo>) {
        if !matches!(self.state, PairState::Dead { .. }) {
            todo.push(Todo::Dead {
                device: dev.into(),
                node: self.node.clone(),
                cause: cause.clone(),
                unanswered,
            });
        }
        self.state = PairState::Dead { cause };
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        dev: &str,
        peer: &PeerSpec,
        verdict: Verdict,
        cause: Cause,
        device_wide: bool,
        planned_answers: bool,
        now: Instant,
        todo: &mut Vec<Todo>,
    ) {
        if let Verdict::Unanswered { probe: true, .. } = verdict {
            if let Some(to) = probe_target(peer) {
                todo.push(Todo::Probe {
                    device: dev.into(),
                    node: peer.node.clone(),
                    key: peer.public_key,
                    to,
                });
            }
        }
        // A dead pair stays dead until it answers: after a repair its counters start
        // again (idle) and its evidence is fresh (unanswered), neither is an answer.
        let dead = match verdict {
            Verdict::Dead { since } => Some(*self.dead_since.get_or_insert(since)),
            Verdict::Alive => None,
            Verdict::Idle | Verdict::Unanswered { .. } => self.dead_since,
        };
        let Some(since) = dead else {
            if let Some(since) = self.dead_since.take() {
                todo.push(Todo::Alive {
                    device: dev.into(),
                    node: peer.node.clone(),
                    dead_for: now.saturating_duration_since(since),
                    repaired_by: self.repairs.last_step(),
                });
                self.repairs = Repairs::default();
            }
            self.state = match verdict {
                Verdict::Alive => PairState::Alive,
                Verdict::Unanswered { .. } => PairState::Waiting,
                _ => PairState::Idle,
            };
            return;
        };
        self.turn_dead(
            dev,
            cause.clone(),
            now.saturating_duration_since(since),
            todo,
        );
        let reapply_wait = repair::reapply_wait(&cause, peer.keepalive);
        // Roamed to an endpoint the planned one cannot stand in for (a NAT's port): kept,
        // and the sessions the peer's packets arrive on are never dropped.
        let roamed = match &cause {
            Cause::Unanswered {
                endpoint: Some(e),
                planned,
            } if e != planned && !planned_answers => Some(*e),
            _ => None,
        };
        let answered = self.track.answered_at().is_some() && roamed.is_none();
        match self.repairs.next(now, device_wide, reapply_wait, answered) {
            Action::Wait => {}
            Action::Do(step) => {
                self.track.repaired(now);
                let peer = match roamed {
                    Some(endpoint) => PeerSpec {
                        endpoint,
                        ..peer.clone()
                    },
                    None => peer.clone(),
                };
                todo.push(Todo::Repair {
                    device: dev.into(),
                    peer,
                    step,
                    cause,
                });
            }
            Action::BackOff { pause, .. } => todo.push(Todo::BackOff {
                device: dev.into(),
                node: peer.node.clone(),
                pause,
                cause,
            }),
        }
    }
}

#[cfg(test)]
mod tests;
