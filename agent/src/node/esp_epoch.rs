//! The ipsec backend's epochs.
//! - Lost SA state (a reboot, a flush, a state deleted behind the agent): states installed
//!   once are never installed again with the same key, so this node takes a new epoch
//!   (persisted first), publishes it, and the plan that follows — once the registry carries
//!   it — derives new keys for every pair it is part of.
//! - Rotation (`weft keys rotate`, `--all`): the next epoch is persisted and announced with
//!   a moment (`lead` ahead); until then every node receives on both epochs' states, from
//!   then on it sends with the new one. The announcement then stays published for
//!   `SETTLE`, while the epoch left is still received on, and only then is the new epoch
//!   published alone. A moment never moves: peers act on it as soon as they see it.

use std::time::{Duration, SystemTime};

use tracing::{info, warn};
use weft_backends::model::NextKey;
use weft_backends::plan::ipsec::{backend_data, rotating_backend_data, IpsecData, NextEpoch};

use crate::keys::rotation::RotateError;

use super::run_loop::Controller;

impl Controller<'_> {
    pub(super) async fn esp_lost(&mut self, lost: &[String]) {
        let Some(first) = lost.first() else {
            return;
        };
        warn!(
            lost = lost.len(),
            first = %first,
            "ipsec: states installed under this epoch are gone; a new epoch replaces every key"
        );
        match self.dataplane.bump_esp_epoch() {
            Some(Ok(epoch)) => {
                // A rotation under way is overtaken: the new epoch is newer than its.
                self.esp_rotation = None;
                let public = self.keys.key.public_key();
                self.keys.attrs.backend_data = Some(backend_data(&public, &epoch));
                self.keys.publish().await;
                info!(epoch = epoch.number, "ipsec: new epoch published");
            }
            Some(Err(e)) => warn!(
                error = %e,
                "ipsec: persisting a new epoch failed; nothing is installed until it succeeds"
            ),
            None => {}
        }
    }
}

/// When this node starts a new ESP epoch by itself (`RekeyAfter`): `after` from the start
/// of its epoch (`since`), unless a rotation is under way (it ends with a new epoch, and
/// so a new start).
pub(super) fn rekey_at(
    since: Option<SystemTime>,
    after: Option<Duration>,
    rotating: bool,
) -> Option<SystemTime> {
    if rotating {
        return None;
    }
    since?.checked_add(after?)
}

impl Controller<'_> {
    /// This node's epoch is `RekeyAfter` old: a rotation to the next one starts, as `weft
    /// keys rotate` would start it.
    pub(super) async fn rekey(&mut self) {
        match self.rotate_esp().await {
            Ok(next) => info!(
                switch_at_ms = next.switch_at_ms,
                "ipsec: the epoch reached RekeyAfter; rotating to a new one"
            ),
            Err(e) => {
                warn!(error = %e, "ipsec: the epoch reached RekeyAfter, but cannot rotate; trying again in a minute");
                self.rekey_not_before = Some(SystemTime::now() + REKEY_RETRY);
            }
        }
    }

    /// When `rekey` is due, if the backend asks for it.
    pub(super) fn rekey_due(&self) -> Option<SystemTime> {
        let weft_backends::netconf::Backend::Ipsec(conf) = &self.net.backend else {
            return None;
        };
        let due = rekey_at(
            self.dataplane.esp_epoch_since(),
            conf.rekey_after,
            self.esp_rotation.is_some(),
        )?;
        Some(self.rekey_not_before.map_or(due, |t| t.max(due)))
    }
}

/// How often the inbound states' counters are read while a peer's evidence of holding
/// this node's next epoch is awaited (`DesiredState::esp_watch`). Until it comes this
/// node sends with the epoch being left, which the peer still receives on: the wait loses
/// nothing, it only delays the switch.
const ESP_POLL: Duration = Duration::from_millis(20);

impl Controller<'_> {
    /// How long until the counters are read, while the last plan awaits evidence.
    pub(super) fn esp_poll(&self) -> Option<Duration> {
        if !self.last.as_ref().is_some_and(|s| s.esp_watch) {
            return None;
        }
        Some(
            self.esp_read
                .map_or(Duration::ZERO, |t| ESP_POLL.saturating_sub(t.elapsed())),
        )
    }

    /// Reads which inbound states have carried packets; true if one newly has (the plan
    /// may then switch a peer to this node's next epoch).
    pub(super) async fn esp_newly_heard(&mut self) -> bool {
        self.esp_read = Some(std::time::Instant::now());
        let Some(state) = self.last.as_ref() else {
            return false;
        };
        match self.dataplane.esp_heard(state) {
            Ok(heard) => {
                let new = heard.difference(&self.esp_heard).count();
                self.esp_heard = heard;
                if new > 0 {
                    info!(
                        states = new,
                        "ipsec: inbound states newly carry packets while peers' evidence of this node's next epoch is awaited"
                    );
                }
                new > 0
            }
            Err(e) => {
                warn!(error = %e, "ipsec: reading the inbound states' counters");
                false
            }
        }
    }
}

impl Controller<'_> {
    /// Logs each ipsec peer that `state` starts sending to with a newer epoch of this node
    /// than the last plan did: why (the peer's evidence, or the end of the wait) and how
    /// long after this node's announced moment.
    pub(super) fn log_esp_switches(&self, state: &weft_backends::model::DesiredState) {
        let (Some(new), Some(old)) = (
            state.ipsec.as_ref(),
            self.last.as_ref().and_then(|s| s.ipsec.as_ref()),
        ) else {
            return;
        };
        let moment = self.esp_rotation.map(|r| r.next.switch_at);
        for p in &new.peers {
            let Some(before) = old.peers.iter().find(|o| o.node == p.node) else {
                continue;
            };
            if p.outbound.local_epoch.number <= before.outbound.local_epoch.number {
                continue;
            }
            let evidence = p.inbound.iter().any(|sa| {
                sa.local_epoch == p.outbound.local_epoch && self.esp_heard.contains(&sa.spi)
            });
            let after_moment_ms = moment
                .and_then(|m| SystemTime::now().duration_since(m).ok())
                .map(|d| d.as_millis() as u64);
            info!(
                node = %p.node,
                epoch = p.outbound.local_epoch.number,
                cause = match (moment, evidence) {
                    (None, _) => "a new epoch",
                    (Some(_), true) => "evidence",
                    (Some(_), false) => "the wait's end",
                },
                after_moment_ms,
                "ipsec: sending to the peer with this node's next epoch"
            );
        }
    }
}

/// How long a `RekeyAfter` rotation that could not start waits before it is tried again.
const REKEY_RETRY: Duration = Duration::from_secs(60);

/// How long after its moment a rotation's announcement stays published: peers that learn
/// of the moment late keep sending with the epoch being left until they do, and this node
/// keeps receiving on it (and stages the states for it) while the announcement stands.
pub(super) const SETTLE: Duration = Duration::from_secs(10);

/// This node's ipsec rotation under way.
#[derive(Debug, Clone, Copy)]
pub(super) struct EspRotation {
    pub next: NextEpoch,
    /// The moment has passed: the node sends with the next epoch and the announcement
    /// settles.
    pub switched: bool,
}

impl EspRotation {
    /// When the loop next has something to do for it: the moment, then the end of settling.
    pub(super) fn due(&self) -> SystemTime {
        match self.switched {
            false => self.next.switch_at,
            true => self.next.switch_at + SETTLE,
        }
    }
}

impl Controller<'_> {
    /// Starts a rotation of this node's ESP keys (a new epoch), or returns the one under way.
    /// One that has switched and is settling ends first (its announcement is withdrawn).
    pub(super) async fn rotate_esp(&mut self) -> Result<NextKey, RotateError> {
        let public = self.keys.key.public_key();
        let answer = |next: &NextEpoch| NextKey {
            public_key: public.to_string(),
            switch_at_ms: next
                .switch_at
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            generation: next.epoch.number,
        };
        match self.esp_rotation {
            Some(r) if !r.switched => return Ok(answer(&r.next)),
            Some(_) => self.settle_esp_rotation().await,
            None => {}
        }
        let current = IpsecData::decode(self.keys.attrs.backend_data.as_ref())
            .map_err(|e| RotateError::State(anyhow::anyhow!("this node's ipsec data: {e}")))?
            .epoch;
        let epoch = match self.dataplane.advance_esp_epoch() {
            Some(Ok(epoch)) => epoch,
            Some(Err(e)) => return Err(RotateError::State(anyhow::anyhow!("{e}"))),
            None => return Err(RotateError::NoKey),
        };
        let next = NextEpoch {
            epoch,
            switch_at: SystemTime::now() + self.keys.lead,
        };
        self.keys.attrs.backend_data = Some(rotating_backend_data(&public, &current, &next));
        self.keys.publish().await;
        info!(epoch = epoch.number, "ipsec: next epoch announced");
        self.esp_rotation = Some(EspRotation {
            next,
            switched: false,
        });
        Ok(answer(&next))
    }

    /// The rotation's moment, or the end of its settling, has come. True when the plan
    /// changes (the node sends with the next epoch from now on).
    pub(super) async fn esp_rotation_due(&mut self) -> bool {
        let Some(rotation) = self.esp_rotation else {
            return false;
        };
        if rotation.switched {
            self.settle_esp_rotation().await;
            return false;
        }
        // The plan takes the moment from the registry's copy of this node's data: without
        // the announcement there, this node keeps sending with the epoch it leaves until the
        // registry carries it (then the moment is past and it switches at once). The moment
        // never moves: a peer that has seen it acts on it, and an epoch never goes back.
        let announced = IpsecData::decode(self.me.backend_data.as_ref())
            .is_ok_and(|d| d.next == Some(rotation.next));
        if !announced {
            warn!(
                epoch = rotation.next.epoch.number,
                "ipsec: the registry had not carried the announced epoch by its moment; this node switches when it does"
            );
        }
        self.esp_rotation = Some(EspRotation {
            switched: true,
            ..rotation
        });
        info!(
            epoch = rotation.next.epoch.number,
            "ipsec: switched to the next epoch; the epoch left is still received on while the announcement settles"
        );
        true
    }

    /// Settling is over: the next epoch is published as this node's epoch.
    async fn settle_esp_rotation(&mut self) {
        let Some(rotation) = self.esp_rotation.take() else {
            return;
        };
        let public = self.keys.key.public_key();
        self.keys.attrs.backend_data = Some(backend_data(&public, &rotation.next.epoch));
        self.keys.publish().await;
        info!(
            epoch = rotation.next.epoch.number,
            "ipsec: rotation settled; the epoch left is withdrawn"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RekeyAfter` counts from the start of the epoch (the epoch file's last write, which
    /// every rotation and every bump rewrites); nothing is due while a rotation runs or
    /// when the option is off.
    #[test]
    fn a_rekey_is_due_rekey_after_from_the_epochs_start() {
        let since = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let day = Duration::from_secs(86_400);
        assert_eq!(rekey_at(Some(since), Some(day), false), Some(since + day));
        assert_eq!(rekey_at(Some(since), Some(day), true), None);
        assert_eq!(rekey_at(Some(since), None, false), None);
        assert_eq!(rekey_at(None, Some(day), false), None);
    }
}
