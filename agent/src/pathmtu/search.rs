//! Which probe sizes to send, and what their answers say: packetization-layer path MTU
//! discovery (RFC 8899 style) over padded probes that the peer acknowledges. A round
//! sends its sizes at once; the largest acknowledged is the path's MTU as far as that
//! round can tell, and the next round searches between it and the smallest size lost
//! above it, until the two are `RESOLUTION` apart.

/// The smallest path MTU searched: IPv6's minimum, and below any real underlay.
pub const FLOOR: u16 = 1280;
/// Searching stops once the largest size acknowledged and the smallest lost are this
/// close.
pub const RESOLUTION: u16 = 4;
/// The most sizes one round sends.
const PER_ROUND: usize = 8;
/// MTUs paths commonly have (Ethernet, PPPoE, VPNs, cloud networks), tried first.
const PLATEAUS: [u16; 10] = [1500, 1492, 1480, 1460, 1450, 1440, 1420, 1400, 1380, 1350];

/// The first round's sizes for a path no wider than `max` (this node's own interface):
/// `max` itself, the plateaus below it, and `FLOOR`; largest first.
pub fn first_round(max: u16) -> Vec<u16> {
    let mut sizes = vec![max.max(FLOOR)];
    sizes.extend(PLATEAUS.iter().copied().filter(|p| *p < max && *p > FLOOR));
    sizes.push(FLOOR);
    sizes.dedup();
    sizes
}

/// What the rounds so far established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds {
    /// The largest size acknowledged.
    pub acked: u16,
    /// Each loss above `acked`: the size, and the round (from 0) it was lost in.
    losses: Vec<(u16, u8)>,
    /// Rounds taken so far.
    rounds: u8,
}

impl Bounds {
    /// The smallest size lost above the largest acknowledged, if any was.
    pub fn lost(&self) -> Option<u16> {
        self.losses.iter().map(|(size, _)| *size).min()
    }

    /// Whether the losses above `acked` come from two rounds at least. One round's losses
    /// alone may be probes dropped on the way (a burst into a full buffer, a peer busy
    /// past the round's wait), which would read as a narrower path than there is.
    fn confirmed(&self) -> bool {
        let mut rounds = self.losses.iter().map(|(_, round)| *round);
        rounds
            .next()
            .is_some_and(|first| rounds.any(|r| r != first))
    }
}

/// The bounds after a round that sent `sent` and had `acked` of them acknowledged;
/// `None` if nothing was ever acknowledged (the peer does not answer). A size lost in an
/// earlier round and acknowledged now was a loss on the way, not the path: it no longer
/// bounds the search.
pub fn update(before: Option<Bounds>, sent: &[u16], acked: &[u16]) -> Option<Bounds> {
    let best = acked.iter().copied().max();
    let acked_now = match (&before, best) {
        (Some(b), Some(a)) => b.acked.max(a),
        (Some(b), None) => b.acked,
        (None, Some(a)) => a,
        (None, None) => return None,
    };
    let (mut losses, round) = before.map_or((Vec::new(), 0), |b| (b.losses, b.rounds));
    losses.retain(|(size, _)| *size > acked_now);
    losses.extend(
        sent.iter()
            .filter(|s| **s > acked_now && !acked.contains(s))
            .map(|s| (*s, round)),
    );
    Some(Bounds {
        acked: acked_now,
        losses,
        rounds: round.saturating_add(1),
    })
}

/// The next round's sizes, evenly between the bounds, and the lost sizes again until a
/// second round has seen a loss above the largest acknowledged; empty when the search is
/// done.
pub fn next_round(bounds: &Bounds) -> Vec<u16> {
    let Some(lost) = bounds.lost() else {
        return Vec::new();
    };
    let gap = lost.saturating_sub(bounds.acked);
    let mut sizes: Vec<u16> = if gap > RESOLUTION {
        let steps = (usize::from(gap / RESOLUTION)).min(PER_ROUND + 1);
        (1..steps)
            .map(|i| bounds.acked + (u32::from(gap) * i as u32 / steps as u32) as u16)
            .filter(|s| *s > bounds.acked && *s < lost)
            .collect()
    } else {
        Vec::new()
    };
    if !bounds.confirmed() {
        sizes.extend(bounds.losses.iter().map(|(size, _)| *size));
    }
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the whole search against a path of `mtu` (every probe up to it answered).
    fn search(max: u16, mtu: u16) -> (Option<u16>, usize) {
        let mut sizes = first_round(max);
        let mut bounds = None;
        let mut rounds = 0;
        while !sizes.is_empty() {
            rounds += 1;
            let acked: Vec<u16> = sizes.iter().copied().filter(|s| *s <= mtu).collect();
            bounds = update(bounds, &sizes, &acked);
            let Some(b) = &bounds else { break };
            sizes = next_round(b);
        }
        (bounds.map(|b| b.acked), rounds)
    }

    #[test]
    fn the_search_finds_the_path_mtu_within_the_resolution_in_few_rounds() {
        for mtu in [1280, 1300, 1333, 1399, 1400, 1401, 1420, 1450, 1479, 1500] {
            let (found, rounds) = search(1500, mtu);
            let found = found.unwrap();
            assert!(
                found <= mtu && mtu - found < RESOLUTION,
                "{mtu}: found {found}"
            );
            assert!(rounds <= 4, "{mtu}: {rounds} rounds");
        }
        assert_eq!(
            search(1500, 1200).0,
            None,
            "a path below the floor answers nothing"
        );
        assert_eq!(
            search(1400, 1500).0,
            Some(1400),
            "never above this node's own MTU"
        );
        assert_eq!(search(9000, 9000).0, Some(9000));
    }

    #[test]
    fn a_lost_probe_below_an_acknowledged_one_does_not_lower_the_result() {
        let b = update(None, &[1500, 1400, 1280], &[1400]).unwrap();
        assert_eq!((b.acked, b.lost()), (1400, Some(1500)));
        let b = update(Some(b), &[1450, 1420], &[]).unwrap();
        assert_eq!((b.acked, b.lost()), (1400, Some(1420)));
    }

    /// Runs the search against a path of `mtu` that drops, in the first round only, the
    /// sizes in `dropped` (acknowledgements late past the round's wait read the same).
    fn search_with_loss(max: u16, mtu: u16, dropped: &[u16]) -> (Option<u16>, usize) {
        let mut sizes = first_round(max);
        let mut bounds = None;
        let mut rounds = 0;
        while !sizes.is_empty() {
            rounds += 1;
            let acked: Vec<u16> = sizes
                .iter()
                .copied()
                .filter(|s| *s <= mtu && !(rounds == 1 && dropped.contains(s)))
                .collect();
            bounds = update(bounds, &sizes, &acked);
            let Some(b) = &bounds else { break };
            sizes = next_round(b);
        }
        (bounds.map(|b| b.acked), rounds)
    }

    #[test]
    fn probes_lost_on_the_way_in_one_round_never_read_as_a_narrower_path() {
        // The largest probe alone, the largest few, and a burst in the middle.
        for dropped in [&[1500][..], &[1500, 1492, 1480], &[1460, 1450, 1440]] {
            let (found, rounds) = search_with_loss(1500, 1500, dropped);
            assert_eq!(found, Some(1500), "{dropped:?} dropped once");
            assert!(rounds <= 2, "{dropped:?}: {rounds} rounds");
        }
        // A narrow path with a loss on the way still finds its MTU.
        let (found, _) = search_with_loss(1500, 1410, &[1400]);
        let found = found.unwrap();
        assert!(found <= 1410 && 1410 - found < RESOLUTION, "found {found}");
    }

    #[test]
    fn a_narrow_path_is_believed_once_two_rounds_lost_above_it() {
        let b = update(None, &[1500, 1492, 1400], &[1400]).unwrap();
        let sizes = next_round(&b);
        assert!(sizes.contains(&1492), "lost once: sent again: {sizes:?}");
        let b = update(Some(b), &sizes, &[1404, 1408, 1412]).unwrap();
        assert_eq!(b.acked, 1412);
        assert!(b.confirmed(), "{b:?}");
    }
}
