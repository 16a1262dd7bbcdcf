//! An outside host that knows only the device's public key (it is in the registry) attacks
//! a userspace device with a live session, from another address, with packets this test
//! crafts itself: a flood of handshake initiations with a valid mac1 puts the device under
//! load, then forged handshake responses, cookie replies and data messages name the
//! session's real index (as an on-path observer would see it). The device must answer
//! with cookie replies only: the peer's endpoint stays, the tunnel keeps carrying traffic
//! both ways, and the attacker receives nothing but cookie replies (no data message, no
//! handshake). Before the fix the device took its own cookie reply as proof and moved the
//! peer to the attacker. Nor can another process on the host bind the device's port.

mod userspace_client;

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use boringtun::noise::{Tunn, TunnResult};
use userspace_client::{
    client_tunn, device_key, device_with_client, ping, receive_before, the_peer, Setup, DEVICE,
};
use weft_lab::netns::in_new_netns;

const INITIATION: u8 = 1;
const RESPONSE: u8 = 2;
const COOKIE_REPLY: u8 = 3;
const DATA: u8 = 4;

/// Writes a valid mac1 into a handshake message to the device (its MACs are last).
fn sign_mac1(msg: &mut [u8]) {
    let device = x25519_dalek::PublicKey::from(&device_key());
    weft_userspace::wg::cookie::write_mac1(device.as_bytes(), msg);
}

/// Bytes from a xorshift generator: the attacker's "ephemeral keys" and ciphertexts.
fn noise_bytes(seed: &mut u64, out: &mut [u8]) {
    for b in out {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *b = *seed as u8;
    }
}

/// The sender index of the attacker's last initiation: the device's cookie reply to it
/// shows that every datagram before it was handled.
const LAST: u32 = 0xfeed_face;

/// An initiation with a valid mac1 and garbage inside, from sender index `sender`.
fn initiation(seed: &mut u64, sender: u32) -> Vec<u8> {
    let mut m = vec![0u8; 148];
    m[0] = INITIATION;
    m[4..8].copy_from_slice(&sender.to_le_bytes());
    noise_bytes(seed, &mut m[8..116]);
    sign_mac1(&mut m);
    m
}

/// The attacker's datagrams: `flood` initiations with a valid mac1 (garbage inside), then
/// for each session slot of `index` a forged response (valid mac1), a cookie reply and a
/// data message naming it, then one more initiation (sender `LAST`).
fn forged(index: u32, flood: usize) -> Vec<Vec<u8>> {
    let mut seed = 0x5eed_0fa7_7ac4_u64;
    let mut out: Vec<Vec<u8>> = (0..flood)
        .map(|i| initiation(&mut seed, i as u32))
        .collect();
    for slot in 0..=255u32 {
        let receiver = (index & !0xff) | slot;
        let mut r = vec![0u8; 92];
        r[0] = RESPONSE;
        r[4..8].copy_from_slice(&(0xa77a_c000 | slot).to_le_bytes());
        r[8..12].copy_from_slice(&receiver.to_le_bytes());
        noise_bytes(&mut seed, &mut r[12..60]);
        sign_mac1(&mut r);
        out.push(r);
        let mut c = vec![0u8; 64];
        c[0] = COOKIE_REPLY;
        c[4..8].copy_from_slice(&receiver.to_le_bytes());
        noise_bytes(&mut seed, &mut c[8..]);
        out.push(c);
        let mut d = vec![0u8; 32 + 64];
        d[0] = DATA;
        d[4..8].copy_from_slice(&receiver.to_le_bytes());
        noise_bytes(&mut seed, &mut d[8..]);
        out.push(d);
    }
    out.push(initiation(&mut seed, LAST));
    out
}

/// The device's session index as the client's data messages name it.
fn device_index(tunn: &mut Tunn) -> u32 {
    let mut out = vec![0u8; 256];
    match tunn.encapsulate(&[], &mut out) {
        TunnResult::WriteToNetwork(p) if p[0] == DATA => {
            u32::from_le_bytes([p[4], p[5], p[6], p[7]])
        }
        other => panic!("the client has a session, so a keepalive is a data message: {other:?}"),
    }
}

/// The types of the datagrams that reach `sock` until the cookie reply to the
/// initiation from `LAST` (or `wait` passes, or `until_last` is false and `sock` stays
/// quiet for 200 ms).
fn received(sock: &UdpSocket, wait: Duration, until_last: bool) -> Vec<u8> {
    let mut buf = vec![0u8; 2048];
    let mut types = Vec::new();
    let deadline = Instant::now() + wait;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let quiet = if until_last {
            left
        } else {
            left.min(Duration::from_millis(200))
        };
        sock.set_read_timeout(Some(quiet.max(Duration::from_millis(1))))
            .unwrap();
        let Ok((n, _)) = sock.recv_from(&mut buf) else {
            break;
        };
        types.push(if n > 0 { buf[0] } else { 0 });
        if until_last && n >= 8 && buf[0] == COOKIE_REPLY && buf[4..8] == LAST.to_le_bytes() {
            break;
        }
    }
    types
}

/// Waits up to `wait` for the client to receive a data message from the device that
/// decrypts to a UDP packet for port 9 (what the kernel behind the device sent).
fn client_receives_udp(tunn: &mut Tunn, client: &UdpSocket, wait: Duration) -> bool {
    let mut buf = vec![0u8; 2048];
    let mut out = vec![0u8; 2048];
    let deadline = Instant::now() + wait;
    while let Some(n) = receive_before(client, deadline, &mut buf) {
        if let TunnResult::WriteToTunnelV4(p, _) = tunn.decapsulate(None, &buf[..n], &mut out) {
            if p[9] == 17 && p[22..24] == 9u16.to_be_bytes() {
                return true;
            }
        }
    }
    false
}

#[test]
fn a_stranger_with_forged_handshakes_and_cookies_cannot_steer_the_peer() {
    in_new_netns(|| async {
        let dev = "wgt-atk";
        let Setup { mut us, client } = device_with_client(dev, None).await;
        let client_addr: SocketAddr = client.local_addr().unwrap();
        let mut tunn = client_tunn(None, 1);
        assert!(ping(&mut tunn, &client, 1, Duration::from_secs(5)).answered);
        let index = device_index(&mut tunn);

        let attacker = UdpSocket::bind("127.0.0.2:0").unwrap();
        // 3,000 initiations put the handshake queue past an eighth of its 4,096 (under
        // load) without filling it, so every forgery after them is queued and handled.
        for d in forged(index, 3000) {
            attacker.send_to(&d, DEVICE).unwrap();
        }
        // The device handles the datagrams of one socket in order: the cookie reply to the
        // last initiation shows every forgery before it was handled.
        let mut seen = received(&attacker, Duration::from_secs(10), true);
        assert_eq!(
            seen.last(),
            Some(&COOKIE_REPLY),
            "the flood put the device under load, and it answered the last initiation with a cookie reply"
        );
        let peer = the_peer(&mut us, dev).await;
        assert_eq!(
            peer.endpoint,
            Some(client_addr),
            "the peer's endpoint stays where its verified messages come from"
        );

        // Traffic the device starts now, before the client sends anything, goes to the
        // client and decrypts on the live session.
        let app = UdpSocket::bind("10.77.0.1:0").unwrap();
        app.send_to(b"to the client", "10.77.1.2:9").unwrap();
        assert!(
            client_receives_udp(&mut tunn, &client, Duration::from_secs(5)),
            "the device's own traffic reaches the client through the tunnel"
        );
        assert!(ping(&mut tunn, &client, 2, Duration::from_secs(5)).answered);

        seen.extend(received(&attacker, Duration::from_secs(1), false));
        let others: Vec<u8> = seen.into_iter().filter(|t| *t != COOKIE_REPLY).collect();
        assert!(
            others.is_empty(),
            "the attacker received only cookie replies, also got message types {others:?}"
        );
        assert_eq!(the_peer(&mut us, dev).await.endpoint, Some(client_addr));
    });
}

/// A flood of initiations with a valid mac1 from one host, as fast as the test can send
/// them, and from the same host initiations of a stranger's key that carry its cookie
/// (valid mac2), while the client pings through its live session: every ping is answered
/// (the handshake messages wait on their own thread's queue, never in front of data, and
/// a source with its cookie gets 20 a second of handshake work), and the flooder gets
/// cookie replies and nothing else. The pings' worst round trip is printed.
#[test]
fn a_flood_of_initiations_from_one_host_leaves_the_data_path_alone() {
    in_new_netns(|| async {
        let dev = "wgt-fld";
        let Setup { us: _us, client } = device_with_client(dev, None).await;
        let mut tunn = client_tunn(None, 1);
        assert!(ping(&mut tunn, &client, 1, Duration::from_secs(5)).answered);

        let attacker = UdpSocket::bind("127.0.0.3:0").unwrap();
        let mut seed = 0xf100_d5ee_d000_u64;
        let flood: Vec<Vec<u8>> = (0..4096).map(|i| initiation(&mut seed, i)).collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sender = {
            let (sock, stop) = (attacker.try_clone().unwrap(), stop.clone());
            std::thread::spawn(move || {
                let mut sent = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for d in &flood {
                        let _ = sock.send_to(d, DEVICE);
                    }
                    sent += flood.len();
                }
                sent
            })
        };
        // The same host from another port, with its cookie: a stranger's key, whose
        // initiations carry a valid mac2 once the device's cookie reply came back, as fast
        // as it can make them (two X25519 each).
        let with_cookie = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                use weft_userspace::wg::handshake::Handshake;
                let sock = UdpSocket::bind("127.0.0.3:0").unwrap();
                sock.set_read_timeout(Some(Duration::from_millis(20)))
                    .unwrap();
                let device = x25519_dalek::PublicKey::from(&device_key());
                let stranger = x25519_dalek::StaticSecret::from([0x42; 32]);
                let mut hs = Handshake::new(stranger, device, None);
                let (mut sent, mut with_mac2, mut cookie) = (0usize, 0usize, false);
                let mut out = [0u8; 148];
                let mut reply = [0u8; 256];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if hs.initiate(sent as u32, Instant::now(), &mut out).is_none() {
                        continue;
                    }
                    let _ = sock.send_to(&out, DEVICE);
                    sent += 1;
                    with_mac2 += usize::from(cookie);
                    // Until it has its cookie, it waits a moment for the reply to this
                    // initiation (the full queue may have dropped it: then it tries again).
                    let waiting = Instant::now();
                    while !cookie && waiting.elapsed() < Duration::from_millis(200) {
                        if let Ok((n, _)) = sock.recv_from(&mut reply) {
                            cookie = hs.take_cookie(&reply[..n], Instant::now()).is_ok();
                        }
                    }
                }
                (sent, with_mac2)
            })
        };
        let start = Instant::now();
        let (mut answered, mut worst) = (0, Duration::ZERO);
        for seq in 2..62u16 {
            let at = Instant::now();
            if ping(&mut tunn, &client, seq, Duration::from_secs(2)).answered {
                answered += 1;
                worst = worst.max(at.elapsed());
            }
            std::thread::sleep(Duration::from_millis(40));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let sent = sender.join().unwrap();
        let (cookied, with_mac2) = with_cookie.join().unwrap();
        let flooded = start.elapsed();
        let seen = received(&attacker, Duration::from_secs(2), false);
        println!(
            "flood: {sent} initiations in {flooded:.1?} ({:.0}/s) and {cookied} from a stranger's key ({with_mac2} with its cookie); pings answered {answered} of 60, worst round trip {worst:?}; replies to the flooder: {}",
            sent as f64 / flooded.as_secs_f64(),
            seen.len()
        );
        assert_eq!(answered, 60, "every ping through the live session answered");
        assert!(
            with_mac2 > 0,
            "the stranger got its cookie and flooded with it"
        );
        assert!(!seen.is_empty(), "the flood put the device under load");
        assert!(
            seen.iter().all(|t| *t == COOKIE_REPLY),
            "only cookie replies"
        );
    });
}

/// Another process on the host cannot take the device's port, even with SO_REUSEADDR set
/// on its own socket (the device's sockets do not set it, so the kernel refuses the
/// second bind and the tunnel's datagrams keep reaching the device).
#[test]
fn another_process_cannot_bind_the_device_port() {
    in_new_netns(|| async {
        let Setup { .. } = device_with_client("wgt-port", None).await;
        for addr in ["0.0.0.0:51999", "127.0.0.1:51999", "[::]:51999"] {
            let addr: SocketAddr = addr.parse().unwrap();
            let domain = socket2::Domain::for_address(addr);
            let s = socket2::Socket::new(domain, socket2::Type::DGRAM, None).unwrap();
            s.set_reuse_address(true).unwrap();
            if addr.is_ipv6() {
                s.set_only_v6(true).unwrap();
            }
            assert!(
                s.bind(&addr.into()).is_err(),
                "a second socket bound the device's port at {addr}"
            );
        }
    });
}
