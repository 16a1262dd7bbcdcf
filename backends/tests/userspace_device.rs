//! weft's userspace WireGuard device against a WireGuard peer made of boringtun's Noise
//! core and a plain UDP socket, in a fresh network namespace: thousands of malformed
//! datagrams at its port change nothing, then a handshake completes and a ping through the
//! tunnel is answered by the kernel behind the device, encrypted; a packet whose inner
//! source is outside the peer's AllowedIPs never reaches the interface.

use std::net::UdpSocket;
use std::time::Duration;

use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use weft_backends::apply::wireguard::userspace::Userspace;
use weft_backends::userspace::checksum;
use weft_lab::netns::{in_new_netns, sh};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An ICMP echo request from `src` to 10.77.0.1.
fn echo_request(seq: u16, src: [u8; 4]) -> Vec<u8> {
    let mut p = vec![0u8; 28 + 32];
    p[0] = 0x45;
    let len = p.len() as u16;
    p[2..4].copy_from_slice(&len.to_be_bytes());
    p[8] = 64;
    p[9] = 1;
    p[12..16].copy_from_slice(&src);
    p[16..20].copy_from_slice(&[10, 77, 0, 1]);
    checksum::ipv4_header(&mut p[..20]);
    p[20] = 8;
    p[24..26].copy_from_slice(&0x4242u16.to_be_bytes());
    p[26..28].copy_from_slice(&seq.to_be_bytes());
    let sum = !checksum::fold(checksum::add(0, &p[20..]));
    p[22..24].copy_from_slice(&sum.to_be_bytes());
    p
}

/// Datagrams of every message type and length, with random bytes after the type.
fn garbage(count: usize) -> Vec<Vec<u8>> {
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..count)
        .map(|i| {
            let len = (next() % 200) as usize + if i % 3 == 0 { 1400 } else { 0 };
            let mut d: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if let Some(t) = d.first_mut() {
                *t = (i % 6) as u8;
            }
            d
        })
        .collect()
}

#[test]
fn garbage_changes_nothing_and_a_real_peer_gets_through() {
    in_new_netns(|| async {
        sh("ip link set lo up");
        let dev = "wgt-dev";
        let mut us = Userspace::default();
        us.ensure(dev).unwrap();
        let device_key = StaticSecret::from([7u8; 32]);
        let client_key = StaticSecret::from([9u8; 32]);
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let request = format!(
            "set=1\nprivate_key={}\nlisten_port=51999\npublic_key={}\nendpoint={}\nallowed_ip=10.77.1.0/24\n\n",
            hex(device_key.as_bytes()),
            hex(PublicKey::from(&client_key).as_bytes()),
            client.local_addr().unwrap()
        );
        us.set(dev, &[request]).await.unwrap();
        sh(&format!(
            "ip addr add 10.77.0.1/24 dev {dev} && ip link set {dev} up"
        ));
        sh(&format!("ip route add 10.77.1.0/24 dev {dev}"));

        for d in garbage(5000) {
            client.send_to(&d, "127.0.0.1:51999").unwrap();
        }

        let mut tunn = Tunn::new(
            client_key,
            PublicKey::from(&device_key),
            None,
            None,
            1,
            None,
        );
        let mut out = vec![0u8; 2048];
        let mut buf = vec![0u8; 2048];
        // The first encapsulate queues the packet and starts the handshake.
        match tunn.encapsulate(&echo_request(1, [10, 77, 1, 2]), &mut out) {
            TunnResult::WriteToNetwork(init) => client.send_to(init, "127.0.0.1:51999").unwrap(),
            other => panic!("expected a handshake initiation, got {other:?}"),
        };
        let mut replies = 0;
        while replies == 0 {
            let (n, _) = client.recv_from(&mut buf).expect("the device answers");
            let mut result = tunn.decapsulate(None, &buf[..n], &mut out);
            loop {
                match result {
                    TunnResult::WriteToNetwork(p) => {
                        client.send_to(p, "127.0.0.1:51999").unwrap();
                    }
                    TunnResult::WriteToTunnelV4(p, src) => {
                        assert_eq!(src, std::net::Ipv4Addr::new(10, 77, 0, 1));
                        assert_eq!(p[20], 0, "an ICMP echo reply");
                        replies += 1;
                        break;
                    }
                    _ => break,
                }
                result = tunn.decapsulate(None, &[], &mut out);
            }
        }
        let state = us.get(dev).await.unwrap();
        let peer = state
            .peers
            .values()
            .next()
            .expect("the peer is still there");
        assert!(peer.last_handshake.is_some(), "the handshake is on record");
        assert!(peer.rx_bytes > 0 && peer.tx_bytes > 0);

        // A packet whose inner source is outside the peer's AllowedIPs is dropped: of a
        // spoofed request and a good one sent after it, only the good one reaches the
        // interface (the device handles a peer's datagrams in order).
        let before = rx_packets(dev);
        for (seq, src) in [(2, [10, 77, 2, 2]), (3, [10, 77, 1, 2])] {
            if let TunnResult::WriteToNetwork(p) =
                tunn.encapsulate(&echo_request(seq, src), &mut out)
            {
                client.send_to(p, "127.0.0.1:51999").unwrap();
            }
        }
        let (n, _) = client
            .recv_from(&mut buf)
            .expect("the good request is answered");
        match tunn.decapsulate(None, &buf[..n], &mut out) {
            TunnResult::WriteToTunnelV4(p, _) => assert_eq!(&p[26..28], &3u16.to_be_bytes()),
            other => panic!("expected the reply to request 3, got {other:?}"),
        }
        assert_eq!(rx_packets(dev), before + 1, "only the good request got in");
    });
}

/// Packets the kernel received on `dev` (what the device wrote to it).
fn rx_packets(dev: &str) -> u64 {
    let json = sh(&format!("ip -j -s link show dev {dev}"));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v[0]["stats64"]["rx"]["packets"].as_u64().unwrap()
}
