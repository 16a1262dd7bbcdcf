//! The ipsec backend's share of `Backend.PostQuantum`: a pair's ESP keys take the PSK of its
//! last post-quantum round as part of their salt, so recorded ESP traffic stays secret
//! unless ML-KEM falls too.
//!
//! A new PSK changes the pair's keys, so its states take new SPIs: the PSK's slot (1 or 2,
//! alternating; classical is 0) is part of the SPI's generation byte. From the moment a
//! PSK takes over, a node receives on the states of both (the one it replaced for
//! `SETTLE`), and sends with the new one from `CONFIRM_GRACE` after that moment. The two
//! nodes take the PSK within the commit's one-way delay of each other, so each has received
//! on the new states for about that long before the other sends on them: neither loses a
//! packet to the other being a moment late. By the clock alone, unlike an epoch (whose
//! peers learn of it through the registry, seconds apart, and send on evidence): a choice
//! that went by evidence could go back to the old states when the evidence is read afresh,
//! and the old outbound key, once removed, is never installed again.

use std::time::{Duration, SystemTime};

use crate::model::{EspPq, PairSecret};

/// How long after a new PSK took over the states of the one it replaced still receive.
pub const SETTLE: Duration = Duration::from_secs(10);

/// The PSKs a pair's states are keyed with at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Slots {
    /// In force; `None`: the pair is classical.
    current: Option<EspPq>,
    /// While the one replaced still receives: `Some(None)` for classical.
    previous: Option<Option<EspPq>>,
    since: SystemTime,
}

impl Slots {
    /// The pair's slots at `now`, from its secret (`None`: classical).
    pub(super) fn new(secret: Option<&PairSecret>, now: SystemTime) -> Slots {
        let Some(s) = secret else {
            return Slots {
                current: None,
                previous: None,
                since: SystemTime::UNIX_EPOCH,
            };
        };
        let current = EspPq {
            slot: s.slot,
            psk: s.psk.clone(),
        };
        let previous = s.previous.as_ref().map(|(psk, slot)| EspPq {
            slot: *slot,
            psk: psk.clone(),
        });
        // Two PSKs in a row never share a slot; one that did would share SPIs too.
        let settling =
            now < s.since + SETTLE && previous.as_ref().is_none_or(|p| p.slot != current.slot);
        Slots {
            current: Some(current),
            previous: settling.then_some(previous),
            since: s.since,
        }
    }

    /// What the states this node receives on are keyed with: the PSK in force first.
    pub(super) fn receiving(&self) -> impl Iterator<Item = &Option<EspPq>> {
        std::iter::once(&self.current).chain(self.previous.as_ref())
    }

    /// What this node sends with at `now` (see the module), and the moment that changes,
    /// if one is ahead.
    pub(super) fn sending(&self, now: SystemTime) -> (Option<EspPq>, Option<SystemTime>) {
        let Some(previous) = &self.previous else {
            return (self.current.clone(), None);
        };
        let until = self.since + super::ipsec::CONFIRM_GRACE;
        if now >= until {
            (self.current.clone(), Some(self.since + SETTLE))
        } else {
            (previous.clone(), Some(until))
        }
    }
}

/// The slot of a state's key: 0 classical, else its PSK's.
pub(super) fn slot(pq: &Option<EspPq>) -> u8 {
    pq.as_ref().map_or(0, |p| p.slot)
}
