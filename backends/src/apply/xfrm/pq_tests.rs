//! A pair's post-quantum PSK in its ESP keys: both nodes derive the same keys from it, the
//! keys differ from the classical ones and from another PSK's, and the states of two PSKs
//! in a row stand side by side under their own SPIs.

use weft_crypto::PresharedKey;

use super::tests::{book, installed_once, node, spec, Kernel, Node};
use crate::model::{EspPq, IpsecSpec};

/// `me`'s spec towards `peer`, every state keyed with the PSK `seed` in `slot`.
pub(super) fn with_pq(me: &Node, peer: &Node, slot: u8, seed: u8) -> IpsecSpec {
    let mut s = spec(me, &[peer]);
    let pq = Some(EspPq {
        slot,
        psk: PresharedKey::from_bytes([seed; 32]),
    });
    let p = &mut s.peers[0];
    // The SPIs as the plan gives them: the slot moves the generation byte by 4 each.
    p.outbound.spi += 4 * u32::from(slot);
    p.outbound.pq = pq.clone();
    for sa in &mut p.inbound {
        sa.spi += 4 * u32::from(slot);
        sa.pq = pq.clone();
    }
    s
}

fn outbound_key(k: &mut Kernel, spec: &IpsecSpec) -> Vec<u8> {
    let spi = spec.peers[0].outbound.spi;
    let sa = k.xfrm().states.iter().find(|s| s.spec.spi == spi).unwrap();
    sa.spec.key.as_bytes().to_vec()
}

#[test]
fn a_post_quantum_psk_keys_both_ends_alike_and_unlike_the_classical_keys() {
    let (a, b) = (node(1), node(2));
    let (mut ka, mut kb) = (
        Kernel::new(book(None, a.epoch)),
        Kernel::new(book(None, b.epoch)),
    );
    let classical = spec(&a, &[&b]);
    ka.pass(&classical, &a.key);
    let classical_key = outbound_key(&mut ka, &classical);

    let (at_a, at_b) = (with_pq(&a, &b, 1, 7), with_pq(&b, &a, 1, 7));
    ka.pass(&at_a, &a.key);
    kb.pass(&at_b, &b.key);
    let a_out = outbound_key(&mut ka, &at_a);
    let b_in = kb
        .xfrm()
        .state(super::tests::ip(2), at_a.peers[0].outbound.spi)
        .map(|s| s.key.as_bytes().to_vec());
    assert_eq!(Some(a_out.clone()), b_in, "node 2 receives on node 1's key");
    assert_ne!(a_out, classical_key);

    // The next PSK, in the other slot: its states stand beside the first's while the pair
    // switches (the plan lists both), under other SPIs and other keys.
    let mut both = with_pq(&a, &b, 2, 8);
    both.peers[0]
        .inbound
        .extend(at_a.peers[0].inbound.iter().cloned());
    ka.pass(&both, &a.key);
    let next = outbound_key(&mut ka, &both);
    assert_ne!(next, a_out);
    let spis: Vec<u32> = ka.xfrm().states.iter().map(|s| s.spec.spi).collect();
    assert_eq!(spis.len(), 3, "one out, two in: {spis:x?}");
    installed_once(ka.xfrm());
}
