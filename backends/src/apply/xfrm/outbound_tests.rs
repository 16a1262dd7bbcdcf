//! One outbound state per pair: the kernel picks among a pair's outbound states by an add
//! time kept in whole seconds, so one the plan left goes as soon as its successor stands,
//! not after the grace inbound states get; it stays while its successor is refused; a
//! pair that left the plan retires its outbound state after the grace.

use std::time::Duration;

use super::pq_tests::with_pq;
use super::tests::{book, installed_once, ip, node, spec, Kernel};
use super::Xfrm;
use crate::plan::ipsec::IF_ID;

const LONG: Duration = Duration::from_secs(3600);

/// weft's states from `from` to `to`, by SPI.
fn spis(k: &mut Kernel, from: u32, to: u32) -> Vec<u32> {
    let mut out: Vec<u32> = k
        .xfrm()
        .states(IF_ID)
        .unwrap()
        .into_iter()
        .filter(|s| s.spec.src == ip(from) && s.spec.dst == ip(to))
        .map(|s| s.spec.spi)
        .collect();
    out.sort_unstable();
    out
}

#[test]
fn a_superseded_outbound_state_goes_in_the_pass_its_successor_stands() {
    let (a, b) = (node(1), node(2));
    let mut k = Kernel::with_grace(book(None, a.epoch), LONG);
    let first = with_pq(&a, &b, 1, 7);
    k.pass(&first, &a.key);
    let next = with_pq(&a, &b, 2, 8);
    let (_, changes) = k.pass(&next, &a.key);
    assert_eq!(
        spis(&mut k, 1, 2),
        vec![next.peers[0].outbound.spi],
        "only the planned outbound state: {changes:#?}"
    );
    assert!(
        changes
            .iter()
            .any(|c| c.contains("the pair's planned outbound state stands")),
        "{changes:#?}"
    );
    // Inbound states the plan left keep receiving for the grace.
    let mut inbound = vec![first.peers[0].inbound[0].spi, next.peers[0].inbound[0].spi];
    inbound.sort_unstable();
    assert_eq!(spis(&mut k, 2, 1), inbound);
    installed_once(k.xfrm());
}

#[test]
fn an_outbound_state_stays_while_its_successor_is_refused() {
    let (a, b) = (node(1), node(2));
    // No grace at all: only the refusal keeps the old outbound state.
    let mut k = Kernel::new(book(None, a.epoch));
    let first = spec(&a, &[&b]);
    k.pass(&first, &a.key);
    let next = with_pq(&a, &b, 1, 7);
    let blocked = next.peers[0].outbound.spi;
    // The squatter: a state at the successor's place, under another interface id.
    let mut other = Kernel::new(book(None, a.epoch));
    other.pass(&next, &a.key);
    let mut squatter = (other.xfrm().states.iter())
        .find(|s| s.spec.spi == blocked)
        .cloned()
        .unwrap();
    squatter.spec.if_id = IF_ID + 1;
    k.xfrm().states.push(squatter);
    for round in 0..2 {
        let (outcome, changes, errors) = k.pass_with_errors(&next, &a.key);
        assert!(outcome.lost.is_empty(), "{:?}", outcome.lost);
        assert_eq!(errors.len(), 1, "round {round}: {errors:?}");
        assert_eq!(
            spis(&mut k, 1, 2),
            vec![first.peers[0].outbound.spi],
            "round {round}: the pair's only way out stays: {changes:#?}"
        );
    }
    k.xfrm().states.retain(|s| s.spec.if_id == IF_ID);
    k.pass(&next, &a.key);
    assert_eq!(spis(&mut k, 1, 2), vec![blocked]);
    installed_once(k.xfrm());
}

#[test]
fn a_pair_that_left_the_plan_retires_its_outbound_state_after_the_grace() {
    let (a, b, c) = (node(1), node(2), node(3));
    let mut k = Kernel::with_grace(book(None, a.epoch), LONG);
    k.pass(&spec(&a, &[&b, &c]), &a.key);
    let (_, changes) = k.pass(&spec(&a, &[&b]), &a.key);
    assert_eq!(
        spis(&mut k, 1, 3).len(),
        1,
        "kept for the grace: {changes:#?}"
    );
    let mut k = Kernel::new(book(None, a.epoch));
    k.pass(&spec(&a, &[&b, &c]), &a.key);
    k.pass(&spec(&a, &[&b]), &a.key);
    assert!(spis(&mut k, 1, 3).is_empty());
    assert_eq!(spis(&mut k, 1, 2).len(), 1);
}
