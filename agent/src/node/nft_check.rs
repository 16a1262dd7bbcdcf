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
                    self.record_repairs(&r.changes);
                    self.esp_lost(&r.esp_lost).await;
                }
                Err(e) => warn!(error = %e, "nftables check failed"),
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
