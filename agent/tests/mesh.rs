//! End to end, as root, in the lab: three nodes each run the real `weft agent` (etcd
//! registry, wireguard backend, userspace implementation) in their own namespaces, with
//! two pods each. Every pod reaches every pod on the other nodes, and a capture on the
//! underlay during that traffic shows only WireGuard's UDP: no packet carries a pod
//! address in clear.

use std::process::{Command, Stdio};
use std::time::Duration;

use weft_lab::lab::{Lab, LabConfig};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

#[test]
fn three_nodes_every_pod_reaches_every_pod_and_nothing_leaks() {
    let lab = Lab::start(LabConfig::wireguard(3, WEFT)).unwrap();
    let capture_file = lab.dir().join("underlay.pcap");
    let mut capture = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.fabric(),
            "tcpdump",
            "-Z",
            "root",
            "--immediate-mode",
            "-i",
            "br0",
            "-nn",
            "-U",
            "-w",
        ])
        .arg(&capture_file)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(lab.dir().join("tcpdump.log")).unwrap())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));

    assert_eq!(lab.assert_all_pairs(), 24);

    Command::new("kill")
        .args(["-INT", &capture.id().to_string()])
        .status()
        .unwrap();
    capture.wait().unwrap();
    let dump = Command::new("tcpdump")
        .args(["-nn", "-r"])
        .arg(&capture_file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&dump.stdout);
    let leaks: Vec<&str> = text.lines().filter(|l| l.contains("10.244.")).collect();
    assert!(
        leaks.is_empty(),
        "pod addresses seen in clear on the underlay:\n{}",
        leaks.join("\n")
    );
    let wireguard = text
        .lines()
        .filter(|l| l.contains(".51820: UDP") || l.contains(".51820 > "))
        .count();
    assert!(
        wireguard > 24,
        "expected WireGuard traffic on the underlay, saw {wireguard} packets:\n{text}\ntcpdump: {}{}",
        std::fs::read_to_string(lab.dir().join("tcpdump.log")).unwrap_or_default(),
        String::from_utf8_lossy(&dump.stderr)
    );
    // Everything on the wire is WireGuard, etcd (the registry) or ARP.
    let other: Vec<&str> = text
        .lines()
        .filter(|l| {
            !l.contains(".51820")
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
