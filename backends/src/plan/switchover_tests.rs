//! Table tests for a peer's announced key in `plan`: staged beside the current key, taking
//! over on its first handshake (an `Observed` input) or at the end of the grace, and the
//! device watch the plan asks for meanwhile.

use std::time::{Duration, SystemTime};

use super::tests::{good_peer, key, local, run_observing, CONF, NOW};
use super::DesiredState;
use crate::model::{KeyMove, Lease, Observed, PeerSpec, SWITCH_GRACE, WATCH_BEFORE};

fn run_observed(peers: Vec<Lease>, observed: &Observed) -> DesiredState {
    run_observing(local(), CONF, peers, false, observed).unwrap()
}

/// Each peer's (key, AllowedIPs) in the plan.
fn peer_keys(state: &DesiredState) -> Vec<(weft_crypto::PublicKey, usize)> {
    state.tunnels[0]
        .peers
        .iter()
        .map(|p| (p.public_key, p.allowed_ips.len()))
        .collect()
}

/// `offset_ms` from the planner's now, in milliseconds since the epoch.
fn at(offset_ms: i64) -> u64 {
    (NOW.as_millis() as i64 + offset_ms) as u64
}

/// The good peer, announcing `public_key` as its next key, switching at `switch_at_ms`.
fn announced(switch_at_ms: u64, public_key: String) -> Lease {
    let mut b = good_peer();
    b.next_key = Some(crate::model::NextKey {
        public_key,
        switch_at_ms,
        generation: 2,
    });
    b
}

/// The device showed the announced key (22) in use.
fn in_use() -> Observed {
    Observed {
        next_keys_in_use: [key(22)].into(),
        ..Observed::default()
    }
}

#[test]
fn an_announced_key_is_staged_then_takes_over_on_its_handshake_or_after_the_grace() {
    let moment = |ms: u64| SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
    let in_use = in_use();
    let none = Observed::default();
    let (staged, switched) = (vec![(key(22), 0), (key(2), 1)], vec![(key(22), 1)]);
    // (switch moment relative to now, what the device showed, expected peers, clock
    // switch, watch window)
    let grace = SWITCH_GRACE.as_millis() as i64;
    type Case<'a> = (
        &'a str,
        i64,
        &'a Observed,
        Vec<(weft_crypto::PublicKey, usize)>,
        bool,
    );
    let cases: Vec<Case> = vec![
        (
            "3 s ahead, not in use: staged beside the old key",
            3_000,
            &none,
            staged.clone(),
            true,
        ),
        (
            "3 s ahead, handshaken: switched at once",
            3_000,
            &in_use,
            switched.clone(),
            false,
        ),
        (
            "at its moment, not in use: still staged (the grace)",
            0,
            &none,
            staged.clone(),
            true,
        ),
        (
            "within the grace, not in use",
            -grace + 1,
            &none,
            staged.clone(),
            true,
        ),
        (
            "at the end of the grace: the clock switches it",
            -grace,
            &none,
            switched.clone(),
            false,
        ),
        ("long past", -60_000, &none, switched.clone(), false),
    ];
    for (what, offset, observed, want, watching) in cases {
        let state = run_observed(vec![announced(at(offset), key(22).to_string())], observed);
        assert_eq!(peer_keys(&state), want, "{what}");
        let switch = moment(at(offset)) + SWITCH_GRACE;
        if watching {
            assert_eq!(state.next_switch, Some(switch), "{what}");
            let w = state.key_watch.as_ref().expect("a watch");
            assert_eq!(
                (&w.keys(), w.from, w.until),
                (&vec![key(22)], moment(at(offset)) - WATCH_BEFORE, switch),
                "{what}"
            );
            // Once the key handshakes, its staged entry takes the current one's
            // AllowedIPs on the device where both are.
            let staged = state.tunnels[0]
                .peers
                .iter()
                .find(|p| p.public_key == key(22))
                .expect("the staged entry");
            let current = state.tunnels[0]
                .peers
                .iter()
                .find(|p| p.public_key == key(2))
                .expect("the current entry");
            assert_eq!(
                w.moves,
                vec![KeyMove {
                    device: state.tunnels[0].device.clone(),
                    next: PeerSpec {
                        public_key: key(22),
                        ..current.clone()
                    },
                    current: key(2),
                    announced: moment(at(offset)),
                }],
                "{what}"
            );
            assert!(staged.allowed_ips.is_empty(), "{what}");
        } else {
            assert_eq!((state.next_switch, state.key_watch), (None, None), "{what}");
        }
    }
}

#[test]
fn an_announced_key_that_is_junk_the_peers_own_or_ours_is_not_staged() {
    let in_use = in_use();
    // An announced key that does not parse is ignored; so is one equal to the peer's
    // current key.
    for junk in ["junk".to_string(), key(2).to_string()] {
        let state = run_observed(vec![announced(at(3_000), junk.clone())], &in_use);
        assert_eq!(peer_keys(&state), vec![(key(2), 1)], "{junk}");
        assert_eq!(state.key_watch, None, "{junk}");
    }
    // One equal to this node's key takes nothing from it: the announcer is left out.
    let state = run_observed(vec![announced(at(3_000), key(1).to_string())], &in_use);
    assert_eq!(peer_keys(&state), vec![]);
    assert_eq!(
        state.left_out[0].reason.to_string(),
        format!(
            "its announced next key {} is node node-a's public key; left out until it announces another",
            key(1)
        )
    );
}

#[test]
fn a_clock_running_an_hour_ahead_waits_for_the_lead_after_seeing_the_announcement() {
    let now = SystemTime::UNIX_EPOCH + NOW;
    let seen = |ago_ms: u64| Observed {
        next_keys_seen: [(key(22), now - Duration::from_millis(ago_ms))].into(),
        ..Observed::default()
    };
    // The rotating node's moment is an hour behind this node's clock.
    let lease = || announced(at(-3_600_000), key(22).to_string());
    // Just seen: staged, switched by the clock only SEEN_LEAD + the grace after seeing it.
    let state = run_observed(vec![lease()], &seen(0));
    assert_eq!(peer_keys(&state), vec![(key(22), 0), (key(2), 1)]);
    let lead = crate::model::SEEN_LEAD;
    assert_eq!(state.next_switch, Some(now + lead + SWITCH_GRACE));
    // Its handshake still switches it at once.
    let mut handshaken = seen(0);
    handshaken.next_keys_in_use = [key(22)].into();
    let state = run_observed(vec![lease()], &handshaken);
    assert_eq!(peer_keys(&state), vec![(key(22), 1)]);
    // Seen long enough ago: the clock switches it.
    let ago = (lead + SWITCH_GRACE).as_millis() as u64;
    let state = run_observed(vec![lease()], &seen(ago));
    assert_eq!(peer_keys(&state), vec![(key(22), 1)]);
}

/// An announcement that reached this node late (its registry's delay) is switched by the
/// clock no sooner than `SEEN_LEAD` after it was seen, but the handshake watch starts
/// before the announced moment: the rotating node switches then, and a slow registry must
/// not delay noticing it.
#[test]
fn a_late_announcement_is_watched_from_the_announced_moment() {
    let now = SystemTime::UNIX_EPOCH + NOW;
    let observed = Observed {
        next_keys_seen: [(key(22), now)].into(),
        ..Observed::default()
    };
    let state = run_observed(vec![announced(at(1_000), key(22).to_string())], &observed);
    assert_eq!(peer_keys(&state), vec![(key(22), 0), (key(2), 1)]);
    let until = now + crate::model::SEEN_LEAD + SWITCH_GRACE;
    assert_eq!(state.next_switch, Some(until));
    let w = state.key_watch.expect("a watch");
    assert_eq!(
        (w.keys(), w.from, w.until),
        (
            vec![key(22)],
            SystemTime::UNIX_EPOCH + Duration::from_millis(at(1_000)) - WATCH_BEFORE,
            until
        )
    );
}

#[test]
fn a_key_taken_over_by_the_clock_alone_is_named_for_a_handshake_at_once() {
    let grace = SWITCH_GRACE.as_millis() as i64;
    let peer = |offset_ms: i64| vec![announced(at(offset_ms), key(22).to_base64())];
    let none = Observed::default();
    let on_clock = run_observed(peer(-grace - 1), &none);
    assert_eq!(on_clock.switched_on_clock, [key(22)]);
    // Switched on its handshake: the session is there already.
    assert!(run_observed(peer(-grace - 1), &in_use())
        .switched_on_clock
        .is_empty());
    assert!(run_observed(peer(-100), &in_use())
        .switched_on_clock
        .is_empty());
    // Staged: nothing switched.
    assert!(run_observed(peer(1_000), &none)
        .switched_on_clock
        .is_empty());
}
