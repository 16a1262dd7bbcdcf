//! The book over a device of three peers, read once a second: node-b faulted, node-c
//! carrying traffic, node-d idle.

use super::*;

/// The tests read once a second.
const READ: Duration = Duration::from_secs(1);
use crate::model::fixtures::{key, tunnel};

fn peer(node: &str, seed: u8) -> PeerSpec {
    PeerSpec {
        node: node.into(),
        public_key: key(seed),
        endpoint: format!("198.51.100.{seed}:51820").parse().unwrap(),
        allowed_ips: vec![format!("10.244.{seed}.0/24").parse().unwrap()],
        keepalive: 0,
        psk: None,
        via: Default::default(),
    }
}

fn spec() -> TunnelSpec {
    tunnel(vec![
        peer("node-b", 2),
        peer("node-c", 3),
        peer("node-d", 4),
    ])
}

/// Counters per peer, each second: `(tx, rx)` for b, c, d.
type Second = [(u64, u64); 3];

fn read(spec: &TunnelSpec, s: &Second) -> HashMap<PublicKey, PeerRead> {
    spec.peers
        .iter()
        .zip(s)
        .map(|(p, (tx, rx))| {
            let counters = Counters {
                tx_bytes: *tx,
                rx_bytes: *rx,
            };
            (
                p.public_key,
                PeerRead {
                    endpoint: Some(p.endpoint),
                    counters,
                },
            )
        })
        .collect()
}

/// Runs the book over `seconds`, probing as told; returns each second's to-dos, probes left
/// out.
fn run(seconds: &[Second]) -> Vec<(usize, Todo)> {
    let spec = spec();
    let start = Instant::now();
    let mut book = Book::default();
    let mut out = Vec::new();
    for (i, s) in seconds.iter().enumerate() {
        let now = start + READ * i as u32;
        for t in book.observe(&spec, &read(&spec, s), now) {
            if let Todo::Probe { device, key, .. } = &t {
                book.probed(device, key, now);
                continue;
            }
            out.push((i, t));
        }
    }
    out
}

/// b stops answering after second 5 (it keeps being sent to); c answers throughout
/// unless `c_dies` (then it stops too); d is idle.
fn fault(seconds: u64, c_dies: bool, b_back: Option<u64>) -> Vec<Second> {
    (0..seconds)
        .map(|i| {
            let b_rx = match b_back {
                Some(back) if i >= back => 900 * i,
                _ => 900 * i.min(5),
            };
            let c_rx = if c_dies { 700 * i.min(5) } else { 700 * i };
            [(1000 * i, b_rx), (800 * i, c_rx), (300, 200)]
        })
        .collect()
}

fn nodes(todo: &[(usize, Todo)]) -> Vec<&str> {
    todo.iter()
        .map(|(_, t)| match t {
            Todo::Probe { node, .. }
            | Todo::Dead { node, .. }
            | Todo::Repair {
                peer: PeerSpec { node, .. },
                ..
            }
            | Todo::BackOff { node, .. }
            | Todo::Alive { node, .. } => node.as_str(),
            Todo::RecreateDevice { .. } | Todo::DeviceBackOff { .. } => "(device)",
        })
        .collect()
}

#[test]
fn one_dead_pair_is_found_repaired_in_small_steps_and_the_others_are_left_alone() {
    let todo = run(&fault(30, false, None));
    assert!(nodes(&todo).iter().all(|n| *n == "node-b"), "{todo:?}");
    let (at, first) = &todo[0];
    assert!(*at <= 10, "dead only at second {at}");
    assert!(matches!(
        first,
        Todo::Dead {
            cause: Cause::Unanswered { .. },
            ..
        }
    ));
    let steps: Vec<(usize, Step)> = todo
        .iter()
        .filter_map(|(i, t)| match t {
            Todo::Repair { step, .. } => Some((*i, *step)),
            _ => None,
        })
        .collect();
    assert_eq!(steps[0], (*at, Step::Reapply), "{todo:?}");
    assert_eq!(steps[1], (at + 2, Step::Rehandshake), "{todo:?}");
    assert!(todo.iter().any(|(i, t)| *i == at + 4
        && matches!(t, Todo::BackOff { pause, .. } if *pause == repair::BACKOFF_FIRST)));
    assert!(!todo
        .iter()
        .any(|(_, t)| matches!(t, Todo::RecreateDevice { .. })));
}

#[test]
fn a_pair_that_never_answered_is_reapplied_but_never_rehandshaken() {
    // b is sent to from the start and never heard from (a node down, or not up yet).
    let seconds: Vec<Second> = (0..30)
        .map(|i| [(1000 * i, 0), (800 * i, 700 * i), (300, 200)])
        .collect();
    let todo = run(&seconds);
    assert!(nodes(&todo).iter().all(|n| *n == "node-b"), "{todo:?}");
    assert!(
        todo.iter().any(|(_, t)| matches!(t, Todo::Dead { .. })),
        "{todo:?}"
    );
    let s = steps(&todo);
    assert!(!s.is_empty(), "{todo:?}");
    assert!(s.iter().all(|(_, step)| *step == Step::Reapply), "{todo:?}");
    // Re-applied, given its 2 s, then the pause: no re-handshake between.
    assert!(todo.iter().any(|(i, t)| *i == s[0].0 + 2
        && matches!(t, Todo::BackOff { pause, .. } if *pause == repair::BACKOFF_FIRST)));
}

#[test]
fn a_pair_that_answers_after_a_repair_is_alive_again_and_says_what_worked() {
    let todo = run(&fault(30, false, Some(10)));
    let alive: Vec<&Todo> = todo
        .iter()
        .filter(|(_, t)| matches!(t, Todo::Alive { .. }))
        .map(|(_, t)| t)
        .collect();
    assert_eq!(alive.len(), 1, "{todo:?}");
    assert!(matches!(
        alive[0],
        Todo::Alive { repaired_by: Some(Step::Reapply), dead_for, .. } if *dead_for < Duration::from_secs(6)
    ));
    // Nothing after it.
    let (last, _) = todo.last().unwrap();
    assert_eq!(todo.iter().filter(|(i, _)| i == last).count(), 1);
}

#[test]
fn every_busy_pair_dead_recreates_the_device_once() {
    let todo = run(&fault(20, true, None));
    let recreated: Vec<usize> = todo
        .iter()
        .filter(|(_, t)| matches!(t, Todo::RecreateDevice { .. }))
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(recreated.len(), 1, "{todo:?}");
    assert!(!nodes(&todo).contains(&"node-d"), "the idle pair: {todo:?}");
}

#[test]
fn an_idle_device_has_nothing_to_do() {
    let idle: Vec<Second> = (0..60).map(|_| [(10, 10), (20, 20), (30, 30)]).collect();
    assert_eq!(run(&idle), vec![]);
}

#[test]
fn a_device_that_does_not_answer_is_recreated_then_left_a_pause() {
    let spec = spec();
    let start = Instant::now();
    let mut book = Book::default();
    // Traffic on b and c, then the device stops answering at second 3.
    for i in 0..3u32 {
        let s = [(1000 * u64::from(i), 900 * u64::from(i)), (10, 10), (0, 0)];
        book.observe(&spec, &read(&spec, &s), start + READ * i);
    }
    let since = start + READ * 3;
    let mut todo = Vec::new();
    for i in 3..20u32 {
        for t in book.unanswered(&spec, since, start + READ * i) {
            todo.push((i, t));
        }
    }
    let first = 3 + DEAD_AFTER.as_secs() as u32;
    assert_eq!(todo.first().map(|(i, _)| *i), Some(first), "{todo:?}");
    let dead: Vec<&str> = todo
        .iter()
        .filter_map(|(_, t)| match t {
            Todo::Dead { node, cause, .. } => {
                assert_eq!(*cause, Cause::DeviceNotAnswering);
                Some(node.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(dead, ["node-b", "node-c", "node-d"]);
    let device: Vec<(u32, bool)> = todo
        .iter()
        .filter_map(|(i, t)| match t {
            Todo::RecreateDevice { .. } => Some((*i, true)),
            Todo::DeviceBackOff { .. } => Some((*i, false)),
            _ => None,
        })
        .collect();
    let pause_at = first + repair::RECREATE_WAIT.as_secs() as u32;
    assert_eq!(device, [(first, true), (pause_at, false)]);
    // The device made again answers: its pairs are judged afresh, idle ones idle.
    let s = [(0, 0), (0, 0), (0, 0)];
    book.observe(&spec, &read(&spec, &s), start + READ * 21);
    assert!(book.states().all(|(.., state)| *state == PairState::Idle));
}

#[test]
fn a_roamed_endpoint_that_stops_answering_is_named_so() {
    let cause = Cause::Unanswered {
        endpoint: "203.0.113.9:40000".parse().ok(),
        planned: "198.51.100.2:51820".parse().unwrap(),
    };
    assert_eq!(cause.label(), "roamed endpoint unanswered");
    assert!(cause
        .to_string()
        .contains("the registry's is 198.51.100.2:51820"));
}

#[test]
fn a_staged_key_and_a_peer_missing_from_the_device_are_not_judged() {
    let mut spec = spec();
    spec.peers[0].allowed_ips.clear(); // node-b's entry is a key being staged
    let start = Instant::now();
    let mut book = Book::default();
    let mut todo = Vec::new();
    for i in 0..20u32 {
        let mut r = read(&spec, &[(1000 * u64::from(i), 0), (10, 10), (0, 0)]);
        r.remove(&key(3)); // node-c is not on the device
        todo.extend(book.observe(&spec, &r, start + READ * i));
    }
    assert_eq!(todo, vec![]);
    assert_eq!(
        probe_target(&peer("node-c", 3)),
        Some("10.244.3.0".parse().unwrap())
    );
}

/// b sits behind a NAT (keepalive 5 s) that rebinds at second 5: the port WireGuard had
/// learned stops answering. The re-apply puts the registry's endpoint (the NAT's front
/// door, which leads nowhere); only b's next keepalive, on the session this node still
/// holds, shows its new port. So b is not re-handshaken (which would drop that session)
/// before its keepalive interval has passed; `b_back`: the second b's keepalive arrives.
fn natted(b_back: Option<usize>, planned_answers: bool) -> Vec<(usize, Todo)> {
    let mut spec = spec();
    spec.peers[0].keepalive = 5;
    let learned: SocketAddr = "203.0.113.9:40000".parse().unwrap();
    let start = Instant::now();
    let mut book = Book::default();
    if planned_answers {
        book.answering.insert(spec.peers[0].endpoint.ip());
    }
    let mut out = Vec::new();
    let mut endpoint = learned;
    for i in 0..30usize {
        let now = start + READ * i as u32;
        let back = b_back.is_some_and(|at| i >= at);
        let s = fault(30, false, b_back.map(|at| at as u64))[i];
        let mut r = read(&spec, &s);
        if back {
            endpoint = "203.0.113.9:45001".parse().unwrap(); // roamed to the new port
        }
        if let Some(b) = r.get_mut(&key(2)) {
            b.endpoint = Some(endpoint);
        }
        for t in book.observe(&spec, &r, now) {
            match &t {
                Todo::Probe { device, key, .. } => book.probed(device, key, now),
                Todo::Repair { peer, .. } => {
                    endpoint = peer.endpoint;
                    out.push((i, t));
                }
                _ => out.push((i, t)),
            }
        }
    }
    out
}

fn steps(todo: &[(usize, Todo)]) -> Vec<(usize, Step)> {
    todo.iter()
        .filter_map(|(i, t)| match t {
            Todo::Repair { step, .. } => Some((*i, *step)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_natted_pair_is_repaired_by_its_own_packets_never_by_an_endpoint_it_cannot_be_reached_at() {
    // Nothing comes back, and the registry's endpoint (a NAT's address, port 51820) answers
    // no probe: the re-apply keeps the endpoint WireGuard learned, and the sessions the
    // peer's next packets arrive on are never dropped (no re-handshake), however long.
    let todo = natted(None, false);
    let s = steps(&todo);
    assert!(s.iter().all(|(_, step)| *step == Step::Reapply), "{todo:?}");
    for (_, t) in &todo {
        if let Todo::Repair { peer, .. } = t {
            assert_eq!(
                peer.endpoint,
                "203.0.113.9:40000".parse().unwrap(),
                "{todo:?}"
            );
        }
    }
    assert!(
        todo.iter().any(|(_, t)| matches!(t, Todo::BackOff { .. })),
        "{todo:?}"
    );
    // The peer's keepalive from its new port comes: alive by what it showed.
    let reapplied = s[0].0;
    let todo = natted(Some(reapplied + 4), false);
    assert_eq!(steps(&todo), [(reapplied, Step::Reapply)], "{todo:?}");
    assert!(todo.iter().any(|(_, t)| matches!(t, Todo::Alive { .. })));
}

#[test]
fn a_roamed_pair_whose_planned_endpoint_answers_is_put_back_and_given_its_keepalive_first() {
    // The registry's endpoint answers probes: the re-apply puts it back, and the
    // re-handshake waits the keepalive interval on top.
    let todo = natted(None, true);
    let s = steps(&todo);
    assert_eq!(s[0].1, Step::Reapply, "{todo:?}");
    assert_eq!(s[1], (s[0].0 + 2 + 5, Step::Rehandshake), "{todo:?}");
    // The keepalive comes 4 s after the re-apply (later than `STEP_WAIT`): the pair is
    // alive again by the re-apply alone, its session kept.
    let reapplied = s[0].0;
    let todo = natted(Some(reapplied + 4), true);
    assert_eq!(steps(&todo), [(reapplied, Step::Reapply)], "{todo:?}");
    assert!(todo.iter().any(|(_, t)| matches!(
        t,
        Todo::Alive {
            repaired_by: Some(Step::Reapply),
            ..
        }
    )));
    // A pair that had not roamed keeps the short wait.
    assert_eq!(
        repair::reapply_wait(
            &Cause::Unanswered {
                endpoint: "198.51.100.2:51820".parse().ok(),
                planned: "198.51.100.2:51820".parse().unwrap(),
            },
            5
        ),
        repair::STEP_WAIT
    );
}

#[test]
fn pairs_that_never_answered_are_dead_but_never_recreate_the_device() {
    // Every peer is sent to from the start (the handshake primed when it was added) and
    // none ever answers: nodes that are down, not a device at fault.
    let silent: Vec<Second> = (0..40)
        .map(|i| [(148 * (i + 1), 0), (148 * (i + 1), 0), (148 * (i + 1), 0)])
        .collect();
    let todo = run(&silent);
    let dead = todo
        .iter()
        .filter(|(_, t)| matches!(t, Todo::Dead { .. }))
        .count();
    assert_eq!(dead, 3, "{todo:?}");
    assert!(
        !todo
            .iter()
            .any(|(_, t)| matches!(t, Todo::RecreateDevice { .. } | Todo::DeviceBackOff { .. })),
        "{todo:?}"
    );
}
