//! One bad registry entry never cuts off a node that was working. In an etcd lab, entries
//! are written after the nodes' own: one publishing node 2's WireGuard key, one announcing
//! node 2's key as its next key, one wider lease covering node 2's subnet (wireguard), and
//! one publishing node 2's VTEP MAC (vxlan). The incumbents keep what they had (all pairs
//! still reach each other), and every node leaves out only the newcomers, named in
//! `weft status`, the log, `weft doctor` and `/metrics`.

use std::time::Duration;

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::netns::http_get;
use weft_lab::wait::found_or;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
const PORT: u16 = 10267;

/// Node `i`'s published lease value.
fn published(lab: &Lab, i: usize) -> serde_json::Value {
    lab.published_lease(i).expect("the node's lease")
}

fn put(lab: &Lab, name: &str, value: &serde_json::Value) {
    lab.etcd()
        .etcdctl(&[
            "put",
            &format!("/coreos.com/network/subnets/{name}"),
            &value.to_string(),
        ])
        .unwrap();
}

/// Waits until every node's `weft status` shows each of `names` left out, and returns
/// node 1's rows for them.
fn left_out_everywhere(lab: &Lab, names: &[&str]) -> Vec<String> {
    let tables = || -> Vec<String> {
        (0..lab.nodes.len())
            .map(|i| {
                lab.on_node(i, &format!("{WEFT} status"))
                    .unwrap_or_default()
            })
            .collect()
    };
    let rows = |table: &str| -> Vec<String> {
        names
            .iter()
            .filter_map(|n| {
                table
                    .lines()
                    .find(|l| l.starts_with(n) && l.contains("left out: "))
                    .map(str::to_string)
            })
            .collect()
    };
    found_or(
        "left out everywhere",
        Duration::from_secs(10),
        || {
            let tables = tables();
            (tables.iter().all(|t| rows(t).len() == names.len())).then(|| rows(&tables[0]))
        },
        || tables().join("\n"),
    )
}

fn subnet_name(lab: &Lab, i: usize) -> String {
    let s = lab.nodes[i].subnet.unwrap();
    format!("{}-{}", s.network(), s.prefix_len())
}

#[test]
fn entries_copying_a_nodes_key_or_covering_its_subnet_leave_out_only_themselves() {
    let mut cfg = LabConfig::wireguard(3, WEFT);
    cfg.extra_args.push(format!("--healthz-port={PORT}"));
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    let victim = published(&lab, 1);
    let key = victim["BackendData"]["PublicKey"]
        .as_str()
        .unwrap()
        .to_string();
    let watch = ClearWatch::start(&lab).unwrap();
    // A record whose key is not a key: skipped, nothing else changes.
    put(
        &lab,
        "10.244.249.0-24",
        &serde_json::json!({
        "PublicIP": "198.51.100.96", "BackendType": "wireguard",
        "BackendData": {"PublicKey": "not a key", "Port": 51820}}),
    );
    // A stale or forged record with node 2's key.
    put(
        &lab,
        "10.244.250.0-24",
        &serde_json::json!({
        "PublicIP": "198.51.100.99", "BackendType": "wireguard",
        "BackendData": {"PublicKey": key, "Port": 51820}}),
    );
    // A node announcing node 2's key as its next one.
    let own = weft_crypto::PrivateKey::from_bytes([91; 32])
        .public_key()
        .to_string();
    put(
        &lab,
        "10.244.251.0-24",
        &serde_json::json!({
        "PublicIP": "198.51.100.98", "BackendType": "wireguard",
        "BackendData": {"PublicKey": own, "Port": 51820},
        "WeftNextKey": {"PublicKey": key, "SwitchAt": 4_000_000_000_000u64, "Generation": 2}}),
    );
    // A lease twice the size, over node 2's subnet.
    let s = lab.nodes[1].subnet.unwrap();
    let wide = ipnet::Ipv4Net::new(s.network(), s.prefix_len() - 1)
        .unwrap()
        .trunc();
    let wide_name = format!("{}-{}", wide.network(), wide.prefix_len());
    put(
        &lab,
        &wide_name,
        &serde_json::json!({
        "PublicIP": "198.51.100.97", "BackendType": "wireguard",
        "BackendData": {"PublicKey": weft_crypto::PrivateKey::from_bytes([92; 32]).public_key().to_string(), "Port": 51820}}),
    );

    let rows = left_out_everywhere(&lab, &["10.244.250.0-24", "10.244.251.0-24", &wide_name]);
    println!("{}", rows.join("\n"));
    let victim_name = subnet_name(&lab, 1);
    assert!(
        rows[0].contains(&format!(
            "also published by node {victim_name}, which keeps it"
        )),
        "{}",
        rows[0]
    );
    assert!(
        rows[1].contains(&format!(
            "its announced next key {key} is node {victim_name}'s public key"
        )),
        "{}",
        rows[1]
    );
    assert!(
        rows[2].contains(&format!(
            "is not a /{} like every node's subnet",
            s.prefix_len()
        )),
        "{}",
        rows[2]
    );
    // Node 2 is still everyone's peer, every pod pair still works, and no pod packet
    // went out in clear while the bad entries came.
    lab.assert_all_pairs();
    let watched = watch.finish().unwrap();
    eprintln!("bad entries: {watched:?}, nothing in clear");
    assert_newcomer_named(&lab);
}

/// The log, the doctor and /metrics name the newcomer (the copied key's entry).
fn assert_newcomer_named(lab: &Lab) {
    let log = std::fs::read_to_string(lab.nodes[0].agent_log()).unwrap();
    assert!(
        log.lines().any(|l| l.contains("peer left out")
            && l.contains("\"10.244.250.0-24\"")
            && l.contains("which keeps it")),
        "{log}"
    );
    let (said, doctor) = lab.doctor_says(
        0,
        &["left out: 4 node(s)", "10.244.250.0-24: its public key"],
    );
    assert!(said, "{doctor}");
    let node = &lab.nodes[0];
    let (code, metrics) = http_get(&node.ns, &format!("{}:{PORT}", node.ip), "/metrics");
    assert_eq!(code, 200, "{metrics}");
    assert!(
        metrics.contains("weft_peers_left_out{node=\"10.244.250.0-24\",reason=\"its public key"),
        "{metrics}"
    );
}

#[test]
fn an_entry_copying_a_nodes_vtep_mac_leaves_out_only_itself() {
    let lab = Lab::start(LabConfig::backend(3, WEFT, "vxlan", false)).unwrap();
    lab.assert_all_pairs();
    let victim = published(&lab, 1);
    put(
        &lab,
        "10.244.250.0-24",
        &serde_json::json!({
        "PublicIP": "198.51.100.99", "BackendType": "vxlan",
        "BackendData": victim["BackendData"]}),
    );
    let rows = left_out_everywhere(&lab, &["10.244.250.0-24"]);
    println!("{}", rows.join("\n"));
    let mac = victim["BackendData"]["VtepMAC"].as_str().unwrap();
    assert!(
        rows[0].contains(&format!(
            "VtepMAC {mac} is also published by node {}, which keeps it",
            subnet_name(&lab, 1)
        )),
        "{}",
        rows[0]
    );
    lab.assert_all_pairs();
}

/// When the registry created node `i`'s lease (its create revision).
fn created(lab: &Lab, i: usize) -> i64 {
    let key = lab.lease_key(i).unwrap();
    let out = lab.etcd().etcdctl(&["get", &key, "-w", "json"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["kvs"][0]["create_revision"].as_i64().unwrap()
}

/// A node that turns bad after joining is older in the registry than a node that joined
/// after it; copying that younger node's key (and its published proof) into its own lease
/// must not take the key from it. The younger node proves holding its key for its own
/// name, the copier cannot, so every other node leaves the copier out and keeps reaching
/// the younger node.
#[test]
fn an_older_entry_copying_a_younger_nodes_key_is_the_one_left_out() {
    let mut lab = Lab::start(LabConfig::wireguard(3, WEFT)).unwrap();
    lab.assert_all_pairs();
    let (old, young) = if created(&lab, 0) < created(&lab, 1) {
        (0, 1)
    } else {
        (1, 0)
    };
    let victim = found_or(
        "the younger node's key proof published",
        Duration::from_secs(10),
        || Some(published(&lab, young)).filter(|v| v.get("WeftKeyProof").is_some()),
        || published(&lab, young).to_string(),
    );
    // The older node turns bad: its agent stops defending its lease, and the lease copies
    // the younger node's key and proof.
    lab.stop_agent(old, "TERM").unwrap();
    let mut forged = published(&lab, old);
    forged["BackendData"] = victim["BackendData"].clone();
    forged["WeftKeyProof"] = victim["WeftKeyProof"].clone();
    put(&lab, &subnet_name(&lab, old), &forged);

    let (copier, owner) = (subnet_name(&lab, old), subnet_name(&lab, young));
    let table = || {
        lab.on_node(2, &format!("{WEFT} status"))
            .unwrap_or_default()
    };
    let row = found_or(
        "node 3 leaving out the copier",
        Duration::from_secs(10),
        || {
            (table().lines())
                .find(|l| l.starts_with(&copier) && l.contains("left out: "))
                .map(str::to_string)
        },
        || format!("{}\n{}", table(), lab.logs()),
    );
    assert!(
        row.contains(&format!("also published by node {owner}, which keeps it")),
        "{row}"
    );
    let (from, to) = (&lab.nodes[2].pods[0], &lab.nodes[young].pods[0]);
    assert!(
        lab.ping(&from.ns, to.ip, Duration::from_secs(5)),
        "node 3 still reaches the younger node"
    );
}
