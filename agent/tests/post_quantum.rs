//! Post-quantum pair secrets (`Backend.PostQuantum`) in the lab, on the userspace device
//! here and on kernel WireGuard in the VM (`kernel_vm`): every pair holds a PSK of its own
//! on both its devices within 5 s of start, a new one every period, while a 100 pps ping
//! loses at most one packet and nothing crosses the underlay in clear; a node that takes
//! no part leaves its pairs classical and reachable; a peer's garbled key and hostile
//! datagrams are refused, by size before anything else, and leave every pair up.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::traffic::Probe;
use weft_lab::wait::{bound, until_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
/// The lab's round period: five of them in the traffic test.
const PERIOD: Duration = Duration::from_secs(8);

/// A lab of `nodes` with `PostQuantum`, its rounds every `period` (the agent's 2 minutes
/// when `None`).
fn config(nodes: usize, period: Option<Duration>) -> LabConfig {
    let mut cfg =
        LabConfig::wireguard(nodes, WEFT).backend_key("PostQuantum", serde_json::Value::Bool(true));
    if let Some(p) = period {
        cfg.extra_args
            .push(format!("--post-quantum-period={}", p.as_secs()));
    }
    cfg
}

/// Each node's PSK by peer key, as its device shows it.
fn psks(lab: &Lab) -> Vec<BTreeMap<String, String>> {
    (0..lab.nodes.len())
        .map(|i| {
            lab.on_node(i, "wg show flannel-wg preshared-keys")
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let mut cols = l.split_whitespace();
                    Some((cols.next()?.to_string(), cols.next()?.to_string()))
                })
                .collect()
        })
        .collect()
}

/// The pairs among `nodes`: each with one PSK on both its devices, no two the same; each
/// pair's PSK, or what differs.
fn agreed(lab: &Lab, nodes: &[usize]) -> Result<BTreeMap<(usize, usize), String>, String> {
    let psks = psks(lab);
    let key = |i: usize| lab.wg_public_key(i).unwrap_or_default();
    let mut out = BTreeMap::new();
    for (x, &i) in nodes.iter().enumerate() {
        for &j in &nodes[x + 1..] {
            let (a, b) = (psks[i].get(&key(j)), psks[j].get(&key(i)));
            match (a, b) {
                (Some(a), Some(b)) if a == b && a != "(none)" => {
                    if out.values().any(|p| p == a) {
                        return Err(format!("pair {i}-{j} has another pair's PSK"));
                    }
                    out.insert((i, j), a.clone());
                }
                _ => return Err(format!("pair {i}-{j}: {a:?} on {i}, {b:?} on {j}")),
            }
        }
    }
    Ok(out)
}

fn status(lab: &Lab, i: usize) -> String {
    lab.on_node(i, &format!("{WEFT} status"))
        .unwrap_or_default()
}

#[test]
fn every_pair_gets_a_psk_of_its_own_that_changes_every_period_without_loss() {
    let lab = Lab::start(config(3, Some(PERIOD))).unwrap();
    let all = [0, 1, 2];
    let started = Instant::now();
    until_or(
        "every pair with a post-quantum PSK of its own on both devices",
        bound(Duration::from_secs(5), Duration::from_secs(10)),
        || agreed(&lab, &all).is_ok(),
        || format!("{:?}\n{}", agreed(&lab, &all), lab.logs()),
    );
    println!(
        "every pair protected {:.1} s after the lab was up",
        started.elapsed().as_secs_f64()
    );
    // `weft status` follows at the pass the last round wakes.
    for i in all {
        until_or(
            "weft status: both of the node's pairs protected",
            Duration::from_secs(5),
            || status(&lab, i).matches(": protected, secret").count() == 2,
            || status(&lab, i),
        );
    }

    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let watch = ClearWatch::start(&lab).unwrap();
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    // Each pair's PSKs as they came. A pair's two devices switch a few milliseconds apart
    // (more under emulation): a read between the two switches is passed over.
    let mut seen: BTreeMap<(usize, usize), Vec<String>> = BTreeMap::new();
    // Six periods' time for five rounds: a round's moment drifts by its own length.
    let end = Instant::now() + 6 * PERIOD;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(250));
        for (pair, psk) in agreed(&lab, &all).unwrap_or_default() {
            let psks = seen.entry(pair).or_default();
            if psks.last() != Some(&psk) {
                psks.push(psk);
            }
        }
    }
    let d = probe.finish().unwrap();
    let watched = watch.finish().unwrap();
    let counts: Vec<usize> = seen.values().map(Vec::len).collect();
    println!("PSKs per pair over 6 periods: {counts:?}; ping {d:?}; {watched:?}, nothing in clear");
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(
        counts.iter().all(|n| *n >= 5),
        "a new PSK every period: {counts:?}"
    );
    let distinct: BTreeSet<&String> = seen.values().flatten().collect();
    assert_eq!(
        distinct.len(),
        counts.iter().sum::<usize>(),
        "every PSK new, and each pair's own"
    );
    assert!(d.pings_lost <= 1, "{d:?}\n{}", lab.logs());
    assert!(d.stream_error.is_none(), "{d:?}");
    lab.assert_all_pairs();
}

#[test]
fn a_node_that_takes_no_part_keeps_its_pairs_classical_and_reachable() {
    let mut cfg = config(3, None);
    cfg.agent_env
        .push((2, "WEFT_POST_QUANTUM_OFF".into(), "true".into()));
    let lab = Lab::start(cfg).unwrap();
    until_or(
        "the pair of the two post-quantum nodes protected",
        bound(Duration::from_secs(5), Duration::from_secs(10)),
        || agreed(&lab, &[0, 1]).is_ok(),
        || lab.logs(),
    );
    lab.assert_all_pairs();
    let psks = psks(&lab);
    let key2 = lab.wg_public_key(2).unwrap();
    for i in [0, 1] {
        assert_eq!(
            psks[i].get(&key2).map(String::as_str),
            Some("(none)"),
            "node {i}"
        );
        let text = status(&lab, i);
        assert!(
            text.contains("classical: it publishes no ML-KEM key"),
            "{text}"
        );
    }
    assert!(psks[2].values().all(|p| p == "(none)"), "{:?}", psks[2]);
}

#[test]
fn a_garbled_key_and_hostile_datagrams_are_refused_and_every_pair_stays_up() {
    let mut cfg = config(3, None);
    // An entry (no agent behind it) publishing an ML-KEM key that does not decode.
    cfg.seed = vec![(
        "/coreos.com/network/subnets/10.244.250.0-24".into(),
        format!(
            r#"{{"PublicIP":"198.51.100.99","BackendType":"wireguard","BackendData":{{"PublicKey":"{}","Port":51820}},"WeftMlKemKey":"{}"}}"#,
            weft_crypto::PrivateKey::generate().unwrap().public_key(),
            "A".repeat(1580)
        ),
    )];
    let lab = Lab::start(cfg).unwrap();
    until_or(
        "every pair of agents protected",
        bound(Duration::from_secs(5), Duration::from_secs(10)),
        || agreed(&lab, &[0, 1, 2]).is_ok(),
        || lab.logs(),
    );
    let text = status(&lab, 0);
    assert!(text.contains("its ML-KEM key does not decode"), "{text}");
    let before = agreed(&lab, &[0, 1, 2]).unwrap();

    // From a pod of node 1, into the tunnel to node 0's agent: junk, a message-sized
    // datagram of garbage, and one far larger than any message.
    let pod = &lab.nodes[1].pods[0];
    let target = lab.nodes[0].subnet.unwrap().network();
    let mut message_sized = b"wpq1".to_vec();
    message_sized.resize(1216, 0);
    let datagrams = vec![b"hello".to_vec(), message_sized, vec![0x77; 60_000]];
    let to = std::net::SocketAddr::new(target.into(), 51823);
    weft_lab::netns::in_named_netns(&pod.ns, move || -> std::io::Result<()> {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
        for d in &datagrams {
            socket.send_to(d, to)?;
        }
        Ok(())
    })
    .join()
    .unwrap()
    .unwrap()
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(agreed(&lab, &[0, 1, 2]).unwrap(), before, "nothing changed");
    lab.assert_all_pairs();
}
