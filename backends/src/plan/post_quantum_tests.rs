//! `Backend.PostQuantum` in the plan: which peers run rounds (and why a pair stays
//! classical), and the PSK each WireGuard peer gets from a completed round.

use std::collections::BTreeMap;

use weft_crypto::pq::{combine, KemKeyPair};
use weft_crypto::PresharedKey;

use super::tests::{good_peer, ip, key, lease, local, run_with_psks, NOW};
use crate::model::{DesiredState, Lease, PairSecret, PqKey};

const PQ: &str =
    r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "PostQuantum": true}}"#;
const PQ_CLUSTER_PSK: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "PostQuantum": true, "PSK": "FpCyhws9cxwWoV4xELtfJvjJN+zQVRPISllRWgeopVE="}}"#;
const CLASSICAL: &str =
    r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "PostQuantum": false}}"#;

fn with_ek(mut l: Lease, seed: u8) -> Lease {
    l.ml_kem_key = Some(KemKeyPair::from_seed([seed; 64]).encaps_key().to_base64());
    l
}

fn peers() -> Vec<Lease> {
    let mut garbled = lease("node-d", "10.244.4.0/24", ip(4), 4);
    garbled.ml_kem_key = Some("QUJD".into());
    vec![
        with_ek(good_peer(), 2),
        lease("node-c", "10.244.3.0/24", ip(3), 3),
        garbled,
    ]
}

fn run(config: &str, psks: &BTreeMap<weft_crypto::PublicKey, PairSecret>) -> DesiredState {
    run_with_psks(local(), config, peers(), false, &Default::default(), psks).unwrap()
}

fn psk_of(state: &DesiredState, node: &str) -> Option<PresharedKey> {
    state.tunnels[0]
        .peers
        .iter()
        .find(|p| p.node == node)
        .unwrap()
        .psk
        .clone()
}

#[test]
fn every_peer_is_listed_with_its_key_or_why_its_pair_stays_classical() {
    let state = run(PQ, &Default::default());
    let listed: Vec<(&str, &PqKey)> = state
        .post_quantum
        .iter()
        .map(|p| (p.node.as_str(), &p.ek))
        .collect();
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(matches!(listed[0], ("node-b", PqKey::Published(_))));
    assert_eq!(listed[1], ("node-c", &PqKey::None));
    let ("node-d", PqKey::Bad(why)) = listed[2] else {
        panic!("{listed:?}")
    };
    assert!(
        why.contains("does not decode") && why.contains("bytes"),
        "{why}"
    );
    let b = &state.post_quantum[0];
    let tunnel: std::net::IpAddr = "10.244.2.0".parse().unwrap();
    assert_eq!((b.public_key, b.address), (key(2), tunnel));
    assert_eq!(
        b.ek,
        PqKey::Published(KemKeyPair::from_seed([2; 64]).encaps_key())
    );
    // Every peer keeps its tunnel, whatever its ML-KEM key.
    assert_eq!(state.tunnels[0].peers.len(), 3);
    assert!(state.left_out.is_empty(), "{:?}", state.left_out);
}

#[test]
fn a_completed_round_gives_its_peer_the_pairs_psk_and_no_other() {
    let pair = PresharedKey::from_bytes([7; 32]);
    let psks = BTreeMap::from([(key(2), PairSecret::settled(pair.clone(), 1))]);
    let state = run(PQ, &psks);
    assert_eq!(psk_of(&state, "node-b"), Some(pair.clone()));
    assert_eq!(psk_of(&state, "node-c"), None);

    let cluster: PresharedKey = "FpCyhws9cxwWoV4xELtfJvjJN+zQVRPISllRWgeopVE="
        .parse()
        .unwrap();
    let state = run(PQ_CLUSTER_PSK, &psks);
    assert_eq!(
        psk_of(&state, "node-b"),
        Some(combine(&pair, Some(&cluster)))
    );
    assert_eq!(psk_of(&state, "node-c"), Some(cluster));
}

#[test]
fn with_post_quantum_off_nothing_is_listed_and_no_pair_psk_is_used() {
    let psks = BTreeMap::from([(
        key(2),
        PairSecret::settled(PresharedKey::from_bytes([7; 32]), 1),
    )]);
    let state = run(CLASSICAL, &psks);
    assert!(state.post_quantum.is_empty());
    assert_eq!(psk_of(&state, "node-b"), None);
}

#[test]
fn a_staged_next_key_is_not_a_pair_of_its_own() {
    let mut b = with_ek(good_peer(), 2);
    b.next_key = Some(crate::model::NextKey {
        public_key: key(22).to_base64(),
        switch_at_ms: NOW.as_millis() as u64 + 60_000,
        generation: 2,
    });
    let state = run_with_psks(
        local(),
        PQ,
        vec![b],
        false,
        &Default::default(),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(state.tunnels[0].peers.len(), 2, "current and staged keys");
    let keys: Vec<_> = state.post_quantum.iter().map(|p| p.public_key).collect();
    assert_eq!(keys, [key(2)]);
}

#[test]
fn a_peers_next_key_starts_classical_staged_switched_and_watched() {
    let pair = PresharedKey::from_bytes([7; 32]);
    let cluster: PresharedKey = "FpCyhws9cxwWoV4xELtfJvjJN+zQVRPISllRWgeopVE="
        .parse()
        .unwrap();
    let psks = BTreeMap::from([(key(2), PairSecret::settled(pair.clone(), 1))]);
    let announcing = |ahead_ms: i64| {
        let mut b = with_ek(good_peer(), 2);
        b.next_key = Some(crate::model::NextKey {
            public_key: key(22).to_base64(),
            switch_at_ms: (NOW.as_millis() as i64 + ahead_ms) as u64,
            generation: 2,
        });
        b
    };
    let plan = |ahead_ms: i64, config: &str| {
        let no = Default::default();
        run_with_psks(
            local(),
            config,
            vec![announcing(ahead_ms)],
            false,
            &no,
            &psks,
        )
        .unwrap()
    };
    let psk_of_key = |state: &DesiredState, k| {
        let p = state.tunnels[0].peers.iter().find(|p| p.public_key == k);
        p.unwrap().psk.clone()
    };
    for (config, classical) in [(PQ, None), (PQ_CLUSTER_PSK, Some(cluster.clone()))] {
        // Before the moment: the current key keeps the pair's PSK; the staged key, and the
        // entry the switch watcher would move the AllowedIPs to, have the classical one.
        let staged = plan(60_000, config);
        assert_eq!(
            psk_of_key(&staged, key(2)),
            Some(combine(&pair, classical.as_ref()))
        );
        assert_eq!(psk_of_key(&staged, key(22)), classical);
        assert_eq!(
            staged.key_watch.as_ref().unwrap().moves[0].next.psk,
            classical
        );
        // After it: the switched entry is the new key's, classical too.
        let switched = plan(-60_000, config);
        assert_eq!(switched.tunnels[0].peers.len(), 1);
        assert_eq!(psk_of_key(&switched, key(22)), classical);
    }
    // A round with the new key completed: its PSK, staged and switched alike.
    let new_pair = PresharedKey::from_bytes([9; 32]);
    let psks = BTreeMap::from([(key(22), PairSecret::settled(new_pair.clone(), 2))]);
    let no = Default::default();
    let state = run_with_psks(local(), PQ, vec![announcing(-60_000)], false, &no, &psks).unwrap();
    assert_eq!(psk_of_key(&state, key(22)), Some(combine(&new_pair, None)));
}
