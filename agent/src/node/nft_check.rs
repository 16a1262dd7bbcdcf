//! The control loop's nftables checks: on the tables' change events (at most two listings
//! a second), and on its periodic check, which lists them at least every minute even when
//! no event says they changed.

use std::time::{Duration, Instant, SystemTime};

use tracing::warn;

use super::error_policy::log_report;
use super::run_loop::Controller;

/// The tables are listed at least this often even when no event says they changed.
const NFT_SAFETY: Duration = Duration::from_secs(60);
/// An event lists the tables at once unless they were listed this recently (then they are
/// listed when this much has passed): a busy neighbour's rule churn (kube-proxy's) costs
/// at most two `nft list` a second.
const NFT_EVENT_GAP: Duration = Duration::from_millis(500);

impl Controller<'_> {
    /// An nftables event (`Some`), or the end of them (`None`: then every check lists the
    /// tables, as without events).
    pub(super) async fn nft_event(&mut self, changed: Option<()>) {
        if changed.is_none() {
            warn!("nftables events stopped: listing the tables at every check");
            self.inputs.nft_changes = None;
            return;
        }
        self.nft_dirty = true;
        if self.nft_listed.elapsed() >= NFT_EVENT_GAP {
            self.check_nft().await;
        }
    }

    /// How long until a change reported too soon after the last listing is looked at.
    pub(super) fn nft_deferred(&self) -> Option<Duration> {
        (self.nft_dirty && self.inputs.nft_changes.is_some())
            .then(|| NFT_EVENT_GAP.saturating_sub(self.nft_listed.elapsed()))
    }

    pub(super) async fn check_nft(&mut self) {
        self.inputs.health.beat();
        let tables = self.inputs.nft_changes.is_none()
            || self.nft_dirty
            || self.nft_listed.elapsed() >= NFT_SAFETY;
        if tables {
            self.nft_dirty = false;
            self.nft_listed = Instant::now();
        }
        if let Some(state) = &self.last {
            match self
                .dataplane
                .reconcile_nft(state, &self.keys.key, tables)
                .await
            {
                Ok(r) => {
                    log_report(&r);
                    if !r.changes.is_empty() {
                        // Something changed the tables behind the agent: `weft doctor`
                        // names it even after the tables are back.
                        let now = crate::keys::rotation::ms(SystemTime::now());
                        self.inputs.snapshot.update(|s| s.repaired(&r.changes, now));
                    }
                    self.esp_lost(&r.esp_lost).await;
                }
                Err(e) => warn!(error = %e, "nftables check failed"),
            }
        }
    }
}
