//! Key rotation in the lab, measured: a TCP stream and a 100 pps ping run between a pod on
//! the rotating node and a pod on another node while the key changes. The stream must not
//! reset nor stall for 1 s or more, the ping must lose at most 1 s of packets; the figures
//! are printed. Afterwards: the node's device and published key agree, every other node
//! holds exactly one peer for it (the new key) and no peer without AllowedIPs, and every
//! pod reaches every other.

use std::time::Duration;

use weft_lab::lab::{Lab, LabConfig};
use weft_lab::traffic::{Disruption, Probe};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn wg_key(lab: &Lab, i: usize) -> String {
    lab.on_node(i, "wg show flannel-wg public-key")
        .unwrap()
        .trim()
        .to_string()
}

/// Every other node has `i`'s current key as its only entry for `i`, and no peer without
/// AllowedIPs is left anywhere.
pub fn assert_one_peer_per_node(lab: &Lab) {
    for (j, node) in lab.nodes.iter().enumerate() {
        let allowed = lab.on_node(j, "wg show flannel-wg allowed-ips").unwrap();
        assert!(
            !allowed.contains("(none)"),
            "node {}: {allowed}",
            node.index
        );
        assert_eq!(
            allowed.lines().count(),
            lab.nodes.len() - 1,
            "node {}: {allowed}",
            node.index
        );
        for (i, _) in lab.nodes.iter().enumerate().filter(|(i, _)| *i != j) {
            let key = wg_key(lab, i);
            assert!(
                allowed.contains(&key),
                "node {} lacks node {}'s key {key}: {allowed}",
                node.index,
                i + 1
            );
        }
    }
}

fn assert_bounded(what: &str, d: &Disruption) {
    println!("{what}: {d}");
    assert!(
        d.stream_error.is_none(),
        "{what}: the TCP stream broke: {d}"
    );
    assert!(d.stream_bytes > 0, "{what}: no data: {d}");
    assert!(d.max_stall < Duration::from_secs(1), "{what}: {d}");
    assert!(d.ping_loss() <= Duration::from_secs(1), "{what}: {d}");
}

/// Rotates node 0's key through its local agent while traffic runs to node 1.
fn rotate_one_locally(lab: &Lab) -> Disruption {
    let before = wg_key(lab, 0);
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    let out = lab.on_node(0, &format!("{WEFT} keys rotate")).unwrap();
    println!("{out}");
    std::thread::sleep(Duration::from_secs(2));
    let d = probe.finish().unwrap();
    let after = wg_key(lab, 0);
    assert_ne!(before, after, "the key did not change");
    assert!(out.contains(&after), "{out}");
    d
}

#[test]
fn one_node_rotates_its_key_through_the_local_agent_etcd() {
    let lab = Lab::start(LabConfig::wireguard(3, WEFT)).unwrap();
    lab.assert_all_pairs();
    let d = rotate_one_locally(&lab);
    assert_bounded("one-node rotation (etcd)", &d);
    assert_one_peer_per_node(&lab);
    lab.assert_all_pairs();
}
