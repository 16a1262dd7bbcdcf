//! Table tests for claims on what another node holds (a subnet, a WireGuard key, an
//! announced next key): the incumbent keeps it, and only the newcomer is left out.

use super::tests::{good_peer, ip, key, lease, run, CONF};
use crate::model::{Lease, NextKey, RouteRole};

/// `lease(node, subnet, ip, key seed)` created at `created` (None: not known).
fn claimant(node: &str, subnet: &str, seed: u8, created: Option<i64>) -> Lease {
    let mut l = lease(node, subnet, ip(seed), seed);
    l.created = created;
    l
}

#[test]
fn a_claim_on_a_taken_subnet_or_key_leaves_out_only_the_newcomer() {
    let next_key = |l: &mut Lease, seed: u8| {
        l.next_key = Some(NextKey {
            public_key: key(seed).to_base64(),
            switch_at_ms: 4_000_000_000_000,
            generation: 2,
        });
    };
    // (case, peers besides node-b, the nodes kept, the one left out with its reason)
    type Case<'a> = (&'a str, Vec<Lease>, Vec<&'a str>, &'a str, String);
    let cases: Vec<Case> = vec![
        ("one subnet, the older entry keeps it",
         vec![claimant("node-x", "10.244.9.0/24", 9, Some(5)), claimant("node-y", "10.244.9.0/24", 10, Some(3))],
         vec!["node-b", "node-y"], "node-x",
         "its subnet 10.244.9.0/24 overlaps node node-y's, which keeps it (the older entry, or the narrower subnet); left out until it lets go".into()),
        ("one subnet, creation unknown: the first name keeps it",
         vec![claimant("node-x", "10.244.9.0/24", 9, None), claimant("node-y", "10.244.9.0/24", 10, None)],
         vec!["node-b", "node-x"], "node-y",
         "its subnet 10.244.9.0/24 overlaps node node-x's, which keeps it (the older entry, or the narrower subnet); left out until it lets go".into()),
        ("a wider subnet covering others is refused by its length",
         vec![claimant("node-x", "10.244.9.0/24", 9, Some(5)), claimant("node-y", "10.244.8.0/23", 10, Some(1))],
         vec!["node-b", "node-x"], "node-y",
         "its subnet 10.244.8.0/23 is not a /24 like every node's subnet".into()),
        ("a narrower subnet too",
         vec![claimant("node-x", "10.244.9.0/25", 9, Some(5))],
         vec!["node-b"], "node-x",
         "its subnet 10.244.9.0/25 is not a /24 like every node's subnet".into()),
        ("one key, the older entry keeps it",
         vec![claimant("node-x", "10.244.9.0/24", 9, Some(2)), claimant("node-y", "10.244.10.0/24", 9, Some(1))],
         vec!["node-b", "node-y"], "node-x",
         format!("its public key {} is also published by node node-y, which keeps it (it proves holding the key, or is the older entry); left out until it changes", key(9))),
        ("one key, the newcomer's creation unknown",
         vec![claimant("node-x", "10.244.9.0/24", 9, Some(7)), claimant("node-y", "10.244.10.0/24", 9, None)],
         vec!["node-b", "node-x"], "node-y",
         format!("its public key {} is also published by node node-x, which keeps it (it proves holding the key, or is the older entry); left out until it changes", key(9))),
        ("another node's key announced as next key, even by an older entry",
         vec![claimant("node-x", "10.244.9.0/24", 9, Some(7)), {
             let mut y = claimant("node-y", "10.244.10.0/24", 10, Some(1));
             next_key(&mut y, 9);
             y
         }],
         vec!["node-b", "node-x"], "node-y",
         format!("its announced next key {} is node node-x's public key; left out until it announces another", key(9))),
    ];
    for (name, mut peers, kept, out, why) in cases {
        peers.push(good_peer());
        let state = run(CONF, peers, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut planned: Vec<_> = state.tunnels[0]
            .peers
            .iter()
            .map(|p| p.node.as_str())
            .collect();
        planned.sort_unstable();
        assert_eq!(planned, kept, "{name}");
        let reasons: Vec<_> = state
            .left_out
            .iter()
            .map(|l| (l.node.as_str(), l.reason.to_string()))
            .collect();
        assert_eq!(reasons, [(out, why)], "{name}");
        // The kept peers' routes are in place, the newcomer has none.
        for node in &kept {
            assert!(
                state
                    .routes
                    .iter()
                    .any(|r| r.role == RouteRole::Peer((*node).into())),
                "{name}: {node}"
            );
        }
        assert!(
            !state
                .routes
                .iter()
                .any(|r| r.role == RouteRole::Peer(out.into())),
            "{name}"
        );
    }
}

/// `claimant` with a proof, for its own name, that it holds the private key of seed `seed`.
fn proven(node: &str, subnet: &str, seed: u8, created: Option<i64>) -> Lease {
    let mut l = claimant(node, subnet, seed, created);
    let private = weft_crypto::PrivateKey::from_bytes([seed; 32]);
    l.key_proof = Some(weft_crypto::proof::prove(&private, node).unwrap());
    l
}

/// A key stays with the entry that proves holding it, whichever entry the registry
/// created first: an older (compromised) node that copies a younger node's key, even with
/// the younger one's proof, is the one left out; in the other order too. Without proofs
/// (nodes of older versions) the older entry keeps it, as before.
#[test]
fn a_key_stays_with_the_entry_that_proves_holding_it_in_either_order() {
    let copied_proof = |mut copier: Lease, owner: &Lease| {
        copier.key_proof = owner.key_proof;
        copier
    };
    let owner_young = proven("node-x", "10.244.9.0/24", 9, Some(7));
    let owner_old = proven("node-x", "10.244.9.0/24", 9, Some(1));
    let cases = [
        (
            "an older copier",
            vec![
                owner_young.clone(),
                claimant("node-y", "10.244.10.0/24", 9, Some(1)),
            ],
        ),
        (
            "an older copier with the owner's proof",
            vec![
                owner_young.clone(),
                copied_proof(
                    claimant("node-y", "10.244.10.0/24", 9, Some(1)),
                    &owner_young,
                ),
            ],
        ),
        (
            "a younger copier",
            vec![
                owner_old.clone(),
                claimant("node-y", "10.244.10.0/24", 9, Some(7)),
            ],
        ),
    ];
    for (name, mut peers) in cases {
        peers.push(good_peer());
        let state = run(CONF, peers, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut kept: Vec<&str> = state.tunnels[0]
            .peers
            .iter()
            .map(|p| p.node.as_str())
            .collect();
        kept.sort_unstable();
        assert_eq!(kept, ["node-b", "node-x"], "{name}");
        assert_eq!(state.left_out.len(), 1, "{name}: {:?}", state.left_out);
        assert_eq!(state.left_out[0].node, "node-y", "{name}");
        assert!(
            state.left_out[0]
                .reason
                .to_string()
                .contains("published by node node-x"),
            "{name}: {}",
            state.left_out[0].reason
        );
    }
}
