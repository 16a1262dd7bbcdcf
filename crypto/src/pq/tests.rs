use super::*;
use crate::{PresharedKey, PrivateKey};

fn ss(fill: u8) -> SharedSecret {
    // A secret with known bytes, through the KEM's own path: decapsulating garbage gives a
    // pseudo-random one, so tests make theirs by encapsulating with fixed randomness.
    let pair = KemKeyPair::from_seed([fill; SEED_LEN]);
    super::kem::encapsulate_with(&pair.encaps_key(), [fill; 32]).1
}

#[test]
fn a_seed_gives_one_key_pair_and_the_two_sides_share_a_secret() {
    let seed = [7u8; SEED_LEN];
    let (a, b) = (KemKeyPair::from_seed(seed), KemKeyPair::from_seed(seed));
    assert_eq!(a.encaps_key(), b.encaps_key());
    assert_eq!(a.seed(), &seed);
    let fresh = KemKeyPair::generate().unwrap();
    assert_ne!(fresh.encaps_key(), a.encaps_key());

    let (ct, sent) = encapsulate(&fresh.encaps_key()).unwrap();
    assert_eq!(fresh.decapsulate(&ct), sent);
    let (ct2, sent2) = encapsulate(&fresh.encaps_key()).unwrap();
    assert_ne!(ct, ct2, "each encapsulation is fresh");
    assert_ne!(sent, sent2);
    // Another key pair cannot open it.
    assert_ne!(a.decapsulate(&ct), sent);
}

#[test]
fn a_tampered_ciphertext_gives_another_secret_not_an_error() {
    let pair = KemKeyPair::generate().unwrap();
    let (ct, sent) = encapsulate(&pair.encaps_key()).unwrap();
    for at in [0, 500, CIPHERTEXT_LEN - 1] {
        let mut bytes = *ct.as_bytes();
        bytes[at] ^= 1;
        let tampered = Ciphertext::from_bytes(&bytes).unwrap();
        assert_ne!(pair.decapsulate(&tampered), sent, "byte {at}");
    }
}

#[test]
fn encapsulation_keys_are_checked_before_use() {
    let ek = KemKeyPair::generate().unwrap().encaps_key();
    let text = ek.to_base64();
    assert_eq!(text.len(), ENCAPS_KEY_BASE64_LEN);
    assert_eq!(EncapsKey::from_base64(&text).unwrap(), ek);
    assert_eq!(EncapsKey::from_base64(&format!(" {text}\n")).unwrap(), ek);

    assert!(matches!(
        EncapsKey::from_bytes(&ek.as_bytes()[1..]),
        Err(KemError::Length { got: 1183, .. })
    ));
    assert!(matches!(
        EncapsKey::from_base64(&text[4..]),
        Err(KemError::Length { .. })
    ));
    let huge = "A".repeat(1 << 20);
    assert!(matches!(
        EncapsKey::from_base64(&huge),
        Err(KemError::Length { got, .. }) if got == 1 << 20
    ));
    let mut bad = text.clone().into_bytes();
    bad[10] = b'#';
    assert!(matches!(
        EncapsKey::from_base64(std::str::from_utf8(&bad).unwrap()),
        Err(KemError::Base64(_))
    ));
    // A coefficient of q or more (12 bits all set: 4095 > 3329) fails FIPS 203's check.
    let mut bytes = *ek.as_bytes();
    bytes[0] = 0xff;
    bytes[1] |= 0x0f;
    assert_eq!(EncapsKey::from_bytes(&bytes), Err(KemError::NotReduced));
    assert!(matches!(
        Ciphertext::from_bytes(&[0; 100]),
        Err(KemError::Length { got: 100, .. })
    ));
}

#[test]
fn secrets_never_print() {
    let pair = KemKeyPair::from_seed([0x5a; SEED_LEN]);
    let (ct, secret) = encapsulate(&pair.encaps_key()).unwrap();
    let shown = format!("{pair:?} {secret:?} {ct:?}");
    assert!(!shown.contains("5a5a"), "{shown}");
    assert!(shown.contains("<secret>"));
}

struct Node {
    key: PrivateKey,
}

fn two_nodes() -> (Node, Node) {
    let a = Node {
        key: PrivateKey::generate().unwrap(),
    };
    let b = Node {
        key: PrivateKey::generate().unwrap(),
    };
    if a.key.public_key() < b.key.public_key() {
        (a, b)
    } else {
        (b, a)
    }
}

#[test]
fn the_pair_orders_its_keys_the_same_from_either_side() {
    let (lo, hi) = two_nodes();
    let (l, h) = (lo.key.public_key(), hi.key.public_key());
    assert_eq!(Pair::new(l, h), Pair::new(h, l));
    let pair = Pair::new(h, l).unwrap();
    assert!(pair.is_lo(&l) && !pair.is_lo(&h));
    assert_eq!(Pair::new(l, l), None);
}

fn round_input<'a>(
    pair: &'a Pair,
    ss: (&'a SharedSecret, &'a SharedSecret),
    eks: (&'a [u8; 32], &'a [u8; 32]),
    round: u64,
) -> RoundInput<'a> {
    RoundInput {
        pair,
        round,
        lo_to_hi: ss.0,
        hi_to_lo: ss.1,
        ek_hi: eks.0,
        ek_lo: eks.1,
    }
}

#[test]
fn every_input_of_a_round_changes_its_psk() {
    let (lo, hi) = two_nodes();
    let pair = Pair::new(lo.key.public_key(), hi.key.public_key()).unwrap();
    let other = Pair::new(
        lo.key.public_key(),
        PrivateKey::generate().unwrap().public_key(),
    )
    .unwrap();
    let (s1, s2, s3) = (ss(1), ss(2), ss(3));
    let (e1, e2, e3) = ([1u8; 32], [2u8; 32], [3u8; 32]);
    let base = RoundSecret::derive(&round_input(&pair, (&s1, &s2), (&e1, &e2), 100));
    let again = RoundSecret::derive(&round_input(&pair, (&s1, &s2), (&e1, &e2), 100));
    assert_eq!(base.psk(), again.psk(), "deterministic");
    let variants = [
        round_input(&other, (&s1, &s2), (&e1, &e2), 100),
        round_input(&pair, (&s3, &s2), (&e1, &e2), 100),
        round_input(&pair, (&s1, &s3), (&e1, &e2), 100),
        round_input(&pair, (&s2, &s1), (&e1, &e2), 100),
        round_input(&pair, (&s1, &s2), (&e3, &e2), 100),
        round_input(&pair, (&s1, &s2), (&e1, &e3), 100),
        round_input(&pair, (&s1, &s2), (&e1, &e2), 101),
    ];
    let mut seen = vec![base.psk().clone()];
    for (i, input) in variants.iter().enumerate() {
        let psk = RoundSecret::derive(input).psk().clone();
        assert!(!seen.contains(&psk), "variant {i} repeats a PSK");
        seen.push(psk);
    }
}

#[test]
fn the_cluster_psk_changes_the_peer_psk_and_none_leaves_it() {
    let pq = PresharedKey::from_bytes([1; 32]);
    let (c1, c2) = (
        PresharedKey::from_bytes([2; 32]),
        PresharedKey::from_bytes([3; 32]),
    );
    assert_eq!(combine(&pq, None), pq);
    let (with1, with2) = (combine(&pq, Some(&c1)), combine(&pq, Some(&c2)));
    assert!(with1 != pq && with1 != c1 && with1 != with2);
    assert_eq!(with1, combine(&pq, Some(&c1)));
}

#[test]
fn a_confirmation_proves_the_same_round_secret() {
    let (lo, hi) = two_nodes();
    let pair = Pair::new(lo.key.public_key(), hi.key.public_key()).unwrap();
    let (s1, s2) = (ss(1), ss(2));
    let e = [0u8; 32];
    let mine = RoundSecret::derive(&round_input(&pair, (&s1, &s2), (&e, &e), 5));
    let theirs = RoundSecret::derive(&round_input(&pair, (&s1, &s2), (&e, &e), 5));
    let wrong = RoundSecret::derive(&round_input(&pair, (&s2, &s1), (&e, &e), 5));
    let tag = mine.confirm(b"reply 5");
    assert!(theirs.confirms(b"reply 5", &tag));
    assert!(!theirs.confirms(b"reply 6", &tag));
    assert!(!wrong.confirms(b"reply 5", &tag));
    assert_ne!(
        mine.confirm(b"reply 5")[..],
        mine.psk().as_bytes()[..CONFIRM_LEN]
    );
}

fn sample(from: &Node, to: &Node, body: Body) -> Message {
    Message {
        from: from.key.public_key(),
        to: to.key.public_key(),
        round: 1_700_000_000_000,
        ek: [4; FINGERPRINT_LEN],
        body,
    }
}

fn bodies() -> Vec<Body> {
    let ek = KemKeyPair::from_seed([1; SEED_LEN]).encaps_key();
    let ct = encapsulate(&ek).unwrap().0;
    vec![
        Body::Init { ct: ct.clone() },
        Body::Reply {
            ct,
            confirm: [5; CONFIRM_LEN],
        },
        Body::Commit {
            switch_in_ms: 1_000,
            confirm: [6; CONFIRM_LEN],
        },
        Body::Ack {
            confirm: [7; CONFIRM_LEN],
        },
    ]
}

#[test]
fn each_message_kind_goes_from_one_node_of_the_pair_to_the_other() {
    let (a, b) = two_nodes();
    let at_a = AuthKey::new(&a.key, &b.key.public_key()).unwrap();
    let at_b = AuthKey::new(&b.key, &a.key.public_key()).unwrap();
    for body in bodies() {
        let msg = sample(&a, &b, body);
        let bytes = msg.encode(&at_a);
        assert!(
            bytes.len() <= MAX_LEN,
            "{}: {}",
            msg.body.name(),
            bytes.len()
        );
        // IPv6's minimum MTU less its and UDP's headers: never fragmented.
        assert!(bytes.len() <= 1280 - 40 - 8);
        assert_eq!(
            Message::addressed(&bytes).unwrap(),
            (a.key.public_key(), b.key.public_key())
        );
        assert_eq!(Message::decode(&bytes, &at_b).unwrap(), msg);
    }
}

#[test]
fn a_message_from_outside_the_pair_or_altered_is_refused() {
    let (a, b) = two_nodes();
    let stranger = PrivateKey::generate().unwrap();
    let at_b = AuthKey::new(&b.key, &a.key.public_key()).unwrap();
    // The stranger knows both public keys, and claims to be a.
    let forged = AuthKey::new(&stranger, &b.key.public_key()).unwrap();
    for body in bodies() {
        let msg = sample(&a, &b, body);
        let name = msg.body.name();
        assert_eq!(
            Message::decode(&msg.encode(&forged), &at_b),
            Err(MessageError::Tag),
            "{name}"
        );
        let good = msg.encode(&AuthKey::new(&a.key, &b.key.public_key()).unwrap());
        for at in [
            0usize,
            4,
            5,
            8,
            40,
            72,
            80,
            96,
            good.len() - 17,
            good.len() - 1,
        ] {
            let mut bad = good.clone();
            bad[at] ^= 0x80;
            assert!(Message::decode(&bad, &at_b).is_err(), "{name}: byte {at}");
        }
    }
}

#[test]
fn sizes_are_refused_before_any_tag_is_computed() {
    let (a, b) = two_nodes();
    let at_b = AuthKey::new(&b.key, &a.key.public_key()).unwrap();
    let good = sample(
        &a,
        &b,
        Body::Ack {
            confirm: [0; CONFIRM_LEN],
        },
    )
    .encode(&AuthKey::new(&a.key, &b.key.public_key()).unwrap());
    let long = vec![0u8; 65_000];
    assert_eq!(
        Message::decode(&long, &at_b),
        Err(MessageError::TooLong { got: 65_000 })
    );
    assert_eq!(
        Message::decode(&good[..50], &at_b),
        Err(MessageError::TooShort { got: 50 })
    );
    let mut magic = good.clone();
    magic[0] = b'x';
    assert_eq!(Message::decode(&magic, &at_b), Err(MessageError::Magic));
    let mut kind = good.clone();
    kind[4] = 9;
    assert_eq!(Message::decode(&kind, &at_b), Err(MessageError::Kind(9)));
    let mut padded = good.clone();
    padded.extend_from_slice(&[0; 8]);
    assert!(matches!(
        Message::decode(&padded, &at_b),
        Err(MessageError::Length { kind: 4, .. })
    ));
}

#[test]
fn a_pair_needs_two_keys_and_a_contributory_one() {
    let a = PrivateKey::generate().unwrap();
    assert_eq!(
        AuthKey::new(&a, &a.public_key()).unwrap_err(),
        PairKeyError::OwnKey
    );
    // The all-zero point is of low order.
    assert_eq!(
        AuthKey::new(&a, &crate::PublicKey::from_bytes([0; 32])).unwrap_err(),
        PairKeyError::NonContributory
    );
}
