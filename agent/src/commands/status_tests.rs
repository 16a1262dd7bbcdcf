//! `weft status`'s rows, table and path lines, from snapshots and device reads made up here.

use super::*;
use crate::observe::snapshot::{LeftOutInfo, PeerInfo, RegistryEntry};
use weft_backends::apply::wireguard::WgPeer;
use weft_crypto::PrivateKey;

#[test]
fn states_from_the_device_and_the_plan() {
    let key = |n: u8| PrivateKey::from_bytes([n; 32]).public_key();
    let peer = |n: u8| PeerInfo {
        node: format!("n{n}"),
        subnet: format!("10.244.{n}.0/24").parse().ok(),
        endpoint: Some(format!("198.51.100.{n}:51820")),
        public_key: Some(key(n).to_string()),
        device: Some("flannel-wg".into()),
        ..PeerInfo::default()
    };
    let mut snapshot = Snapshot {
        peers: vec![peer(2), peer(3), peer(4)],
        left_out: vec![LeftOutInfo {
            node: "n5".into(),
            reason: "its backend data is bad".into(),
        }],
        ..Snapshot::default()
    };
    snapshot.registry.insert(
        "n5".into(),
        RegistryEntry {
            subnet: "10.244.5.0/24".parse().ok(),
            ..RegistryEntry::default()
        },
    );
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
    let mut device = WgDevice::default();
    device.peers.insert(
        key(2),
        WgPeer {
            endpoint: "198.51.100.2:40000".parse().ok(),
            last_handshake: Some(Duration::from_secs(9_990)),
            rx_bytes: 2048,
            tx_bytes: 10,
            ..WgPeer::default()
        },
    );
    device.peers.insert(
        key(3),
        WgPeer {
            last_handshake: Some(Duration::from_secs(9_000)),
            ..WgPeer::default()
        },
    );
    let devices = [("flannel-wg".to_string(), device)].into();
    let r = rows(&snapshot, &devices, &BTreeMap::new(), now);
    let states: Vec<&str> = r.iter().map(|r| r.state.as_str()).collect();
    assert_eq!(
        states,
        [
            "up",
            "no handshake",
            "not on device",
            "left out: its backend data is bad"
        ]
    );
    // The endpoint the device uses (a roamed one) is shown.
    assert_eq!(r[0].endpoint, "198.51.100.2:40000");
    assert_eq!(r[0].handshake_secs, Some(10));
    let mut r = r;
    r[1].path = Some("via n9".into());
    r[2].path = Some("no path: n1 and n4 cannot reach each other".into());
    let text = table(&Report {
        node: "n1".into(),
        subnet: "10.244.1.0/24".into(),
        backend: "wireguard".into(),
        implementation: "userspace".into(),
        device: Some("flannel-wg".into()),
        public_ip: Some("198.51.100.1".into()),
        peers: r,
        paths: vec![],
        post_quantum: vec![],
        relay: Some(crate::observe::snapshot::RelayInfo {
            port: 51824,
            routes: 4,
            datagrams: 10,
            bytes: 2048,
            pairs: vec![crate::observe::snapshot::RelayedPair {
                from: "n7".into(),
                to: "n8".into(),
                bytes: 1024,
            }],
            ..Default::default()
        }),
        backends: Default::default(),
    });
    assert!(
        text.contains("n2    10.244.2.0/24  198.51.100.2:40000  -        10 s ago"),
        "{text}"
    );
    assert!(text.contains("via n9"), "{text}");
    assert!(
        text.contains("n4: no path: n1 and n4 cannot reach each other"),
        "{text}"
    );
    assert!(
        text.contains("relay (this node is a gateway, UDP port 51824): 4 pair routes"),
        "{text}"
    );
    assert!(text.contains("  n7 -> n8: 1.0 KiB"), "{text}");
    assert!(text.contains("2.0 KiB / 10 B"), "{text}");
    assert!(text.contains("n5    10.244.5.0/24  -"), "{text}");
}

#[test]
fn an_ipsec_peer_is_up_with_both_states_and_shows_their_bytes() {
    use weft_backends::apply::xfrm::{ObservedSa, SaSpec};
    let peer = |n: u8| PeerInfo {
        node: format!("n{n}"),
        subnet: format!("10.244.{n}.0/24").parse().ok(),
        endpoint: Some(format!("198.51.100.{n}")),
        device: Some("flannel-ipsec".into()),
        spi_in: Some(0x8000_0000 | u32::from(n) << 8),
        spi_out: Some(0x8000_0100),
        ..PeerInfo::default()
    };
    let sa = |dst: u8, spi: u32, bytes: u64| ObservedSa {
        spec: SaSpec {
            src: Ipv4Addr::UNSPECIFIED,
            dst: Ipv4Addr::new(198, 51, 100, dst),
            spi,
            algorithm: String::new(),
            key: Default::default(),
            icv_bits: 128,
            udp_encap: false,
            if_id: IF_ID,
            reqid: 1,
        },
        bytes,
        packets: 1,
        replay_failed: 0,
        integrity_failed: 0,
        replay_window: 1024,
        esn: true,
    };
    let states = [
        sa(1, 0x8000_0200, 3072),
        sa(2, 0x8000_0100, 10),
        sa(1, 0x8000_0300, 5),
    ];
    let snapshot = Snapshot {
        peers: vec![peer(2), peer(3)],
        ..Snapshot::default()
    };
    let esp = pairs(
        &states,
        Ipv4Addr::new(198, 51, 100, 1),
        snapshot.peers.iter().map(|p| {
            let remote = p.endpoint.as_deref().unwrap().parse().unwrap();
            (
                p.node.clone(),
                remote,
                p.spi_in.unwrap(),
                p.spi_out.unwrap(),
            )
        }),
    );
    let r = rows(&snapshot, &BTreeMap::new(), &esp, SystemTime::UNIX_EPOCH);
    assert_eq!(
        (r[0].state.as_str(), r[0].rx_bytes, r[0].tx_bytes),
        ("up", Some(3072), Some(10))
    );
    assert_eq!(
        (r[1].state.as_str(), r[1].rx_bytes, r[1].tx_bytes),
        ("no outbound SA", Some(5), None)
    );
}

#[test]
fn a_changing_cluster_shows_peers_per_backend_and_names_each_clear_pair() {
    use crate::observe::snapshot::{BackendsInfo, ClearPairInfo};
    let b = BackendsInfo {
        peers: [("wireguard".to_string(), 2), ("vxlan".to_string(), 1)].into(),
        clear: vec![ClearPairInfo {
            node: "n3".into(),
            why: "it publishes no encrypting backend (it runs vxlan)".into(),
        }],
        also: vec!["vxlan".into()],
    };
    let text = super::backend_lines(&b, "wireguard");
    assert!(
        text.contains("backend change: peers per backend: vxlan 1, wireguard 2; this node also speaks vxlan while a peer runs it"),
        "{text}"
    );
    assert!(
        text.contains("in clear: n3: it publishes no encrypting backend (it runs vxlan)"),
        "{text}"
    );
    // One backend everywhere: nothing said.
    let one = BackendsInfo {
        peers: [("wireguard".to_string(), 3)].into(),
        ..BackendsInfo::default()
    };
    assert_eq!(super::backend_lines(&one, "wireguard"), "");
}
