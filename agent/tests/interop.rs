//! weft's userspace device against another WireGuard implementation for several minutes,
//! through two rekeys, with traffic both ways, one way, and an idle gap: nothing is lost
//! around the rekeys. The other side is Debian's wireguard-go on the host (today's
//! protocol, an independent implementation) and kernel WireGuard in the VM
//! (`WEFT_LAB_IMPLEMENTATION=kernel`). The phases' lengths are the thing under test
//! (WireGuard rekeys a session 120 s after it was made), so they are waited out.
//!
//! weft (namespace 2, 192.168.241.2) sends first, so it initiates the first session and
//! rekeys it when it sends after 120 s: once in the one-way phase, once in the last.

use std::net::UdpSocket;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weft_lab::conformance::{kernel, Net};
use weft_lab::netns::in_named_netns;
use weft_lab::wait;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Pings from namespace `i` to `addr`, five a second for `secs` seconds, as a process.
fn pings(net: &Net, i: usize, addr: &str, secs: u32) -> Child {
    Command::new("ip")
        .args([
            "netns",
            "exec",
            net.ns(i),
            "ping",
            "-n",
            "-q",
            "-i",
            "0.2",
            "-W",
            "2",
        ])
        .args(["-c", &(secs * 5).to_string(), addr])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ping runs")
}

/// (sent, received) of a finished ping.
fn counted(child: Child) -> (u32, u32) {
    let out = child.wait_with_output().expect("ping ends");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or_else(|| panic!("no summary from ping: {text}"));
    let n: Vec<u32> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    (n[0], n[1])
}

/// The handshake times weft's device reports for its peer, as `wg show` prints them.
fn latest_handshake(net: &Net, dev: &str) -> String {
    net.show(2, dev, "latest-handshakes")
        .ok()
        .and_then(|v| v.into_iter().next())
        .map(|(_, t)| t)
        .unwrap_or_default()
}

#[test]
fn through_two_rekeys_against_another_implementation_nothing_is_lost() {
    let mut net = Net::new(WEFT).unwrap();
    let other = if kernel() {
        net.device(1, 0, 1).unwrap()
    } else {
        net.wireguard_go(1, 0, 1).unwrap()
    };
    let weft = net.userspace_device(2, 0, 2).unwrap();
    let (k1, k2) = (net.keys("k1").unwrap(), net.keys("k2").unwrap());
    net.join_over_loopback((&other, &k1), (&weft, &k2)).unwrap();
    wait::until_or(
        "weft's first handshake",
        Duration::from_secs(10),
        || net.ok(2, "ping -c 1 -W 1 192.168.241.1"),
        || net.diagnose(),
    );
    let start = Instant::now();
    let mut handshakes = vec![latest_handshake(&net, &weft)];
    let mut seen = |net: &Net| {
        let t = latest_handshake(net, &weft);
        if handshakes.last() != Some(&t) {
            handshakes.push(t);
        }
    };

    // Both ways for 100 s.
    let (a, b) = (
        pings(&net, 2, "192.168.241.1", 100),
        pings(&net, 1, "192.168.241.2", 100),
    );
    let (both_first, back_first) = (counted(a), counted(b));
    seen(&net);

    // One way, weft to the other side, for 90 s: UDP datagrams counted where they land.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let sink = in_named_netns(net.ns(1), move || {
        let s = UdpSocket::bind("192.168.241.1:9000").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = ready_tx.send(());
        let mut buf = [0u8; 64];
        let mut got = 0u32;
        while let Ok((n, _)) = s.recv_from(&mut buf) {
            if &buf[..n] == b"end" {
                break;
            }
            got += 1;
        }
        got
    });
    ready_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let source = in_named_netns(net.ns(2), || {
        let s = UdpSocket::bind("192.168.241.2:0").unwrap();
        let begin = Instant::now();
        let mut sent = 0u32;
        while begin.elapsed() < Duration::from_secs(90) {
            if s.send_to(&sent.to_le_bytes(), "192.168.241.1:9000").is_ok() {
                sent += 1;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // What was in flight lands before the end marker is read.
        std::thread::sleep(Duration::from_millis(500));
        let _ = s.send_to(b"end", "192.168.241.1:9000");
        sent
    });
    let one_way_sent = source.join().unwrap().unwrap();
    let one_way_got = sink.join().unwrap().unwrap();
    seen(&net);

    // Idle for 30 s: nothing sent either way.
    std::thread::sleep(Duration::from_secs(30));

    // Both ways again, past the second rekey (240 s after the first handshake).
    let left = Duration::from_secs(285)
        .saturating_sub(start.elapsed())
        .as_secs() as u32;
    let (a, b) = (
        pings(&net, 2, "192.168.241.1", left),
        pings(&net, 1, "192.168.241.2", left),
    );
    let (both_last, back_last) = (counted(a), counted(b));
    seen(&net);

    println!(
        "interop with {}: {:.0} s; pings weft→peer {both_first:?} then {both_last:?}, \
         peer→weft {back_first:?} then {back_last:?} (sent, answered); one way \
         {one_way_got} of {one_way_sent}; handshakes seen by weft: {handshakes:?}",
        if kernel() {
            "kernel WireGuard"
        } else {
            "wireguard-go"
        },
        start.elapsed().as_secs_f64()
    );
    for (what, (sent, got)) in [
        ("weft→peer, both ways", both_first),
        ("peer→weft, both ways", back_first),
        ("weft→peer, last phase", both_last),
        ("peer→weft, last phase", back_last),
    ] {
        assert_eq!(got, sent, "{what}: pings lost\n{}", net.diagnose());
    }
    assert_eq!(one_way_got, one_way_sent, "one way: datagrams lost");
    assert!(
        handshakes.len() >= 3,
        "at least two rekeys after the first handshake: {handshakes:?}"
    );
}
