//! The ipsec reconciler's refusals and new epochs, against in-memory kernels: a refused
//! state fails alone; a peer going back to old keys is refused; a restored record over an
//! empty kernel, or this node's address or subnet changing, asks for a new epoch; each pair
//! has its own reqid; a new PSK replaces every key.

use weft_crypto::esp::{Epoch, EspStore};
use weft_crypto::PrivateKey;

use super::tests::{book, installed_once, ip, node, spec, Kernel, Node};
use super::{EspKey, Xfrm};
use crate::plan::ipsec::IF_ID;

/// A state the kernel refuses (here: another owner's state already holds its destination
/// and SPI) is an error of its own: every other state and every policy is still put in,
/// nothing counts as lost (so no epoch bump), and once the way is clear it goes in.
#[test]
fn a_refused_state_fails_alone_and_is_not_taken_for_lost() {
    let (a, b, c) = (node(1), node(2), node(3));
    let want = spec(&a, &[&b, &c]);
    let blocked = want.peers[0].inbound[0].spi;
    // The squatter: the same state, under another interface id.
    let mut other = Kernel::new(book(None, a.epoch));
    other.pass(&want, &a.key);
    let mut squatter = other
        .xfrm()
        .states
        .iter()
        .find(|s| s.spec.spi == blocked)
        .unwrap()
        .clone();
    squatter.spec.if_id = IF_ID + 1;
    let mut k = Kernel::new(book(None, a.epoch));
    k.xfrm().states.push(squatter);

    for round in 0..2 {
        let (outcome, _, errors) = k.pass_with_errors(&want, &a.key);
        assert!(outcome.lost.is_empty(), "round {round}: {:?}", outcome.lost);
        assert_eq!(errors.len(), 1, "round {round}: {errors:?}");
        assert!(errors[0].contains("File exists"), "{errors:?}");
        let ours = k.xfrm().states(IF_ID).unwrap();
        assert_eq!(ours.len(), 3, "the other three states of the two pairs");
        assert_eq!(k.xfrm().policies(IF_ID).unwrap().len(), 6, "every policy");
    }
    k.xfrm().states.retain(|s| s.spec.if_id == IF_ID);
    let (outcome, changes) = k.pass(&want, &a.key);
    assert!(outcome.lost.is_empty());
    assert!(k.xfrm().state(ip(1), blocked).is_some(), "{changes:?}");
    installed_once(k.xfrm());
}

/// A peer that publishes an epoch it left (or a public IP it had before) brings the plan
/// back to keys installed before: they are not installed again, and this node does not
/// take that for a loss of its own (no epoch bump, which one peer could otherwise force
/// on every node as often as it liked); only that pair waits, with the reason named.
#[test]
fn a_peer_going_back_to_old_keys_is_refused_without_an_epoch_bump() {
    let (a, b, c) = (node(1), node(2), node(3));
    let mut k = Kernel::new(book(None, a.epoch));
    let mut b2 = Node {
        epoch: b.epoch.next().unwrap(),
        ..node(2)
    };
    b2.key = b.key.clone();
    let first = spec(&a, &[&b, &c]);
    k.pass(&first, &a.key);
    k.pass(&spec(&a, &[&b2, &c]), &a.key);
    let mut elsewhere = first.clone();
    elsewhere.peers[0].remote = ip(200);
    let before = k.xfrm().added.len();
    for (what, spec) in [
        ("its old epoch", &first),
        ("another IP", &elsewhere),
        ("back", &first),
    ] {
        let (outcome, _, errors) = k.pass_with_errors(spec, &a.key);
        assert!(outcome.lost.is_empty(), "{what}: {:?}", outcome.lost);
        if what != "another IP" {
            assert!(
                !errors.is_empty() && errors.iter().all(|e| e.starts_with("node node-2: ")),
                "{what}: {errors:?}"
            );
        }
    }
    assert!(
        k.xfrm().added[before..]
            .iter()
            .all(|sa| sa.dst == ip(200) || sa.src == ip(200)),
        "only the states towards the new IP went in: {:?}",
        &k.xfrm().added[before..]
    );
    installed_once(k.xfrm());
    // A state that stood and is gone is still a loss.
    let standing = k.xfrm().states(IF_ID).unwrap();
    let victim = standing
        .iter()
        .find(|s| s.spec.dst == ip(3))
        .unwrap()
        .spec
        .clone();
    k.xfrm().delete_state(&victim).unwrap();
    assert_eq!(k.pass_with_errors(&first, &a.key).0.lost.len(), 1);
}

/// A state directory restored from a backup (or a reboot) with a record that does not
/// name every key installed since: the kernel holds none of weft's states while the
/// record names some, so the epoch (and its nonce, restored with it) is not used again,
/// even for a plan whose keys the old record does not name.
#[test]
fn a_restored_record_with_an_empty_kernel_asks_for_a_new_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let store = EspStore::new(dir.path());
    let (b, c) = (node(2), node(3));
    let key = PrivateKey::generate().unwrap();
    let mut k = Kernel::new(book(Some(store.clone()), Epoch::first().unwrap()));
    let epoch = k.plane.book.epoch();
    let me = Node {
        key: key.clone(),
        epoch,
        n: 1,
    };
    k.pass(&spec(&me, &[&b]), &key);
    // The backup was taken here; then node 3 joined and its keys went in.
    let backup = std::fs::read(store.record_path()).unwrap();
    k.pass(&spec(&me, &[&b, &c]), &key);
    // Reboot and restore: the kernel is empty, and the plan has only node 3 for now.
    std::fs::write(store.record_path(), backup).unwrap();
    let mut restored = Kernel::new(book(Some(store.clone()), epoch));
    let (out, _) = restored.pass(&spec(&me, &[&c]), &key);
    assert_eq!(out.lost.len(), 1, "{:?}", out.lost);
    assert!(
        restored.xfrm().added.is_empty(),
        "node 3's keys not installed again"
    );
}

/// Keys are recorded alone: this node's own address or subnet changing would bring its
/// keys back under other addresses or SPIs with their sequence numbers restarted. That is
/// this node's change, so it takes a new epoch; nothing is installed again.
#[test]
fn this_nodes_address_or_subnet_changing_asks_for_a_new_epoch() {
    let (a, b) = (node(1), node(2));
    let first = spec(&a, &[&b]);
    let mut moved = first.clone();
    moved.local = ip(100);
    let mut renumbered = first.clone();
    renumbered.peers[0].outbound.spi += 1 << 8;
    for (what, next) in [("address", moved), ("subnet", renumbered)] {
        let mut k = Kernel::new(book(None, a.epoch));
        k.pass(&first, &a.key);
        let added = k.xfrm().added.len();
        let (out, _, errors) = k.pass_with_errors(&next, &a.key);
        assert!(
            !out.lost.is_empty() && errors.is_empty(),
            "{what}: {out:?} {errors:?}"
        );
        assert_eq!(
            k.xfrm().added.len(),
            added,
            "{what}: nothing installed again"
        );
    }
}

/// Every state and policy of a pair carries that pair's reqid, and no two pairs share
/// one: the kernel matches a template only with states of its reqid, so one pair's policy
/// can neither pick another pair's state for its traffic nor accept packets that another
/// pair's state decrypted (as it could when both pairs had the same tunnel ends).
#[test]
fn each_pairs_states_and_policies_carry_its_own_reqid() {
    let (a, b, c) = (node(1), node(2), node(3));
    let mut k = Kernel::new(book(None, a.epoch));
    let want = spec(&a, &[&b, &c]);
    k.pass(&want, &a.key);
    let mut reqids = std::collections::BTreeSet::new();
    for p in &want.peers {
        let subnet = match p.subnet {
            ipnet::IpNet::V4(n) => n,
            ipnet::IpNet::V6(_) => unreachable!(),
        };
        let states: Vec<u32> = k
            .xfrm()
            .states
            .iter()
            .filter(|s| s.spec.src == p.remote || s.spec.dst == p.remote)
            .map(|s| s.spec.reqid)
            .collect();
        let policies: Vec<u32> = k
            .xfrm()
            .policies
            .iter()
            .filter(|x| x.src == subnet || x.dst == subnet)
            .map(|x| x.reqid)
            .collect();
        assert_eq!((states.len(), policies.len()), (2, 3), "node {}", p.node);
        let reqid = states[0];
        assert!(reqid != 0);
        assert!(
            states.iter().chain(&policies).all(|r| *r == reqid),
            "node {}",
            p.node
        );
        assert!(
            reqids.insert(reqid),
            "node {}'s reqid {reqid} is another pair's",
            p.node
        );
    }
}

/// A new PSK (the Secret's rotation) salts every key anew: each pair's states are
/// replaced with keys never installed before, none is derived from the cached ones.
#[test]
fn a_new_psk_replaces_every_key() {
    let (a, b) = (node(1), node(2));
    let mut k = Kernel::new(book(None, a.epoch));
    let mut want = spec(&a, &[&b]);
    want.psk = Some(crate::netconf::IpsecPsk(vec![4; 32]));
    k.pass(&want, &a.key);
    let before: Vec<EspKey> = k.xfrm().states.iter().map(|s| s.spec.key.clone()).collect();
    want.psk = Some(crate::netconf::IpsecPsk(vec![5; 32]));
    let (out, _) = k.pass(&want, &a.key);
    assert!(out.lost.is_empty());
    assert_eq!(k.xfrm().states.len(), 2);
    assert!(k
        .xfrm()
        .states
        .iter()
        .all(|s| !before.contains(&s.spec.key)));
    installed_once(k.xfrm());
}
