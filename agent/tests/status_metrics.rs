//! `weft status` and `/metrics` on a live lab mesh: every peer up with a fresh handshake
//! and bytes both ways, a peer with a bad key shown as left out with its reason, a peer's
//! new key counted as a new generation; and a clear error when no agent runs.

use std::time::{Duration, Instant};

use weft_lab::lab::{Lab, LabConfig};
use weft_lab::netns::http_get;
use weft_lab::wait::{found_or, until_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
const PORT: u16 = 10267;
const RESYNC_SECS: u64 = 2;

fn metrics(lab: &Lab, i: usize) -> String {
    let node = &lab.nodes[i];
    let (code, body) = http_get(&node.ns, &format!("{}:{PORT}", node.ip), "/metrics");
    assert_eq!(code, 200, "{body}");
    body
}

/// The value of the first series starting with `prefix`.
fn value(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn status_and_metrics_describe_the_mesh() {
    let mut cfg = LabConfig::wireguard(3, WEFT);
    cfg.extra_args.push(format!("--healthz-port={PORT}"));
    // /metrics shows the counters of the last full pass: resync often, to see them soon.
    cfg.extra_args
        .push(format!("--resync-period={RESYNC_SECS}"));
    cfg.seed = vec![(
        "/coreos.com/network/subnets/10.244.250.0-24".into(),
        r#"{"PublicIP":"198.51.100.99","BackendType":"wireguard","BackendData":{"PublicKey":"bm90LWEta2V5","Port":51820}}"#.into(),
    )];
    let started = Instant::now();
    let mut lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    let name = |i: usize| {
        let s = lab.nodes[i].subnet.unwrap();
        format!("{}-{}", s.network(), s.prefix_len())
    };

    let table = lab.on_node(0, &format!("{WEFT} status")).unwrap();
    println!("{table}");
    assert!(table.starts_with(&format!("node {} (", name(0))), "{table}");
    for i in [1, 2] {
        let row = table
            .lines()
            .find(|l| l.starts_with(&name(i)))
            .unwrap_or_else(|| panic!("no row for node {i}:\n{table}"));
        assert!(row.ends_with("up"), "{row}");
        assert!(row.contains(&format!("{}:51820", lab.nodes[i].ip)), "{row}");
        assert!(row.contains(" s ago"), "{row}");
    }
    let bad = table
        .lines()
        .find(|l| l.starts_with("10.244.250.0-24"))
        .unwrap();
    assert!(bad.contains("left out: "), "{bad}");

    let json: serde_json::Value =
        serde_json::from_str(&lab.on_node(0, &format!("{WEFT} status --json")).unwrap()).unwrap();
    let peers = json["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 3);
    for p in peers.iter().filter(|p| p["state"] == "up") {
        assert!(p["rx_bytes"].as_u64().unwrap() > 0 && p["tx_bytes"].as_u64().unwrap() > 0);
        // A handshake of this lab's (a fixed bound fails under the VM's emulated CPU,
        // where starting the lab takes about a minute).
        let age = p["handshake_secs"].as_u64().unwrap();
        assert!(
            age <= started.elapsed().as_secs(),
            "handshake {age} s ago: {p}"
        );
    }
    assert_eq!(peers.iter().filter(|p| p["state"] == "up").count(), 2);

    // The traffic above is counted once a full pass has read the device after it: within
    // one resync period (and a pass), never by a read per scrape.
    let n1 = format!("{{node=\"{}\"}}", name(1));
    let m = found_or(
        "node 2's traffic counted both ways on node 1",
        Duration::from_secs(2 * RESYNC_SECS + 2),
        || {
            let m = metrics(&lab, 0);
            // Both directions' counters: the pass that read the device may have come
            // between the handshake's first message and the first one this node sent.
            let counted = |name: &str| value(&m, &format!("{name}{n1}")).is_some_and(|v| v > 0.0);
            (counted("weft_peer_receive_bytes_total") && counted("weft_peer_transmit_bytes_total"))
                .then_some(m)
        },
        || metrics(&lab, 0),
    );
    assert!(
        value(&m, "weft_reconcile_passes_total").unwrap() >= 1.0,
        "{m}"
    );
    assert!(m.contains("weft_reconcile_duration_seconds_bucket"), "{m}");
    assert_eq!(value(&m, "weft_peers "), Some(2.0), "{m}");
    assert!(
        value(&m, "weft_registry_events_total{event=\"joined\"}").unwrap() >= 3.0,
        "{m}"
    );
    assert!(
        m.contains("weft_peers_left_out{node=\"10.244.250.0-24\",reason=\""),
        "{m}"
    );
    let age = value(&m, &format!("weft_peer_last_handshake_age_seconds{n1}")).unwrap();
    assert!(
        (0.0..=started.elapsed().as_secs_f64()).contains(&age),
        "{age}"
    );
    assert!(value(&m, &format!("weft_peer_receive_bytes_total{n1}")).unwrap() > 0.0);
    assert!(value(&m, &format!("weft_peer_transmit_bytes_total{n1}")).unwrap() > 0.0);
    assert!(
        m.contains(&format!("endpoint=\"{}:51820\"", lab.nodes[1].ip)),
        "{m}"
    );
    // Each peer's path, as the agent measured it (every link here is 1500), with its time.
    let path = format!("{{node=\"{}\",address=\"{}\"}}", name(1), lab.nodes[1].ip);
    let m = found_or(
        "node 2's path MTU in node 1's metrics",
        Duration::from_secs(10),
        || {
            let m = metrics(&lab, 0);
            m.contains(&format!("weft_peer_path_mtu_bytes{path}"))
                .then_some(m)
        },
        || metrics(&lab, 0),
    );
    assert_eq!(
        value(&m, &format!("weft_peer_path_mtu_bytes{path}")),
        Some(1500.0),
        "{m}"
    );
    assert!(
        value(
            &m,
            &format!("weft_peer_path_mtu_measured_timestamp_seconds{path}")
        )
        .unwrap()
            > 1.7e9,
        "{m}"
    );
    assert!(
        !m.contains("weft_peer_route_mtu_bytes{"),
        "no path is narrow here: {m}"
    );
    let table = lab.on_node(0, &format!("{WEFT} status")).unwrap();
    assert!(
        table.contains(&format!(
            "{} ({}): path MTU 1500, measured",
            name(1),
            lab.nodes[1].ip
        )),
        "{table}"
    );
    assert_eq!(
        value(&m, &format!("weft_peer_key_generation{n1}")),
        Some(1.0)
    );

    // Someone else writes node 1's lease: it is written back and counted.
    assert_eq!(value(&m, "weft_leases_defended_total"), Some(0.0), "{m}");
    assert_eq!(
        value(&m, "weft_steering_annotation_changes_total"),
        Some(0.0),
        "{m}"
    );
    lab.etcd()
        .etcdctl(&[
            "put",
            &format!("/coreos.com/network/subnets/{}", name(0)),
            r#"{"PublicIP":"198.51.100.66","BackendType":"wireguard","BackendData":{"PublicKey":"bm90LWEta2V5","Port":51820}}"#,
        ])
        .unwrap();
    until_or(
        "the lease defended once",
        Duration::from_secs(5),
        || value(&metrics(&lab, 0), "weft_leases_defended_total") == Some(1.0),
        || metrics(&lab, 0),
    );

    // Node 2 comes back with a new key: generation 2 on node 0.
    lab.stop_agent(1, "TERM").unwrap();
    std::fs::remove_file(lab.nodes[1].dir.join("lib/wireguard.key")).unwrap();
    lab.start_agent(1).unwrap();
    until_or(
        "node 2's key generation 2 on node 1",
        Duration::from_secs(15),
        || value(&metrics(&lab, 0), &format!("weft_peer_key_generation{n1}")) == Some(2.0),
        || metrics(&lab, 0),
    );

    lab.stop_agent(0, "TERM").unwrap();
    let err = lab.on_node(0, &format!("{WEFT} status")).unwrap_err();
    assert!(
        format!("{err:#}").contains("is `weft agent` running"),
        "{err:#}"
    );
}
