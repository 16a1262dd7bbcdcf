//! Post-quantum pair secrets (`Backend.PostQuantum`) in the lab, on the userspace device
//! here and on kernel WireGuard in the VM (`kernel_vm`): every pair holds a PSK of its own
//! on both its devices within 5 s of start, a new one every period, while a 100 pps ping
//! loses at most one packet and nothing crosses the underlay in clear; a node that takes
//! no part leaves its pairs classical and reachable; a peer's garbled key and hostile
//! datagrams are refused, by size before anything else, and leave every pair up. On ipsec
//! (kernel ESP: the VM), every pair's ESP keys take the PSK, in a slot of their own that
//! alternates, new keys every period, with the same bounds on loss and leaks.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::pinger::{unix_ms, unix_now, Pinger};
use weft_lab::traffic::Probe;
use weft_lab::wait::{self, bound, until_or};

mod pq_lab;
use pq_lab::*;

/// The lab's round period: five of them in the traffic test.
const PERIOD: Duration = Duration::from_secs(8);
/// Pings at 100 pps the ipsec lab may lose over its 6 periods: the target, as on WireGuard.
/// (Before a late pass's grace ran from the pass, a PSK first planned seconds after its
/// moment cost one hole of up to 400 ms: docs/post-quantum.md.)
const IPSEC_LOSS: u64 = 1;

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
    status_follows(&lab);

    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let watch = ClearWatch::start(&lab).unwrap();
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    let started_rounds = Instant::now();
    // Each node's PSK for each peer as it came, one device at a time; a pair's PSK counts
    // once both of its nodes have been seen holding it. (A pair's two devices switch apart,
    // and one read of every device takes seconds under emulation: reads that had to catch
    // both devices holding the same PSK at once missed rounds there, four and two a pair
    // in CI's VM where the agents logged a new PSK every period.)
    let keys: Vec<String> = all.iter().map(|&i| lab.wg_public_key(i).unwrap()).collect();
    let mut held: BTreeMap<(usize, usize), Vec<String>> = BTreeMap::new();
    // Until every pair has had five rounds: within six periods (a round's moment drifts by
    // its own length), twelve under emulation, where one read of a device takes a second
    // or more and a pair's PSK is seen only once each of its two devices was read while it
    // held it (the VM saw 6, 6 and 5 in 9.6 periods while the agents logged a round a
    // period).
    let end = Instant::now() + bound(6 * PERIOD, 12 * PERIOD);
    let five_each = |seen: &BTreeMap<(usize, usize), Vec<String>>| {
        seen.len() == 3 && seen.values().all(|psks| psks.len() >= 5)
    };
    while Instant::now() < end && !five_each(&held_by_both(&held)) {
        std::thread::sleep(Duration::from_millis(250));
        for (i, by_key) in psks(&lab).iter().enumerate() {
            for (j, key) in keys.iter().enumerate().filter(|(j, _)| *j != i) {
                let Some(psk) = by_key.get(key).filter(|p| *p != "(none)") else {
                    continue;
                };
                let psks = held.entry((i, j)).or_default();
                if psks.last() != Some(psk) {
                    psks.push(psk.clone());
                }
            }
        }
    }
    let seen = held_by_both(&held);
    let d = probe.finish().unwrap();
    let watched = watch.finish().unwrap();
    let counts: Vec<usize> = seen.values().map(Vec::len).collect();
    println!(
        "PSKs per pair in {:.1} periods: {counts:?}; ping {d:?}; {watched:?}, nothing in clear",
        started_rounds.elapsed().as_secs_f64() / PERIOD.as_secs_f64()
    );
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(
        counts.iter().all(|n| *n >= 5),
        "a new PSK every period: {counts:?}\n{}",
        pq_lines(&lab)
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
fn a_cluster_psk_rotation_changes_every_post_quantum_pair_at_its_moment_without_loss() {
    // The lab's etcd speaks plain HTTP: the agents must be told to accept the PSK in clear.
    let mut cfg = config(3, None);
    cfg.extra_args.push("--etcd-insecure".into());
    let lab = Lab::start(cfg).unwrap();
    let all = [0, 1, 2];
    let genpsk = || {
        weft_crypto::PresharedKey::generate()
            .unwrap()
            .to_base64_secret()
    };
    let key = "/coreos.com/network/weft/psk";
    let first = genpsk();
    until_or(
        "every pair post-quantum",
        bound(Duration::from_secs(5), Duration::from_secs(10)),
        || agreed(&lab, &all).is_ok(),
        || format!("{:?}\n{}", agreed(&lab, &all), lab.logs()),
    );
    let alone = agreed(&lab, &all).unwrap();
    // The cluster PSK is combined with each pair's own: every pair's PSK changes, and no
    // device shows the cluster PSK itself.
    lab.etcd()
        .etcdctl(&["put", key, &format!(r#"{{"PSK": "{first}"}}"#)])
        .unwrap();
    // Until every pair's PSK differs from what it was in `old`.
    let wait_changed = |what: &str, old: &BTreeMap<(usize, usize), String>| {
        until_or(
            what,
            Duration::from_secs(5),
            || {
                agreed(&lab, &all)
                    .is_ok_and(|now| now.iter().all(|(pair, psk)| old.get(pair) != Some(psk)))
            },
            || format!("{:?}\n{}", agreed(&lab, &all), lab.logs()),
        )
    };
    wait_changed("every pair's PSK combined with the cluster PSK", &alone);
    let combined = agreed(&lab, &all).unwrap();
    assert!(!combined.values().any(|p| *p == first), "{combined:?}");

    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let watch = ClearWatch::start(&lab).unwrap();
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    let next = genpsk();
    // The moment is 5 s ahead: until a second before it, every pair keeps its PSK.
    let at = unix_ms() + 5000;
    let value = format!(r#"{{"PSK": "{first}", "NextPSK": "{next}", "SwitchAt": {at}}}"#);
    lab.etcd().etcdctl(&["put", key, &value]).unwrap();
    wait::throughout_or(
        "every pair keeping its PSK until a second before the moment",
        Duration::from_millis(u64::try_from(at.saturating_sub(unix_ms() + 1000)).unwrap_or(0)),
        || agreed(&lab, &all).as_ref() == Ok(&combined),
        || format!("{:?}", agreed(&lab, &all)),
    );
    wait_changed(
        "every pair's PSK combined with the next cluster PSK",
        &combined,
    );
    let after = agreed(&lab, &all).unwrap();
    assert!(!after.values().any(|p| *p == next), "{after:?}");
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(5)),
        "{}",
        lab.logs()
    );
    let d = probe.finish().unwrap();
    let watched = watch.finish().unwrap();
    println!(
        "cluster PSK rotation on post-quantum pairs: ping {d:?}; {watched:?}, nothing in clear"
    );
    assert!(d.pings_lost <= 1, "{d:?}\n{}", lab.logs());
    assert!(d.stream_error.is_none(), "{d:?}");
    lab.assert_all_pairs();
}

#[test]
fn a_key_rotation_takes_the_ml_kem_key_along_and_every_pair_is_protected_again() {
    let lab = Lab::start(config(3, None)).unwrap();
    let all = [0, 1, 2];
    until_or(
        "every pair protected",
        bound(Duration::from_secs(5), Duration::from_secs(10)),
        || agreed(&lab, &all).is_ok(),
        || lab.logs(),
    );
    let before = agreed(&lab, &all).unwrap();
    let published = |i: usize| {
        lab.published_lease(i)
            .and_then(|l| l.get("WeftMlKemKey")?.as_str().map(str::to_string))
            .unwrap_or_default()
    };
    let key_file = lab.nodes[0].dir.join("lib/mlkem.key");
    let (ek_before, file_before) = (published(0), std::fs::read_to_string(&key_file).unwrap());
    assert!(!ek_before.is_empty());

    let (a, b) = (&lab.nodes[1].pods[0], &lab.nodes[0].pods[0]);
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    let out = lab
        .on_node(0, &format!("{WEFT} keys rotate --timeout 30"))
        .unwrap_or_else(|e| panic!("{e:#}\n{}", lab.logs()));
    assert!(out.contains("switched to"), "{out}");
    // A new ML-KEM key, kept 0600 and published; the rounds of node 0's pairs use it (the
    // peers encapsulate to the published key, which node 0 alone can decapsulate).
    let file_after = std::fs::read_to_string(&key_file).unwrap();
    assert_ne!(file_after, file_before, "mlkem.key rewritten");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    until_or(
        "node 0's new ML-KEM key published",
        Duration::from_secs(10),
        || {
            let ek = published(0);
            !ek.is_empty() && ek != ek_before
        },
        || lab.logs(),
    );
    until_or(
        "every pair protected, node 0's two with new PSKs",
        bound(Duration::from_secs(5), Duration::from_secs(10)),
        || {
            agreed(&lab, &all).is_ok_and(|now| {
                now.iter()
                    .filter(|((i, _), _)| *i == 0)
                    .all(|(pair, psk)| before.get(pair) != Some(psk))
            })
        },
        || format!("{:?}\n{}", agreed(&lab, &all), lab.logs()),
    );
    let d = probe.finish().unwrap();
    println!("key and ML-KEM key rotated: ping {d:?}");
    assert!(d.pings_lost <= 3, "{d:?}\n{}", lab.logs());
    let text = status(&lab, 0);
    assert_eq!(text.matches(": protected, secret").count(), 2, "{text}");
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

/// A node that lost its saved PSKs (and its device's sessions) comes back classical while
/// its peer still holds the pair's PSK: their handshakes fail. Only the node that lost them
/// sends (a ping its peer never gets, so never answers): its liveness watcher finds the pair
/// dead, re-applies and re-handshakes it, then tells the peer it is classical; the peer
/// goes classical too, the ping gets through, and a round protects the pair again.
#[test]
fn a_node_that_lost_its_psks_is_reached_again_and_protected_again() {
    let mut cfg = config(3, None);
    cfg.settle = true;
    let mut lab = Lab::start(cfg).unwrap();
    let before = agreed(&lab, &[0, 1]).unwrap();
    lab.stop_agent(1, "KILL").unwrap();
    lab.on_node(
        1,
        // The userspace device's process ends with its interface.
        "rm -f /var/lib/weft/pq-pairs.json && ip link del flannel-wg",
    )
    .unwrap();
    until_or(
        "node 1's device gone",
        Duration::from_secs(5),
        || lab.device_pids(1).is_empty() && lab.on_node(1, "ip link show flannel-wg").is_err(),
        || lab.logs(),
    );
    lab.start_agent(1).unwrap();
    let started = Instant::now();
    let (from, to) = (&lab.nodes[1].pods[0].ns, lab.nodes[0].pods[0].ip);
    assert!(
        lab.ping(
            from,
            to,
            bound(Duration::from_secs(20), Duration::from_secs(40))
        ),
        "node 1 never reached node 0\n{}",
        pq_lines(&lab)
    );
    let reached = started.elapsed();
    // By its own watcher (it answers the handshakes the other sends, and nothing comes
    // of them), or by the notice.
    assert!(
        lab.nodes[0].logged_at("classical PSK").is_some(),
        "node 0 kept its PSK\n{}",
        pq_lines(&lab)
    );
    until_or(
        "the pair protected again",
        // Under emulation the leader's first round message waits for the classical
        // handshake and then for its 1 s repeat.
        bound(Duration::from_secs(5), Duration::from_secs(15)),
        || agreed(&lab, &[0, 1]).is_ok_and(|now| now[&(0, 1)] != before[&(0, 1)]),
        || pq_lines(&lab),
    );
    println!(
        "a node that lost its PSKs: reached again {:.1} s after its restart, protected again {:.1} s after it",
        reached.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
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
    // Refusals are logged at debug only: the PSKs are watched for a second after the
    // datagrams, and must not change in it.
    wait::throughout_or(
        "every pair's PSK as before the hostile datagrams",
        Duration::from_secs(1),
        || agreed(&lab, &[0, 1, 2]).as_ref() == Ok(&before),
        || lab.logs(),
    );
    lab.assert_all_pairs();
}

#[test]
#[ignore = "needs a kernel with ESP and XFRM interfaces: run by the VM runner"]
fn ipsec_pairs_take_a_post_quantum_psk_into_their_keys_every_period_without_loss() {
    let mut cfg = LabConfig::backend(3, WEFT, "ipsec", false)
        .backend_key("PostQuantum", serde_json::Value::Bool(true));
    cfg.extra_args
        .push(format!("--post-quantum-period={}", PERIOD.as_secs()));
    cfg.settle = false;
    let lab = Lab::start(cfg).unwrap();
    let all = [0usize, 1, 2];
    let ip = |j: usize| lab.nodes[j].ip.to_string();
    // Every direction of every pair sends with a post-quantum state (slot 1 or 2).
    let protected = || {
        all.iter().all(|&i| {
            let out = esp_out(&lab, i);
            all.iter().filter(|&&j| j != i).all(|&j| {
                out.get(&ip(j))
                    .is_some_and(|(spi, _)| [1, 2].contains(&slot(&lab, i, j, *spi)))
            })
        })
    };
    let started = Instant::now();
    until_or(
        "every pair sending with post-quantum ESP keys",
        bound(Duration::from_secs(5), Duration::from_secs(10)),
        protected,
        || {
            let states: Vec<_> = all.iter().map(|&i| esp_out(&lab, i)).collect();
            format!("{states:?}\n{}", lab.logs())
        },
    );
    println!(
        "every ipsec pair post-quantum {:.1} s after the lab was up",
        started.elapsed().as_secs_f64()
    );
    status_follows(&lab);

    lab.assert_all_pairs();

    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let watch = ClearWatch::start(&lab).unwrap();
    let ping = Pinger::start(&a.ns, b.ip, Duration::from_millis(10)).unwrap();
    // Each direction's keys and slots as they came, and when (for the failure message).
    let mut seen: BTreeMap<(usize, usize), Vec<(u64, String)>> = BTreeMap::new();
    let mut timeline = String::new();
    let (t0, t0_unix) = (Instant::now(), unix_now());
    let end = Instant::now() + 6 * PERIOD;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(250));
        for i in all {
            for (dst, (spi, key)) in esp_out(&lab, i) {
                let Some(j) = all.iter().position(|&j| ip(j) == dst) else {
                    continue;
                };
                let keys = seen.entry((i, j)).or_default();
                if keys.last().map(|k| &k.1) != Some(&key) {
                    let slot = slot(&lab, i, j, spi);
                    let at = t0.elapsed().as_secs_f64();
                    timeline += &format!("{at:.1} s: {i} -> {j} spi {spi:08x} slot {slot}\n");
                    keys.push((slot, key));
                }
            }
        }
    }
    let ping = ping.finish().unwrap();
    let (sent, lost) = (ping.sent, ping.sent.saturating_sub(ping.received));
    let watched = watch.finish().unwrap();
    let counts: Vec<usize> = seen.values().map(Vec::len).collect();
    println!("ESP keys per direction over 6 periods: {counts:?}; ping at 100 pps: {lost} of {sent} lost; {watched:?}, nothing in clear");
    assert_eq!(seen.len(), 6, "{seen:?}");
    assert!(
        counts.iter().all(|n| *n >= 5) && watched.answered * 10 >= watched.sent * 9,
        "new keys every period, every pair answering: {counts:?}, {watched:?}\n{timeline}\n{}",
        pq_logs(&lab)
    );
    for (dir, keys) in &seen {
        let slots: Vec<u64> = keys.iter().map(|k| k.0).collect();
        assert!(
            slots.iter().all(|s| [1, 2].contains(s)) && slots.windows(2).all(|w| w[0] != w[1]),
            "{dir:?}: slots {slots:?}"
        );
    }
    let distinct: BTreeSet<&String> = seen.values().flatten().map(|k| &k.1).collect();
    assert_eq!(
        distinct.len(),
        counts.iter().sum::<usize>(),
        "every key new"
    );
    assert!(
        sent > 0 && lost <= IPSEC_LOSS,
        "{lost} of {sent} lost, the longest run {:?} (the timeline from {:.2} s since 1970):\n{timeline}\n{}",
        ping.longest_hole,
        t0_unix,
        pq_logs(&lab)
    );
    lab.assert_all_pairs();
}
