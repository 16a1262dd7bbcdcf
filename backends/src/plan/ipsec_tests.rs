//! The ipsec plan: `flannel-ipsec` carries the whole pod network (covering route, fail-closed
//! blackhole), one route per peer, each peer with both epochs and SPIs unique per receiver;
//! bad peers left out with the reason; the published data both ways.

use serde_json::json;
use weft_crypto::esp::Epoch;
use weft_crypto::PrivateKey;

use std::time::{Duration, SystemTime};

use super::ipsec::{
    backend_data, generation, rotating_backend_data, spi, IpsecData, NextEpoch, IF_ID,
};
use super::unencrypted_tests::{lease, run_observed_at, run_on, run_on_at};
use crate::model::{BackendDataError, LeaveReason, Observed, RouteRole};

const CONF: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec"}}"#;

pub(super) fn epoch(n: u64) -> Epoch {
    Epoch {
        number: n,
        nonce: [n as u8; 16],
    }
}

pub(super) fn node(n: u8, key: &PrivateKey, e: u64) -> crate::model::Lease {
    lease(
        &format!("node-{n}"),
        &format!("10.244.{n}.0/24"),
        [198, 51, 100, n],
        "ipsec",
        backend_data(&key.public_key(), &epoch(e)),
    )
}

#[test]
fn the_pod_network_goes_into_flannel_ipsec_with_a_route_per_peer() {
    let keys: Vec<PrivateKey> = (0..4).map(|_| PrivateKey::generate().unwrap()).collect();
    let peers = vec![node(2, &keys[2], 1), node(3, &keys[3], 5)];
    let state = run_on(CONF, node(1, &keys[1], 2), peers, &[]).unwrap();
    let ipsec = state.ipsec.as_ref().unwrap();
    assert_eq!(
        (ipsec.device.as_str(), ipsec.if_id),
        ("flannel-ipsec", IF_ID)
    );
    assert_eq!((ipsec.mtu, state.subnet_env.mtu), (1440, 1440));
    assert_eq!(ipsec.local.to_string(), "198.51.100.1");
    assert_eq!(ipsec.epoch, epoch(2));
    assert_eq!(ipsec.addresses, ["10.244.1.0/32".parse().unwrap()]);
    assert_eq!(state.fail_closed, ["10.244.0.0/16".parse().unwrap()]);
    let guard = &state.guard[0];
    assert_eq!(
        (guard.tunnels.as_slice(), guard.own),
        (
            &["flannel-ipsec".to_string()][..],
            Some("10.244.1.0/24".parse().unwrap())
        )
    );
    let routes: Vec<String> = state
        .routes
        .iter()
        .map(|r| format!("{} dev {} {:?}", r.dst, r.device, r.role))
        .collect();
    assert_eq!(
        routes,
        [
            "10.244.2.0/24 dev flannel-ipsec Peer(\"node-2\")",
            "10.244.3.0/24 dev flannel-ipsec Peer(\"node-3\")",
            "10.244.0.0/16 dev flannel-ipsec Covering",
        ]
    );
    assert!(matches!(state.routes[2].role, RouteRole::Covering));
    let p3 = &ipsec.peers[1];
    assert_eq!(
        (p3.node.as_str(), p3.outbound.peer_epoch),
        ("node-3", epoch(5))
    );
    assert_eq!(p3.remote.to_string(), "198.51.100.3");
    // Received from node-3: its subnet's index 3, generation 5 + 2 × 2; sent to it: this
    // node's index 1, generation 2 + 2 × 5.
    assert_eq!(p3.spi_in(), 0x8000_0309);
    assert_eq!(p3.outbound.spi, 0x8000_010c);
    assert_eq!(p3.inbound.len(), 1, "no rotation: one inbound state");
    assert_eq!(ipsec.peers[0].spi_in(), 0x8000_0205);
    let encap = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "UDPEncap": true, "MTU": 9000}}"#;
    let state = run_on(encap, node(1, &keys[1], 2), vec![], &[]).unwrap();
    assert_eq!(state.ipsec.unwrap().mtu, 8932);
}

#[test]
fn the_mirror_plan_on_the_peer_swaps_the_spis() {
    let (a, b) = (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    );
    let at_1 = run_on(CONF, node(1, &a, 3), vec![node(2, &b, 9)], &[]).unwrap();
    let at_2 = run_on(CONF, node(2, &b, 9), vec![node(1, &a, 3)], &[]).unwrap();
    let (p, q) = (&at_1.ipsec.unwrap().peers[0], &at_2.ipsec.unwrap().peers[0]);
    assert_eq!((p.spi_in(), p.outbound.spi), (q.outbound.spi, q.spi_in()));
}

#[test]
fn a_new_epoch_on_either_side_gives_new_spis() {
    let net = "10.244.0.0/16".parse().unwrap();
    let sub = "10.244.7.0/24".parse().unwrap();
    // The four combinations of two consecutive epochs on each side all differ.
    let spis: std::collections::HashSet<u32> = [(1, 4), (2, 4), (1, 5), (2, 5)]
        .iter()
        .map(|&(s, r)| spi(net, sub, generation(&epoch(s), &epoch(r), 0)).unwrap())
        .collect();
    assert_eq!(spis.len(), 4);
    assert_eq!(spi(net, "10.245.0.0/24".parse().unwrap(), 0), None);
    // Every SPI is far from the reserved 1–255.
    assert!(spi(net, "10.244.0.0/24".parse().unwrap(), 0).unwrap() >= 1 << 31);
}

#[test]
fn bad_peers_are_left_out_with_the_reason_and_the_rest_stays() {
    let keys: Vec<PrivateKey> = (0..6).map(|_| PrivateKey::generate().unwrap()).collect();
    let mut garbled = node(3, &keys[3], 1);
    garbled.backend_data =
        Some(json!({"PublicKey": "nope", "Epoch": 1, "Nonce": "AAAAAAAAAAAAAAAAAAAAAA=="}));
    let mut no_epoch = node(4, &keys[4], 1);
    no_epoch.backend_data = Some(json!({"PublicKey": keys[4].public_key().to_base64()}));
    let copy = node(5, &keys[2], 1);
    let ours = node(6, &keys[1], 1);
    let peers = vec![node(2, &keys[2], 1), garbled, no_epoch, copy, ours];
    let state = run_on(CONF, node(1, &keys[1], 1), peers, &[]).unwrap();
    let kept: Vec<&str> = state
        .ipsec
        .as_ref()
        .unwrap()
        .peers
        .iter()
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(kept, ["node-2"]);
    let reasons: Vec<String> = state.left_out.iter().map(|l| l.to_string()).collect();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    assert!(
        reasons[0]
            .starts_with("node node-3 left out: its backend-data is unusable: PublicKey \"nope\""),
        "{reasons:?}"
    );
    assert_eq!(
        reasons[1],
        "node node-4 left out: its backend-data is unusable: it has no Epoch"
    );
    assert!(matches!(
        state.left_out[2].reason,
        LeaveReason::DuplicateKey { .. }
    ));
    assert!(matches!(
        state.left_out[3].reason,
        LeaveReason::KeyIsOurs { .. }
    ));
}

#[test]
fn published_data_decodes_and_bad_values_are_named() {
    let key = PrivateKey::generate().unwrap().public_key();
    let data = backend_data(&key, &epoch(3));
    assert_eq!(data["Epoch"], 3);
    assert_eq!(data["Nonce"], "AwMDAwMDAwMDAwMDAwMDAw==");
    let back = IpsecData::decode(Some(&data)).unwrap();
    assert_eq!(
        (back.public_key, back.epoch, back.next),
        (key, epoch(3), None)
    );
    let next = NextEpoch {
        epoch: epoch(4),
        switch_at: SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
    };
    let data = rotating_backend_data(&key, &epoch(3), &next);
    assert_eq!(data["SwitchAt"], 1_700_000_000_123u64);
    assert_eq!(IpsecData::decode(Some(&data)).unwrap().next, Some(next));
    let bad = |v| IpsecData::decode(Some(&v)).unwrap_err().to_string();
    let k = key.to_base64();
    assert_eq!(
        bad(json!({"PublicKey": k, "Epoch": 0, "Nonce": "AwMDAwMDAwMDAwMDAwMDAw=="})),
        "Epoch 0 is not a positive whole number"
    );
    assert_eq!(
        bad(json!({"PublicKey": k, "Epoch": 1, "Nonce": "AAAA"})),
        "Nonce \"AAAA\" is not 16 bytes of standard base64"
    );
    assert_eq!(
        bad(
            json!({"PublicKey": k, "Epoch": 1, "Nonce": "AwMDAwMDAwMDAwMDAwMDAw==", "NextEpoch": 2, "NextNonce": "AwMDAwMDAwMDAwMDAwMDAw=="})
        ),
        "it has no SwitchAt"
    );
    assert_eq!(IpsecData::decode(None), Err(BackendDataError::Missing));
}

#[test]
fn this_nodes_own_data_must_be_usable() {
    let key = PrivateKey::generate().unwrap();
    let mut me = node(1, &key, 1);
    me.backend_data = Some(json!(null));
    let err = run_on(CONF, me, vec![], &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("this node's (node-1) published backend data is unusable"),
        "{err}"
    );
}

/// A lease whose node has announced epoch `next` for `at_ms` after the Unix epoch.
fn rotating(n: u8, key: &PrivateKey, e: u64, next: u64, at_ms: u64) -> crate::model::Lease {
    let mut l = node(n, key, e);
    let next = NextEpoch {
        epoch: epoch(next),
        switch_at: SystemTime::UNIX_EPOCH + Duration::from_millis(at_ms),
    };
    l.backend_data = Some(rotating_backend_data(&key.public_key(), &epoch(e), &next));
    l
}

#[test]
fn a_rotation_stages_the_next_epochs_inbound_states_and_switches_at_the_moment() {
    let (a, b) = (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    );
    // Node 2 announces epoch 2 for t = 5 s; the plans at t = 0 (before) and t = 5 s (after).
    let plan_at = |me: crate::model::Lease, peer: crate::model::Lease, secs: u64| {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        let state = run_on_at(CONF, me, vec![peer], &[], now).unwrap();
        (state.next_switch, state.ipsec.unwrap().peers[0].clone())
    };
    let (switch, at_1) = plan_at(node(1, &a, 1), rotating(2, &b, 1, 2, 5_000), 0);
    assert_eq!(
        switch,
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(5))
    );
    assert_eq!(
        at_1.outbound.peer_epoch,
        epoch(1),
        "sends with the current epoch"
    );
    let staged: Vec<u64> = at_1.inbound.iter().map(|s| s.peer_epoch.number).collect();
    assert_eq!(staged, [1, 2], "receives on both");
    assert_ne!(at_1.inbound[0].spi, at_1.inbound[1].spi);
    // The rotating node's own plan mirrors it.
    let (own_switch, at_2) = plan_at(rotating(2, &b, 1, 2, 5_000), node(1, &a, 1), 0);
    assert_eq!(own_switch, switch);
    assert_eq!(at_2.outbound.local_epoch, epoch(1));
    let staged: Vec<u64> = at_2.inbound.iter().map(|s| s.local_epoch.number).collect();
    assert_eq!(staged, [1, 2]);
    // From the moment on node 1 sends with epoch 2, on the SPI node 2 staged for it.
    let (_, after_1) = plan_at(node(1, &a, 1), rotating(2, &b, 1, 2, 5_000), 5);
    assert_eq!(after_1.outbound.peer_epoch, epoch(2));
    assert_eq!(
        after_1.outbound.spi, at_2.inbound[1].spi,
        "node 2 staged it"
    );
    // Node 2 sends with epoch 2 once node 1 has shown it holds the epoch's states (a packet
    // counted on node 2's inbound state of epoch 2), or 2 s after the moment without it;
    // until then with epoch 1, which node 1 still receives on, and it watches the counters.
    let plan_seen = |secs: u64, heard: &[u32]| {
        let observed = Observed {
            esp_heard: heard.iter().copied().collect(),
            ..Observed::default()
        };
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        let me = rotating(2, &b, 1, 2, 5_000);
        let state = run_observed_at(CONF, me, vec![node(1, &a, 1)], &[], now, &observed).unwrap();
        let peer = state.ipsec.as_ref().unwrap().peers[0].clone();
        (state.next_switch, state.esp_watch, peer.outbound)
    };
    let grace_end = SystemTime::UNIX_EPOCH + Duration::from_secs(7);
    let (switch, watching, unconfirmed) = plan_seen(5, &[]);
    assert_eq!((switch, watching), (Some(grace_end), true));
    assert_eq!(
        unconfirmed.spi, at_1.inbound[0].spi,
        "node 1 receives on it"
    );
    // Traffic on another state is no evidence.
    assert_eq!(plan_seen(5, &[at_2.inbound[0].spi]).2, unconfirmed);
    let next_spi = at_1.inbound[1].spi;
    for (what, secs, heard) in [
        ("evidence", 5, vec![at_2.inbound[1].spi]),
        ("the grace is over", 7, vec![]),
    ] {
        let (switch, watching, outbound) = plan_seen(secs, &heard);
        assert_eq!((switch, watching), (None, false), "{what}");
        assert_eq!(outbound.local_epoch, epoch(2), "{what}");
        assert_eq!(outbound.spi, next_spi, "{what}: node 1 staged it");
    }
    // While the announcement stands, node 1 still receives on the epoch node 2 left (a
    // node that learns of the moment late still sends with it); once node 2 publishes
    // epoch 2 alone, on that only.
    let left: Vec<u64> = after_1
        .inbound
        .iter()
        .map(|s| s.peer_epoch.number)
        .collect();
    assert_eq!(left, [2, 1]);
    let (_, settled) = plan_at(node(1, &a, 1), node(2, &b, 2), 20);
    assert_eq!(settled.inbound.len(), 1);
    assert_eq!(settled.inbound[0].spi, after_1.inbound[0].spi);
}

#[test]
fn a_peers_epoch_learned_after_this_nodes_moment_is_heard_with_the_epoch_it_left() {
    // Both nodes rotate at once (`--all`): node 1's moment is at 5 s, node 2's at 6 s, and
    // node 2 plans at 8 s, past both (and past its wait for node 1's evidence). Node 1 may
    // not have learned of node 2's moment yet and send with (its epoch 2, node 2's epoch
    // 1): node 2 must hold that state too.
    let (a, b) = (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    );
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(8);
    let me = rotating(2, &b, 1, 2, 6_000);
    let state = run_on_at(CONF, me, vec![rotating(1, &a, 1, 2, 5_000)], &[], now).unwrap();
    let peer = &state.ipsec.unwrap().peers[0];
    let pairs: Vec<(u64, u64)> = peer
        .inbound
        .iter()
        .map(|s| (s.peer_epoch.number, s.local_epoch.number))
        .collect();
    assert_eq!(pairs, [(2, 2), (2, 1), (1, 2), (1, 1)]);
    let spis: std::collections::BTreeSet<u32> = peer.inbound.iter().map(|s| s.spi).collect();
    assert_eq!(spis.len(), 4, "four SPIs");
    assert_eq!(
        (
            peer.outbound.local_epoch.number,
            peer.outbound.peer_epoch.number
        ),
        (2, 2)
    );
}

/// The nodes ipsec keeps as peers, by name.
fn kept(state: &crate::model::DesiredState) -> Vec<&str> {
    let ipsec = state.ipsec.as_ref().unwrap();
    ipsec.peers.iter().map(|p| p.node.as_str()).collect()
}

/// A node that publishes another node's public IP (or this node's) would get its own SAs
/// chosen for that node's pods, and its inbound SA would pass the check meant for that
/// node's subnet: it is left out, the older entry keeps the IP, in either order of names.
#[test]
fn a_public_ip_that_another_node_holds_is_left_out() {
    let keys: Vec<PrivateKey> = (0..5).map(|_| PrivateKey::generate().unwrap()).collect();
    for (victim_created, thief_created) in [(1, 2), (2, 1)] {
        let mut victim = node(2, &keys[2], 1);
        victim.created = Some(victim_created);
        let mut thief = node(3, &keys[3], 1);
        thief.public_ip = victim.public_ip;
        thief.created = Some(thief_created);
        let mut ours = node(4, &keys[4], 1);
        ours.public_ip = Some([198, 51, 100, 1].into());
        ours.created = Some(0);
        let state = run_on(CONF, node(1, &keys[1], 1), vec![victim, thief, ours], &[]).unwrap();
        let (older, newer) = if victim_created < thief_created {
            ("node-2", "node-3")
        } else {
            ("node-3", "node-2")
        };
        assert_eq!(kept(&state), [older]);
        let mut reasons: Vec<String> = state.left_out.iter().map(|l| l.to_string()).collect();
        reasons.sort();
        assert_eq!(
            reasons,
            [
                format!("node {newer} left out: its public IP 198.51.100.2 is also published by node {older}, which keeps it (the older entry); left out until it changes"),
                "node node-4 left out: it publishes this node's own public IP 198.51.100.1".to_string(),
            ]
        );
    }
}

/// A next epoch that is not the epoch after the current one (the same, 256 further on,
/// or back) would give two inbound states one SPI, whose EEXIST once aborted every pass:
/// the peer is left out with the field named, and the others stay.
#[test]
fn a_next_epoch_that_is_not_the_following_one_is_left_out() {
    let keys: Vec<PrivateKey> = (0..4).map(|_| PrivateKey::generate().unwrap()).collect();
    for next in [3, 259, 2, 5] {
        let bad = rotating(3, &keys[3], 3, next, 1_000);
        let peers = vec![node(2, &keys[2], 1), bad];
        let state = run_on(CONF, node(1, &keys[1], 1), peers, &[]).unwrap();
        assert_eq!(kept(&state), ["node-2"], "NextEpoch {next}");
        assert_eq!(
            state.left_out[0].to_string(),
            format!("node node-3 left out: its backend-data is unusable: NextEpoch {next} is not Epoch + 1 (4)")
        );
    }
    let fine = rotating(3, &keys[3], 3, 4, 1_000);
    let state = run_on(CONF, node(1, &keys[1], 1), vec![fine], &[]).unwrap();
    assert_eq!(kept(&state), ["node-3"]);
    let spis: std::collections::BTreeSet<u32> = state.ipsec.as_ref().unwrap().peers[0]
        .inbound
        .iter()
        .map(|sa| sa.spi)
        .collect();
    assert_eq!(
        spis.len(),
        state.ipsec.as_ref().unwrap().peers[0].inbound.len()
    );
}

/// As with WireGuard: of two ipsec entries with one key, the one that proves holding it
/// keeps it, in either order of creation.
#[test]
fn an_ipsec_key_stays_with_the_entry_that_proves_holding_it() {
    let keys: Vec<PrivateKey> = (0..4).map(|_| PrivateKey::generate().unwrap()).collect();
    for (owner_created, copier_created) in [(5, 1), (1, 5)] {
        let mut owner = node(2, &keys[2], 1);
        owner.created = Some(owner_created);
        owner.key_proof = Some(weft_crypto::proof::prove(&keys[2], "node-2").unwrap());
        let mut copier = node(3, &keys[2], 1);
        copier.created = Some(copier_created);
        copier.key_proof = owner.key_proof;
        let state = run_on(CONF, node(1, &keys[1], 1), vec![owner, copier], &[]).unwrap();
        assert_eq!(kept(&state), ["node-2"], "owner created {owner_created}");
        assert!(matches!(
            &state.left_out[0].reason,
            LeaveReason::DuplicateKey { other, .. } if other == "node-2"
        ));
    }
}
