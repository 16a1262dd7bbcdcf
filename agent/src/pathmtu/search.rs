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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The largest size acknowledged.
    pub acked: u16,
    /// The smallest size lost above it, if any was.
    pub lost: Option<u16>,
}

/// The bounds after a round that sent `sent` and had `acked` of them acknowledged;
/// `None` if nothing was ever acknowledged (the peer does not answer).
pub fn update(before: Option<Bounds>, sent: &[u16], acked: &[u16]) -> Option<Bounds> {
    let best = acked.iter().copied().max();
    let acked_now = match (before, best) {
        (Some(b), Some(a)) => b.acked.max(a),
        (Some(b), None) => b.acked,
        (None, Some(a)) => a,
        (None, None) => return None,
    };
    let lost_now = sent
        .iter()
        .copied()
        .filter(|s| *s > acked_now && !acked.contains(s));
    let lost = lost_now
        .chain(before.and_then(|b| b.lost).filter(|l| *l > acked_now))
        .min();
    Some(Bounds {
        acked: acked_now,
        lost,
    })
}

/// The next round's sizes, evenly between the bounds; empty when the search is done.
pub fn next_round(bounds: Bounds) -> Vec<u16> {
    let Some(lost) = bounds.lost else {
        return Vec::new();
    };
    let gap = lost.saturating_sub(bounds.acked);
    if gap <= RESOLUTION {
        return Vec::new();
    }
    let steps = (usize::from(gap / RESOLUTION)).min(PER_ROUND + 1);
    (1..steps)
        .map(|i| bounds.acked + (u32::from(gap) * i as u32 / steps as u32) as u16)
        .filter(|s| *s > bounds.acked && *s < lost)
        .collect()
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
            let Some(b) = bounds else { break };
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
        assert_eq!(
            b,
            Bounds {
                acked: 1400,
                lost: Some(1500)
            }
        );
        let b = update(Some(b), &[1450, 1420], &[]).unwrap();
        assert_eq!(
            b,
            Bounds {
                acked: 1400,
                lost: Some(1420)
            }
        );
    }
}
