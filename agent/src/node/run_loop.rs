//! The control loop: registry → plan → data plane, level-triggered. Whatever wakes it (a
//! new view, a change to our own lease, a deletion the kernel reports, the resync timer,
//! a key or PSK switch) re-plans the whole node from the latest state (`pass`); a pass
//! woken by the registry or a deletion is incremental, the periodic resync is full. This
//! module only chooses what woke the loop; `pass` runs one pass and `error_policy` says
//! what a failure means.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;
use tracing::{debug, info, warn};
use weft_backends::apply::Dataplane;
use weft_backends::model::{ClusterView, DesiredState, Lease};
use weft_backends::netconf::NetConf;
use weft_backends::plan::PlanOptions;

use crate::cli::AgentArgs;
use crate::keys::psk::PskSources;
use crate::keys::rotation::{KeyState, RotateRequest};
use crate::keys::switch_watch;
use crate::keys::switchover::Switchover;
use crate::observe::http::Health;
use crate::observe::metrics::Metrics;
use crate::observe::snapshot;

use super::loop_timing::{
    interval, jittered, liveness_event, next_event, sleep_for, sleep_until, switch_near, switched,
    SWITCH_GUARD,
};

/// Everything that can wake the control loop.
pub(crate) struct LoopInputs {
    pub(crate) views: watch::Receiver<Arc<ClusterView>>,
    pub(crate) local: watch::Receiver<Lease>,
    pub(crate) deletions: tokio::sync::mpsc::Receiver<()>,
    /// nf_tables' events; `None` where they cannot be had (the tables are then listed
    /// at every check).
    pub(crate) nft_changes: Option<tokio::sync::mpsc::Receiver<()>>,
    pub(crate) shutdown: watch::Receiver<bool>,
    /// Told once the data plane is first programmed (the registry may announce it).
    pub(crate) ready: watch::Sender<bool>,
    pub(crate) health: Health,
    pub(crate) snapshot: snapshot::Shared,
    pub(crate) metrics: Metrics,
    pub(crate) rotate: tokio::sync::mpsc::Receiver<RotateRequest>,
    /// Rotation requests an operator wrote in the registry (their ids).
    pub(crate) registry_rotations: tokio::sync::mpsc::Receiver<String>,
    pub(crate) psk: PskSources,
    /// The path MTU prober: what to measure, and what it measured.
    pub(crate) path_mtu: crate::pathmtu::Handle,
    /// The post-quantum task: each plan's pairs to it, the PSKs in force from it.
    pub(crate) pq: crate::pq::Handle,
}

/// How often the periodic checks run (liveness, the node's address, ipsec's states; the
/// nftables tables when events say they changed, or when no events can be had).
const NFT_CHECK: Duration = Duration::from_secs(2);
/// The longest the resync is put off for switches near, in all.
const RESYNC_PUT_OFF: Duration = Duration::from_secs(30);

/// The loop's state between passes, and what it works with.
pub(super) struct Controller<'a> {
    pub(super) args: &'a AgentArgs,
    pub(super) net: &'a NetConf,
    pub(super) options: &'a PlanOptions,
    pub(super) keys: &'a mut KeyState,
    pub(super) dataplane: &'a mut Dataplane,
    pub(super) inputs: LoopInputs,
    /// The last plan applied.
    pub(super) last: Option<std::sync::Arc<DesiredState>>,
    /// Plans each pass, re-planning only the nodes that changed where it can.
    pub(super) planner: weft_backends::plan::Planner,
    /// Passes run so far.
    pub(super) passes: u64,
    /// The liveness watcher named the drift the next full pass puts back (the pass does
    /// not name it again).
    pub(super) drift_told: bool,
    /// The registry's view as read for the last pass.
    pub(super) raw_view: Arc<ClusterView>,
    pub(super) me: Lease,
    pub(super) switchover: Switchover,
    /// The key-switch watcher (WireGuard only).
    pub(super) switch_watch: Option<switch_watch::Handle>,
    /// The liveness watcher (WireGuard only).
    pub(super) liveness: Option<crate::liveness::Handle>,
    pub(super) roaming: super::roaming::Roaming,
    /// The moment the last plan was made for (what PSK was in force then).
    pub(super) planned_at: SystemTime,
    resync: tokio::time::Interval,
    resync_period: Duration,
    nft_check: tokio::time::Interval,
    psk_check: tokio::time::Interval,
    /// An nftables event came after the tables were last listed.
    pub(super) nft_dirty: bool,
    /// When the tables were last listed (or last verified beside the loop).
    pub(super) nft_listed: Instant,
    /// The verifications run beside the loop: whether the tables were as planned.
    pub(super) nft_verified: super::nft_check::Verifications,
    /// ipsec: this node's announced next epoch, until its moment.
    pub(super) esp_rotation: Option<super::esp_epoch::EspRotation>,
    /// ipsec: a `RekeyAfter` rotation that could not start is tried again from then on.
    pub(super) rekey_not_before: Option<SystemTime>,
    /// ipsec: the inbound SPIs that have carried packets, and when they were last read.
    pub(super) esp_heard: std::collections::BTreeSet<u32>,
    pub(super) esp_read: Option<Instant>,
    /// When this node first planned with each pair's post-quantum PSK.
    pub(super) pq_seen: super::pq_seen::PqSeen,
    /// Peers' next keys taken over by the clock: their handshakes started at once.
    pub(super) clock_switches: super::clock_switch::ClockSwitches,
    /// The old backends this node still speaks, and since when no peer runs each.
    pub(super) retiring: super::also::Retiring,
    /// Until when the guard still takes clear pod packets of pairs that moved to an
    /// encrypting backend (`also::CLEAR_DRAIN`).
    pub(super) accept_clear_until: Option<SystemTime>,
    /// Since when the resync has been put off for switches near (it is put off for at
    /// most `RESYNC_PUT_OFF`: with many pairs, one is always near).
    resync_put_off: Option<Instant>,
    /// Cross-zone pairs' path failures (`paths`), and the watcher's dead pairs feeding it.
    pub(super) paths: super::paths::PathMemory,
    path_dead: Option<tokio::sync::mpsc::UnboundedReceiver<crate::liveness::PathEvent>>,
    /// A device handle for re-handshaking pairs that moved path (made when first needed).
    pub(super) path_wg: Option<weft_backends::apply::wireguard::devices::WgImpl>,
    /// This node's relay, while it is a gateway.
    pub(super) relay: Option<crate::relay::Gateway>,
}

/// The watcher's next word on a pair's path, or never (no watcher).
async fn recv_path_dead(
    rx: &mut Option<tokio::sync::mpsc::UnboundedReceiver<crate::liveness::PathEvent>>,
) -> Option<crate::liveness::PathEvent> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// What woke the loop, when it needs a pass.
enum Wake {
    /// Re-plan; `full` reads every WireGuard device afresh.
    Pass {
        full: bool,
    },
    Shutdown,
}

/// A peer's announced key reached its grace: the pass that switches to it.
fn clock_switch() -> Wake {
    info!(
        cause = "clock",
        "a peer's announced key reached its grace: switching to it"
    );
    Wake::Pass { full: false }
}

pub(crate) async fn control_loop(
    args: &AgentArgs,
    net: &NetConf,
    options: &PlanOptions,
    keys: &mut KeyState,
    dataplane: &mut Dataplane,
    inputs: LoopInputs,
) {
    let me = inputs.local.borrow().clone();
    let switched = switch_watch::Switched::default();
    let switch_watch = match dataplane.another_wg_handle() {
        Some(Ok(wg)) => match switch_watch::spawn(wg, switched.clone()) {
            Ok(handle) => Some(handle),
            Err(e) => {
                warn!(error = %e, "cannot start the key-switch watcher: peers' new keys switch by the clock");
                None
            }
        },
        Some(Err(e)) => {
            warn!(error = %e, "cannot open the key-switch watcher's device handle: peers' new keys switch by the clock");
            None
        }
        None => None,
    };
    let (path_dead_tx, path_dead) = tokio::sync::mpsc::unbounded_channel();
    let liveness = start_liveness(dataplane, &inputs, path_dead_tx);
    let mut node = Controller {
        args,
        net,
        options,
        keys,
        dataplane,
        inputs,
        last: None,
        planner: Default::default(),
        passes: 0,
        drift_told: false,
        raw_view: Arc::new(ClusterView::default()),
        me,
        switchover: Switchover::new(switched),
        switch_watch,
        liveness,
        roaming: Default::default(),
        planned_at: SystemTime::UNIX_EPOCH,
        resync: interval(args.resync_period),
        resync_period: args.resync_period,
        nft_check: interval(NFT_CHECK),
        psk_check: interval(Duration::from_secs(1)),
        nft_dirty: true,
        nft_listed: Instant::now(),
        retiring: Default::default(),
        accept_clear_until: Some(SystemTime::now() + super::also::CLEAR_DRAIN),
        nft_verified: Default::default(),
        esp_rotation: None,
        rekey_not_before: None,
        esp_heard: Default::default(),
        esp_read: None,
        pq_seen: Default::default(),
        clock_switches: Default::default(),
        resync_put_off: None,
        paths: Default::default(),
        path_dead: Some(path_dead),
        path_wg: None,
        relay: None,
    };
    node.inputs.psk.refresh();
    if !node.first_listing().await {
        return;
    }
    // The first pass and the periodic resync read every WireGuard device; a pass woken by
    // the registry or a deletion trusts what the last passes read (no event reports their
    // peers changing).
    let mut full = true;
    loop {
        node.pass(full).await;
        match node.wait().await {
            Wake::Pass { full: next } => full = next,
            Wake::Shutdown => return,
        }
    }
}

/// Starts the liveness watcher on a handle of its own (WireGuard only).
fn start_liveness(
    dataplane: &Dataplane,
    inputs: &LoopInputs,
    path_dead: tokio::sync::mpsc::UnboundedSender<crate::liveness::PathEvent>,
) -> Option<crate::liveness::Handle> {
    let started = dataplane.another_wg_handle()?.and_then(|wg| {
        let dead_pairs = Some(inputs.pq.fall_back.clone());
        crate::liveness::spawn(
            wg,
            inputs.snapshot.clone(),
            inputs.metrics.clone(),
            dead_pairs,
            path_dead,
        )
        .map_err(|e| weft_backends::apply::ApplyError::Io {
            op: "starting the liveness watcher".into(),
            source: e,
        })
    });
    match started {
        Ok(handle) => Some(handle),
        Err(e) => {
            warn!(error = %e, "no liveness watcher: dead pairs are repaired by the resync alone");
            None
        }
    }
}

impl Controller<'_> {
    /// The watcher found the pair with `node` dead: whether its path changes (a pass
    /// follows).
    fn path_dead(&mut self, node: &str) -> bool {
        let cross_zone = self.raw_view.get(node).is_some_and(
            |peer| matches!((&self.me.reach.zone, &peer.reach.zone), (Some(a), Some(b)) if a != b),
        );
        self.paths
            .dead(node, self.last.as_deref(), cross_zone, SystemTime::now())
    }

    /// What the liveness watcher asked for, before the full pass it calls for.
    async fn liveness_event(&mut self, event: crate::liveness::Event) {
        match event {
            crate::liveness::Event::Drift { device, found } => {
                self.drift_told = true;
                info!(device = %device, drift = ?found, cause = "drift", "a full pass puts the device back as planned");
            }
            crate::liveness::Event::Recreate { device, cause } => {
                match self.dataplane.remove_wg_device(&device).await {
                    Ok(removed) => {
                        info!(device = %device, removed, cause = %cause, "the device at fault is removed; the pass makes it again")
                    }
                    Err(e) => warn!(device = %device, error = %e, "removing the device at fault"),
                }
            }
        }
    }

    /// Waits for the registry's first full listing; false on shutdown. Nothing is planned
    /// before it: a plan made from the empty view would remove every peer that a previous
    /// run left in place, dropping traffic that the restart should not touch.
    async fn first_listing(&mut self) -> bool {
        loop {
            tokio::select! {
                listed = self.inputs.views.changed() => match listed {
                    Ok(()) => break,
                    Err(_) => return false,
                },
                // Waiting for the registry (which retries on its own) is not being wedged.
                _ = self.nft_check.tick() => self.inputs.health.beat(),
                _ = self.inputs.shutdown.changed() => return false,
            }
        }
        info!(
            nodes = self.inputs.views.borrow().leases.len(),
            "first full listing"
        );
        true
    }

    /// Waits for whatever calls for the next pass, handling on the way what needs none
    /// (the nftables check, rotation requests).
    async fn wait(&mut self) -> Wake {
        if let Some(wake) = self.moments_past().await {
            return wake;
        }
        loop {
            let (psk_switch, peer_switch) = (self.psk_switch(), self.peer_switch());
            let nft_deferred = self.nft_deferred();
            let esp_poll = self.esp_poll();
            let rekey = self.rekey_due();
            // In order: an operator's request and the announced moments are never kept
            // waiting behind the periodic checks (`tokio::select!` alone starts at a random
            // branch and takes the first one ready, so a check that was always ready —
            // slower than its period — kept a rotation request waiting for 20 s and more).
            tokio::select! {
                biased;
                _ = self.inputs.shutdown.changed() => return Wake::Shutdown,
                Some(request) = self.inputs.rotate.recv() => self.rotate_on_request(request).await,
                Some(id) = self.inputs.registry_rotations.recv() => self.rotate_from_registry(&id).await,
                // This node's announced ipsec epoch: its moment, then the end of settling.
                () = sleep_until(self.esp_rotation.map(|r| r.due())) => {
                    if self.esp_rotation_due().await {
                        return Wake::Pass { full: false };
                    }
                }
                // An old backend no peer runs any more: its grace has passed.
                () = sleep_for(self.retiring.wait(Instant::now())) => {
                    let drained = self.retiring.drained(Instant::now());
                    let retired = self.retire_backends().await;
                    if drained || retired {
                        return Wake::Pass { full: drained };
                    }
                }
                // This node's ipsec epoch has reached `RekeyAfter`.
                () = sleep_until(rekey) => self.rekey().await,
                // This node's announced switch.
                () = sleep_until(self.keys.due()) => {
                    if self.switch_own_key().await {
                        return Wake::Pass { full: false };
                    }
                }
                // The announced PSK takes over.
                () = sleep_until(psk_switch) => return Wake::Pass { full: false },
                // A peer's announced switch, at the latest: its new key takes over now.
                () = sleep_until(peer_switch) => return clock_switch(),
                // ipsec: has the peer that this node waits for sent on its next epoch?
                () = sleep_for(esp_poll) => {
                    if self.esp_newly_heard().await {
                        return Wake::Pass { full: false };
                    }
                }
                // A pair's device drifted from the plan, or is at fault: a full pass
                // re-reads it and puts it back (after removing a device at fault).
                Some(event) = liveness_event(&mut self.liveness) => {
                    self.liveness_event(event).await;
                    return Wake::Pass { full: true };
                }
                // A pair died on its path: a cross-zone pair takes another.
                Some(event) = recv_path_dead(&mut self.path_dead) => match event {
                    crate::liveness::PathEvent::Dead(node) => {
                        if self.path_dead(&node) {
                            return Wake::Pass { full: false };
                        }
                    }
                    // The device holds another gateway for the pair: plan with it read.
                    crate::liveness::PathEvent::Roamed(_) => return Wake::Pass { full: true },
                },
                // The key-switch watcher moved a peer to its next key: the pass removes
                // the entry it left.
                Some(()) = switched(&mut self.switch_watch) => return Wake::Pass { full: false },
                _ = self.inputs.views.changed() => return Wake::Pass { full: false },
                // A path's MTU was measured, or changed, or went silent: its routes and
                // the snapshot follow.
                _ = self.inputs.path_mtu.mtus.changed() => return Wake::Pass { full: false },
                // A post-quantum PSK took over (or a pair fell back): the peer's PSK follows.
                _ = self.inputs.pq.published.changed() => return Wake::Pass { full: false },
                _ = self.inputs.local.changed() => return Wake::Pass { full: false },
                // Links, addresses and neighbours are read in every pass, the routes in
                // the pass after a deletion (the monitor does not report the agent's own
                // route deletions), and a deleted device is recreated and read afresh; so
                // a deletion needs no full pass.
                Some(()) = self.inputs.deletions.recv() => {
                    self.dataplane.forget_routes();
                    return Wake::Pass { full: false };
                }
                // The PSK sources: the registry's key, or the mounted Secret (read every
                // second; a Secret's files change without an event we could wait on). A
                // closed registry channel would be ready forever: it is left out.
                changed = self.inputs.psk.registry.changed(),
                    if self.inputs.psk.dir.is_none() && self.inputs.psk.registry.has_changed().is_ok() => {
                    if changed.is_ok() && self.inputs.psk.refresh() {
                        return Wake::Pass { full: false };
                    }
                }
                _ = self.psk_check.tick(), if self.inputs.psk.dir.is_some() => {
                    if self.inputs.psk.refresh() {
                        return Wake::Pass { full: false };
                    }
                }
                _ = self.resync.tick() => if self.resync_due() {
                    self.resync.reset_after(jittered(self.resync_period));
                    return Wake::Pass { full: true };
                },
                changed = next_event(&mut self.inputs.nft_changes),
                    if self.inputs.nft_changes.is_some() => {
                    self.nft_event(changed).await;
                }
                // A verification beside the loop found the tables as planned, or not.
                Some(as_planned) = self.nft_verified.results.recv() => self.nft_verified(as_planned),
                // An event that came too soon after the last listing.
                () = sleep_for(nft_deferred) => self.check_nft().await,
                _ = self.nft_check.tick() => {
                    self.check_nft().await;
                    self.follow_address().await;
                }
            }
        }
    }

    /// The announced moments that passed while the loop was busy (a pass, a check): taken
    /// before anything else. In the `select!` below their timers are not ready when first
    /// polled even when due (tokio's timer fires on its next tick), so an event ready at
    /// once (a registry change, a post-quantum PSK published) won every time: in the VM a
    /// node switched its own key 2.4 s after its moment, behind four event passes, and its
    /// peers' traffic fell into the gap.
    async fn moments_past(&mut self) -> Option<Wake> {
        let now = SystemTime::now();
        let past = |at: Option<SystemTime>| at.is_some_and(|at| at <= now);
        if past(self.esp_rotation.map(|r| r.due())) && self.esp_rotation_due().await {
            return Some(Wake::Pass { full: false });
        }
        if past(self.keys.due()) && self.switch_own_key().await {
            return Some(Wake::Pass { full: false });
        }
        if past(self.psk_switch()) {
            return Some(Wake::Pass { full: false });
        }
        if past(self.peer_switch()) {
            return Some(clock_switch());
        }
        None
    }

    /// An announced PSK takes over at its moment. The pass owed is the first planned after
    /// it, even if the loop was busy elsewhere (the nftables check, a rotation) when the
    /// moment came: measured from the last plan, not from now.
    fn psk_switch(&self) -> Option<SystemTime> {
        let psk = self.inputs.psk.state.as_ref();
        psk.and_then(|p| p.next_switch(self.planned_at))
    }

    /// The next moment a peer's announced key takes over by the clock (the last plan's).
    fn peer_switch(&self) -> Option<SystemTime> {
        self.last.as_ref().and_then(|s| s.next_switch)
    }

    /// This node's announced key switch, at its moment; whether a pass must follow. The
    /// device takes the key in an event's pass, which reads only what it changes: a full
    /// pass first re-reads every link, address and route (0.9 s under the VM's emulation),
    /// and each peer switches to the new key by its clock 2 s after the moment whether the
    /// device has it or not.
    async fn switch_own_key(&mut self) -> bool {
        let published = self.inputs.local.borrow().next_key.clone();
        let switched = self.keys.switch(published.as_ref()).await;
        if switched {
            // Every pair is a new one under the new key: classical until its round.
            let _ = self.inputs.pq.own_key.try_send(self.keys.key.clone());
        }
        switched
    }

    /// Whether the resync runs now: it is put off while this node's key switch, a peer's
    /// announced key switch (the pass that stages or switches its key would otherwise wait
    /// behind it), or a pair's post-quantum PSK taking over is near (the same for the pass
    /// that installs the PSK's states). Put off, it is looked at again `SWITCH_GUARD` later.
    fn resync_due(&mut self) -> bool {
        let now = SystemTime::now();
        let near = |at: Option<SystemTime>| at.is_some_and(|at| switch_near(at, now));
        let pq = self.inputs.pq.published.borrow().next_switch;
        let waited = self
            .resync_put_off
            .get_or_insert_with(Instant::now)
            .elapsed();
        if waited < RESYNC_PUT_OFF {
            if near(self.keys.due()) {
                info!("resync put off until this node's key switch is done");
                self.resync.reset_after(SWITCH_GUARD);
                return false;
            }
            if near(self.last.as_ref().and_then(|s| s.next_switch)) {
                info!("resync put off until a peer's key switch is done");
                self.resync.reset_after(SWITCH_GUARD);
                return false;
            }
            if near(pq) {
                debug!("resync put off until a post-quantum PSK has taken over");
                self.resync.reset_after(SWITCH_GUARD);
                return false;
            }
        }
        self.resync_put_off = None;
        true
    }
}
