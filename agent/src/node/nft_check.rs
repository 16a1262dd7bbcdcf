//! The control loop's nftables checks: on the tables' change events (at most two listings
//! a second), and on its periodic check, which has them listed at least every minute even
//! when no event says they changed. That minute's listing runs beside the loop while the
//! events are live (it only verifies; a difference it finds is listed and repaired by the
//! loop), so no pass, announced key or PSK waits for its `nft` runs.

use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc;
use tracing::{debug, warn};
use weft_backends::apply::{tables_as_planned, ApplyError, NftCli};

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

    /// Whether nf_tables' events vouch for the tables as last listed: they are live and
    /// have reported no change since, and the last listing is within `NFT_SAFETY`. A
    /// full pass then leaves the tables to the checks. Listing them was five `nft` runs
    /// (now one for the tables there are, then one for each of those), 0.5–1 s each
    /// under the VM's emulation: most of a 4–7 s full pass, during which a peer's
    /// announced key waited to be staged and missed its moment.
    pub(super) fn tables_vouched_for(&self) -> bool {
        self.inputs.nft_changes.is_some()
            && !self.nft_dirty
            && self.nft_listed.elapsed() < NFT_SAFETY
    }

    pub(super) async fn check_nft(&mut self) {
        self.inputs.health.beat();
        let events = self.inputs.nft_changes.is_some();
        let safety = self.nft_listed.elapsed() >= NFT_SAFETY;
        if events && !self.nft_dirty && safety {
            self.verify_tables();
        }
        let tables = !events || self.nft_dirty;
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
                    self.record_repairs(&r.changes);
                    self.esp_lost(&r.esp_lost).await;
                }
                Err(e) => warn!(error = %e, "nftables check failed"),
            }
        }
    }

    /// Starts listing the tables beside the loop, to compare them with the last plan.
    fn verify_tables(&mut self) {
        self.nft_listed = Instant::now();
        let Some(state) = &self.last else {
            return;
        };
        let (masquerade, guard) = (state.masquerade.clone(), state.guard.clone());
        let results = self.nft_verified.tell.clone();
        tokio::spawn(async move {
            let found = tables_as_planned(&mut NftCli::default(), &masquerade, &guard).await;
            let _ = results.send(found).await;
        });
    }

    /// What a verification beside the loop found: a difference (or a failure to list) is
    /// the loop's to list and repair, as after an event.
    pub(super) fn nft_verified(&mut self, found: Result<bool, ApplyError>) {
        match found {
            Ok(true) => debug!("nftables tables verified as planned"),
            Ok(false) => {
                warn!("the nftables tables differ from the plan with no event seen: repairing");
                self.nft_dirty = true;
            }
            Err(e) => {
                warn!(error = %e, "verifying the nftables tables");
                self.nft_dirty = true;
            }
        }
    }

    /// Changes that put back what something else changed behind the agent: `weft doctor`
    /// names them even after the tables are back.
    pub(super) fn record_repairs(&self, changes: &[String]) {
        if !changes.is_empty() {
            let now = crate::keys::rotation::ms(SystemTime::now());
            self.inputs.snapshot.update(|s| s.repaired(changes, now));
        }
    }
}

/// The results of the verifications run beside the loop (`verify_tables`).
pub(crate) struct Verifications {
    tell: mpsc::Sender<Result<bool, ApplyError>>,
    pub(super) results: mpsc::Receiver<Result<bool, ApplyError>>,
}

impl Default for Verifications {
    fn default() -> Self {
        let (tell, results) = mpsc::channel(1);
        Verifications { tell, results }
    }
}

/// The nftables changes of a pass whose tables were planned as in the pass before
/// (`last`): repairs, as the checks' are. A pass often puts a deleted table back before
/// the check its event calls for gets to it.
pub(super) fn pass_repairs(
    last: Option<&weft_backends::model::DesiredState>,
    state: &weft_backends::model::DesiredState,
    changes: &[String],
) -> Vec<String> {
    let same = last.is_some_and(|l| l.masquerade == state.masquerade && l.guard == state.guard);
    if !same {
        return Vec::new();
    }
    changes
        .iter()
        .filter(|c| c.starts_with("replace nftables table"))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use weft_backends::model::{DesiredState, Family, MasqueradeTable};

    use super::pass_repairs;

    fn with_table() -> DesiredState {
        let mut s = DesiredState::default();
        s.masquerade.push(MasqueradeTable {
            family: Family::Ipv4,
            table: "flannel-ipv4",
            postrouting: Vec::new(),
            forward: Vec::new(),
        });
        s
    }

    #[test]
    fn a_pass_that_puts_back_a_table_planned_as_before_is_a_repair() {
        let changes = vec![
            "replace nftables table ip flannel-ipv4".to_string(),
            "add route 10.244.1.0/24 dev flannel-wg".to_string(),
        ];
        let (before, now) = (with_table(), with_table());
        assert_eq!(
            pass_repairs(Some(&before), &now, &changes),
            ["replace nftables table ip flannel-ipv4"]
        );
        // The first pass, and a pass whose tables' plan changed, repair nothing.
        assert!(pass_repairs(None, &now, &changes).is_empty());
        let mut changed = with_table();
        changed.masquerade[0].table = "flannel-ipv6";
        assert!(pass_repairs(Some(&before), &changed, &changes).is_empty());
    }
}
