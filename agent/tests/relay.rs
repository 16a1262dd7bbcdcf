//! Cross-VPC clusters whose nodes have no public address: two sites, each a private
//! segment behind a NAT that maps every flow to a random port, with one or two nodes per
//! site on a 1:1 public address (gateways: a1, b1; b3 public, not a gateway), the others
//! private (a2, b2). a2 and b2 cannot reach each other at all; their pair goes through a
//! gateway's relay, which forwards their WireGuard datagrams without any of their keys.
//!
//! One lab, in phases (each a claim of docs/cross-zone.md):
//! every pod pair reaches every other, a2–b2 through a gateway both ends agree on and all
//! others direct; 16 MiB both ways arrive intact (4 MiB under the VM's emulated CPU); nothing in clear on any segment and none
//! of the pair's pod packets on the gateway's own tunnel device; the pair idle for longer
//! than the NATs' UDP timeout carries its first packet at once; the gateway's agent
//! restarted (its relay routes taken back from its state file) and then the gateway cut off
//! the network while a transfer runs: the pair moves to the other gateway within 10 s and
//! the transfer arrives intact; the gateway back takes no pair from the other; the two
//! sites peered (a direct path that appears) moves the pair off the relay. Run on the host with the userspace
//! device; the VM runs it on kernel WireGuard (`WEFT_LAB_IMPLEMENTATION`).

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use weft_lab::lab::capture::{leaks, UnderlayCapture};
use weft_lab::lab::sites::{Sites, UDP_TIMEOUT_S};
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::live_demo::transfer;
use weft_lab::traffic::Probe;
use weft_lab::wait;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
const A2: usize = 0;
const A1: usize = 1;
const B1: usize = 2;
const B2: usize = 3;

/// Node `i`'s pairs as its `weft status --json` names them: peer node → path.
fn paths(lab: &Lab, i: usize) -> BTreeMap<String, String> {
    let text = lab
        .on_node(i, &format!("{WEFT} status --json"))
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    json["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some((
                p["node"].as_str()?.to_string(),
                p["path"].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// The gateway (its lab index) carrying a2–b2 as a2 sees it, once b2 sees the same.
fn carrier(lab: &Lab) -> Option<usize> {
    let via = paths(lab, A2)
        .get(&lab.node_name(B2))?
        .strip_prefix("via ")?
        .to_string();
    let back = paths(lab, B2)
        .get(&lab.node_name(A2))?
        .strip_prefix("via ")?
        .to_string();
    (via == back).then_some(())?;
    [A1, B1].into_iter().find(|&g| lab.node_name(g) == via)
}

fn ping_once(lab: &Lab, from: usize, to: usize) -> bool {
    let (ns, ip) = (&lab.nodes[from].pods[0].ns, lab.nodes[to].pods[0].ip);
    Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "ping",
            "-c",
            "1",
            "-W",
            "1",
            &ip.to_string(),
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn private_nodes_of_two_sites_reach_each_other_through_a_gateway_that_holds_no_key() {
    let mut cfg = LabConfig::wireguard(5, WEFT);
    cfg.net_conf = r#"{"Network": "10.244.0.0/16", "SubnetMax": "10.244.199.0", "Backend": {"Type": "wireguard", "PersistentKeepaliveInterval": 5}}"#.into();
    cfg.sites = Some(Sites::two());
    let started = Instant::now();
    let mut lab = Lab::start(cfg).unwrap();
    wait::until_or(
        "a2 and b2 through one gateway",
        Duration::from_secs(20),
        || carrier(&lab).is_some(),
        || {
            format!(
                "a2: {:?}\nb2: {:?}\n{}\n{}\n{}",
                paths(&lab, A2),
                paths(&lab, B2),
                lab.status(A2),
                lab.status(A1),
                lab.logs()
            )
        },
    );
    println!(
        "relayed pair up {:.1} s after the lab began starting (agents, pods, post-quantum rounds)",
        started.elapsed().as_secs_f64()
    );
    lab.assert_all_pairs();

    // Only a2–b2 is relayed; every other pair is direct.
    for i in 0..5 {
        for (peer, path) in paths(&lab, i) {
            let relayed = [(A2, B2), (B2, A2)]
                .iter()
                .any(|&(x, y)| i == x && peer == lab.node_name(y));
            assert_eq!(
                path.starts_with("via "),
                relayed,
                "node {i} -> {peer}: {path}"
            );
        }
    }
    let gw = carrier(&lab).unwrap();
    let other = if gw == A1 { B1 } else { A1 };

    // 16 MiB both ways (4 MiB in the VM, which carries 2 MiB/s), every segment and the
    // gateway's tunnel device watched.
    let bulk_bytes = wait::bound(16u64 << 20, 4 << 20);
    let fabric = lab.fabric();
    let mut caps: Vec<UnderlayCapture> = ["br0", "br2", "br3"]
        .iter()
        .map(|b| UnderlayCapture::start_on(&lab, &fabric, b, &[]).unwrap())
        .collect();
    let tunnel = UnderlayCapture::start_on(&lab, &lab.nodes[gw].ns, "flannel-wg", &[]).unwrap();
    let pod = |i: usize| (lab.nodes[i].pods[0].ns.clone(), lab.nodes[i].pods[0].ip);
    let (pa, pb) = (pod(A2), pod(B2));
    for (from, to) in [(&pa, &pb), (&pb, &pa)] {
        let (rate, intact) = transfer(&from.0, &to.0, to.1, bulk_bytes).unwrap();
        assert!(
            intact,
            "{bulk_bytes} bytes {} -> {} arrived with another SHA-256",
            from.1, to.1
        );
        println!(
            "{bulk_bytes} bytes {} -> {} through the relay at {rate:.0} MiB/s",
            from.1, to.1
        );
    }
    let inside = tunnel.finish().unwrap();
    let pair: Vec<&str> = inside
        .lines()
        .filter(|l| l.contains(&pa.1.to_string()) || l.contains(&pb.1.to_string()))
        .collect();
    assert!(
        pair.is_empty(),
        "the gateway's tunnel device saw the relayed pair's packets:\n{}",
        pair.join("\n")
    );
    for cap in caps.drain(..) {
        let text = cap.finish().unwrap();
        assert!(
            leaks(&text).is_empty(),
            "pod addresses in clear:\n{}",
            leaks(&text).join("\n")
        );
        assert!(
            text.contains(".51824"),
            "no relayed datagram on this segment:\n{}",
            &text[..text.len().min(2000)]
        );
    }
    let status = lab.status(gw);
    assert!(
        status.contains(&format!("{} -> {}", lab.node_name(A2), lab.node_name(B2))),
        "{status}"
    );

    // Idle for longer than the NATs' UDP timeout, then one packet: answered at once (the
    // relayed pair's keepalive keeps the mappings and the relay's routes).
    std::thread::sleep(Duration::from_secs(u64::from(UDP_TIMEOUT_S) + 5));
    assert!(
        ping_once(&lab, A2, B2),
        "first packet after idling lost\n{}",
        lab.logs()
    );

    // The gateway's agent restarts: its relay takes its routes back from its state file.
    let probe = Probe::start(&pa.0, &pb.0, pb.1).unwrap();
    lab.stop_agent(gw, "TERM").unwrap();
    lab.start_agent(gw).unwrap();
    wait::until_or(
        "the relay back with its routes",
        Duration::from_secs(20),
        || lab.status(gw).contains("routes taken back"),
        || lab.logs(),
    );
    std::thread::sleep(Duration::from_secs(2));
    let restart = probe.finish().unwrap();
    println!("gateway agent restart: {restart}");
    assert!(restart.stream_error.is_none(), "{restart}");

    // The carrying gateway cut off while a transfer runs: the pair moves to the other.
    let probe = Probe::start(&pa.0, &pb.0, pb.1).unwrap();
    let (from, to_ns, to_ip) = (pa.0.clone(), pb.0.clone(), pb.1);
    // Long enough to be under way when the gateway goes: about 3 s here, 8 s in the VM.
    let bytes = wait::bound(512u64 << 20, 16 << 20);
    let bulk = std::thread::spawn(move || transfer(&from, &to_ns, to_ip, bytes));
    std::thread::sleep(Duration::from_millis(300));
    let cut = Instant::now();
    lab.set_link(gw, false).unwrap();
    assert!(
        !bulk.is_finished(),
        "the transfer ended before the gateway was cut"
    );
    wait::until_or(
        "the pair on the other gateway",
        Duration::from_secs(20),
        || carrier(&lab) == Some(other),
        || lab.logs(),
    );
    let (_, intact) = bulk.join().unwrap().unwrap();
    assert!(
        intact,
        "the transfer across the failover arrived with another SHA-256"
    );
    let failover = probe.finish().unwrap();
    println!(
        "gateway cut off: on the other gateway after {:.1} s; {failover}",
        cut.elapsed().as_secs_f64()
    );
    let hole = failover.longest_hole.map_or(0, |h| h.pings);
    assert!(
        hole <= 1000,
        "pings lost for {} ms (bound 10 s): {failover}",
        hole * 10
    );

    // The gateway back: the pair stays where it is.
    lab.set_link(gw, true).unwrap();
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        carrier(&lab),
        Some(other),
        "the pair moved back: {:?}",
        paths(&lab, A2)
    );

    // The two sites are peered (a VPC peering comes up): a2 and b2 reach each other on
    // their own addresses, their probes are answered, and the pair leaves the relay.
    lab.peer_sites().unwrap();
    wait::until_or(
        "a2 -> b2 direct",
        Duration::from_secs(60),
        || {
            [(A2, B2), (B2, A2)].iter().all(|&(x, y)| {
                paths(&lab, x)
                    .get(&lab.node_name(y))
                    .is_some_and(|p| p == "direct")
            })
        },
        || lab.logs(),
    );
    assert!(
        lab.ping(&pa.0, pb.1, Duration::from_secs(10)),
        "{}",
        lab.logs()
    );
}
