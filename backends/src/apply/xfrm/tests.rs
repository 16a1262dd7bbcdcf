//! The ipsec reconciler against in-memory kernels: two nodes' passes give mirror SAs; a
//! second pass writes nothing; a lost state is never installed again (it asks for a new
//! epoch, and the new epoch's keys all differ); a restart that finds its states adopts
//! them; a reboot (states gone, record on disk) asks for a new epoch; a deleted policy or
//! interface comes back; 1000 peers, then zero writes.

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::time::Duration;

use weft_crypto::esp::{Epoch, EspStore, Loaded};
use weft_crypto::PrivateKey;

use super::{reconcile_ipsec, EspBook, EspKey, IpsecOutcome, PolicyDir, Xfrm};
use crate::apply::dataplane_ipsec::IpsecPlane;
use crate::apply::fake::{FakeNetlink, FakeXfrm};
use crate::apply::reconcile_tests::block_on;
use crate::apply::Netlink;
use crate::model::{EspSa, IpsecPeer, IpsecSpec};
use crate::netconf::EspAlgorithm;
use crate::plan::ipsec::{generation, spi, IF_ID};

pub(super) struct Node {
    pub(super) key: PrivateKey,
    pub(super) epoch: Epoch,
    pub(super) n: u32,
}

pub(super) fn ip(n: u32) -> Ipv4Addr {
    Ipv4Addr::from(0xc633_6400 + n) // 198.51.100.n
}

fn subnet(n: u32) -> ipnet::IpNet {
    format!("10.{}.{}.0/24", n / 256, n % 256).parse().unwrap()
}

fn net() -> ipnet::IpNet {
    "10.0.0.0/8".parse().unwrap()
}

pub(super) fn spec(me: &Node, peers: &[&Node]) -> IpsecSpec {
    let peers = peers
        .iter()
        .map(|p| IpsecPeer {
            node: format!("node-{}", p.n),
            public_key: p.key.public_key(),
            remote: ip(p.n),
            subnet: subnet(p.n),
            outbound: EspSa {
                spi: spi(net(), subnet(me.n), generation(&me.epoch, &p.epoch, 0)).unwrap(),
                local_epoch: me.epoch,
                peer_epoch: p.epoch,
                pq: None,
            },
            inbound: vec![EspSa {
                spi: spi(net(), subnet(p.n), generation(&p.epoch, &me.epoch, 0)).unwrap(),
                local_epoch: me.epoch,
                peer_epoch: p.epoch,
                pq: None,
            }],
        })
        .collect();
    IpsecSpec {
        device: "flannel-ipsec".into(),
        if_id: IF_ID,
        underlay_device: None,
        mtu: 1440,
        addresses: vec![],
        local: ip(me.n),
        epoch: me.epoch,
        algorithm: EspAlgorithm::Aes128Gcm,
        psk: None,
        udp_encap: false,
        subnet: subnet(me.n),
        network: net(),
        peers,
    }
}

pub(super) fn node(n: u32) -> Node {
    Node {
        key: PrivateKey::generate().unwrap(),
        epoch: Epoch::first().unwrap(),
        n,
    }
}

pub(super) fn book(store: Option<EspStore>, epoch: Epoch) -> EspBook {
    let loaded = match &store {
        Some(s) => s.load().unwrap(),
        None => Loaded {
            epoch,
            installed: HashSet::new(),
            bumped: None,
        },
    };
    EspBook::new(store, loaded)
}

pub(super) struct Kernel {
    nl: FakeNetlink,
    pub(super) plane: IpsecPlane<FakeXfrm>,
}

impl Kernel {
    pub(super) fn new(book: EspBook) -> Self {
        Self::with_grace(book, Duration::ZERO)
    }

    /// A kernel whose reconciler keeps states the plan left for `grace`.
    pub(super) fn with_grace(book: EspBook, grace: Duration) -> Self {
        Kernel {
            nl: FakeNetlink::default(),
            plane: IpsecPlane::new(FakeXfrm::default(), book, None).with_grace(grace),
        }
    }

    pub(super) fn pass(
        &mut self,
        spec: &IpsecSpec,
        key: &PrivateKey,
    ) -> (IpsecOutcome, Vec<String>) {
        let (outcome, changes, errors) = self.pass_with_errors(spec, key);
        assert!(errors.is_empty(), "{errors:?}");
        (outcome, changes)
    }

    /// A pass, with the errors it reported.
    pub(super) fn pass_with_errors(
        &mut self,
        spec: &IpsecSpec,
        key: &PrivateKey,
    ) -> (IpsecOutcome, Vec<String>, Vec<String>) {
        let (mut changes, mut errors) = (Vec::new(), Vec::new());
        let outcome = block_on(reconcile_ipsec(
            &mut self.nl,
            &mut self.plane,
            Some(spec),
            key,
            true,
            &mut changes,
            &mut errors,
        ))
        .unwrap();
        (outcome, changes, errors)
    }

    fn writes(&self) -> u64 {
        self.nl.writes() + self.plane.xfrm.writes()
    }

    pub(super) fn xfrm(&mut self) -> &mut FakeXfrm {
        &mut self.plane.xfrm
    }
}

/// No (key, SPI, destination) went in twice.
pub(super) fn installed_once(x: &FakeXfrm) {
    let mut seen = HashSet::new();
    for sa in &x.added {
        assert!(
            seen.insert((sa.key.as_bytes().to_vec(), sa.spi, sa.dst)),
            "installed twice: {sa:?}"
        );
    }
}

#[test]
fn two_nodes_get_mirror_states_and_a_second_pass_writes_nothing() {
    let (a, b) = (node(1), node(2));
    let mut ka = Kernel::new(book(None, a.epoch));
    let mut kb = Kernel::new(book(None, b.epoch));
    let (out, changes) = ka.pass(&spec(&a, &[&b]), &a.key);
    assert!(out.created && out.lost.is_empty());
    assert_eq!(changes.len(), 1 + 2 + 3, "{changes:#?}");
    kb.pass(&spec(&b, &[&a]), &b.key);
    let a_out = &ka
        .plane
        .xfrm
        .states
        .iter()
        .find(|s| s.spec.src == ip(1))
        .unwrap()
        .spec;
    let b_in = kb.plane.xfrm.state(ip(2), a_out.spi).unwrap();
    assert_eq!((a_out.key.clone(), a_out.spi), (b_in.key.clone(), b_in.spi));
    assert_eq!(a_out.key.len(), 20);
    assert_eq!(a_out.algorithm, "rfc4106(gcm(aes))");
    let dirs: Vec<PolicyDir> = ka.plane.xfrm.policies.iter().map(|p| p.dir).collect();
    assert_eq!(dirs, [PolicyDir::In, PolicyDir::Out, PolicyDir::Fwd]);
    let before = ka.writes();
    let (out, changes) = ka.pass(&spec(&a, &[&b]), &a.key);
    assert_eq!(
        (out, changes.len(), ka.writes() - before),
        (IpsecOutcome::default(), 0, 0)
    );
}

#[test]
fn a_lost_state_is_never_installed_again_and_a_new_epoch_replaces_every_key() {
    let (a, b, c) = (node(1), node(2), node(3));
    let mut me = Node {
        epoch: a.epoch,
        ..node(1)
    };
    me.key = a.key.clone();
    let mut k = Kernel::new(book(None, me.epoch));
    k.pass(&spec(&me, &[&b, &c]), &me.key);
    let victim = k.xfrm().states[0].spec.clone();
    k.xfrm().delete_state(&victim).unwrap();
    let before = k.writes();
    let (out, _) = k.pass(&spec(&me, &[&b, &c]), &me.key);
    assert_eq!(out.lost.len(), 1, "{out:?}");
    assert_eq!(
        k.writes() - before,
        0,
        "nothing installed under the old epoch"
    );
    // The agent bumps; until the new epoch is published nothing is installed either.
    let new = k.plane.book.bump().unwrap();
    let (out, changes) = k.pass(&spec(&me, &[&b, &c]), &me.key);
    assert!(out.lost.is_empty() && changes.is_empty(), "{changes:?}");
    me.epoch = new;
    let old_keys: HashSet<Vec<u8>> = k
        .xfrm()
        .added
        .iter()
        .map(|s| s.key.as_bytes().to_vec())
        .collect();
    let (out, _) = k.pass(&spec(&me, &[&b, &c]), &me.key);
    assert!(out.lost.is_empty());
    assert_eq!(k.xfrm().states.len(), 4, "old states removed, new ones in");
    for s in &k.xfrm().states {
        assert!(
            !old_keys.contains(s.spec.key.as_bytes()),
            "a key of the old epoch: {:?}",
            s.spec
        );
    }
    installed_once(k.xfrm());
}

/// `me`'s spec towards `peer` with one more inbound state: `peer` sending with `peer_epoch`
/// to `me`'s `local_epoch` (a combination staged during a rotation).
fn with_inbound(me: &Node, peer: &Node, peer_epoch: Epoch, local_epoch: Epoch) -> IpsecSpec {
    let mut s = spec(me, &[peer]);
    s.peers[0].inbound.push(EspSa {
        spi: spi(
            net(),
            subnet(peer.n),
            generation(&peer_epoch, &local_epoch, 0),
        )
        .unwrap(),
        local_epoch,
        peer_epoch,
        pq: None,
    });
    s
}

#[test]
fn a_rotation_still_installs_the_left_epochs_keys_once_and_a_bump_does_not() {
    // Node 1 rotates (advance) and learns only afterwards that node 2 moves too: the
    // state for (node 2's next epoch, node 1's left epoch) is installed then, once.
    let (mut me, b) = (node(1), node(2));
    let mut k = Kernel::new(book(None, me.epoch));
    k.pass(&spec(&me, &[&b]), &me.key);
    let left = me.epoch;
    me.epoch = k.plane.book.advance().unwrap();
    let b_next = b.epoch.next().unwrap();
    let late = with_inbound(&me, &b, b_next, left);
    let (out, changes) = k.pass(&late, &me.key);
    assert!(out.lost.is_empty(), "{out:?}");
    let late_spi = late.peers[0].inbound[1].spi;
    assert!(
        k.xfrm().states.iter().any(|s| s.spec.spi == late_spi),
        "{changes:?}"
    );
    let before = k.writes();
    k.pass(&late, &me.key);
    assert_eq!(k.writes(), before, "steady");
    // After a bump (lost state), keys of an earlier epoch never go in again.
    let (mut fresh, c) = (node(1), node(3));
    let mut k = Kernel::new(book(None, fresh.epoch));
    let left = fresh.epoch;
    fresh.epoch = k.plane.book.bump().unwrap();
    let stale = with_inbound(&fresh, &c, c.epoch, left);
    k.pass(&stale, &fresh.key);
    let stale_spi = stale.peers[0].inbound[1].spi;
    assert!(!k.xfrm().states.iter().any(|s| s.spec.spi == stale_spi));
    installed_once(k.xfrm());
}

#[test]
fn a_restart_adopts_intact_states_and_a_reboot_asks_for_a_new_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let store = EspStore::new(dir.path());
    let b = node(2);
    let key = PrivateKey::generate().unwrap();
    let mut k = Kernel::new(book(Some(store.clone()), Epoch::first().unwrap()));
    let me = |epoch| Node {
        key: key.clone(),
        epoch,
        n: 1,
    };
    let epoch = k.plane.book.epoch();
    k.pass(&spec(&me(epoch), &[&b]), &key);
    // Restart: a new book from disk, the same kernel.
    k.plane.book = book(Some(store.clone()), epoch);
    assert_eq!(k.plane.book.epoch(), epoch);
    let before = k.writes();
    let (out, _) = k.pass(&spec(&me(epoch), &[&b]), &key);
    assert_eq!((out.lost.len(), k.writes() - before), (0, 0));
    // Reboot: the kernel is empty, the record is on disk.
    let mut rebooted = Kernel::new(book(Some(store.clone()), epoch));
    let (out, changes) = rebooted.pass(&spec(&me(epoch), &[&b]), &key);
    assert_eq!(
        out.lost.len(),
        3,
        "both states and the empty kernel: {changes:?}"
    );
    assert!(out.lost[2].contains("a reboot or a restored state directory"));
    assert!(rebooted.xfrm().added.is_empty());
    let new = rebooted.plane.book.bump().unwrap();
    assert_eq!(
        store.load().unwrap().epoch,
        new,
        "the new epoch is on disk first"
    );
    rebooted.pass(&spec(&me(new), &[&b]), &key);
    assert_eq!(rebooted.xfrm().states.len(), 2);
    let old: Vec<&EspKey> = k.xfrm().added.iter().map(|s| &s.key).collect();
    assert!(rebooted.xfrm().added.iter().all(|s| !old.contains(&&s.key)));
}

#[test]
fn a_deleted_policy_or_interface_comes_back() {
    let (a, b) = (node(1), node(2));
    let mut k = Kernel::new(book(None, a.epoch));
    k.pass(&spec(&a, &[&b]), &a.key);
    let p = k.xfrm().policies[1].clone();
    k.xfrm().delete_policy(&p).unwrap();
    let (_, changes) = k.pass(&spec(&a, &[&b]), &a.key);
    assert_eq!(changes, [format!("put {p}")]);
    let link = block_on(k.nl.link("flannel-ipsec")).unwrap().unwrap();
    block_on(k.nl.del_link(&link)).unwrap();
    let (out, _) = k.pass(&spec(&a, &[&b]), &a.key);
    assert!(out.created && out.lost.is_empty());
    let xfrm = block_on(k.nl.link("flannel-ipsec")).unwrap().unwrap().xfrm;
    assert_eq!(xfrm.map(|x| x.if_id), Some(IF_ID));
}

#[test]
fn a_thousand_peers_then_zero_writes() {
    let me = node(1);
    let peers: Vec<Node> = (2..1002).map(node).collect();
    let refs: Vec<&Node> = peers.iter().collect();
    let s = spec(&me, &refs);
    let mut k = Kernel::new(book(None, me.epoch));
    k.pass(&s, &me.key);
    assert_eq!(
        (k.xfrm().states.len(), k.xfrm().policies.len()),
        (2000, 3000)
    );
    let spis: HashSet<(Ipv4Addr, u32)> = k
        .xfrm()
        .states
        .iter()
        .map(|s| (s.spec.dst, s.spec.spi))
        .collect();
    assert_eq!(spis.len(), 2000);
    let before = k.writes();
    k.pass(&s, &me.key);
    assert_eq!(k.writes() - before, 0);
    installed_once(k.xfrm());
}
