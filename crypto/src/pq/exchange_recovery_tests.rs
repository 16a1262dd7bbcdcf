//! The exchange after a restart or on a lossy path: a restored PSK stays until the next
//! period, a restart between commit and moment still switches with the peer, an unanswered
//! init is repeated less and less often, a commit is sent until it is acknowledged, and a
//! key change right after a takeover waits for the gap.

use super::exchange_tests::{kind, never, nodes, run, Side, Wire, T0};
use super::*;

#[test]
fn a_restored_psk_stays_in_force_until_the_next_period() {
    let timing = Timing {
        period: 10_000,
        ..Timing::default()
    };
    let (mut a, mut b) = nodes(timing);
    run(&mut a, &mut b, 0, 2_000, &mut never);
    let saved = a.psk(T0 + 2_000).unwrap();
    // Both agents restart with what they saved.
    let mut a2 = Exchange::new(
        &a.own,
        b.own.key.public_key(),
        b.own.kem.encaps_key(),
        timing,
        T0 + 3_000,
    )
    .unwrap();
    let mut b2 = Exchange::new(
        &b.own,
        a.own.key.public_key(),
        a.own.kem.encaps_key(),
        timing,
        T0 + 3_000,
    )
    .unwrap();
    a2.restore(Some(saved.clone()), None);
    b2.restore(Some(saved.clone()), None);
    assert_eq!(a2.poll(T0 + 3_000).unwrap().wake_at, saved.round + 10_000);
    let (mut a, mut b) = (Side { ex: a2, ..a }, Side { ex: b2, ..b });
    run(&mut a, &mut b, 3_000, 9_990, &mut never);
    assert_eq!(a.psk(T0 + 9_990), Some(saved.clone()));
    run(&mut a, &mut b, 10_000, 12_000, &mut never);
    assert_ne!(a.psk(T0 + 12_000), Some(saved));
    assert_eq!(a.psk(T0 + 12_000), b.psk(T0 + 12_000));
}

#[test]
fn a_restart_between_commit_and_moment_switches_with_the_peer() {
    let (mut a, mut b) = nodes(Timing::default());
    // The first round: committed on both sides, its moment (the switch delay) not come.
    run(&mut a, &mut b, 0, 100, &mut never);
    let (committed, moment) = match (a.ex.pending(), b.ex.pending()) {
        (Some(x), Some(y)) if x == y => (x.clone(), x.at_ms),
        other => panic!("not committed on both sides: {other:?}"),
    };
    assert!(moment > T0 + 100 && a.psk(T0 + 100).is_none());
    // The leader restarts with what it saved; the follower runs on.
    let mut a2 = Exchange::new(
        &a.own,
        b.own.key.public_key(),
        b.own.kem.encaps_key(),
        Timing::default(),
        T0 + 200,
    )
    .unwrap();
    a2.restore(None, Some(committed.clone()));
    let mut a = Side { ex: a2, ..a };
    let after = moment - T0 + 100;
    let wire = run(&mut a, &mut b, 200, after, &mut never);
    assert!(
        wire.sent.is_empty(),
        "no new round: {} datagrams",
        wire.sent.len()
    );
    assert_eq!(a.psk(T0 + after), Some(committed.clone()));
    assert_eq!(b.psk(T0 + after), Some(committed));
}

#[test]
fn an_unanswered_init_is_repeated_less_and_less_often() {
    let (mut a, mut b) = nodes(Timing::default());
    let wire = run(&mut a, &mut b, 0, 40_000, &mut |_| true);
    let inits = wire.sent.iter().filter(|d| kind(d) == 1).count();
    // 0, 1, 3, 7, 15, 31 s: six in 40 s, not one per step.
    assert_eq!(inits, 6);
    assert!(a.psk(T0 + 40_000).is_none());
}

#[test]
fn a_commit_is_sent_until_it_is_acknowledged() {
    let (mut a, mut b) = nodes(Timing::default());
    let mut acks_lost = 0;
    let first = run(&mut a, &mut b, 0, 20_000, &mut |d| {
        let lost = kind(d) == 4;
        acks_lost += usize::from(lost);
        lost
    });
    let commits = |w: &Wire| w.sent.iter().filter(|d| kind(d) == 3).count();
    // Sent at 0, 1, 3, 7 and 15 s, each acknowledged and each ack lost.
    assert_eq!((commits(&first), acks_lost), (5, 5));
    assert_eq!(a.psk(T0 + 20_000), b.psk(T0 + 20_000), "both switched");
    let rest = run(&mut a, &mut b, 20_010, 60_000, &mut never);
    assert_eq!(commits(&rest), 1, "one more, acknowledged, and no other");
    assert_eq!(a.psk(T0 + 60_000), b.psk(T0 + 60_000));
}

/// PSKs alternate between two slots, so the one after next takes the slot of the one
/// before: a round a key change calls for right after a takeover waits for `min_gap`.
#[test]
fn a_key_change_right_after_a_takeover_waits_for_the_gap() {
    let (mut a, mut b) = nodes(Timing {
        period: 600_000,
        ..Timing::default()
    });
    run(&mut a, &mut b, 0, 1_500, &mut never);
    let first = a.psk(T0 + 1_500).unwrap();
    b.own.kem = KemKeyPair::generate().unwrap();
    a.ex.peer_ek_changed(b.own.kem.encaps_key(), T0 + 1_500);
    let gap_end = first.at_ms - T0 + MIN_GAP;
    let wire = run(&mut a, &mut b, 1_500, gap_end - 10, &mut never);
    assert!(wire.sent.is_empty(), "{} datagrams", wire.sent.len());
    let wire = run(&mut a, &mut b, gap_end, gap_end + 2_000, &mut never);
    assert!(wire.refused.is_empty(), "{:?}", wire.refused);
    let second = a.psk(T0 + gap_end + 2_000).unwrap();
    assert_eq!(Some(&second), b.psk(T0 + gap_end + 2_000).as_ref());
    assert_ne!(second.psk, first.psk);
    assert!(second.at_ms >= first.at_ms + MIN_GAP, "{second:?}");
    assert_ne!(second.slot(), first.slot());
    // A change long after the last takeover begins at once, as before.
    b.own.kem = KemKeyPair::generate().unwrap();
    let later = gap_end + 60_000;
    a.ex.peer_ek_changed(b.own.kem.encaps_key(), T0 + later);
    let wire = run(&mut a, &mut b, later, later, &mut never);
    assert_eq!(wire.sent.len(), 4, "a whole round within the step");
}
