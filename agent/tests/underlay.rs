//! The node's underlay changing under a running agent, in the lab: its address replaced
//! (as a DHCP renewal or an operator would), and its link taken down and up. The agent of
//! node 1 finds its address itself (`--iface=eth0`, no `--public-ip`).

use std::time::{Duration, Instant};

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{devices_created, in_ns, Lab, LabConfig, EXT_IP};
use weft_lab::wait::until_or;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn lab() -> Lab {
    let mut cfg = LabConfig::wireguard(3, WEFT);
    cfg.own_address = vec![0];
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    lab
}

fn published_ip(lab: &Lab) -> String {
    lab.published_lease(0)
        .and_then(|v| v["PublicIP"].as_str().map(str::to_string))
        .unwrap_or_default()
}

fn endpoint_on(lab: &Lab, i: usize, key: &str) -> String {
    lab.on_node(i, "wg show flannel-wg endpoints")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_node_whose_address_changes_publishes_the_new_one_and_peers_follow() {
    let lab = lab();
    let key = lab.wg_public_key(0).unwrap();
    assert_eq!(published_ip(&lab), "198.51.100.1");
    let watch = ClearWatch::start(&lab).unwrap();

    let ns = &lab.nodes[0].ns;
    in_ns(
        ns,
        &format!(
            "sysctl -qw net.ipv4.conf.eth0.promote_secondaries=1 && \
             ip addr add 198.51.100.31/24 dev eth0 && ip addr del 198.51.100.1/24 dev eth0 && \
             ip route replace default via {EXT_IP}"
        ),
    )
    .unwrap();
    let changed = Instant::now();
    // The bounds are twice what docs/reliability.md claims (8 s: 5 s of it the dead
    // connection's request timeout).
    let published = until_or(
        "the new address published",
        Duration::from_secs(16),
        || published_ip(&lab) == "198.51.100.31",
        || lab.logs(),
    );
    for i in 1..3 {
        until_or(
            "peers sending to the new address",
            Duration::from_secs(5),
            || endpoint_on(&lab, i, &key) == "198.51.100.31:51820",
            || lab.logs(),
        );
    }
    let followed = changed.elapsed();
    // Every pod pair again (the device keeps a peer's session when its endpoint changes).
    let deadline = changed + Duration::from_secs(16);
    let failed = loop {
        let (_, failed) = lab.all_pairs(Duration::from_secs(2));
        if failed.is_empty() || Instant::now() > deadline {
            break failed;
        }
    };
    assert!(failed.is_empty(), "{failed:?}\n{}", lab.logs());
    let all_pairs = changed.elapsed();
    let watched = watch.finish().unwrap();
    let log = std::fs::read_to_string(lab.nodes[0].agent_log()).unwrap();
    assert!(
        log.contains("this node's address changed; publishing the new one"),
        "{log}"
    );
    eprintln!(
        "address changed: published in {published:?}, both peers' endpoints {followed:?} and all pod pairs {all_pairs:?} after the change; streams {watched:?}"
    );
}

#[test]
fn the_underlay_link_down_and_up_leaves_the_mesh_as_it_was() {
    let lab = lab();
    let ns = &lab.nodes[0].ns;
    let watch = ClearWatch::start(&lab).unwrap();
    in_ns(ns, "ip link set eth0 down").unwrap();
    std::thread::sleep(Duration::from_secs(5));
    // Taking a link down drops its routes; the OS's network configuration puts the
    // default route back when it comes up, as this does.
    in_ns(
        ns,
        &format!("ip link set eth0 up && ip route replace default via {EXT_IP}"),
    )
    .unwrap();
    let up = Instant::now();
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    until_or(
        "pod traffic after the link came up",
        Duration::from_secs(5),
        || in_ns(&a.ns, &format!("ping -c 1 -W 1 -q {}", b.ip)).is_ok(),
        || lab.logs(),
    );
    let back = up.elapsed();
    lab.assert_all_pairs();
    let watched = watch.finish().unwrap();
    assert_eq!(
        published_ip(&lab),
        "198.51.100.1",
        "the address did not change"
    );
    let log = std::fs::read_to_string(lab.nodes[0].agent_log()).unwrap();
    assert_eq!(devices_created(&log), 1, "the device was recreated:\n{log}");
    assert!(!log.contains("address changed"), "{log}");
    eprintln!("link down 5 s: pod traffic back {back:?} after it came up; streams {watched:?}");
}
