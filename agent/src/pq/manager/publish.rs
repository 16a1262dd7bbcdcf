//! What the task tells the rest of the agent after each wake-up: the PSKs in force (to the
//! control loop), each pair's status, and the saved file; only for the pairs that changed.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tracing::{info, warn};
use weft_backends::model::PairSecret;
use weft_crypto::pq::Installed;
use weft_crypto::PublicKey;

use super::{now_ms, Kept, Manager, SAVE_EVERY_MAX, SAVE_EVERY_PAIR};

impl Manager {
    /// Tells the loop the PSKs in force and the next switch, saves them, and updates the
    /// status: of the pairs that changed only (`dirty`, and those whose switch came).
    pub(super) fn publish(&mut self) {
        let now = now_ms();
        while let Some(&(at, key)) = self.switches.first() {
            if at > now {
                break;
            }
            self.switches.pop_first();
            if let Some(pair) = self.pairs.get_mut(&key) {
                pair.switch_at = None;
            }
            self.dirty.insert(key);
        }
        let mut news: Vec<(PublicKey, Option<PairSecret>)> = Vec::new();
        let mut status = self.status.lock().ok();
        for key in std::mem::take(&mut self.dirty) {
            let Some(pair) = self.pairs.get_mut(&key) else {
                // A peer that left is kept for its return: its PSK stays, saved too.
                let waiting = (self.left.contains_key(&key))
                    .then(|| self.restored.get(&key)?.in_force(now))
                    .flatten();
                match waiting {
                    Some(i) => news.push((key, Some(secret(i, None)))),
                    None => {
                        self.unsaved |= self.kept.remove(&key).is_some();
                        news.push((key, None));
                    }
                }
                continue;
            };
            let installed = pair.ex.psk(now).cloned();
            match &installed {
                Some(i) if pair.in_force != Some(i.round) => {
                    pair.rounds += 1;
                    info!(peer = %pair.node, round = i.round, rounds = pair.rounds, "post-quantum PSK in force");
                }
                _ => {}
            }
            pair.in_force = installed.as_ref().map(|i| i.round);
            let switch_at = pair.ex.pending().map(|p| p.at_ms);
            if pair.switch_at != switch_at {
                if let Some(at) = pair.switch_at {
                    self.switches.remove(&(at, key));
                }
                if let Some(at) = switch_at {
                    self.switches.insert((at, key));
                }
                pair.switch_at = switch_at;
            }
            if let Some(status) = status.as_mut() {
                let s = status.entry(key).or_default();
                s.node.clone_from(&pair.node);
                s.round_ms = pair.in_force;
                s.rounds = pair.rounds;
                if s.round_ms.is_some() {
                    s.classical_because = None;
                } else if s.classical_because.is_none() {
                    s.classical_because = Some("its first round has not completed".into());
                }
                s.last_refusal = pair.ex.last_refusal().map(ToString::to_string);
            }
            news.push((
                key,
                installed.as_ref().map(|i| secret(i, pair.ex.previous())),
            ));
            let kept = Kept {
                current: installed,
                next: pair.ex.pending().cloned(),
            };
            self.unsaved |= if kept.is_empty() {
                self.kept.remove(&key).is_some()
            } else {
                self.kept.insert(key, kept.clone()) != Some(kept)
            };
        }
        drop(status);
        let next_switch = (self.switches.first())
            .map(|(ms, _)| SystemTime::UNIX_EPOCH + Duration::from_millis(*ms));
        // The map is copied only if the loop's pass holds it at this moment.
        self.published.send_if_modified(|p| {
            let own = Some(self.own_public);
            let mut changed = p.next_switch != next_switch || p.own != own;
            p.next_switch = next_switch;
            p.own = own;
            for (key, secret) in news {
                if p.psks.get(&key) == secret.as_ref() {
                    continue;
                }
                let psks = Arc::make_mut(&mut p.psks);
                match secret {
                    Some(s) => psks.insert(key, s),
                    None => psks.remove(&key),
                };
                changed = true;
            }
            changed
        });
        if self.save_due() == Some(Duration::ZERO) {
            self.save();
        }
    }

    /// How long until the PSKs kept are written, if they differ from the file.
    pub(super) fn save_due(&self) -> Option<Duration> {
        if !self.unsaved {
            return None;
        }
        let every = (SAVE_EVERY_PAIR
            .saturating_mul(u32::try_from(self.kept.len()).unwrap_or(u32::MAX)))
        .min(SAVE_EVERY_MAX);
        Some(
            self.stored_at
                .map_or(Duration::ZERO, |at| every.saturating_sub(at.elapsed())),
        )
    }

    pub(super) fn save(&mut self) {
        if !std::mem::take(&mut self.unsaved) {
            return;
        }
        if let Err(e) = self.saved.store(&self.own_public, &self.kept) {
            warn!(path = %self.saved.path().display(), error = %e, "post-quantum PSKs not saved: after a restart these pairs fall back to classical until a round");
        }
        self.stored_at = Some(std::time::Instant::now());
    }
}

/// A PSK in force as the plan takes it, with the one it replaced.
pub(super) fn secret(installed: &Installed, previous: Option<&Installed>) -> PairSecret {
    PairSecret {
        psk: installed.psk.clone(),
        slot: installed.slot(),
        since: SystemTime::UNIX_EPOCH + Duration::from_millis(installed.at_ms),
        previous: previous.map(|p| (p.psk.clone(), p.slot())),
    }
}
