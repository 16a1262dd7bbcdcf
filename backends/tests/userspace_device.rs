//! weft's userspace WireGuard device against a WireGuard peer made of boringtun's Noise
//! core and a plain UDP socket, in a fresh network namespace: thousands of malformed
//! datagrams at its port change nothing, then a handshake completes and a ping through the
//! tunnel is answered by the kernel behind the device, encrypted; a packet whose inner
//! source is outside the peer's AllowedIPs never reaches the interface; a PSK change keeps
//! the session until a handshake with the new PSK replaces it, and a keepalive change
//! loses no ping; an endpoint or AllowedIPs change keeps the session (no new handshake);
//! a new device starts at MTU 1420 and pads what it encrypts to 16 bytes, never past its MTU.

mod userspace_client;

use std::time::{Duration, Instant};

use boringtun::noise::TunnResult;
use boringtun::x25519::PublicKey;
use userspace_client::{
    client_key, client_tunn, device_with_client, echo_request, echo_request_of, hex, ping,
    receive_before, the_peer, Setup, DEVICE,
};
use weft_lab::netns::{in_new_netns, sh};

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

/// A keepalive change is applied in place, as kernel WireGuard applies it: the session
/// stays (no handshake follows), and every ping across the change is answered.
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
        for seq in 2..12 {
            let seen = ping(&mut tunn, &client, seq, Duration::from_secs(2));
            assert!(seen.answered, "ping {seq} across the keepalive change");
            assert_eq!(seen.initiations, 0, "the session is kept: no handshake");
        }
        assert_eq!(the_peer(&mut us, dev).await.keepalive, 25);
    });
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

/// The peer's endpoint set to another address (`wg set … endpoint`) keeps the session: what
/// the device sends next goes to the new endpoint as a data message of the session it has,
/// which the client decrypts with no handshake in between.
#[test]
fn an_endpoint_change_keeps_the_session() {
    in_new_netns(|| async {
        let dev = "wgt-ep";
        let Setup { mut us, client } = device_with_client(dev, None).await;
        let mut tunn = client_tunn(None, 1);
        assert!(ping(&mut tunn, &client, 1, Duration::from_secs(5)).answered);
        let moved = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let change = format!(
            "set=1\npublic_key={}\nendpoint={}\n\n",
            hex(PublicKey::from(&client_key()).as_bytes()),
            moved.local_addr().unwrap()
        );
        us.set(dev, &[change]).await.unwrap();
        assert_eq!(
            the_peer(&mut us, dev).await.endpoint,
            Some(moved.local_addr().unwrap())
        );
        // The kernel behind the device pings the client's inner address: one echo request.
        sh("ping -c 1 -W 1 10.77.1.2 >/dev/null 2>&1 || true");
        let (mut out, mut buf) = (vec![0u8; 2048], vec![0u8; 2048]);
        let n = receive_before(&moved, Instant::now() + Duration::from_secs(5), &mut buf)
            .expect("the device sends to the new endpoint");
        assert_eq!(buf[0], 4, "a data message, not a handshake initiation");
        match tunn.decapsulate(None, &buf[..n], &mut out) {
            TunnResult::WriteToTunnelV4(p, src) => {
                assert_eq!(src, std::net::Ipv4Addr::new(10, 77, 0, 1));
                assert_eq!(p[20], 8, "the kernel's echo request");
            }
            other => panic!("the old session does not decrypt it: {other:?}"),
        }
    });
}

/// AllowedIPs replaced (`replace_allowed_ips`, one more subnet) keeps the session: a request
/// from the newly allowed subnet, sent on the session made before the change, is answered
/// on it, with no handshake from the device.
#[test]
fn an_allowed_ips_change_keeps_the_session() {
    in_new_netns(|| async {
        let dev = "wgt-aip";
        let Setup { mut us, client } = device_with_client(dev, None).await;
        let mut tunn = client_tunn(None, 1);
        assert!(ping(&mut tunn, &client, 1, Duration::from_secs(5)).answered);
        let change = format!(
            "set=1\npublic_key={}\nreplace_allowed_ips=true\nallowed_ip=10.77.1.0/24\nallowed_ip=10.77.2.0/24\n\n",
            hex(PublicKey::from(&client_key()).as_bytes())
        );
        us.set(dev, &[change]).await.unwrap();
        sh(&format!("ip route add 10.77.2.0/24 dev {dev}"));
        let (mut out, mut buf) = (vec![0u8; 2048], vec![0u8; 2048]);
        if let TunnResult::WriteToNetwork(p) =
            tunn.encapsulate(&echo_request_of(7, [10, 77, 2, 5], 60), &mut out)
        {
            assert_eq!(p[0], 4, "sent on the session made before the change");
            client.send_to(p, DEVICE).unwrap();
        }
        let n = receive_before(&client, Instant::now() + Duration::from_secs(5), &mut buf)
            .expect("the request from the newly allowed subnet is answered");
        assert_eq!(buf[0], 4, "a data message, not a handshake initiation");
        match tunn.decapsulate(None, &buf[..n], &mut out) {
            TunnResult::WriteToTunnelV4(p, _) => {
                assert_eq!(
                    &p[16..20],
                    &[10, 77, 2, 5],
                    "the reply goes to the new subnet"
                );
                assert_eq!(&p[26..28], &7u16.to_be_bytes());
            }
            other => panic!("the old session does not decrypt the reply: {other:?}"),
        }
    });
}

/// A device starts at kernel WireGuard's MTU, 1420; each echo reply it encrypts is padded
/// to a multiple of 16 bytes (the data message is 32 bytes longer than the padded packet),
/// but never past the interface's MTU, and it decrypts to the reply's own length.
#[test]
fn data_messages_are_padded_to_sixteen_bytes_within_the_mtu() {
    in_new_netns(|| async {
        let dev = "wgt-pad";
        let Setup { us: _us, client } = device_with_client(dev, None).await;
        assert!(
            sh(&format!("ip link show {dev}")).contains("mtu 1420"),
            "a new device's MTU"
        );
        let mut tunn = client_tunn(None, 1);
        assert!(ping(&mut tunn, &client, 1, Duration::from_secs(5)).answered);
        let (mut out, mut buf) = (vec![0u8; 2048], vec![0u8; 2048]);
        for (seq, len, message) in [
            (10u16, 29usize, 32 + 32),
            (11, 60, 32 + 64),
            (12, 64, 32 + 64),
            (13, 1000, 32 + 1008),
            (14, 1400, 32 + 1408),
            (15, 1410, 32 + 1420),
            (16, 1420, 32 + 1420),
        ] {
            if let TunnResult::WriteToNetwork(p) =
                tunn.encapsulate(&echo_request_of(seq, [10, 77, 1, 2], len), &mut out)
            {
                client.send_to(p, DEVICE).unwrap();
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            let reply = loop {
                let n = receive_before(&client, deadline, &mut buf)
                    .unwrap_or_else(|| panic!("no reply to the {len}-byte request"));
                if buf[0] != 4 || n == 32 {
                    continue; // not a data message, or a keepalive
                }
                let TunnResult::WriteToTunnelV4(p, _) = tunn.decapsulate(None, &buf[..n], &mut out)
                else {
                    panic!("a data message that does not decrypt");
                };
                break (n, p.len());
            };
            assert_eq!(
                reply,
                (message, len),
                "the {len}-byte reply: (datagram, packet)"
            );
        }
    });
}

/// Packets the kernel received on `dev` (what the device wrote to it).
fn rx_packets(dev: &str) -> u64 {
    let json = sh(&format!("ip -j -s link show dev {dev}"));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v[0]["stats64"]["rx"]["packets"].as_u64().unwrap()
}
