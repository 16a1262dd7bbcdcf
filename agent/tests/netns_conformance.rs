//! The scenarios of WireGuard's own conformance test (the kernel's netns selftest, which
//! wireguard-go also runs), written for weft: the userspace device here, kernel WireGuard
//! in the VM (`WEFT_LAB_IMPLEMENTATION=kernel`), so the two are shown to behave alike.
//!
//! - Devices born in namespace 0 and moved into 1 and 2 (their UDP sockets stay in 0, on
//!   its loopback): both families inside, IPv4 and IPv6 outside, a TCP transfer, the MTU's
//!   edges and a large MTU, roaming both ways, the crypto-RP filter.
//! - Devices in their own namespaces behind a router: NAT with a persistent keepalive;
//!   replies from the address the peer chose, and not after that address is gone.
//! - The UAPI: many peers with many allowed IPs, read back whole.
//! - The userspace device's life: moving is not deleting, deleting ends it within a
//!   second (its socket gone, the reason logged), one process per device name.

use std::time::{Duration, Instant};

use weft_lab::conformance::{kernel, Keys, Net};
use weft_lab::netns::in_named_netns;
use weft_lab::wait;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// How long a first handshake may take before a ping answers.
const FIRST_ANSWER: Duration = Duration::from_secs(5);

/// Two devices and their keys.
struct Pair {
    net: Net,
    d1: String,
    d2: String,
    k1: Keys,
    k2: Keys,
}

/// Waits until namespace `i` pings `addr` (a first handshake first).
fn reaches(net: &Net, i: usize, addr: &str) {
    wait::until_or(
        &format!("namespace {i} reaching {addr}"),
        wait::bound(FIRST_ANSWER, FIRST_ANSWER * 4),
        || net.ok(i, &format!("ping -c 1 -W 1 {addr}")),
        || net.diagnose(),
    );
}

/// The netns trick: both devices born in namespace 0, moved into 1 and 2, each with
/// 192.168.241.N/24 and fd00::N/24, their peers at the loopback of namespace 0 (IPv6's
/// when `outer_v6`), ports 1 and 2.
fn moved_pair(outer_v6: bool) -> Pair {
    let mut net = Net::new(WEFT).unwrap();
    let d1 = net.device(1, 0, 1).unwrap();
    let d2 = net.device(2, 0, 2).unwrap();
    let lo = if outer_v6 { "[::1]" } else { "127.0.0.1" };
    pair(
        net,
        d1,
        d2,
        [Some(format!("{lo}:2")), Some(format!("{lo}:1"))],
    )
}

/// Devices `d1` (namespace 1, port 1) and `d2` (namespace 2, port 2) given keys, each
/// other as peer (at `endpoints`, if given), 192.168.241.N/24 and fd00::N/24, and set up.
fn pair(net: Net, d1: String, d2: String, endpoints: [Option<String>; 2]) -> Pair {
    let (k1, k2) = (net.keys("k1").unwrap(), net.keys("k2").unwrap());
    for (i, dev, me, peer) in [(1, &d1, &k1, &k2), (2, &d2, &k2, &k1)] {
        let other = 3 - i;
        let endpoint = endpoints[i - 1]
            .as_ref()
            .map(|e| format!(" endpoint {e}"))
            .unwrap_or_default();
        net.sh(
            i,
            &format!(
                "ip addr add 192.168.241.{i}/24 dev {dev} && ip addr add fd00::{i}/24 dev {dev} && \
                 wg set {dev} private-key {} listen-port {i} peer {} \
                 allowed-ips 192.168.241.{other}/32,fd00::{other}/128{endpoint} && \
                 ip link set {dev} up",
                me.file.display(),
                peer.public
            ),
        )
        .unwrap();
    }
    Pair {
        net,
        d1,
        d2,
        k1,
        k2,
    }
}

/// Both ways, both families, and a TCP transfer that arrives intact.
fn carries_everything(p: &Pair) {
    reaches(&p.net, 2, "192.168.241.1");
    reaches(&p.net, 1, "192.168.241.2");
    reaches(&p.net, 2, "fd00::1");
    reaches(&p.net, 1, "fd00::2");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let sink = in_named_netns(p.net.ns(2), move || {
        weft_lab::tcp::sink_on("192.168.241.2".parse().unwrap(), 7411, || {
            let _ = ready_tx.send(());
        })
    });
    ready_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let source = in_named_netns(p.net.ns(1), || {
        weft_lab::tcp::source("192.168.241.2:7411", 16 << 20)
    });
    let sent = source.join().unwrap().unwrap().unwrap();
    let got = sink.join().unwrap().unwrap().unwrap();
    assert_eq!(
        sent.split_whitespace().take(2).collect::<Vec<_>>(),
        got.split_whitespace().take(2).collect::<Vec<_>>(),
        "the transfer arrived whole"
    );
}

#[test]
fn devices_moved_to_other_namespaces_carry_both_families() {
    let p = moved_pair(false);
    carries_everything(&p);
    if !kernel() {
        for dev in [&p.d1, &p.d2] {
            assert!(
                !p.net.log(dev).contains("deleted"),
                "a move is not a deletion: {}",
                p.net.log(dev)
            );
        }
    }
}

#[test]
fn an_ipv6_outer_transport_carries_both_families() {
    let p = moved_pair(true);
    carries_everything(&p);
    let seen = p.net.endpoint(1, &p.d1, &p.k2.public);
    assert_eq!(seen.as_deref(), Some("[::1]:2"));
}

/// The largest packet the MTU takes goes through whole with DF; one byte more is refused
/// at the sender; a large MTU carries large packets (fragmented outside, on loopback never).
#[test]
fn the_mtus_edges_and_a_large_mtu() {
    let p = moved_pair(false);
    reaches(&p.net, 1, "192.168.241.2");
    let ping = |size: usize, to: &str| p.net.ok(1, &format!("ping -c 1 -W 2 -M do -s {size} {to}"));
    // 1420: 1392 bytes of ICMP payload in IPv4, 1372 in IPv6.
    assert!(ping(1392, "192.168.241.2"), "the MTU's largest IPv4 packet");
    assert!(!ping(1393, "192.168.241.2"), "one byte past the MTU");
    reaches(&p.net, 1, "fd00::2");
    assert!(ping(1372, "fd00::2"), "the MTU's largest IPv6 packet");
    for (i, dev) in [(1, &p.d1), (2, &p.d2)] {
        p.net.sh(i, &format!("ip link set {dev} mtu 9000")).unwrap();
    }
    assert!(ping(8972, "192.168.241.2"), "a large MTU's largest packet");
    assert!(ping(8952, "fd00::2"));
}

/// Roaming: node 1 moves to another port and, over IPv4, to another source address (the
/// loopback's 127.0.0.1 replaced by 127.212.121.99, so the address it answered from is
/// gone): node 2 follows it to where its packets now come from; then again over IPv6.
#[test]
fn roaming_both_ways() {
    let p = moved_pair(false);
    reaches(&p.net, 1, "192.168.241.2");
    p.net
        .sh(
            0,
            "ip -4 addr del 127.0.0.1/8 dev lo && ip -4 addr add 127.212.121.99/8 dev lo",
        )
        .unwrap();
    p.net
        .sh(
            1,
            &format!(
                "wg set {d} listen-port 9999 && wg set {d} peer {} endpoint 127.0.0.1:2",
                p.k2.public,
                d = p.d1
            ),
        )
        .unwrap();
    reaches(&p.net, 1, "fd00::2");
    assert_eq!(
        p.net.endpoint(2, &p.d2, &p.k1.public).as_deref(),
        Some("127.212.121.99:9999"),
        "node 2 follows node 1 to its new address and port"
    );
    p.net
        .sh(
            1,
            &format!(
                "wg set {d} listen-port 9998 && wg set {d} peer {} endpoint [::1]:2",
                p.k2.public,
                d = p.d1
            ),
        )
        .unwrap();
    reaches(&p.net, 1, "192.168.241.2");
    assert_eq!(
        p.net.endpoint(2, &p.d2, &p.k1.public).as_deref(),
        Some("[::1]:9998")
    );
    // And node 2 roams too: node 1 follows it.
    p.net
        .sh(2, &format!("wg set {} listen-port 9997", p.d2))
        .unwrap();
    reaches(&p.net, 2, "192.168.241.1");
    assert_eq!(
        p.net.endpoint(1, &p.d1, &p.k2.public).as_deref(),
        Some("[::1]:9997")
    );
}

/// A packet whose inner source belongs to another peer's AllowedIPs (more specific) is
/// dropped: nothing from peer 2 with 192.168.241.2 arrives once another peer owns .2/32.
#[test]
fn the_crypto_rp_filter_drops_sources_of_another_peer() {
    let p = moved_pair(false);
    reaches(&p.net, 2, "192.168.241.1");
    p.net
        .sh(
            1,
            &format!(
                "wg set {} peer {} allowed-ips 192.168.241.0/24",
                p.d1, p.k2.public
            ),
        )
        .unwrap();
    reaches(&p.net, 2, "192.168.241.1");
    let other = p.net.keys("k3").unwrap();
    p.net
        .sh(
            1,
            &format!(
                "wg set {} peer {} allowed-ips 192.168.241.2/32",
                p.d1, other.public
            ),
        )
        .unwrap();
    // The reply would go to the other peer, and what peer 2 sends from .2 is refused.
    assert!(!p.net.ok(2, "ping -c 2 -W 1 192.168.241.1"));
    p.net
        .sh(1, &format!("wg set {} peer {} remove", p.d1, other.public))
        .unwrap();
    reaches(&p.net, 2, "192.168.241.1");
}

/// Devices in their own namespaces (1 and 2), joined through namespace 0: node 1 at
/// 10.0.0.1 (and `extra` addresses) on a link to 0, node 2 at 192.168.1.2 behind 0, which
/// routes between them and, with `nat`, masquerades node 2's traffic as 10.0.0.100.
fn routed_pair(extra: &[&str], nat: bool) -> Pair {
    let mut net = Net::new(WEFT).unwrap();
    let (ns1, ns2) = (net.ns(1).to_string(), net.ns(2).to_string());
    net.sh(
        0,
        &format!(
            "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1 && \
             ip link add v01 type veth peer name v10 netns {ns1} && \
             ip link add v02 type veth peer name v20 netns {ns2} && \
             ip addr add 10.0.0.100/24 dev v01 && ip addr add fd01:aa::100/64 dev v01 nodad && \
             ip addr add 192.168.1.100/24 dev v02 && ip addr add fd01:bb::100/64 dev v02 nodad && \
             ip link set v01 up && ip link set v02 up"
        ),
    )
    .unwrap();
    let mut addrs = String::new();
    for a in extra {
        addrs += &format!("ip addr add {a} dev v10 nodad && ");
    }
    net.sh(
        1,
        &format!(
            "ip addr add 10.0.0.1/24 dev v10 && ip addr add fd01:aa::1/64 dev v10 nodad && \
             {addrs}ip link set v10 up"
        ),
    )
    .unwrap();
    net.sh(
        2,
        "ip addr add 192.168.1.2/24 dev v20 && ip addr add fd01:bb::2/64 dev v20 nodad && \
         ip link set v20 up && ip route add default via 192.168.1.100 && \
         ip -6 route add default via fd01:bb::100",
    )
    .unwrap();
    if nat {
        net.sh(
            0,
            "nft add table ip nat && \
             nft 'add chain ip nat post { type nat hook postrouting priority 100; }' && \
             nft add rule ip nat post ip saddr 192.168.1.0/24 oifname v01 masquerade",
        )
        .unwrap();
    } else {
        net.sh(1, "ip route add 192.168.1.0/24 via 10.0.0.100 && ip -6 route add fd01:bb::/64 via fd01:aa::100")
            .unwrap();
    }
    let d1 = net.device(1, 1, 1).unwrap();
    let d2 = net.device(2, 2, 2).unwrap();
    pair(net, d1, d2, [None, None])
}

/// Node 2 behind NAT, with a persistent keepalive: node 1 learns the mapped address and
/// port from it and reaches node 2 through the NAT without ever being told where it is.
#[test]
fn nat_with_a_persistent_keepalive() {
    let p = routed_pair(&[], true);
    p.net
        .sh(
            2,
            &format!(
                "wg set {} peer {} endpoint 10.0.0.1:1 persistent-keepalive 1",
                p.d2, p.k1.public
            ),
        )
        .unwrap();
    wait::until(
        "node 1 learning node 2's mapped endpoint from its keepalives",
        wait::bound(FIRST_ANSWER, FIRST_ANSWER * 4),
        || {
            p.net
                .endpoint(1, &p.d1, &p.k2.public)
                .is_some_and(|e| e.starts_with("10.0.0.100:"))
        },
    );
    reaches(&p.net, 1, "192.168.241.2");
    reaches(&p.net, 1, "fd00::2");
}

/// Node 1 has two addresses; node 2 reaches it at the second, which node 1's routes never
/// choose as a source (an IPv4 secondary; an IPv6 address no longer preferred). Node 1
/// answers from that one (node 2 keeps the endpoint it chose), and once the address is
/// gone, node 1 sends from the route's choice at once and node 2 follows.
fn replies_from_the_chosen_address(chosen: &str, primary: &str, ping: &str) {
    let p = routed_pair(&["10.0.0.10/24", "fd01:aa::10/64 preferred_lft 0"], false);
    let (ep, primary_ep) = (endpoint_of(chosen, 1), endpoint_of(primary, 1));
    p.net
        .sh(
            2,
            &format!("wg set {} peer {} endpoint {ep}", p.d2, p.k1.public),
        )
        .unwrap();
    reaches(&p.net, 2, ping);
    for _ in 0..3 {
        assert!(p.net.ok(2, &format!("ping -c 1 -W 1 {ping}")));
        assert_eq!(
            p.net.endpoint(2, &p.d2, &p.k1.public).as_deref(),
            Some(ep.as_str()),
            "node 1 answered from another address than the one node 2 chose"
        );
    }
    // Not too sticky: the address goes, node 1's answers come from the route's choice.
    let prefix = if chosen.contains(':') { "64" } else { "24" };
    p.net
        .sh(1, &format!("ip addr del {chosen}/{prefix} dev v10"))
        .unwrap();
    let to_node2 = if ping.contains(':') {
        "fd00::2"
    } else {
        "192.168.241.2"
    };
    let started = Instant::now();
    reaches(&p.net, 1, to_node2);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        p.net.endpoint(2, &p.d2, &p.k1.public).as_deref(),
        Some(primary_ep.as_str()),
        "node 2 follows node 1 to the address it now sends from"
    );
}

fn endpoint_of(ip: &str, port: u16) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

#[test]
fn replies_come_from_the_address_the_peer_chose_ipv4() {
    replies_from_the_chosen_address("10.0.0.10", "10.0.0.1", "192.168.241.1");
}

#[test]
fn replies_come_from_the_address_the_peer_chose_ipv6() {
    replies_from_the_chosen_address("fd01:aa::10", "fd01:aa::1", "fd00::1");
}

/// One peer with 130,560 allowed IPs; 40 peers with 53 allowed IPs each, then 30 more:
/// `wg` reads every one back (the answers span many reads of the socket).
#[test]
fn the_uapi_answers_whole_with_many_peers() {
    let mut net = Net::new(WEFT).unwrap();
    let dev = net.device(1, 1, 1).unwrap();
    let me = net.keys("me").unwrap();
    let mut conf = format!(
        "[Interface]\nPrivateKey = {}\n",
        std::fs::read_to_string(&me.file).unwrap()
    );
    for peer in 0..40u32 {
        let key = net.keys(&format!("p{peer}")).unwrap();
        let ips: Vec<String> = (0..53u32)
            .map(|ip| format!("10.{}.{}.0/24", peer, ip))
            .collect();
        conf += &format!(
            "[Peer]\nPublicKey = {}\nAllowedIPs = {}\n",
            key.public,
            ips.join(", ")
        );
    }
    let file = net.log_path("conf");
    std::fs::write(&file, conf).unwrap();
    net.sh(1, &format!("wg setconf {dev} {}", file.display()))
        .unwrap();
    let allowed = net.show(1, &dev, "allowed-ips").unwrap();
    assert_eq!(allowed.len(), 40);
    let many = net.keys("many").unwrap();
    let mut conf = format!("[Peer]\nPublicKey = {}\n", many.public);
    for a in 1..=255u32 {
        for b in 0..=255u32 {
            conf += &format!("AllowedIPs = {a}.{b}.0.0/16,{a}::{b}/128\n");
        }
    }
    let more = net.log_path("more");
    std::fs::write(&more, conf).unwrap();
    net.sh(1, &format!("wg addconf {dev} {}", more.display()))
        .unwrap();
    let big = net.show(1, &dev, "allowed-ips").unwrap();
    let of_many = big.iter().find(|(k, _)| *k == many.public).unwrap();
    assert_eq!(of_many.1.split_whitespace().count(), 255 * 256 * 2);
    net.sh(1, &format!("wg set {dev} peer {} remove", many.public))
        .unwrap();
    assert!(allowed
        .iter()
        .all(|(_, ips)| ips.split_whitespace().count() == 53));
    for peer in 0..30u32 {
        let key = net.keys(&format!("q{peer}")).unwrap();
        net.sh(
            1,
            &format!(
                "wg set {dev} peer {} allowed-ips 172.16.{peer}.0/24",
                key.public
            ),
        )
        .unwrap();
    }
    let peers = net.sh(1, &format!("wg show {dev} peers")).unwrap();
    assert_eq!(peers.lines().count(), 70);
}

/// The userspace device's life: a move keeps it (a second later it still serves its
/// socket and carries traffic: `devices_moved_…`); deleting its interface where it now is
/// ends the process within a second, its socket removed and the reason logged; and a
/// second process for a name that is served is refused, the first left alone.
#[test]
fn deleting_ends_the_device_promptly_and_one_process_serves_a_name() {
    if kernel() {
        return; // kernel devices have no process
    }
    let mut p = moved_pair(false);
    reaches(&p.net, 1, "192.168.241.2");
    // A second device process for d1's name.
    let second = std::process::Command::new(WEFT)
        .args(["userspace-device", &p.d1])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&second.stderr).into_owned()
        + &String::from_utf8_lossy(&second.stdout);
    assert!(!second.status.success(), "{said}");
    assert!(said.contains("already serves"), "{said}");
    reaches(&p.net, 1, "192.168.241.2");
    // Deleted where it now is.
    let d1 = p.d1.clone();
    p.net.sh(1, &format!("ip link del {d1}")).unwrap();
    let deleted = Instant::now();
    wait::until("the device process ending", Duration::from_secs(5), || {
        matches!(p.net.process(&d1).map(|c| c.try_wait()), Some(Ok(Some(_))))
    });
    assert!(
        deleted.elapsed() < Duration::from_secs(1),
        "{:?}",
        deleted.elapsed()
    );
    assert!(!std::path::Path::new(&format!("/var/run/wireguard/{d1}.sock")).exists());
    let log = p.net.log(&d1);
    assert!(log.contains("its interface was deleted"), "{log}");
    assert!(!log.contains("TUN read failed"), "{log}");
    // The other device carries on.
    assert!(p.net.ok(2, &format!("wg show {}", p.d2)));
}
