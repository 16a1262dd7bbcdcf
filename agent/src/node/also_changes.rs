//! The backends this node speaks besides its config's, as the cluster changes (`also`):
//! retired once no peer runs them, taken up when a peer runs one this node must meet it on.

use std::collections::BTreeSet;
use std::time::{Instant, SystemTime};

use tracing::{info, warn};
use weft_backends::netconf::{BackendKind, Implementation};
use weft_backends::plan::mixed::{to_take_up, KEPT_DURING_A_CHANGE};

use super::run_loop::Controller;

impl Controller<'_> {
    /// Stops speaking the old backends no peer has run for `also::GRACE`: publishes
    /// without them and records it; their devices go `also::CLEAR_DRAIN` later (when
    /// `Retiring::drained` says so, a pass removes them). Whether one was retired.
    pub(super) async fn retire_backends(&mut self) -> bool {
        let now = Instant::now();
        let due = self
            .retiring
            .due(&self.keys.attrs.also, &self.raw_view, &self.me.node, now);
        if due.is_empty() {
            return false;
        }
        for kind in &due {
            if let Some(data) = self.keys.attrs.also.remove(kind) {
                self.retiring.drain(kind.clone(), data, now);
            }
        }
        // Peers retiring theirs at about the same moment send in clear before this node
        // reads it: the guard takes their pods' packets meanwhile.
        self.accept_clear_until = Some(SystemTime::now() + super::also::CLEAR_DRAIN);
        info!(retired = ?due, "no peer runs this node's old backend any more: it is no longer spoken, its devices go");
        self.record_and_publish().await;
        true
    }

    /// Records what this node speaks now (`also::record`) and publishes it.
    async fn record_and_publish(&mut self) {
        super::also::record(
            &self.keys.state_dir(),
            self.keys.attrs.backend,
            self.keys.attrs.backend_data.as_ref(),
            &self.keys.attrs.also,
        );
        self.keys.publish().await;
    }

    /// Takes up the backends of peers this node shares none with and which could not take
    /// up its own (it runs ipsec or ipip, which no node keeps when it leaves them;
    /// `mixed::to_take_up`): publishes them beside its config's and records it, so the
    /// pair runs on them until the change is over (then they are retired as a kept
    /// backend is).
    pub(super) async fn take_up_backends(&mut self) {
        let ours = self.net.backend.kind();
        // Nodes on the other backends take nothing up: no scan of the leases per pass.
        if KEPT_DURING_A_CHANGE.contains(&ours) {
            return;
        }
        let refuse_clear = self.net.backend.refuses_clear();
        let wall = SystemTime::now();
        let wanted: BTreeSet<(BackendKind, Option<u64>)> = self
            .raw_view
            .leases
            .values()
            .filter(|l| l.node != self.me.node && l.expires.is_none_or(|t| t > wall))
            .filter_map(|l| {
                let kind = to_take_up(ours, &self.keys.attrs.also, l, refuse_clear)?;
                let vni = l.backend_data.as_ref().and_then(|d| d.get("VNI")?.as_u64());
                Some((kind, vni))
            })
            .collect();
        let mut taken = Vec::new();
        for (kind, vni) in wanted {
            if self.keys.attrs.also.contains_key(kind.as_str()) {
                continue;
            }
            if kind == BackendKind::Wireguard {
                // Chosen as `Implementation: auto` would: the node's config names none.
                match self.dataplane.take_up_wireguard(Implementation::Auto).await {
                    Ok(Some(why)) => info!(
                        implementation = self.dataplane.implementation(),
                        why, "WireGuard taken up"
                    ),
                    Ok(None) => {}
                    Err(e) => {
                        warn!(error = %e, "taking up WireGuard a peer runs: no implementation");
                        continue;
                    }
                }
            }
            let data = match super::backend_setup::data_to_take_up(
                kind,
                vni,
                &self.keys.key.public_key(),
                &self.keys.state_dir(),
            )
            .await
            {
                Ok(data) => data,
                Err(e) => {
                    warn!(backend = kind.as_str(), error = %format!("{e:#}"), "taking up a backend a peer runs");
                    continue;
                }
            };
            self.keys.attrs.also.insert(kind.as_str().into(), data);
            self.retiring.undrain(kind.as_str());
            taken.push(kind.as_str());
        }
        if taken.is_empty() {
            return;
        }
        info!(taken_up = ?taken, backend = ours.as_str(), "a peer runs a backend this node shares none with, and cannot take up this node's: this node speaks it too until no peer runs it");
        self.record_and_publish().await;
    }
}
