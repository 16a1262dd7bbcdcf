//! A recorded handshake initiation, replayed by a third host after each change that
//! rebuilds a peer's state on the userspace device (keepalive, PSK, private key, the peer
//! removed and added again, the device process killed and started again), is refused: the peer's endpoint stays where it was, pings
//! through the tunnel keep flowing, and nothing is sent to the host that replayed it.
//! The peer is wireguard-go (Debian's package), so the pair speaks today's protocol with
//! an independent implementation; the recording is a real capture on the underlay.
//!
//! The underlay is namespace 0's loopback: the devices are born there (their UDP sockets
//! stay there) and moved into namespaces 1 (wireguard-go) and 2 (weft); the attacker is a
//! UDP socket in namespace 0 on another port.

use std::net::UdpSocket;
use std::process::{Command, Stdio};
use std::time::Duration;

use weft_lab::conformance::Net;
use weft_lab::netns::in_named_netns;
use weft_lab::wait;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// The first UDP payload of `pcap` (a tcpdump capture on a loopback: Ethernet framing).
fn first_payload(pcap: &[u8]) -> Option<Vec<u8>> {
    let record = pcap.get(24..)?;
    let len = u32::from_le_bytes(record.get(8..12)?.try_into().ok()?) as usize;
    let frame = record.get(16..16 + len)?;
    let ip = frame.get(14..)?;
    let ihl = usize::from(ip.first()? & 0x0f) * 4;
    ip.get(ihl + 8..).map(<[u8]>::to_vec)
}

/// Records the first handshake initiation sent to port 2 on namespace 0's loopback while
/// `trigger` runs.
fn record_initiation(net: &Net, trigger: impl FnOnce()) -> Vec<u8> {
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut tcpdump = Command::new("ip")
        .args([
            "netns",
            "exec",
            net.ns(0),
            "tcpdump",
            "-Z",
            "root",
            "-U",
            "-n",
            "-i",
            "lo",
            "-c",
            "1",
            "-w",
        ])
        .arg(file.path())
        .args(["udp dst port 2 and udp[8:4] = 0x01000000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tcpdump runs (scripts/install-deps installs it)");
    // tcpdump says "listening on lo" once its filter is in place.
    let mut stderr = tcpdump.stderr.take().unwrap();
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains("listening on") {
        use std::io::Read;
        assert_eq!(
            stderr.read(&mut byte).unwrap(),
            1,
            "tcpdump ended: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.push(byte[0]);
    }
    trigger();
    wait::until(
        "tcpdump has the initiation",
        Duration::from_secs(10),
        || tcpdump.try_wait().ok().flatten().is_some(),
    );
    let bytes = std::fs::read(file.path()).unwrap();
    let init = first_payload(&bytes).expect("a captured datagram");
    assert_eq!((init.len(), init[0]), (148, 1), "a handshake initiation");
    init
}

/// Sends `datagram` once from a socket of its own in namespace 0 to port 2 (weft's), and
/// says which datagrams (their type bytes) came back to that socket within a second.
fn replay_from_a_third_host(net: &Net, datagram: Vec<u8>) -> Vec<u8> {
    in_named_netns(net.ns(0), move || {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(1)))
            .unwrap();
        socket.send_to(&datagram, "127.0.0.1:2").unwrap();
        let mut buf = [0u8; 2048];
        let mut got = Vec::new();
        while let Ok((n, _)) = socket.recv_from(&mut buf) {
            got.push(buf[..n].first().copied().unwrap_or(0));
        }
        got
    })
    .join()
    .unwrap()
    .unwrap()
}

/// Waits until weft (namespace 2) pings wireguard-go through the tunnel.
fn reaches(net: &Net, what: &str) {
    wait::until_or(
        &format!("{what}: weft reaching wireguard-go"),
        Duration::from_secs(10),
        || net.ok(2, "ping -c 1 -W 1 192.168.241.1"),
        || net.diagnose(),
    );
}

#[test]
fn a_recorded_initiation_replayed_after_each_change_is_refused() {
    let mut net = Net::new(WEFT).unwrap();
    let go = net.wireguard_go(1, 0, 1).unwrap();
    let weft = net.device(2, 0, 2).unwrap();
    let (k1, k2) = (net.keys("k1").unwrap(), net.keys("k2").unwrap());
    let (k2b, psk) = (net.keys("k2b").unwrap(), net.keys("psk").unwrap());
    net.join_over_loopback((&go, &k1), (&weft, &k2)).unwrap();
    // wireguard-go initiates; its initiation is recorded on the underlay.
    let recorded = record_initiation(&net, || {
        assert!(
            net.ok(1, "ping -c 1 -W 5 192.168.241.2"),
            "{}",
            net.diagnose()
        );
    });
    reaches(&net, "first handshake");
    let psk_file = psk.file.display().to_string();
    let changes: Vec<(&str, String)> = vec![
        (
            "a keepalive change",
            format!("wg set {weft} peer {} persistent-keepalive 7", k1.public),
        ),
        (
            "a PSK change",
            format!("wg set {weft} peer {} preshared-key {psk_file}", k1.public),
        ),
        (
            "a private key change and back",
            format!(
                "wg set {weft} private-key {} && wg set {weft} private-key {}",
                k2b.file.display(),
                k2.file.display()
            ),
        ),
        (
            "the peer removed and added again",
            format!(
                "wg set {weft} peer {p} remove && wg set {weft} peer {p} preshared-key {psk_file} \
                 allowed-ips 192.168.241.1/32 endpoint 127.0.0.1:1",
                p = k1.public
            ),
        ),
    ];
    for (what, change) in changes {
        net.sh(2, &change).unwrap();
        if what == "a PSK change" {
            net.sh(
                1,
                &format!("wg set {go} peer {} preshared-key {psk_file}", k2.public),
            )
            .unwrap();
        }
        reaches(&net, what);
        let answered = replay_from_a_third_host(&net, recorded.clone());
        assert_eq!(
            answered,
            [0u8; 0],
            "{what}: weft answered the replay (message types)\n{}",
            net.diagnose()
        );
        assert_eq!(
            net.endpoint(2, &weft, &k1.public).as_deref(),
            Some("127.0.0.1:1"),
            "{what}: the endpoint moved\n{}",
            net.diagnose()
        );
        assert!(
            net.ok(2, "ping -c 5 -i 0.2 -W 1 192.168.241.1"),
            "{what}: pings lost after the replay\n{}",
            net.diagnose()
        );
    }

    // The device process killed and started again: the peer's timestamp is still known
    // (kept beside the UAPI socket), so the replay is refused there too.
    let old = net.process(&weft).expect("weft's device process");
    let pid = old.id();
    old.kill().expect("SIGKILL to the device");
    let status = old.wait().expect("the device's exit");
    eprintln!("device process {pid} killed: {status}");
    wait::until(
        "the killed device's interface gone",
        Duration::from_secs(10),
        || !net.ok(2, &format!("ip link show {weft}")),
    );
    let again = net.userspace_device(2, 0, 2).unwrap();
    net.sh(
        2,
        &format!(
            "ip addr add 192.168.241.2/24 dev {again} && \
             wg set {again} private-key {} listen-port 2 peer {} preshared-key {psk_file} \
             allowed-ips 192.168.241.1/32 endpoint 127.0.0.1:1 && ip link set {again} up",
            k2.file.display(),
            k1.public
        ),
    )
    .unwrap();
    reaches(&net, "a restarted device");
    let answered = replay_from_a_third_host(&net, recorded.clone());
    assert_eq!(
        answered,
        [0u8; 0],
        "a restarted device answered the replay\n{}",
        net.diagnose()
    );
    assert_eq!(
        net.endpoint(2, &again, &k1.public).as_deref(),
        Some("127.0.0.1:1")
    );
    assert!(
        net.ok(2, "ping -c 5 -i 0.2 -W 1 192.168.241.1"),
        "{}",
        net.diagnose()
    );
}
