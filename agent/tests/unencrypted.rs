//! End to end in the lab, the unencrypted backends: vxlan (all pods reach all pods; the
//! kernel's neighbour and FDB entries equal what the peers published; a deleted
//! `flannel.1` comes back with every entry; a peer whose VTEP MAC changes is reached again),
//! vxlan with `DirectRouting` across two segments (a direct route to the on-link peer, vxlan
//! to the routed one, traffic both ways), host-gw on one segment and across two (the
//! routed node left out with the reason, the others working), and switching backends.

use std::time::{Duration, Instant};

use weft_lab::lab::{in_ns, Lab, LabConfig};
use weft_lab::wait::{until, until_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// What node `i` published: (subnet network address, VTEP MAC, public IP).
fn published(lab: &Lab, i: usize) -> (String, String, String) {
    let v = lab.published_lease(i).expect("the node's lease");
    let subnet = lab.nodes[i].subnet.unwrap().network().to_string();
    (
        subnet,
        v["BackendData"]["VtepMAC"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        v["PublicIP"].as_str().unwrap_or_default().to_string(),
    )
}

/// Node `i`'s vxlan entries: neighbours as `ip lladdr`, FDB as `mac dst`.
fn entries(lab: &Lab, i: usize) -> (Vec<String>, Vec<String>) {
    let ns = &lab.nodes[i].ns;
    let neigh = in_ns(ns, "ip neigh show dev flannel.1 nud permanent").unwrap_or_default();
    let fdb = in_ns(ns, "bridge fdb show dev flannel.1").unwrap_or_default();
    let mut n: Vec<String> = neigh
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(format!("{} {}", f.first()?, f.get(2)?))
        })
        .collect();
    let mut d: Vec<String> = fdb
        .lines()
        .filter(|l| l.contains(" dst "))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(format!(
                "{} {}",
                f.first()?,
                f.get(f.iter().position(|w| *w == "dst")? + 1)?
            ))
        })
        .collect();
    n.sort();
    d.sort();
    (n, d)
}

/// What node `i`'s entries should be, from the others' published data.
fn expected(lab: &Lab, i: usize) -> (Vec<String>, Vec<String>) {
    let mut n = Vec::new();
    let mut d = Vec::new();
    for j in (0..lab.nodes.len()).filter(|j| *j != i) {
        let (gw, mac, ip) = published(lab, j);
        n.push(format!("{gw} {mac}"));
        d.push(format!("{mac} {ip}"));
    }
    n.sort();
    d.sort();
    (n, d)
}

#[test]
fn vxlan_mesh_entries_match_what_peers_published_and_heal() {
    let mut lab = Lab::start(LabConfig::backend(3, WEFT, "vxlan", false)).unwrap();
    lab.assert_all_pairs();
    for i in 0..3 {
        assert_eq!(entries(&lab, i), expected(&lab, i), "node {}", i + 1);
        let link = in_ns(&lab.nodes[i].ns, "ip -d -o link show flannel.1").unwrap();
        assert!(
            link.contains("mtu 1450") && link.contains("vxlan id 1"),
            "{link}"
        );
    }

    // flannel.1 deleted: back with every entry, without a restart.
    in_ns(&lab.nodes[0].ns, "ip link del flannel.1").unwrap();
    let back = until(
        "flannel.1 back with its entries",
        Duration::from_secs(2),
        || entries(&lab, 0) == expected(&lab, 0),
    );
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(5)),
        "{}",
        lab.logs()
    );
    eprintln!("vxlan: flannel.1 deleted -> back with all entries in {back:?}");

    // A neighbour entry deleted behind weft's back comes back too, and so does a route.
    let (gw, _, _) = published(&lab, 1);
    in_ns(
        &lab.nodes[0].ns,
        &format!("ip neigh del {gw} dev flannel.1"),
    )
    .unwrap();
    until("the neighbour entry back", Duration::from_secs(2), || {
        entries(&lab, 0) == expected(&lab, 0)
    });
    let s3 = lab.nodes[2].subnet.unwrap();
    in_ns(&lab.nodes[0].ns, &format!("ip route del {s3}")).unwrap();
    until("the route back", Duration::from_secs(2), || {
        in_ns(&lab.nodes[0].ns, "ip -4 route show proto 87")
            .is_ok_and(|r| r.contains(&format!("{s3} via {} dev flannel.1 onlink", s3.network())))
    });

    // So does an FDB entry.
    let (_, mac, ip) = published(&lab, 2);
    in_ns(
        &lab.nodes[0].ns,
        &format!("bridge fdb del {mac} dev flannel.1 dst {ip}"),
    )
    .unwrap();
    until("the FDB entry back", Duration::from_secs(2), || {
        entries(&lab, 0) == expected(&lab, 0)
    });

    // Node 2 loses its VTEP MAC (device and record gone, as on a reinstalled host).
    let old_mac = published(&lab, 1).1;
    lab.stop_agent(1, "TERM").unwrap();
    in_ns(&lab.nodes[1].ns, "ip link del flannel.1").unwrap();
    lab.on_node(1, "rm /var/lib/weft/vtep.mac").unwrap();
    lab.start_agent(1).unwrap();
    let t = Instant::now();
    until(
        "node 2 publishes a new VTEP MAC",
        Duration::from_secs(10),
        || {
            let mac = published(&lab, 1).1;
            !mac.is_empty() && mac != old_mac
        },
    );
    let (a, b) = (lab.nodes[0].pods[0].ns.clone(), lab.nodes[1].pods[0].ip);
    assert!(lab.ping(&a, b, Duration::from_secs(5)), "{}", lab.logs());
    let reached = t.elapsed();
    for i in [0, 2] {
        until_or(
            &format!("node {}: stale entries replaced", i + 1),
            Duration::from_secs(5),
            || entries(&lab, i) == expected(&lab, i),
            || {
                format!(
                    "{:?}, expected {:?}\n{}",
                    entries(&lab, i),
                    expected(&lab, i),
                    lab.logs()
                )
            },
        );
        assert!(
            !entries(&lab, i).1.iter().any(|e| e.starts_with(&old_mac)),
            "node {} kept the old MAC's FDB entry",
            i + 1
        );
    }
    eprintln!("vxlan: a peer's VTEP MAC changed -> reached again {reached:?} after its restart");
}

#[test]
fn vxlan_direct_routing_goes_direct_on_link_and_over_vxlan_across_the_router() {
    let mut cfg = LabConfig::backend(3, WEFT, "vxlan", true);
    cfg.routed = vec![2];
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    let routes = in_ns(&lab.nodes[0].ns, "ip -4 route show proto 87").unwrap();
    let s2 = lab.nodes[1].subnet.unwrap();
    let s3 = lab.nodes[2].subnet.unwrap();
    assert!(
        routes.contains(&format!("{s2} via 198.51.100.2 dev eth0")),
        "node 2 is on-link: a direct route\n{routes}"
    );
    assert!(
        routes.contains(&format!("{s3} via {} dev flannel.1 onlink", s3.network())),
        "node 3 is behind the router: vxlan\n{routes}"
    );
    let routes3 = in_ns(&lab.nodes[2].ns, "ip -4 route show proto 87").unwrap();
    assert!(
        !routes3.contains("dev eth0"),
        "node 3 has no on-link peer\n{routes3}"
    );
}

#[test]
fn host_gw_on_one_segment_reaches_all_and_names_the_routed_node() {
    let lab = Lab::start(LabConfig::backend(3, WEFT, "host-gw", false)).unwrap();
    lab.assert_all_pairs();
    let routes = in_ns(&lab.nodes[0].ns, "ip -4 route show proto 87").unwrap();
    assert!(
        routes.contains(&format!(
            "{} via 198.51.100.2 dev eth0",
            lab.nodes[1].subnet.unwrap()
        )),
        "{routes}"
    );
    drop(lab);

    let mut cfg = LabConfig::backend(3, WEFT, "host-gw", false);
    cfg.routed = vec![2];
    let lab = Lab::start(cfg).unwrap();
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(10)),
        "{}",
        lab.logs()
    );
    assert!(
        lab.ping(&b.ns, a.ip, Duration::from_secs(10)),
        "{}",
        lab.logs()
    );
    let log = std::fs::read_to_string(lab.nodes[0].agent_log()).unwrap();
    assert!(
        log.contains("host-gw needs all nodes on one L2 segment; it is at 203.0.113.3, behind a router: use vxlan with DirectRouting"),
        "{log}"
    );
    let routes = in_ns(&lab.nodes[0].ns, "ip -4 route show proto 87").unwrap();
    assert!(
        !routes.contains(&lab.nodes[2].subnet.unwrap().to_string()),
        "{routes}"
    );
}

#[test]
fn switching_backends_leaves_nothing_of_the_previous_one() {
    let mut lab = Lab::start(LabConfig::backend(2, WEFT, "vxlan", false)).unwrap();
    lab.assert_all_pairs();
    for (backend, gone) in [
        ("host-gw", vec!["flannel.1"]),
        ("wireguard", vec!["flannel.1"]),
        ("vxlan", vec!["flannel-wg"]),
    ] {
        // Onto wireguard, in a cluster that refuses clear pairs (`RefuseClear`): once its
        // agents have read the config (until then the node runs the backend it had), no
        // pod packet in clear, not even toward a peer that has not restarted yet. (Without
        // it such pairs stay on the old backend until both ends move: `rollout.rs`.)
        let conf = match backend {
            "wireguard" => serde_json::json!({"Type": backend, "RefuseClear": true}),
            _ => serde_json::json!({ "Type": backend }),
        };
        let watch = lab.switch_backend_to(conf).unwrap();
        // The old backend's routes and devices carry pod traffic until the new agents
        // replace them: the pairs are tried once every node has only the new backend's.
        let mut routes = Vec::new();
        for i in 0..2 {
            let ns = &lab.nodes[i].ns;
            // Every node switched at once: the old backend is retired once no peer has
            // run it for its grace (10 s), and its device goes 5 s later.
            for dev in &gone {
                until(
                    &format!("{dev} gone after switching to {backend}"),
                    weft_lab::wait::bound(Duration::from_secs(25), Duration::from_secs(40)),
                    || in_ns(ns, &format!("ip link show {dev}")).is_err(),
                );
            }
            let peer = lab.nodes[1 - i].subnet.unwrap().to_string();
            let peer_routes = || in_ns(ns, "ip -4 route show proto 87").unwrap_or_default();
            let one = |text: &str| text.lines().filter(|l| l.starts_with(&peer)).count() == 1;
            until_or(
                &format!("one route to the peer on {backend}"),
                Duration::from_secs(5),
                || one(&peer_routes()),
                || format!("{}\n{}", peer_routes(), lab.logs()),
            );
            routes.push(peer_routes());
        }
        lab.assert_all_pairs();
        if let Some(watch) = watch {
            let watched = watch.finish().unwrap();
            eprintln!("host-gw -> wireguard: {watched:?}, nothing in clear");
        }
        for routes in routes {
            if backend != "wireguard" {
                assert!(!routes.contains("blackhole"), "{routes}");
            }
        }
    }
}

#[test]
fn the_vtep_mac_is_kept_across_a_restart_and_a_deleted_device() {
    let mut lab = Lab::start(LabConfig::backend(2, WEFT, "vxlan", false)).unwrap();
    lab.assert_all_pairs();
    let mac = |lab: &Lab| {
        let link = in_ns(&lab.nodes[0].ns, "ip -o link show flannel.1").unwrap_or_default();
        let mut words = link.split_whitespace().skip_while(|w| *w != "link/ether");
        words.nth(1).unwrap_or_default().to_string()
    };
    let published = |lab: &Lab| {
        let v = lab.published_lease(0).expect("node 1's lease");
        v["BackendData"]["VtepMAC"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let before = mac(&lab);
    assert_eq!(published(&lab), before);
    // Restarted, and restarted with its device gone: the same MAC both times, so peers'
    // neighbour and FDB entries stay right.
    for delete in [false, true] {
        lab.stop_agent(0, "TERM").unwrap();
        if delete {
            in_ns(&lab.nodes[0].ns, "ip link del flannel.1").unwrap();
        }
        lab.start_agent(0).unwrap();
        until("flannel.1 back", Duration::from_secs(10), || {
            !mac(&lab).is_empty()
        });
        assert_eq!(mac(&lab), before, "deleted: {delete}");
        assert_eq!(published(&lab), before, "deleted: {delete}");
        lab.assert_all_pairs();
    }
}
