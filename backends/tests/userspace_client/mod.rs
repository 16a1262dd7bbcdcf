//! The test's side of a userspace device: the device itself (one peer, this client) in the
//! test's network namespace, a WireGuard client made of boringtun's Noise core and a plain
//! UDP socket, and pings through the tunnel.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};
use weft_backends::apply::wireguard::userspace::Userspace;
use weft_backends::apply::wireguard::WgPeer;
use weft_backends::userspace::checksum;
use weft_lab::netns::sh;

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An ICMP echo request from `src` to 10.77.0.1.
pub fn echo_request(seq: u16, src: [u8; 4]) -> Vec<u8> {
    echo_request_of(seq, src, 28 + 32)
}

/// An ICMP echo request from `src` to 10.77.0.1 of `len` bytes of IP packet (at least 28).
pub fn echo_request_of(seq: u16, src: [u8; 4], len: usize) -> Vec<u8> {
    let mut p = vec![0u8; len.max(28)];
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

/// The device's one peer, as `wg show` would report it.
pub async fn the_peer(us: &mut Userspace, dev: &str) -> WgPeer {
    let state = us.get(dev).await.unwrap();
    let peer = state
        .peers
        .values()
        .next()
        .expect("the peer is still there");
    peer.clone()
}

pub const DEVICE: &str = "127.0.0.1:51999";

/// What one ping through a client `Tunn` saw.
pub struct Pinged {
    pub answered: bool,
    /// Handshake initiations from the device that arrived meanwhile.
    pub initiations: usize,
}

/// Sends echo request `seq` through `tunn` (handshaking first if it must) and waits up to
/// `wait` for its reply through `tunn`, answering what the device sends meanwhile.
pub fn ping(tunn: &mut Tunn, client: &UdpSocket, seq: u16, wait: Duration) -> Pinged {
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
    while let Some(n) = receive_before(client, deadline, &mut buf) {
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

pub fn device_key() -> StaticSecret {
    StaticSecret::from([7u8; 32])
}

pub fn client_key() -> StaticSecret {
    StaticSecret::from([9u8; 32])
}

/// The client's Noise state towards the device: PSK `psk`, session index `index`.
pub fn client_tunn(psk: Option<[u8; 32]>, index: u32) -> Tunn {
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
pub struct Setup {
    pub us: Userspace,
    pub client: UdpSocket,
}

/// Device `dev` with one peer (the client, PSK `psk`) at 10.77.1.0/24, its own address
/// 10.77.0.1/24.
pub async fn device_with_client(dev: &str, psk: Option<[u8; 32]>) -> Setup {
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

/// The next datagram at `client` before `deadline`, read into `buf`: its length.
pub fn receive_before(client: &UdpSocket, deadline: Instant, buf: &mut [u8]) -> Option<usize> {
    let left = deadline.checked_duration_since(Instant::now())?;
    client
        .set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .unwrap();
    client.recv_from(buf).ok().map(|(n, _)| n)
}
