//! End to end, as root, in the lab: three nodes each run the real `weft agent` (etcd
//! registry, wireguard backend, userspace implementation) in their own namespaces, with
//! two pods each. Every pod reaches every pod on the other nodes, and a capture on the
//! underlay during that traffic shows only WireGuard's UDP: no packet carries a pod
//! address in clear. A watch from before the first agent starts (the underlay captured
//! whole, pods pinging with a marker payload as soon as they exist) sees no pod packet in
//! clear while the mesh forms.

use weft_lab::lab::capture::{assert_tunnelled, UnderlayCapture};
use weft_lab::lab::{Lab, LabConfig};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

#[test]
fn three_nodes_every_pod_reaches_every_pod_and_nothing_leaks() {
    let mut cfg = LabConfig::wireguard(3, WEFT);
    cfg.watch_start = true;
    let mut lab = Lab::start(cfg).unwrap();
    let start = lab.take_start_watch().unwrap();
    lab.assert_all_pairs();
    let watched = start.finish().unwrap();
    eprintln!("lab start: {watched:?}, nothing in clear");

    let capture = UnderlayCapture::start(&lab).unwrap();
    assert_eq!(lab.assert_all_pairs(), 24);

    let text = capture.finish().unwrap();
    assert_tunnelled(&text, 24);
    // Everything on the wire is WireGuard, etcd (the registry), ARP, or the agents' path
    // MTU probes and their acknowledgements (UDP 51822: a magic, a nonce and zeros; the
    // clear-traffic watch above searched them for pod data with everything else).
    let other: Vec<&str> = text
        .lines()
        .filter(|l| {
            !l.contains(".51820")
                && !l.contains(".51822")
                && !l.contains(".2379")
                && !l.contains("ARP")
                && !l.contains("IP6")
        })
        .collect();
    assert!(
        other.is_empty(),
        "unexpected underlay traffic:\n{}",
        other.join("\n")
    );
    // Each node's device has one peer per other node.
    for (i, n) in lab.nodes.iter().enumerate() {
        let peers = lab.on_node(i, "wg show flannel-wg peers").unwrap();
        assert_eq!(peers.lines().count(), 2, "node {}: {peers}", n.index);
    }
}
