//! The watcher's thread: one read of each planned device per `poll_period`, then what the book
//! says to do (probe, repair, ask the loop), and the pairs' states for the operator.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};
use weft_backends::apply::wireguard::devices::WgImpl;
use weft_backends::apply::wireguard::diff::{DeviceChange, PeerChange, PeerFields};
use weft_backends::apply::wireguard::drift::{drift, Drift};
use weft_backends::apply::wireguard::{WgDevice, WgDevices};
use weft_backends::model::{PeerSpec, TunnelSpec};
use weft_backends::plan::liveness::{
    poll_period, Book, Cause, Counters, PairState, PeerRead, Step, Todo,
};
use weft_crypto::{PrivateKey, PublicKey};

use super::crowd::{crowd, Crowd, LOGGED};
use super::probe::Prober;
use super::{Event, Handle, Plan};
use crate::observe::metrics::Metrics;
use crate::observe::snapshot::{self, PairLiveness};

/// A device that has not answered a read within this is not answering.
const READ_TIMEOUT: Duration = Duration::from_secs(1);
/// The same drift found again after the pass that was to put it back is told again only
/// after this, doubling up to `DRIFT_PAUSE_MAX`.
const DRIFT_PAUSE: Duration = Duration::from_secs(10);
const DRIFT_PAUSE_MAX: Duration = Duration::from_secs(300);
/// The most pairs one repair request to the device carries. At 10,000 dead pairs, one
/// request for them all was 10 MB of text held at once, and a device busy with it for as
/// long as it took kept the loop's own request waiting.
const REPAIR_BATCH: usize = 256;

/// Starts the watcher on a thread of its own, on device handle `wg` (see
/// `Dataplane::another_wg_handle`); it ends when the handle is dropped.
pub fn spawn(
    wg: WgImpl,
    snapshot: snapshot::Shared,
    metrics: Metrics,
    dead_pairs: Option<mpsc::Sender<String>>,
    path_dead: mpsc::UnboundedSender<super::PathEvent>,
) -> std::io::Result<Handle> {
    let (plan_tx, plan_rx) = watch::channel(None);
    let applying = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (events_tx, events_rx) = mpsc::channel(16);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let watcher = Watcher {
        wg,
        book: Book::default(),
        prober: Prober::default(),
        probe_failed: false,
        crowd: Crowd::default(),
        not_answering: HashMap::new(),
        drift_seen: HashMap::new(),
        drift_told: HashMap::new(),
        snapshot,
        metrics,
        events: events_tx,
        dead_pairs,
        path_dead,
        applying: applying.clone(),
        answering_of: None,
        roams_told: HashMap::new(),
    };
    std::thread::Builder::new()
        .name("liveness".into())
        .spawn(move || runtime.block_on(watcher.run(plan_rx)))?;
    Ok(Handle {
        plan: plan_tx,
        events: events_rx,
        generation: 0,
        planned: None,
        applying,
    })
}

struct Watcher {
    wg: WgImpl,
    book: Book,
    prober: Prober,
    /// A probe could not be sent (said once; verdicts then go by the counters alone).
    probe_failed: bool,
    /// The pairs of the read being acted on that turned dead or back off, when more than
    /// `LOGGED` did (else empty: each gets its own line).
    crowd: Crowd,
    /// Devices whose reads time out, since when.
    not_answering: HashMap<String, Instant>,
    /// Drift found at the last read, under which plan.
    drift_seen: HashMap<String, (u64, Vec<Drift>)>,
    /// Drift last told to the loop, when, and the pause before telling it again.
    drift_told: HashMap<String, (Vec<Drift>, Instant, Duration)>,
    snapshot: snapshot::Shared,
    metrics: Metrics,
    events: mpsc::Sender<Event>,
    /// Each pair still dead after re-applying and re-handshaking it, by node (the
    /// post-quantum task falls back to the classical PSK: two different PSKs on the two
    /// sides would leave it dead). Not at the dead verdict itself: a fault the first steps
    /// mend (a wrong endpoint, a device re-created) must not cost the pair its PSK, which
    /// the peer keeps.
    dead_pairs: Option<mpsc::Sender<String>>,
    /// Each pair at its dead verdict, by node: a pair across zones takes another path
    /// (the loop's `paths`).
    path_dead: mpsc::UnboundedSender<super::PathEvent>,
    /// The loop is changing the devices (`Handle::applying`).
    applying: Arc<std::sync::atomic::AtomicBool>,
    /// The plan whose answering addresses the book holds.
    answering_of: Option<u64>,
    /// Relayed pairs whose roamed endpoint the loop was told of, and that endpoint.
    roams_told: HashMap<PublicKey, std::net::SocketAddr>,
}

/// What one read of a device gave.
enum Read {
    Device(WgDevice),
    /// No such device (being made again): nothing to judge.
    Absent,
    NotAnswering,
}

impl Watcher {
    /// A round every `poll_period` (longer for more peers), until the loop's end of the
    /// plan is dropped.
    async fn run(mut self, plan: watch::Receiver<Option<Arc<Plan>>>) {
        loop {
            // Counted, not kept: a plan held through the sleep kept alive a whole plan the
            // loop had left behind, beside the one it works on (at 10,000 peers, megabytes).
            let peers = plan
                .borrow()
                .as_ref()
                .map_or(0, |p| p.tunnels().map(|t| t.peers.len()).sum());
            tokio::time::sleep(poll_period(peers)).await;
            if plan.has_changed().is_err() {
                return;
            }
            // Bound first: a guard taken in the `if let` itself would live through the
            // round, and the loop's next plan (`Handle::follow`) would wait for the round's
            // device read and repairs (260-550 ms at 10,000 peers).
            let latest = plan.borrow().clone();
            if let Some(current) = latest {
                self.round(&current).await;
            }
        }
    }

    /// One read of every planned device, and what follows from it.
    async fn round(&mut self, plan: &Plan) {
        if self.answering_of != Some(plan.generation) {
            self.book.answering = plan.answering.clone();
            self.answering_of = Some(plan.generation);
        }
        let mut counters = BTreeMap::new();
        for spec in plan.tunnels() {
            let todo = match self.read(&spec.device).await {
                Read::Device(device) => {
                    self.not_answering.remove(&spec.device);
                    self.check_drift(plan, spec, &device);
                    let reads = peer_reads(&device);
                    super::roams::tell(&mut self.roams_told, spec, &reads, &self.path_dead);
                    counters.extend(
                        device
                            .peers
                            .iter()
                            .map(|(k, p)| (*k, snapshot::PeerCounters::wireguard(p))),
                    );
                    self.book.observe(spec, &reads, Instant::now())
                }
                Read::Absent => {
                    self.not_answering.remove(&spec.device);
                    Vec::new()
                }
                // Slow to answer while the loop changes it: busy, not at fault.
                Read::NotAnswering if self.applying.load(std::sync::atomic::Ordering::Acquire) => {
                    self.not_answering.remove(&spec.device);
                    Vec::new()
                }
                Read::NotAnswering => {
                    let now = Instant::now();
                    let since = *self
                        .not_answering
                        .entry(spec.device.clone())
                        .or_insert_with(|| now.checked_sub(READ_TIMEOUT).unwrap_or(now));
                    self.book.unanswered(spec, since, now)
                }
            };
            let mut repairs = Vec::new();
            self.crowd = crowd(&todo);
            for t in todo {
                // A key switch under way moves peers' AllowedIPs outside the passes: a
                // repair now would put them back on the key being left.
                if plan.switching && matches!(t, Todo::Repair { .. } | Todo::RecreateDevice { .. })
                {
                    debug!(todo = ?t, "liveness: no repair during a key switch");
                    continue;
                }
                match t {
                    Todo::Repair {
                        peer, step, cause, ..
                    } => repairs.push((peer, step, cause)),
                    t => self.act(t).await,
                }
            }
            self.repair(&spec.device, &repairs).await;
            let crowd = std::mem::take(&mut self.crowd);
            for (nodes, what) in [
                (crowd.dead, "pairs dead: nothing authenticated comes back"),
                (crowd.backing_off, "pairs still dead after re-applying and re-handshaking them: trying again later"),
            ] {
                if nodes.is_empty() {
                    continue;
                }
                let first: Vec<&str> = nodes.iter().take(LOGGED).map(String::as_str).collect();
                warn!(device = %spec.device, pairs = nodes.len(), first = ?first, "{what}");
            }
        }
        self.publish(plan, counters);
    }

    async fn read(&mut self, device: &str) -> Read {
        match tokio::time::timeout(READ_TIMEOUT, self.wg.get(device)).await {
            Ok(Ok(d)) => Read::Device(d),
            Ok(Err(e)) => {
                debug!(device, error = %e, "liveness: reading the device");
                Read::Absent
            }
            Err(_) => Read::NotAnswering,
        }
    }

    /// Drift seen in two reads in a row under the same plan is the loop's to put back.
    fn check_drift(&mut self, plan: &Plan, spec: &TunnelSpec, device: &WgDevice) {
        if plan.switching {
            self.drift_seen.remove(&spec.device);
            return;
        }
        let found = drift(spec, &plan.own, device);
        if found.is_empty() {
            self.drift_seen.remove(&spec.device);
            self.drift_told.remove(&spec.device);
            return;
        }
        let seen = (plan.generation, found);
        if self.drift_seen.get(&spec.device) != Some(&seen) {
            self.drift_seen.insert(spec.device.clone(), seen);
            return;
        }
        self.drift_seen.remove(&spec.device);
        // The same drift again after the pass that was to put it back (a change the
        // device refuses): told again only after a doubling pause, never in a loop.
        let now = Instant::now();
        let pause = match self.drift_told.get(&spec.device) {
            Some((told, at, pause)) if *told == seen.1 => {
                if now.saturating_duration_since(*at) < *pause {
                    return;
                }
                (*pause * 2).min(DRIFT_PAUSE_MAX)
            }
            _ => DRIFT_PAUSE,
        };
        self.drift_told
            .insert(spec.device.clone(), (seen.1.clone(), now, pause));
        let found = super::tell_drift(&self.metrics, &spec.device, &seen.1);
        let event = Event::Drift {
            device: spec.device.clone(),
            found,
        };
        if self.events.try_send(event).is_err() {
            debug!("liveness: the loop has a request pending already");
        }
    }

    async fn act(&mut self, todo: Todo) {
        match todo {
            Todo::Probe {
                device, key, to, ..
            } => self.probe(&device, &key, to),
            Todo::Dead {
                device,
                node,
                cause,
                unanswered,
            } => {
                // Only a path that went unanswered counts against the path (a device that
                // does not answer is this node's fault, not the path's).
                if matches!(cause, Cause::Unanswered { .. }) {
                    let _ = self.path_dead.send(super::PathEvent::Dead(node.clone()));
                }
                if self.crowd.dead.is_empty() {
                    warn!(
                        node = %node,
                        device = %device,
                        cause = cause.label(),
                        unanswered_ms = unanswered.as_millis() as u64,
                        "pair dead: {cause}"
                    );
                } else {
                    debug!(node = %node, device = %device, cause = cause.label(), "pair dead: {cause}");
                }
            }
            // Gathered by `round`, applied together (`repair`).
            Todo::Repair { .. } => {}
            Todo::BackOff {
                device,
                node,
                pause,
                cause,
            } => {
                if self.crowd.backing_off.is_empty() {
                    warn!(
                        node = %node,
                        device = %device,
                        cause = cause.label(),
                        pause_s = pause.as_secs(),
                        "pair still dead after re-applying and re-handshaking it: the fault is \
                         outside this node; trying again in {} s",
                        pause.as_secs()
                    );
                } else {
                    debug!(node = %node, device = %device, pause_s = pause.as_secs(), "pair still dead; trying again later");
                }
                // Still dead after the steps: its path is told again (a verdict the loop
                // did not hold against a path just taken counts now).
                if matches!(cause, Cause::Unanswered { .. }) {
                    let _ = self.path_dead.send(super::PathEvent::Dead(node.clone()));
                }
                if let Some(tx) = &self.dead_pairs {
                    let _ = tx.try_send(node);
                }
            }
            Todo::RecreateDevice { device, cause } => {
                warn!(device = %device, cause = cause.label(), "re-creating the device: {cause}");
                self.metrics
                    .pair_repaired(cause.label(), Step::RecreateDevice.label());
                let event = Event::Recreate {
                    device,
                    cause: cause.to_string(),
                };
                if self.events.try_send(event).is_err() {
                    debug!("liveness: the loop has a request pending already");
                }
            }
            Todo::DeviceBackOff { device, pause } => warn!(
                device = %device,
                pause_s = pause.as_secs(),
                "the device is still at fault after it was re-created; trying again in {} s",
                pause.as_secs()
            ),
            Todo::Alive {
                device,
                node,
                dead_for,
                repaired_by,
            } => info!(
                node = %node,
                device = %device,
                dead_ms = dead_for.as_millis() as u64,
                repaired_by = repaired_by.map_or("nothing", Step::as_str),
                "pair alive again"
            ),
        }
    }

    fn probe(&mut self, device: &str, key: &PublicKey, to: std::net::IpAddr) {
        if let Err(e) = self.prober.send(to) {
            if !self.probe_failed {
                warn!(error = %e, "cannot probe pairs through the tunnel: dead pairs are told by their counters alone");
                self.probe_failed = true;
            }
        }
        // Marked probed even when the send failed: the verdict then waits as long.
        self.book.probed(device, key, Instant::now());
    }

    /// The repair steps one read of `device` asked for, in changes of up to
    /// `REPAIR_BATCH` pairs each (a node whose many peers went down at once sends a few
    /// requests, not one per pair, and the control loop's requests to the device go in
    /// between them instead of waiting behind thousands), then a probe to each pair to see
    /// it work.
    async fn repair(&mut self, device: &str, repairs: &[(PeerSpec, Step, Cause)]) {
        if repairs.is_empty() {
            return;
        }
        if repairs.len() > LOGGED {
            let first: Vec<&str> = repairs
                .iter()
                .take(LOGGED)
                .map(|(p, ..)| p.node.as_str())
                .collect();
            info!(device, pairs = repairs.len(), first = ?first, "repairing dead pairs");
        }
        for batch in repairs.chunks(REPAIR_BATCH) {
            self.repair_batch(device, batch, repairs.len() <= LOGGED)
                .await;
        }
    }

    /// One change to `device` for the pairs of `batch`, then their probes; `each_logged`:
    /// a line for each pair at info (a few), else at debug.
    async fn repair_batch(
        &mut self,
        device: &str,
        batch: &[(PeerSpec, Step, Cause)],
        each_logged: bool,
    ) {
        let mut peers = Vec::with_capacity(2 * batch.len());
        for (peer, step, cause) in batch {
            // One line a pair, unless a crowd: then one line, each pair at debug.
            if each_logged {
                info!(node = %peer.node, device, step = step.as_str(), cause = cause.label(), "repairing a dead pair");
            } else {
                debug!(node = %peer.node, device, step = step.as_str(), cause = cause.label(), "repairing a dead pair");
            }
            self.metrics.pair_repaired(cause.label(), step.label());
            match step {
                Step::Reapply => peers.push(PeerChange::Update {
                    spec: peer.clone(),
                    fields: PeerFields {
                        endpoint: Some(peer.endpoint),
                        allowed_ips: Some(peer.allowed_ips.clone()),
                        keepalive: Some(peer.keepalive),
                        psk: Some(peer.psk.clone()),
                    },
                }),
                Step::Rehandshake => peers.extend([
                    PeerChange::Remove {
                        key: peer.public_key,
                    },
                    PeerChange::Add(peer.clone()),
                ]),
                // The book asks for the device as a whole (`Todo::RecreateDevice`).
                Step::RecreateDevice => {}
            }
        }
        let change = DeviceChange {
            set_private_key: false,
            listen_port: None,
            peers,
        };
        // The change does not set the device's key, so no key is sent.
        let unused = PrivateKey::from_bytes([0; 32]);
        if let Err(e) = self.wg.apply(device, &change, &unused).await {
            warn!(device, pairs = batch.len(), error = %e, "repairing dead pairs failed");
        }
        for (peer, ..) in batch {
            if let Some(to) = weft_backends::plan::liveness::probe_target(peer) {
                self.probe(device, &peer.public_key, to);
            }
        }
    }

    /// The pairs' states and the counters just read, for the operator's views.
    fn publish(&self, plan: &Plan, counters: BTreeMap<PublicKey, snapshot::PeerCounters>) {
        let now = Instant::now();
        let mut rows: Vec<PairLiveness> = self
            .book
            .states()
            .map(|(device, key, node, state)| {
                let (name, cause) = match state {
                    PairState::Idle => ("idle", None),
                    PairState::Alive => ("alive", None),
                    PairState::Waiting => ("waiting", None),
                    PairState::Dead { cause } => ("dead", Some(cause)),
                };
                PairLiveness {
                    node: node.to_string(),
                    device: device.to_string(),
                    state: name.to_string(),
                    cause: cause.map(|c| c.label().to_string()),
                    detail: cause.map(ToString::to_string),
                    dead_secs: self.book.dead_for(device, key, now).map(|d| d.as_secs()),
                }
            })
            .collect();
        rows.sort_by(|a, b| (&a.node, &a.device).cmp(&(&b.node, &b.device)));
        let read_all = plan.tunnels().len();
        self.snapshot.update(|s| {
            s.liveness = rows;
            if read_all > 0 && !counters.is_empty() {
                s.counters = Arc::new(counters);
            }
            s.liveness_at_ms = crate::keys::rotation::ms(SystemTime::now());
        });
    }
}

/// Each peer's endpoint and counters, as the book takes them.
fn peer_reads(device: &WgDevice) -> HashMap<PublicKey, PeerRead> {
    device
        .peers
        .iter()
        .map(|(k, p)| {
            let read = PeerRead {
                endpoint: p.endpoint,
                counters: Counters {
                    tx_bytes: p.tx_bytes,
                    rx_bytes: p.rx_bytes,
                },
            };
            (*k, read)
        })
        .collect()
}

#[cfg(test)]
#[path = "watch_tests.rs"]
mod tests;
