//! The exchange between two nodes' state machines over a simulated network: what arrives,
//! what is lost, replayed, reflected or forged, and what each clock reads.

use super::*;
use crate::{PresharedKey, PrivateKey};

pub(super) struct Side {
    pub(super) own: Own,
    pub(super) ex: Exchange,
    /// Added to the simulation's clock: this node's clock error.
    pub(super) skew: i64,
}

impl Side {
    pub(super) fn now(&self, t: u64) -> u64 {
        t.saturating_add_signed(self.skew)
    }
    pub(super) fn psk(&mut self, t: u64) -> Option<Installed> {
        let now = self.now(t);
        self.ex.psk(now).cloned()
    }
}

pub(super) fn own() -> Own {
    Own {
        key: PrivateKey::generate().unwrap(),
        kem: KemKeyPair::generate().unwrap(),
        previous_kem: None,
    }
}

pub(super) const T0: u64 = 1_800_000_000_000;

/// (leader, follower), each with the other's keys.
pub(super) fn nodes(timing: Timing) -> (Side, Side) {
    let (mut a, mut b) = (own(), own());
    if a.key.public_key() > b.key.public_key() {
        std::mem::swap(&mut a, &mut b);
    }
    let ex_a = Exchange::new(&a, b.key.public_key(), b.kem.encaps_key(), timing, T0).unwrap();
    let ex_b = Exchange::new(&b, a.key.public_key(), a.kem.encaps_key(), timing, T0).unwrap();
    assert!(ex_a.leads() && !ex_b.leads());
    (
        Side {
            own: a,
            ex: ex_a,
            skew: 0,
        },
        Side {
            own: b,
            ex: ex_b,
            skew: 0,
        },
    )
}

/// A datagram's kind (1 init, 2 reply, 3 commit, 4 ack).
pub(super) fn kind(d: &[u8]) -> u8 {
    d[4]
}

/// What went over the wire, and what was refused where.
#[derive(Default)]
pub(super) struct Wire {
    pub(super) sent: Vec<Vec<u8>>,
    pub(super) refused: Vec<Refused>,
}

/// Runs both sides from `from` to `to` (ms after T0) in steps of 10 ms; `lose` decides
/// per datagram whether the network drops it. Returns what was sent and refused.
pub(super) fn run(
    lead: &mut Side,
    follow: &mut Side,
    from: u64,
    to: u64,
    lose: &mut dyn FnMut(&[u8]) -> bool,
) -> Wire {
    let mut wire = Wire::default();
    let mut t = T0 + from;
    while t <= T0 + to {
        let mut to_follow: Vec<Vec<u8>> = lead.ex.poll(lead.now(t)).unwrap().send;
        let mut to_lead: Vec<Vec<u8>> = follow.ex.poll(follow.now(t)).unwrap().send;
        // Deliver until both are quiet (answers within the same step).
        while !to_follow.is_empty() || !to_lead.is_empty() {
            for d in std::mem::take(&mut to_follow) {
                wire.sent.push(d.clone());
                if lose(&d) {
                    continue;
                }
                match follow.ex.receive(&follow.own, &d, follow.now(t)) {
                    Ok(out) => to_lead.extend(out),
                    Err(e) => wire.refused.push(e),
                }
            }
            for d in std::mem::take(&mut to_lead) {
                wire.sent.push(d.clone());
                if lose(&d) {
                    continue;
                }
                match lead.ex.receive(&lead.own, &d, lead.now(t)) {
                    Ok(out) => to_follow.extend(out),
                    Err(e) => wire.refused.push(e),
                }
            }
            to_follow.extend(lead.ex.poll(lead.now(t)).unwrap().send);
        }
        t += 10;
    }
    wire
}

pub(super) fn never(_: &[u8]) -> bool {
    false
}

#[test]
fn a_round_gives_both_nodes_one_psk_from_one_moment() {
    let (mut a, mut b) = nodes(Timing::default());
    assert!(a.psk(T0).is_none() && b.psk(T0).is_none());
    let wire = run(&mut a, &mut b, 0, 2_000, &mut never);
    assert!(wire.refused.is_empty(), "{:?}", wire.refused);
    let kinds: Vec<u8> = wire.sent.iter().map(|d| kind(d)).collect();
    assert_eq!(kinds, [1, 2, 3, 4], "one message of each kind");
    let (pa, pb) = (a.psk(T0 + 2_000).unwrap(), b.psk(T0 + 2_000).unwrap());
    assert_eq!(pa, pb);
    assert_eq!(pa.at_ms, T0 + Timing::default().switch_delay);
    // Before the moment neither has it; from it both.
    let (mut a2, mut b2) = nodes(Timing::default());
    run(&mut a2, &mut b2, 0, 500, &mut never);
    assert!(a2.psk(T0 + 999).is_none() && b2.psk(T0 + 999).is_none());
    assert!(a2.psk(T0 + 1_000).is_some() && b2.psk(T0 + 1_000).is_some());
}

#[test]
fn each_kind_lost_once_still_ends_in_one_psk() {
    for lost_kind in 1..=4u8 {
        let (mut a, mut b) = nodes(Timing::default());
        let mut dropped = false;
        let mut lose = |d: &[u8]| {
            let hit = !dropped && kind(d) == lost_kind;
            dropped |= hit;
            hit
        };
        run(&mut a, &mut b, 0, 6_000, &mut lose);
        assert!(dropped);
        let (pa, pb) = (a.psk(T0 + 6_000), b.psk(T0 + 6_000));
        assert!(pa.is_some(), "kind {lost_kind} lost");
        assert_eq!(pa, pb, "kind {lost_kind} lost");
    }
}

#[test]
fn every_period_a_new_round_changes_the_psk_on_both_at_once() {
    let timing = Timing {
        period: 10_000,
        ..Timing::default()
    };
    let (mut a, mut b) = nodes(timing);
    let mut seen: Vec<PresharedKey> = Vec::new();
    for step in 0..35 {
        let t = step * 1_000;
        run(&mut a, &mut b, t, t + 990, &mut never);
        let (pa, pb) = (a.psk(T0 + t + 995), b.psk(T0 + t + 995));
        assert_eq!(pa, pb, "at {t} ms");
        if let Some(p) = pa {
            if !seen.contains(&p.psk) {
                seen.push(p.psk);
            }
        }
    }
    assert_eq!(seen.len(), 4, "rounds at 0, 10, 20 and 30 s");
}

#[test]
fn psks_in_a_row_have_other_slots_and_both_nodes_know_the_one_replaced() {
    let timing = Timing {
        period: 10_000,
        ..Timing::default()
    };
    // Rounds every 10 s of an even clock would all be even: the leader makes them alternate.
    let (mut a, mut b) = nodes(timing);
    let mut in_force: Vec<Installed> = Vec::new();
    for step in 0..45 {
        let t = step * 1_000;
        run(&mut a, &mut b, t, t + 990, &mut never);
        let (pa, pb) = (a.psk(T0 + t + 995), b.psk(T0 + t + 995));
        assert_eq!(pa, pb, "at {t} ms");
        assert_eq!(a.ex.previous(), b.ex.previous(), "at {t} ms");
        let Some(p) = pa else { continue };
        if in_force.last() != Some(&p) {
            assert_eq!(a.ex.previous(), in_force.last(), "at {t} ms");
            in_force.push(p);
        }
    }
    assert_eq!(in_force.len(), 5, "rounds at 0, 10, 20, 30 and 40 s");
    for w in in_force.windows(2) {
        assert_ne!(
            w[0].slot(),
            w[1].slot(),
            "rounds {} and {}",
            w[0].round,
            w[1].round
        );
    }
    assert!(in_force.iter().all(|i| [1, 2].contains(&i.slot())));
    // A fall-back forgets both: the pair is classical, with nothing to receive on but that.
    a.ex.fall_back(T0 + 50_000);
    assert_eq!(a.ex.previous(), None);
}

#[test]
fn replays_reflections_and_strangers_change_nothing() {
    let (mut a, mut b) = nodes(Timing {
        period: 10_000,
        ..Timing::default()
    });
    let first = run(&mut a, &mut b, 0, 2_000, &mut never);
    run(&mut a, &mut b, 2_010, 12_000, &mut never);
    let (pa, pb) = (a.psk(T0 + 12_000), b.psk(T0 + 12_000));
    assert_eq!(pa, pb);
    let round2 = pa.unwrap();
    let now = T0 + 12_000;
    for d in &first.sent {
        let (to_follower, at_follower) = match kind(d) {
            1 | 3 => (true, b.ex.receive(&b.own, d, now)),
            _ => (false, a.ex.receive(&a.own, d, now)),
        };
        let err = at_follower.unwrap_err();
        assert!(
            matches!(err, Refused::Stale { .. } | Refused::NoRound { .. }),
            "replayed kind {} to the {}: {err}",
            kind(d),
            if to_follower { "follower" } else { "leader" }
        );
    }
    // The leader's own message sent back to it.
    let init = &first.sent[0];
    assert_eq!(
        a.ex.receive(&a.own, init, now).unwrap_err(),
        Refused::NotForUs
    );
    // A third node that knows both public keys.
    let stranger = own();
    let mut forged = Exchange::new(
        &stranger,
        b.own.key.public_key(),
        b.own.kem.encaps_key(),
        Timing::default(),
        now,
    )
    .unwrap();
    if forged.leads() {
        let d = forged.poll(now).unwrap().send.remove(0);
        assert_eq!(
            b.ex.receive(&b.own, &d, now).unwrap_err(),
            Refused::Message(MessageError::Tag)
        );
    }
    assert_eq!(a.psk(now + 100), Some(round2.clone()));
    assert_eq!(b.psk(now + 100), Some(round2));
}

#[test]
fn a_round_to_a_key_the_follower_no_longer_holds_keeps_the_last_good_psk() {
    let timing = Timing {
        period: 10_000,
        ..Timing::default()
    };
    let (mut a, mut b) = nodes(timing);
    run(&mut a, &mut b, 0, 2_000, &mut never);
    let good = b.psk(T0 + 2_000).unwrap();
    // The follower rotates its ML-KEM key and keeps nothing of the old one; the leader
    // has not seen the new key yet.
    b.own.kem = KemKeyPair::generate().unwrap();
    let wire = run(&mut a, &mut b, 2_010, 15_000, &mut never);
    assert!(wire.refused.contains(&Refused::OldKey));
    assert_eq!(a.psk(T0 + 15_000), Some(good.clone()));
    assert_eq!(b.psk(T0 + 15_000), Some(good.clone()));
    // Once the leader has the new key, the next round completes at once.
    a.ex.peer_ek_changed(b.own.kem.encaps_key(), T0 + 15_000);
    run(&mut a, &mut b, 15_000, 17_000, &mut never);
    let (pa, pb) = (a.psk(T0 + 17_000), b.psk(T0 + 17_000));
    assert_eq!(pa, pb);
    assert_ne!(pa, Some(good));
}

#[test]
fn a_round_begun_under_the_previous_key_still_completes() {
    let (mut a, mut b) = nodes(Timing::default());
    let old = std::mem::replace(&mut b.own.kem, KemKeyPair::generate().unwrap());
    b.own.previous_kem = Some(old);
    let wire = run(&mut a, &mut b, 0, 2_000, &mut never);
    assert!(wire.refused.is_empty(), "{:?}", wire.refused);
    assert!(a.psk(T0 + 2_000).is_some());
    assert_eq!(a.psk(T0 + 2_000), b.psk(T0 + 2_000));
}

#[test]
fn a_leader_that_rotated_its_key_replaces_a_secret_resting_on_the_old_one_soon() {
    let (mut a, mut b) = nodes(Timing::default());
    run(&mut a, &mut b, 0, 2_000, &mut never);
    let first = a.psk(T0 + 2_000).unwrap();
    // The leader rotates its ML-KEM key; the follower has not seen the new one published.
    let new_kem = KemKeyPair::generate().unwrap();
    let new_ek = new_kem.encaps_key();
    a.own.previous_kem = Some(std::mem::replace(&mut a.own.kem, new_kem));
    a.ex.own_kem_changed(T0 + 3_000);
    let then = first.at_ms - T0 + MIN_GAP + 1_500;
    run(&mut a, &mut b, 3_000, then, &mut never);
    let stale = a.psk(T0 + then).unwrap();
    assert_ne!(stale.psk, first.psk);
    // The follower sees the new key; the next round comes soon (once the gap after the
    // stale one's takeover has passed), not a period later, and rests on the new key; the
    // one after it a period later.
    b.ex.peer_ek_changed(new_ek, T0 + then);
    let soon = stale.at_ms - T0 + MIN_GAP + 1_500;
    run(&mut a, &mut b, then, soon, &mut never);
    let fresh = a.psk(T0 + soon).unwrap();
    assert_ne!(fresh.psk, stale.psk, "a round soon after the stale one");
    assert!(fresh.at_ms >= stale.at_ms + MIN_GAP, "{fresh:?}");
    assert_eq!(b.psk(T0 + soon), Some(fresh.clone()));
    run(&mut a, &mut b, soon, 60_000, &mut never);
    assert_eq!(a.psk(T0 + 60_000), Some(fresh), "then the period");
}

#[test]
fn a_leader_whose_clock_is_far_off_is_refused_and_nothing_changes() {
    let (mut a, mut b) = nodes(Timing::default());
    a.skew = 10 * 60 * 1_000;
    let wire = run(&mut a, &mut b, 0, 3_000, &mut never);
    assert!(matches!(
        wire.refused.first(),
        Some(Refused::NotFresh {
            skew_ms: 600_000,
            ..
        })
    ));
    assert!(a.psk(T0 + 3_000).is_none() && b.psk(T0 + 3_000).is_none());
    // Within the window (a minute apart) the round completes, and both switch together.
    let (mut a, mut b) = nodes(Timing::default());
    a.skew = 60_000;
    run(&mut a, &mut b, 0, 990, &mut never);
    assert!(a.psk(T0 + 990).is_none() && b.psk(T0 + 990).is_none());
    assert!(a.psk(T0 + 1_000).is_some());
    assert_eq!(
        a.psk(T0 + 1_000).map(|p| p.psk),
        b.psk(T0 + 1_000).map(|p| p.psk)
    );
}

#[test]
fn after_falling_back_a_round_brings_the_protection_back() {
    let (mut a, mut b) = nodes(Timing::default());
    run(&mut a, &mut b, 0, 2_000, &mut never);
    let before = a.psk(T0 + 2_000).unwrap();
    // Only the follower sees the pair fail; its notice takes the leader along.
    let notice = b.ex.fall_back(T0 + 2_000);
    assert!(b.psk(T0 + 2_000).is_none() && a.psk(T0 + 2_000).is_some());
    assert_eq!(a.ex.receive(&a.own, &notice, T0 + 2_010), Ok(Vec::new()));
    assert!(a.psk(T0 + 2_010).is_none());
    run(&mut a, &mut b, 2_010, 4_500, &mut never);
    let after = a.psk(T0 + 4_500).unwrap();
    assert_eq!(Some(after.clone()), b.psk(T0 + 4_500));
    assert_ne!(after.psk, before.psk);
    // The same notice again, or one tampered with, costs the new PSK nothing.
    assert!(matches!(
        a.ex.receive(&a.own, &notice, T0 + 4_500),
        Err(Refused::Stale { .. })
    ));
    let mut forged = b.ex.fall_back(T0 + 4_600);
    b.ex.restore(Some(after.clone()), None);
    let last = forged.len() - 1;
    forged[last] ^= 1;
    assert!(matches!(
        a.ex.receive(&a.own, &forged, T0 + 4_600),
        Err(Refused::Message(_))
    ));
    assert_eq!(a.psk(T0 + 4_600), Some(after.clone()));
}

#[test]
fn a_classical_notice_from_long_ago_is_refused() {
    let (mut a, mut b) = nodes(Timing::default());
    run(&mut a, &mut b, 0, 2_000, &mut never);
    let notice = b.ex.fall_back(T0 + 2_000);
    let late = T0 + 2_000 + Timing::default().freshness + 1;
    assert!(matches!(
        a.ex.receive(&a.own, &notice, late),
        Err(Refused::NotFresh { .. })
    ));
    assert!(a.psk(late).is_some(), "the leader keeps its PSK");
}
