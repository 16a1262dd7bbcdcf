//! weft's userspace WireGuard device against a WireGuard peer made of boringtun's Noise
//! core and a plain UDP socket, in a fresh network namespace: thousands of malformed
//! datagrams at its port change nothing, then a handshake completes and a ping through the
//! tunnel is answered by the kernel behind the device, encrypted; a packet whose inner
//! source is outside the peer's AllowedIPs never reaches the interface; a PSK change keeps
//! the session until a handshake with the new PSK replaces it, and a keepalive change
//! loses no ping.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use weft_backends::apply::wireguard::userspace::Userspace;
use weft_backends::apply::wireguard::WgPeer;
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
        let dev = "wgt-dev";
        let Setup { mut us, client } = device_with_client(dev, None).await;

        for d in garbage(5000) {
            client.send_to(&d, DEVICE).unwrap();
        }

        let mut tunn = client_tunn(None, 1);
        // The first encapsulate queues the packet and starts the handshake.
        assert!(ping(&mut tunn, &client, 1, Duration::from_secs(5)).answered);
        let peer = the_peer(&mut us, dev).await;
        assert!(peer.last_handshake.is_some(), "the handshake is on record");
        assert!(peer.rx_bytes > 0 && peer.tx_bytes > 0);

        // A packet whose inner source is outside the peer's AllowedIPs is dropped: of a
        // spoofed request and a good one sent after it, only the good one reaches the
        // interface (the device handles a peer's datagrams in order).
        let before = rx_packets(dev);
        let mut out = vec![0u8; 2048];
        let mut buf = vec![0u8; 2048];
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        for (seq, src) in [(2, [10, 77, 2, 2]), (3, [10, 77, 1, 2])] {
            if let TunnResult::WriteToNetwork(p) =
                tunn.encapsulate(&echo_request(seq, src), &mut out)
            {
                client.send_to(p, DEVICE).unwrap();
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

/// A keepalive change also makes the peer a new Noise state (boringtun fixes it at
/// creation); the client here accepts its handshake, and every ping across the change,
/// before and after the new session takes over, is answered.
#[test]
fn a_keepalive_change_loses_no_ping() {
    in_new_netns(|| async {
        let dev = "wgt-ka";
        let Setup { mut us, client } = device_with_client(dev, None).await;
        let mut tunn = client_tunn(None, 1);
        assert!(ping(&mut tunn, &client, 1, Duration::from_secs(5)).answered);
        let change = format!(
            "set=1\npublic_key={}\npersistent_keepalive_interval=25\n\n",
            hex(PublicKey::from(&client_key()).as_bytes())
        );
        us.set(dev, &[change]).await.unwrap();
        // Pings until the device's new state has handshaken, then ten more on its session.
        let deadline = Instant::now() + Duration::from_secs(5);
        let (mut seq, mut after) = (2, None);
        while after.is_none_or(|first| seq < first + 10) {
            let seen = ping(&mut tunn, &client, seq, Duration::from_secs(2));
            assert!(seen.answered, "ping {seq} across the keepalive change");
            if seen.initiations > 0 && after.is_none() {
                after = Some(seq);
            }
            assert!(
                after.is_some() || Instant::now() < deadline,
                "the device never handshook after the keepalive change"
            );
            seq += 1;
        }
        assert_eq!(the_peer(&mut us, dev).await.keepalive, 25);
    });
}

/// The device's one peer, as `wg show` would report it.
async fn the_peer(us: &mut Userspace, dev: &str) -> WgPeer {
    let state = us.get(dev).await.unwrap();
    let peer = state
        .peers
        .values()
        .next()
        .expect("the peer is still there");
    peer.clone()
}

/// Packets the kernel received on `dev` (what the device wrote to it).
fn rx_packets(dev: &str) -> u64 {
    let json = sh(&format!("ip -j -s link show dev {dev}"));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v[0]["stats64"]["rx"]["packets"].as_u64().unwrap()
}

const DEVICE: &str = "127.0.0.1:51999";

/// What one ping through a client `Tunn` saw.
struct Pinged {
    answered: bool,
    /// Handshake initiations from the device that arrived meanwhile.
    initiations: usize,
}

/// Sends echo request `seq` through `tunn` (handshaking first if it must) and waits up to
/// `wait` for its reply through `tunn`, answering what the device sends meanwhile.
fn ping(tunn: &mut Tunn, client: &UdpSocket, seq: u16, wait: Duration) -> Pinged {
    let mut out = vec![0u8; 2048];
    let mut buf = vec![0u8; 2048];
    let mut seen = Pinged {
        answered: false,
        initiations: 0,
    };
    if let TunnResult::WriteToNetwork(p) =
        tunn.encapsulate(&echo_request(seq, [10, 77, 1, 2]), &mut out)
    {
        client.send_to(p, DEVICE).unwrap();
    }
    let deadline = Instant::now() + wait;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        client
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        let Ok((n, _)) = client.recv_from(&mut buf) else {
            break;
        };
        seen.initiations += usize::from(buf[0] == 1);
        let mut result = tunn.decapsulate(None, &buf[..n], &mut out);
        loop {
            match result {
                TunnResult::WriteToNetwork(p) => {
                    client.send_to(p, DEVICE).unwrap();
                }
                TunnResult::WriteToTunnelV4(p, src) => {
                    assert_eq!(src, std::net::Ipv4Addr::new(10, 77, 0, 1));
                    if p[20] == 0 && p[26..28] == seq.to_be_bytes() {
                        seen.answered = true;
                        return seen;
                    }
                    break;
                }
                _ => break,
            }
            result = tunn.decapsulate(None, &[], &mut out);
        }
    }
    seen
}

fn device_key() -> StaticSecret {
    StaticSecret::from([7u8; 32])
}

fn client_key() -> StaticSecret {
    StaticSecret::from([9u8; 32])
}

/// The client's Noise state towards the device: PSK `psk`, session index `index`.
fn client_tunn(psk: Option<[u8; 32]>, index: u32) -> Tunn {
    Tunn::new(
        client_key(),
        PublicKey::from(&device_key()),
        psk,
        None,
        index,
        None,
    )
}

/// A userspace device and the UDP socket of its one peer, this test's client.
struct Setup {
    us: Userspace,
    client: UdpSocket,
}

/// Device `dev` with one peer (the client, PSK `psk`) at 10.77.1.0/24, its own address
/// 10.77.0.1/24.
async fn device_with_client(dev: &str, psk: Option<[u8; 32]>) -> Setup {
    sh("ip link set lo up");
    let mut us = Userspace::default();
    us.ensure(dev).unwrap();
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut request = format!(
        "set=1\nprivate_key={}\nlisten_port=51999\npublic_key={}\nendpoint={}\nallowed_ip=10.77.1.0/24\n",
        hex(device_key().as_bytes()),
        hex(PublicKey::from(&client_key()).as_bytes()),
        client.local_addr().unwrap()
    );
    if let Some(psk) = psk {
        request += &format!("preshared_key={}\n", hex(&psk));
    }
    us.set(dev, &[request + "\n"]).await.unwrap();
    sh(&format!(
        "ip addr add 10.77.0.1/24 dev {dev} && ip link set {dev} up"
    ));
    sh(&format!("ip route add 10.77.1.0/24 dev {dev}"));
    Setup { us, client }
}

/// The kernel keeps a session when a peer's PSK changes; so does this device: pings on the
/// old session keep being answered while the device's handshakes under the new PSK are
/// refused by a client that still has the old one; once the client has the new PSK too, a
/// new handshake carries the traffic and the old session is closed.
#[test]
fn a_psk_change_keeps_the_session_until_a_handshake_with_the_new_psk() {
    in_new_netns(|| async {
        let dev = "wgt-psk";
        let (old_psk, new_psk) = ([1u8; 32], [2u8; 32]);
        let Setup { mut us, client } = device_with_client(dev, Some(old_psk)).await;
        let mut old = client_tunn(Some(old_psk), 1);
        assert!(ping(&mut old, &client, 1, Duration::from_secs(5)).answered);

        let change = format!(
            "set=1\npublic_key={}\npreshared_key={}\n\n",
            hex(PublicKey::from(&client_key()).as_bytes()),
            hex(&new_psk)
        );
        us.set(dev, &[change]).await.unwrap();
        // Until the device has tried a handshake under the new PSK (and the client, with
        // the old one, could not complete it), every ping on the old session is answered.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seq = 2;
        loop {
            let seen = ping(&mut old, &client, seq, Duration::from_secs(2));
            assert!(
                seen.answered,
                "ping {seq} on the old session after the PSK change"
            );
            if seen.initiations > 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the device never handshook with the new PSK"
            );
            seq += 1;
        }

        let mut new = client_tunn(Some(new_psk), 2);
        assert!(
            ping(&mut new, &client, 100, Duration::from_secs(5)).answered,
            "a handshake under the new PSK carries traffic"
        );
        let peer = the_peer(&mut us, dev).await;
        assert_eq!(peer.psk.as_ref().map(|k| *k.as_bytes()), Some(new_psk));
        // The new session has carried the client's traffic: the old one is closed.
        weft_lab::wait::until("the old session is closed", Duration::from_secs(5), || {
            seq += 1;
            !ping(&mut old, &client, seq, Duration::from_millis(300)).answered
        });
        assert!(ping(&mut new, &client, 101, Duration::from_secs(5)).answered);
    });
}
