//! `Backend.PostQuantum` on ipsec: a pair's post-quantum PSK keys its states under SPIs of
//! their own slot; a classical pair keeps the SPIs it always had; a new PSK is received on
//! beside the one it replaces and sent with from the grace's end, mirrored on the peer;
//! without `PostQuantum` a PSK is never used.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use weft_crypto::{PresharedKey, PrivateKey, PublicKey};

use super::ipsec::{generation, spi, CONFIRM_GRACE};
use super::ipsec_pq::SETTLE;
use super::ipsec_tests::{epoch, node};
use super::unencrypted_tests::run_secrets_at;
use crate::model::{IpsecPeer, Observed, PairSecret};

const PQ: &str =
    r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "PostQuantum": true}}"#;
const CLASSICAL: &str =
    r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "PostQuantum": false}}"#;

const T: Duration = Duration::from_secs(1_800_000_000);

fn at(offset: Duration) -> SystemTime {
    SystemTime::UNIX_EPOCH + T + offset
}

fn psk(seed: u8) -> PresharedKey {
    PresharedKey::from_bytes([seed; 32])
}

/// Node `me`'s plan (epoch 1) with the other (epoch 1) at `now`, the pair holding `secret`
/// and `heard` SPIs counted; the peer, the next switch and whether counters are watched.
fn plan(
    conf: &str,
    (me, me_key): (u8, &PrivateKey),
    (other, other_key): (u8, &PrivateKey),
    secret: Option<PairSecret>,
    now: SystemTime,
    heard: &[u32],
) -> (IpsecPeer, Option<SystemTime>, bool) {
    let secrets: BTreeMap<PublicKey, PairSecret> = secret
        .into_iter()
        .map(|s| (other_key.public_key(), s))
        .collect();
    let observed = Observed {
        esp_heard: heard.iter().copied().collect(),
        ..Observed::default()
    };
    let peers = vec![node(other, other_key, 1)];
    let state = run_secrets_at(
        conf,
        node(me, me_key, 1),
        peers,
        &[],
        now,
        &observed,
        &secrets,
    )
    .unwrap();
    let peer = state.ipsec.as_ref().unwrap().peers[0].clone();
    (peer, state.next_switch, state.esp_watch)
}

fn keys() -> (PrivateKey, PrivateKey) {
    (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    )
}

#[test]
fn a_pairs_psk_keys_its_states_under_spis_of_its_own_slot() {
    let (a, b) = keys();
    let net = "10.244.0.0/16".parse().unwrap();
    let sub = |n: u8| format!("10.244.{n}.0/24").parse().unwrap();
    let now = at(Duration::ZERO);
    let (classical, ..) = plan(PQ, (1, &a), (2, &b), None, now, &[]);
    let classical_spi = spi(net, sub(1), generation(&epoch(1), &epoch(1), 0)).unwrap();
    assert_eq!(classical.outbound.spi, classical_spi, "slot 0: as ever");
    assert_eq!(classical.outbound.pq, None);

    let settled = PairSecret::settled(psk(7), 2);
    let (at_1, switch, watching) = plan(PQ, (1, &a), (2, &b), Some(settled.clone()), now, &[]);
    assert_eq!((switch, watching), (None, false));
    assert_eq!(at_1.outbound.pq.as_ref().map(|p| p.slot), Some(2));
    assert_eq!(at_1.outbound.spi, classical_spi + 8);
    assert_eq!(at_1.inbound.len(), 1);
    assert!(at_1.inbound.iter().all(|sa| sa.pq == at_1.outbound.pq));
    // The peer's plan mirrors it.
    let (at_2, ..) = plan(PQ, (2, &b), (1, &a), Some(settled.clone()), now, &[]);
    assert_eq!(
        (at_2.outbound.spi, at_2.spi_in()),
        (at_1.spi_in(), at_1.outbound.spi)
    );
    // Without `PostQuantum` no PSK is used, whatever the rounds gave.
    let (off, ..) = plan(CLASSICAL, (1, &a), (2, &b), Some(settled), now, &[]);
    assert_eq!((off.outbound.spi, off.outbound.pq), (classical_spi, None));
}

#[test]
fn a_new_psk_is_received_on_at_once_and_sent_with_after_the_grace_by_the_clock_alone() {
    let (a, b) = keys();
    let since = at(Duration::ZERO);
    let secret = PairSecret {
        psk: psk(8),
        slot: 2,
        since,
        previous: Some((psk(7), 1)),
    };
    let soon = at(Duration::from_millis(300));
    let (at_1, switch, watching) = plan(PQ, (1, &a), (2, &b), Some(secret.clone()), soon, &[]);
    let slots: Vec<Option<u8>> = at_1
        .inbound
        .iter()
        .map(|sa| sa.pq.as_ref().map(|p| p.slot))
        .collect();
    assert_eq!(slots, [Some(2), Some(1)], "receives on both, the new first");
    assert_ne!(at_1.inbound[0].spi, at_1.inbound[1].spi);
    assert_eq!(at_1.outbound.pq.as_ref().map(|p| p.slot), Some(1));
    assert_eq!((switch, watching), (Some(since + CONFIRM_GRACE), false));

    // Node 2 is in the same place: what it sends with, node 1 receives on.
    let (at_2, ..) = plan(PQ, (2, &b), (1, &a), Some(secret.clone()), soon, &[]);
    assert_eq!(at_2.outbound.spi, at_1.inbound[1].spi);
    // Traffic on any state changes nothing (a choice by evidence could go back to the old
    // key when the evidence is read afresh): the clock does.
    let all: Vec<u32> = at_1.inbound.iter().map(|sa| sa.spi).collect();
    let (heard, ..) = plan(PQ, (1, &a), (2, &b), Some(secret.clone()), soon, &all);
    assert_eq!(heard.outbound, at_1.outbound);
    let graced = since + CONFIRM_GRACE;
    let (moved, switch, _) = plan(PQ, (1, &a), (2, &b), Some(secret.clone()), graced, &[]);
    assert_eq!(moved.outbound.pq.as_ref().map(|p| p.slot), Some(2));
    assert_eq!(
        moved.outbound.spi, at_2.inbound[0].spi,
        "node 2 receives on it"
    );
    assert_eq!(switch, Some(since + SETTLE));
    // Once settled, the old slot's state goes.
    let (settled, switch, _) = plan(PQ, (1, &a), (2, &b), Some(secret), since + SETTLE, &[]);
    assert_eq!((settled.inbound.len(), switch), (1, None));
}

#[test]
fn the_first_psk_of_a_classical_pair_takes_over_from_the_classical_states() {
    let (a, b) = keys();
    let since = at(Duration::ZERO);
    let first = PairSecret {
        psk: psk(7),
        slot: 1,
        since,
        previous: None,
    };
    let (classical, ..) = plan(PQ, (1, &a), (2, &b), None, since, &[]);
    let (p, ..) = plan(PQ, (1, &a), (2, &b), Some(first), since, &[]);
    let slots: Vec<Option<u8>> = p
        .inbound
        .iter()
        .map(|sa| sa.pq.as_ref().map(|p| p.slot))
        .collect();
    assert_eq!(slots, [Some(1), None]);
    assert_eq!(
        p.inbound[1], classical.inbound[0],
        "the classical state stays"
    );
    assert_eq!(p.outbound, classical.outbound, "until the grace ends");
}
