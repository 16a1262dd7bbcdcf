//! Two nodes' tasks over real UDP sockets (on two loopback addresses, one port): a round
//! completes and both hold one PSK; a restarted node puts its PSK back; strangers, junk
//! and oversized datagrams change nothing.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use weft_backends::model::{PqKey, PqPeer};
use weft_crypto::pq::{KemKeyPair, Own, Timing};
use weft_crypto::{PresharedKey, PrivateKey};

use super::*;

/// Short periods and repeats, so rounds complete within a test.
pub(super) fn timing() -> Timing {
    Timing {
        period: 60_000,
        retry: 100,
        max_retry: 1_000,
        round_lifetime: 10_000,
        switch_delay: 100,
        freshness: 300_000,
        min_gap: 500,
    }
}

struct Node {
    key: PrivateKey,
    seed: [u8; 64],
    ip: IpAddr,
    dir: tempfile::TempDir,
}

impl Node {
    fn new(last: u8) -> Node {
        Node {
            key: PrivateKey::generate().unwrap(),
            seed: weft_crypto::random_bytes().unwrap(),
            ip: IpAddr::V4(Ipv4Addr::new(127, 0, 0, last)),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn start(&self, port: u16) -> Handle {
        spawn(Config {
            own: Own {
                key: self.key.clone(),
                kem: KemKeyPair::from_seed(self.seed),
                previous_kem: None,
            },
            listen: Listen {
                rounds: vec![self.ip],
                notices: Vec::new(),
            },
            port,
            state_dir: self.dir.path().to_path_buf(),
            timing: timing(),
        })
        .unwrap()
    }

    fn as_peer(&self) -> PqPeer {
        PqPeer {
            node: format!("node-{}", self.ip),
            public_key: self.key.public_key(),
            address: self.ip,
            underlay: self.ip,
            ek: PqKey::Published(KemKeyPair::from_seed(self.seed).encaps_key()),
        }
    }
}

/// A port free on both loopback addresses.
fn free_port() -> u16 {
    loop {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = s.local_addr().unwrap().port();
        if std::net::UdpSocket::bind(("127.0.0.2", port)).is_ok()
            && std::net::UdpSocket::bind(("127.0.0.3", port)).is_ok()
        {
            return port;
        }
    }
}

/// The PSK `handle` holds for `peer`, once it holds one (at most 5 s).
async fn psk_for(handle: &mut Handle, peer: &PublicKey) -> PresharedKey {
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(s) = handle.published.borrow_and_update().psks.get(peer) {
                return s.psk.clone();
            }
            handle.published.changed().await.unwrap();
        }
    })
    .await
    .expect("a post-quantum PSK within 5 s")
}

#[tokio::test]
async fn two_nodes_agree_on_a_psk_and_a_restart_keeps_it() {
    let port = free_port();
    let (a, b) = (Node::new(1), Node::new(2));
    let (mut ha, mut hb) = (a.start(port), b.start(port));
    ha.peers.send_replace(PqList::of(vec![b.as_peer()]));
    hb.peers.send_replace(PqList::of(vec![a.as_peer()]));
    let at_a = psk_for(&mut ha, &b.key.public_key()).await;
    let at_b = psk_for(&mut hb, &a.key.public_key()).await;
    assert_eq!(at_a, at_b);
    let status = ha
        .status
        .lock()
        .unwrap()
        .get(&b.key.public_key())
        .cloned()
        .unwrap();
    assert!(
        status.round_ms.is_some() && status.classical_because.is_none(),
        "{status:?}"
    );
    assert_eq!(status.rounds, 1);

    // a restarts: its saved PSK is back in force before any new round.
    drop(ha);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut ha = a.start(port);
    assert_eq!(
        ha.published
            .borrow()
            .psks
            .get(&b.key.public_key())
            .map(|s| &s.psk),
        Some(&at_b),
        "in force before the plan lists the peer"
    );
    ha.peers.send_replace(PqList::of(vec![b.as_peer()]));
    assert_eq!(psk_for(&mut ha, &b.key.public_key()).await, at_b);
}

#[tokio::test]
async fn strangers_junk_and_huge_datagrams_change_nothing() {
    let port = free_port();
    let (mut a, mut b) = (Node::new(1), Node::new(2));
    // `a` leads the pair: the lower key.
    if a.key.public_key() > b.key.public_key() {
        std::mem::swap(&mut a.key, &mut b.key);
    }
    let (mut ha, mut hb) = (a.start(port), b.start(port));
    ha.peers.send_replace(PqList::of(vec![b.as_peer()]));
    hb.peers.send_replace(PqList::of(vec![a.as_peer()]));
    let before = psk_for(&mut ha, &b.key.public_key()).await;

    // From a third address: junk, a datagram far larger than any message, and a stranger's
    // init claiming to come from `b`'s peer.
    let stranger = std::net::UdpSocket::bind(("127.0.0.3", 0)).unwrap();
    let to = (a.ip, port);
    stranger.send_to(b"hello", to).unwrap();
    stranger.send_to(&vec![0x77; 60_000], to).unwrap();
    let mut forged = weft_crypto::pq::Exchange::new(
        &Own {
            key: PrivateKey::generate().unwrap(),
            kem: KemKeyPair::generate().unwrap(),
            previous_kem: None,
        },
        a.key.public_key(),
        KemKeyPair::from_seed(a.seed).encaps_key(),
        timing(),
        1,
    )
    .unwrap();
    for d in forged.poll(1).unwrap().send {
        stranger.send_to(&d, to).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        ha.published
            .borrow()
            .psks
            .get(&b.key.public_key())
            .map(|s| &s.psk),
        Some(&before)
    );
    // The task is alive and the pair still works: a new round gives both a new PSK.
    ha.fall_back.send(b.as_peer().node).await.unwrap();
    let after = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let now = hb
                .published
                .borrow_and_update()
                .psks
                .get(&a.key.public_key())
                .map(|s| s.psk.clone());
            if now.as_ref().is_some_and(|p| *p != before) {
                return now.unwrap();
            }
            hb.published.changed().await.unwrap();
        }
    })
    .await
    .expect("a new round after the junk");
    assert_eq!(psk_for(&mut ha, &b.key.public_key()).await, after);
}

#[tokio::test]
async fn a_peer_without_a_key_is_classical_with_the_reason() {
    let port = free_port();
    let (a, b) = (Node::new(1), Node::new(2));
    let ha = a.start(port);
    let mut peer = b.as_peer();
    peer.ek = PqKey::None;
    ha.peers.send_replace(PqList::of(vec![peer]));
    tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            if let Some(s) = ha.status.lock().unwrap().get(&b.key.public_key()) {
                if s.classical_because
                    .as_deref()
                    .is_some_and(|w| w.contains("publishes no ML-KEM key"))
                {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the reason in the status");
    assert!(ha.published.borrow().psks.is_empty());
}

/// A peer that leaves the listing (a registry restored from a snapshot, a lease lost and
/// claimed again) and comes back with its key finds the pair's PSK it never stopped using:
/// kept and still published meanwhile; the other pairs untouched.
#[tokio::test]
async fn a_peer_dropped_from_the_plan_and_back_keeps_its_psk_and_the_others_theirs() {
    let port = free_port();
    let (a, b, c) = (Node::new(1), Node::new(2), Node::new(3));
    let (mut ha, hb, mut hc) = (a.start(port), b.start(port), c.start(port));
    ha.peers
        .send_replace(PqList::of(vec![b.as_peer(), c.as_peer()]));
    hb.peers.send_replace(PqList::of(vec![a.as_peer()]));
    hc.peers.send_replace(PqList::of(vec![a.as_peer()]));
    let with_b = psk_for(&mut ha, &b.key.public_key()).await;
    let with_c = psk_for(&mut ha, &c.key.public_key()).await;
    assert_eq!(psk_for(&mut hc, &a.key.public_key()).await, with_c);

    ha.peers.send_replace(PqList::of(vec![b.as_peer()]));
    tokio::time::timeout(Duration::from_secs(2), async {
        while ha.status.lock().unwrap().contains_key(&c.key.public_key()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("c's pair gone from the status");
    let published = ha.published.borrow().clone();
    assert_eq!(
        published.psks.get(&b.key.public_key()).map(|s| &s.psk),
        Some(&with_b),
        "b's pair untouched"
    );
    assert_eq!(
        published.psks.get(&c.key.public_key()).map(|s| &s.psk),
        Some(&with_c),
        "c's PSK kept for its return"
    );

    ha.peers
        .send_replace(PqList::of(vec![b.as_peer(), c.as_peer()]));
    tokio::time::timeout(Duration::from_secs(2), async {
        while !ha.status.lock().unwrap().contains_key(&c.key.public_key()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("c's pair back in the status");
    assert_eq!(psk_for(&mut ha, &c.key.public_key()).await, with_c);
    assert_eq!(psk_for(&mut hc, &a.key.public_key()).await, with_c);
    drop(hb);
}

#[tokio::test]
async fn a_new_own_key_plans_every_pair_classical_until_the_task_has_it() {
    let port = free_port();
    let (a, b) = (Node::new(1), Node::new(2));
    let (mut ha, hb) = (a.start(port), b.start(port));
    ha.peers.send_replace(PqList::of(vec![b.as_peer()]));
    hb.peers.send_replace(PqList::of(vec![a.as_peer()]));
    psk_for(&mut ha, &b.key.public_key()).await;
    let (old, new) = (a.key.public_key(), PrivateKey::generate().unwrap());
    let published = ha.published.borrow().clone();
    assert_eq!(published.own, Some(old));
    assert_eq!(published.psks_for(&old).len(), 1);
    // The loop switched its key and plans before the task heard of it: no pair's PSK.
    assert!(published.psks_for(&new.public_key()).is_empty());
    // Once told, the task forgets the pairs made under the old key.
    ha.own_key.send(new.clone()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(2), async {
        while ha.published.borrow_and_update().own != Some(new.public_key()) {
            ha.published.changed().await.unwrap();
        }
    })
    .await
    .expect("the task publishes under the new key");
    assert!(ha.published.borrow().psks.is_empty());
    drop(hb);
}

/// The loop hands over a plan patched from the last one with the nodes it re-planned: the
/// task changes those nodes' pairs and leaves every other as it was.
#[tokio::test]
async fn a_patched_list_changes_the_pairs_of_its_nodes_alone() {
    use weft_backends::model::DesiredState;
    use weft_backends::plan::{PatchedNode, PlanStamp};

    let port = free_port();
    let (a, b, c) = (Node::new(1), Node::new(2), Node::new(3));
    let (mut ha, hb, mut hc) = (a.start(port), b.start(port), c.start(port));
    hb.peers.send_replace(PqList::of(vec![a.as_peer()]));
    hc.peers.send_replace(PqList::of(vec![a.as_peer()]));
    let mut list = PqList::default();
    let mut hand_over = |generation: u64, peers: Vec<PqPeer>, nodes: &[&Node]| {
        let nodes: Vec<PatchedNode> = (nodes.iter())
            .map(|n| PatchedNode {
                node: n.as_peer().node,
                ..Default::default()
            })
            .collect();
        let stamp = PlanStamp {
            generation: Some(generation),
            patched: (!nodes.is_empty()).then_some((generation - 1, nodes.as_slice())),
        };
        let plan = Arc::new(DesiredState {
            post_quantum: peers,
            ..Default::default()
        });
        assert!(list.follow(&plan, &stamp));
        assert_eq!(list.changed.is_some(), !nodes.is_empty());
        list.clone()
    };
    ha.peers.send_replace(hand_over(1, vec![b.as_peer()], &[]));
    let with_b = psk_for(&mut ha, &b.key.public_key()).await;
    // Node c joins.
    ha.peers
        .send_replace(hand_over(2, vec![b.as_peer(), c.as_peer()], &[&c]));
    let with_c = psk_for(&mut ha, &c.key.public_key()).await;
    assert_eq!(psk_for(&mut hc, &a.key.public_key()).await, with_c);
    let psk = |h: &Handle, n: &Node| {
        let published = h.published.borrow();
        published
            .psks
            .get(&n.key.public_key())
            .map(|s| s.psk.clone())
    };
    assert_eq!(psk(&ha, &b), Some(with_b), "b's pair untouched");
    assert!(ha.status.lock().unwrap().contains_key(&b.key.public_key()));
    // Node b leaves: its pair goes, c's stays.
    ha.peers
        .send_replace(hand_over(3, vec![c.as_peer()], &[&b]));
    tokio::time::timeout(Duration::from_secs(2), async {
        while ha.status.lock().unwrap().contains_key(&b.key.public_key()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("b's pair gone from the status");
    assert!(ha.status.lock().unwrap().contains_key(&c.key.public_key()));
    assert_eq!(psk(&ha, &c), Some(with_c), "c's pair untouched");
    drop(hb);
}

/// The agent's arguments with `--post-quantum-port=port`.
fn args_with_port(port: u16) -> crate::cli::AgentArgs {
    let port = format!("--post-quantum-port={port}");
    let cli = crate::cli::Cli::parse_with_env(
        ["weft", "agent", port.as_str()].into_iter().map(Into::into),
        &|_: &str| None,
    )
    .unwrap();
    match cli.command {
        crate::cli::Command::Agent(a) => *a,
        other => panic!("not the agent: {other:?}"),
    }
}

/// Whether `socket` gets a datagram within `wait`.
fn answered(socket: &std::net::UdpSocket, wait: Duration) -> bool {
    socket.set_read_timeout(Some(wait)).unwrap();
    let mut buf = vec![0u8; 65_536];
    socket.recv_from(&mut buf).is_ok()
}

#[tokio::test]
async fn on_wireguard_the_rounds_listen_on_the_tunnel_address_and_the_underlay_takes_only_notices()
{
    let port = free_port();
    // `b` has tunnel address 127.0.0.2 (its subnet's network address) and public IP
    // 127.0.0.8; its peer `a` is at 127.0.0.1. `a` leads: the lower key.
    let (mut a, mut b) = (Node::new(1), Node::new(2));
    if a.key.public_key() > b.key.public_key() {
        std::mem::swap(&mut a.key, &mut b.key);
    }
    let wireguard = weft_backends::netconf::parse(
        r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#,
    )
    .unwrap();
    let listen = Listen::of(
        &wireguard.backend,
        &["127.0.0.2/32".parse().unwrap()],
        &[IpAddr::V4(Ipv4Addr::new(127, 0, 0, 8))],
    );
    assert_eq!(
        listen,
        Listen {
            rounds: vec![IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))],
            notices: vec![IpAddr::V4(Ipv4Addr::new(127, 0, 0, 8))],
        }
    );
    let hb = start(
        Some(KemKeyPair::from_seed(b.seed)),
        &b.key,
        &args_with_port(port),
        b.dir.path(),
        listen,
    );
    hb.peers.send_replace(PqList::of(vec![a.as_peer()]));
    // Not on every address: the port is free on another of the node's addresses.
    let elsewhere = std::net::UdpSocket::bind(("127.0.0.9", port));
    assert!(
        elsewhere.is_ok(),
        "the port is taken on 127.0.0.9: {elsewhere:?}"
    );

    // `a`'s first message of a round, sent from its address for rounds.
    let at_a = std::net::UdpSocket::bind((a.ip, port)).unwrap();
    let own_a = Own {
        key: a.key.clone(),
        kem: KemKeyPair::from_seed(a.seed),
        previous_kem: None,
    };
    let b_ek = KemKeyPair::from_seed(b.seed).encaps_key();
    let now = now_ms();
    let mut ex =
        weft_crypto::pq::Exchange::new(&own_a, b.key.public_key(), b_ek, timing(), now).unwrap();
    let init = ex.poll(now).unwrap().send;
    assert_eq!(init.len(), 1, "a leads: one init");
    tokio::time::sleep(Duration::from_millis(100)).await;
    // To the public IP: refused unread (only a classical notice is taken there).
    at_a.send_to(&init[0], ("127.0.0.8", port)).unwrap();
    let underlay = tokio::task::spawn_blocking({
        let s = at_a.try_clone().unwrap();
        move || answered(&s, Duration::from_millis(500))
    });
    assert!(!underlay.await.unwrap(), "a round answered on the underlay");
    // To the tunnel address: answered.
    at_a.send_to(&init[0], ("127.0.0.2", port)).unwrap();
    let tunnel = tokio::task::spawn_blocking(move || answered(&at_a, Duration::from_secs(3)));
    assert!(
        tunnel.await.unwrap(),
        "no reply to a round on the tunnel address"
    );
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}
