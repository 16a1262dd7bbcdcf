//! One pass of the control loop: read the latest view, our own lease and what the devices
//! hold, plan, tell the operator's views (snapshot, metrics), write subnet.env, reconcile
//! the data plane. What
//! a failure means is `error_policy`'s to say.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tracing::{info, warn, Instrument};
use weft_backends::model::{DesiredState, DevicePeer, Observed, PeerObserved};
use weft_backends::plan::{PlanInput, PlanKind};

use super::error_policy::{self, report_plan};
use super::run_loop::Controller;
use super::subnet_file;
use crate::keys::psk::effective_net;
use crate::observe::http::Readiness;
use crate::observe::snapshot;
use weft_crypto::PublicKey;

impl Controller<'_> {
    /// Plans the node from the latest state and reconciles; `full` reads every WireGuard
    /// device afresh instead of trusting what the last passes read.
    pub(super) async fn pass(&mut self, full: bool) {
        self.inputs.health.beat();
        self.me = self.inputs.local.borrow_and_update().clone();
        self.raw_view = self.inputs.views.borrow_and_update().clone();
        self.take_up_backends().await;
        // The backends this node speaks besides its config's are what it publishes now,
        // though the registry may not have confirmed it yet: a backend just taken up (or
        // retired) is planned so from the pass that made it so.
        self.me.also = self.keys.attrs.also.clone();
        // What the devices hold (read afresh for a full pass, which then uses this read).
        let device = match self.dataplane.observe(full).await {
            Ok(peers) => peers,
            Err(e) => {
                warn!(error = %e, "reading the WireGuard devices for the plan");
                Default::default()
            }
        };
        // Where the devices send each peer now: a pair the plan moves onto the endpoint its
        // device already holds (it followed the gateway its peer chose) is not moved again.
        let held: BTreeMap<PublicKey, std::net::SocketAddr> = device
            .iter()
            .filter_map(|((_, key), o)| Some((*key, o.endpoint?)))
            .collect();
        let t_plan = Instant::now();
        // A pair may leave clear in this plan: the plan is made again with the guard still
        // taking its peer's clear packets for a moment.
        let again = self
            .last
            .as_ref()
            .is_some_and(|l| l.pair_backends.iter().any(|p| p.why_clear.is_some()))
            .then(|| device.clone());
        let Some((mut state, mut planned)) = self.plan(device, full) else {
            return;
        };
        if let Some(device) =
            again.filter(|_| super::also::left_clear(self.last.as_deref(), &state))
        {
            self.accept_clear_until = Some(SystemTime::now() + super::also::CLEAR_DRAIN);
            let Some(replanned) = self.plan(device, full) else {
                return;
            };
            (state, planned) = replanned;
        }
        let plan_ms = t_plan.elapsed().as_secs_f64() * 1e3;
        if full && !std::mem::take(&mut self.drift_told) {
            self.name_drift(&state);
        }
        // A backend retired (`also`): its devices go, which only a full pass looks for.
        let full = full || super::also::devices_dropped(self.last.as_deref(), &state);
        let patched = matches!(planned, PlanKind::Patched(_)).then(|| self.planner.patched());
        report_plan(self.last.as_deref(), &state, patched);
        self.log_esp_switches(&state);
        self.write_subnet_file(&state);
        self.passes += 1;
        let pass = self.passes;
        let span = tracing::info_span!("reconcile", pass);
        let (started, writes) = (Instant::now(), self.dataplane.writes());
        let applying = self
            .liveness
            .as_ref()
            .map(crate::liveness::Handle::applying);
        let stamp = self.planner.stamp();
        let result = if full && self.tables_vouched_for() {
            self.dataplane
                .reconcile_trusting_tables(&state, &self.keys.key, &stamp)
                .instrument(span)
                .await
        } else if full {
            self.dataplane
                .reconcile(&state, &self.keys.key, &stamp)
                .instrument(span)
                .await
        } else {
            self.dataplane
                .reconcile_incremental(&state, &self.keys.key, &stamp)
                .instrument(span)
                .await
        };
        drop(applying);
        let outcome = error_policy::Outcome {
            pass,
            full,
            started,
            writes: self.dataplane.writes() - writes,
            plan_ms,
            planned,
        };
        if let Ok(report) = &result {
            let repairs =
                super::nft_check::pass_repairs(self.last.as_deref(), &state, &report.changes);
            self.record_repairs(&repairs);
            self.esp_lost(&report.esp_lost).await;
            self.roaming
                .passed(&state, &report.endpoints_set, SystemTime::now());
            if full {
                self.record_counters(&state);
            }
        }
        if let (Ok(_), Some(before)) = (&result, self.last.clone()) {
            self.rehandshake_moved(&before, &state, &held).await;
        }
        self.follow_relay();
        if error_policy::reconciled(&self.inputs, result, &outcome) {
            self.keys.published_after_switch().await;
            self.clock_switches.programmed(&state);
            self.pq_peers_programmed(&state);
        }
        if !state.esp_watch {
            // Read afresh when evidence is awaited next: an old reading is no evidence.
            self.esp_heard.clear();
            self.esp_read = None;
        }
        // The staged entries are on the device now: the watcher looks for their handshakes.
        if let Some(watcher) = &self.switch_watch {
            watcher.follow(state.key_watch.as_ref());
        }
        if let Some(watcher) = &mut self.liveness {
            let stamp = self.planner.stamp();
            watcher.follow(&state, self.keys.key.public_key(), &stamp);
        }
        self.last = Some(state);
        // Which old backends no peer runs, from when: the loop retires each once its grace
        // has passed (and plans at once, before its peers read the retirement).
        let _ = self.retiring.due(
            &self.keys.attrs.also,
            &self.raw_view,
            &self.me.node,
            Instant::now(),
        );
    }

    /// Re-handshakes the pairs `after` moved to another path than `before`'s (`paths`),
    /// but those whose device already holds the new endpoint (`held`).
    async fn rehandshake_moved(
        &mut self,
        before: &DesiredState,
        after: &DesiredState,
        held: &BTreeMap<PublicKey, std::net::SocketAddr>,
    ) {
        let moved = super::paths::moved(before, after, held);
        if moved.is_empty() {
            return;
        }
        self.paths.moved(&moved, SystemTime::now());
        if self.path_wg.is_none() {
            match self.dataplane.another_wg_handle() {
                Some(Ok(wg)) => self.path_wg = Some(wg),
                Some(Err(e)) => {
                    warn!(error = %e, "no device handle to re-handshake pairs that moved path")
                }
                None => {}
            }
        }
        if let Some(wg) = self.path_wg.as_mut() {
            super::paths::rehandshake(wg, &moved).await;
        }
    }

    /// Starts this node's relay when its lease makes it a gateway, stops it when no
    /// longer, and hands it the cluster's members.
    fn follow_relay(&mut self) {
        let listen_port = match self.net.backend {
            weft_backends::netconf::Backend::Wireguard(ref wg) => wg.listen_port,
            _ => return,
        };
        crate::relay::follow(
            &mut self.relay,
            &self.me,
            &self.raw_view,
            listen_port,
            &self.inputs.snapshot,
        );
    }

    /// A full pass the liveness watcher did not ask for (the resync) that finds a device
    /// changed behind the agent says so as the watcher would, then puts it back: the drift
    /// is named whichever of the two reads it first.
    fn name_drift(&self, state: &Arc<DesiredState>) {
        let Some(watcher) = &self.liveness else {
            return;
        };
        let own = self.keys.key.public_key();
        for tunnel in &state.tunnels {
            let Some(device) = self.dataplane.fresh_device(&tunnel.device) else {
                continue;
            };
            let found = watcher.drift(state, own, &tunnel.device, device);
            if !found.is_empty() {
                crate::liveness::tell_drift(&self.inputs.metrics, &tunnel.device, &found);
            }
        }
    }

    /// The peers' counters as this full pass read them, for `/metrics`.
    fn record_counters(&mut self, state: &DesiredState) {
        let mut counters: BTreeMap<PublicKey, snapshot::PeerCounters> = self
            .dataplane
            .last_read_peers()
            .map(|(key, p)| (*key, snapshot::PeerCounters::wireguard(p)))
            .collect();
        for (key, pair) in self.dataplane.esp_counters(state) {
            let inbound = pair.inbound.as_ref();
            let esp = snapshot::PeerCounters {
                last_handshake: None,
                rx_bytes: inbound.map_or(0, |s| s.bytes),
                tx_bytes: pair.outbound.as_ref().map_or(0, |s| s.bytes),
                esp_replay_failed: inbound.map(|s| u64::from(s.replay_failed)),
                esp_integrity_failed: inbound.map(|s| u64::from(s.integrity_failed)),
            };
            counters.insert(key, esp);
        }
        self.inputs
            .snapshot
            .update(|s| s.counters = Arc::new(counters));
    }

    /// The plan for this node now, from the latest view and what the device showed (peers'
    /// announced keys in use, see `switchover`); `None`, logged, when this node cannot be
    /// planned.
    fn plan(
        &mut self,
        device: BTreeMap<DevicePeer, PeerObserved>,
        full: bool,
    ) -> Option<(Arc<DesiredState>, PlanKind)> {
        let view = &self.raw_view;
        let now = SystemTime::now();
        self.planned_at = now;
        let config = effective_net(self.net, self.inputs.psk.state.as_ref(), now);
        self.paths.retain(|n| view.leases.contains_key(n));
        let observed = Observed {
            peers: self.roaming.observed(device),
            esp_heard: self.esp_heard.clone(),
            paths: self.paths.history.clone(),
            accept_clear_until: self.accept_clear_until,
            draining: self.retiring.draining(),
            ..self.switchover.observed(view, &self.me.node, now).clone()
        };
        let path_mtus = self.inputs.path_mtu.mtus.borrow_and_update().mtus.clone();
        let own = self.keys.key.public_key();
        let published = self.inputs.pq.published.borrow_and_update().psks_for(&own);
        let pair_psks = self.pq_seen.plan_with(published, now);
        let me = self.retiring.planned_lease(&self.me);
        let input = PlanInput {
            local: &me,
            view,
            config: &config,
            options: self.options,
            observed: &observed,
            now,
            path_mtus: &path_mtus,
            pair_psks: &pair_psks,
        };
        let (state, planned) = match self.planner.plan(&input, view, full) {
            Ok(planned) => planned,
            Err(e) => {
                error_policy::unplannable(&e);
                return None;
            }
        };
        let (generation, rotating) = (
            self.keys.rotation.generation(),
            self.keys.rotation.pending().cloned(),
        );
        self.inputs.snapshot.planned(&self.me, view, &state);
        self.inputs.snapshot.update(|s| {
            s.key_generation = generation;
            s.rotating = rotating;
        });
        if matches!(planned, PlanKind::Patched(_)) {
            self.inputs.metrics.patched_keys(self.planner.patched());
        } else {
            let peer_keys: Vec<(&str, &PublicKey)> = state
                .tunnels
                .iter()
                .flat_map(|t| &t.peers)
                .map(|p| (p.node.as_str(), &p.public_key))
                .collect();
            self.inputs.metrics.peer_keys(&peer_keys);
        }
        self.measure_paths(&state);
        self.inputs.snapshot.post_quantum(&self.inputs.pq.status);
        Some((state, planned))
    }

    /// Hands the prober this plan's peer addresses, and puts what it measured beside them
    /// in the snapshot.
    fn measure_paths(&mut self, state: &Arc<DesiredState>) {
        let mut keys = path_keys(state);
        let mut addresses: std::collections::BTreeSet<std::net::IpAddr> =
            state.paths.iter().map(|p| p.address).collect();
        // A relayed pair's direct address is probed too: when it answers, the pair goes
        // back to direct (`plan::relay`).
        // An address another peer has too is probed for that peer alone (the plan does
        // not count its answer for the relayed one).
        for (address, key) in relayed_direct(&self.raw_view, state) {
            if addresses.insert(address) {
                keys.insert(address, key);
            }
        }
        let targets = crate::pathmtu::Targets {
            addresses,
            max: u16::try_from(self.options.underlay_mtu).unwrap_or(u16::MAX),
            own: (!keys.is_empty()).then(|| self.keys.key.clone()),
            keys,
        };
        self.inputs.path_mtu.targets.send_if_modified(|t| {
            let changed = *t != targets;
            *t = targets;
            changed
        });
        let measured = &self.inputs.path_mtu.measurements;
        self.inputs.snapshot.paths(state, measured);
    }

    /// Hands the post-quantum manager the pairs of a plan now programmed. Not sooner: a
    /// round's first message to a peer whose device or route the pass has yet to make
    /// cannot leave the node, and each unanswered message is repeated after twice the wait
    /// of the one before (under the VM's emulated CPU, a first pass of 2.4 s cost the
    /// first two sends, and one more lost put the round past 10 s).
    fn pq_peers_programmed(&self, state: &Arc<DesiredState>) {
        let stamp = self.planner.stamp();
        (self.inputs.pq.peers).send_if_modified(|list| list.follow(state, &stamp));
    }

    fn write_subnet_file(&mut self, state: &DesiredState) {
        match subnet_file::write(&self.args.subnet_file, &state.subnet_env) {
            Ok(written) => {
                if written {
                    info!(path = %self.args.subnet_file.display(), "wrote subnet file");
                }
                self.inputs.health.set(Readiness::SubnetFileWritten);
            }
            Err(e) => {
                self.inputs.health.unset(Readiness::SubnetFileWritten);
                error_policy::subnet_file_failed(&e);
            }
        }
    }
}

/// The key of the peer at each measured path's address (its WireGuard entry with
/// AllowedIPs, or its ipsec peer): the prober's acks from there must bear the pair's tag.
/// Empty on backends without keys.
fn path_keys(state: &DesiredState) -> BTreeMap<std::net::IpAddr, PublicKey> {
    let peers = (state.tunnels.iter().flat_map(|t| &t.peers)).filter(|p| !p.allowed_ips.is_empty());
    let wireguard = peers.clone().map(|p| (p.node.as_str(), p.public_key));
    let ipsec =
        (state.ipsec.iter().flat_map(|s| &s.peers)).map(|p| (p.node.as_str(), p.public_key));
    let by_node: BTreeMap<&str, PublicKey> = wireguard.chain(ipsec).collect();
    // A relayed peer's path goes to its gateway, whose agent answers with its own key.
    let via: BTreeMap<&str, &str> = peers
        .filter_map(|p| Some((p.node.as_str(), p.via.gateway()?)))
        .collect();
    (state.paths.iter())
        .filter_map(|p| {
            let node = via.get(p.node.as_str()).copied().unwrap_or(&p.node);
            Some((p.address, *by_node.get(node)?))
        })
        .collect()
}

/// Each relayed WireGuard peer's direct address (its published one) and key.
fn relayed_direct(
    view: &weft_backends::model::ClusterView,
    state: &DesiredState,
) -> Vec<(std::net::IpAddr, PublicKey)> {
    (state.tunnels.iter().flat_map(|t| &t.peers))
        .filter(|p| p.via.gateway().is_some())
        .filter_map(|p| {
            let ip = view.get(&p.node)?.public_ip?;
            Some((std::net::IpAddr::V4(ip), p.public_key))
        })
        .collect()
}
