use super::*;

const ALG: &str = "rfc4106(gcm(aes))";

fn epoch(n: u64, fill: u8) -> Epoch {
    Epoch {
        number: n,
        nonce: [fill; NONCE_LEN],
    }
}

fn keys_of(
    own: &PrivateKey,
    own_epoch: &Epoch,
    peer: &PrivateKey,
    peer_epoch: &Epoch,
    psk: Option<&[u8]>,
) -> PairKeys {
    let peer_public = peer.public_key();
    pair_keys(
        own,
        own_epoch,
        Party {
            key: &peer_public,
            epoch: peer_epoch,
        },
        psk,
        ALG,
        20,
    )
    .unwrap()
}

#[test]
fn both_nodes_derive_mirror_keys_and_the_two_directions_differ() {
    let (a, b) = (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    );
    let (ea, eb) = (epoch(1, 0xaa), epoch(7, 0xbb));
    let at_a = keys_of(&a, &ea, &b, &eb, None);
    let at_b = keys_of(&b, &eb, &a, &ea, None);
    assert_eq!(at_a.outbound, at_b.inbound);
    assert_eq!(at_a.inbound, at_b.outbound);
    assert_ne!(at_a.outbound, at_a.inbound);
    assert_eq!(at_a.outbound.as_bytes().len(), 20);
}

#[test]
fn a_new_epoch_or_nonce_on_either_side_changes_every_key() {
    let (a, b) = (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    );
    let (ea, eb) = (epoch(1, 1), epoch(1, 2));
    let base = keys_of(&a, &ea, &b, &eb, None);
    for (own, peer) in [
        (epoch(2, 1), eb),
        (epoch(1, 9), eb),
        (ea, epoch(2, 2)),
        (ea, epoch(1, 3)),
    ] {
        let other = keys_of(&a, &own, &b, &peer, None);
        assert_ne!(other.outbound, base.outbound, "{own:?} {peer:?}");
        assert_ne!(other.inbound, base.inbound, "{own:?} {peer:?}");
        assert_ne!(other.outbound, base.inbound);
    }
}

#[test]
fn the_psk_and_the_algorithm_are_bound_into_the_keys() {
    let (a, b) = (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    );
    let (ea, eb) = (epoch(1, 1), epoch(1, 2));
    let plain = keys_of(&a, &ea, &b, &eb, None);
    let salted = keys_of(&a, &ea, &b, &eb, Some(b"a cluster secret"));
    assert_ne!(plain.outbound, salted.outbound);
    let b_public = b.public_key();
    let peer = Party {
        key: &b_public,
        epoch: &eb,
    };
    let chacha = pair_keys(&a, &ea, peer, None, "rfc7539esp(chacha20,poly1305)", 20).unwrap();
    assert_ne!(plain.outbound, chacha.outbound);
    let longer = pair_keys(&a, &ea, peer, None, ALG, 36).unwrap();
    assert_ne!(&longer.outbound.as_bytes()[..20], plain.outbound.as_bytes());
}

#[test]
fn a_low_order_peer_key_is_refused() {
    let a = PrivateKey::generate().unwrap();
    let e = epoch(1, 1);
    for low in [[0u8; 32], {
        let mut one = [0u8; 32];
        one[0] = 1;
        one
    }] {
        let key = PublicKey::from_bytes(low);
        let peer = Party {
            key: &key,
            epoch: &e,
        };
        assert_eq!(
            pair_keys(&a, &e, peer, None, ALG, 20),
            Err(DeriveError::NonContributory)
        );
    }
    let b = PrivateKey::generate().unwrap().public_key();
    let peer = Party { key: &b, epoch: &e };
    assert_eq!(
        pair_keys(&a, &e, peer, None, ALG, 37),
        Err(DeriveError::Length(37))
    );
}

/// A fingerprint names the key alone: the same key under another SPI or address is the
/// same installed key (its sequence numbers would restart), another key is not.
#[test]
fn fingerprints_name_the_key_alone() {
    let (a, b) = (
        PrivateKey::generate().unwrap(),
        PrivateKey::generate().unwrap(),
    );
    let k = keys_of(&a, &epoch(1, 1), &b, &epoch(1, 2), None);
    let f = install_fingerprint(&k.outbound);
    assert_eq!(f.len(), FINGERPRINT_LEN);
    assert!(f.bytes().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(f, install_fingerprint(&k.outbound));
    assert_ne!(f, install_fingerprint(&k.inbound));
    let other = keys_of(&a, &epoch(2, 1), &b, &epoch(1, 2), None);
    assert_ne!(f, install_fingerprint(&other.outbound));
}
