//! The path MTU prober on its own, over both families: two hosts in network namespaces
//! joined through two routers whose link between them is narrower (1400) than the hosts'
//! own interfaces (1500), the routers dropping every ICMP "fragmentation needed" and
//! ICMPv6 "packet too big". Each host runs the agent's prober (`weft::pathmtu`); each
//! measures the other's IPv4 and IPv6 address at 1400, from padded probes alone, and a
//! host that answers no probe is reported as such rather than measured.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use weft::pathmtu::{self, Targets};
use weft_lab::netns::{in_named_netns, sh};

const PORT: u16 = 51822;

/// Namespaces `<tag>-a`, `<tag>-r1`, `<tag>-r2`, `<tag>-b`: a and b at 1500, r1–r2 at
/// `narrow`, documentation addresses of both families, ICMP errors dropped on the routers.
struct Topology {
    tag: String,
}

impl Topology {
    fn build(name: &str, narrow: u32) -> Topology {
        let tag = format!("{name}{}", std::process::id() % 100_000);
        let t = Topology { tag };
        for n in ["a", "r1", "r2", "b"] {
            sh(&format!("ip netns add {}", t.ns(n)));
            t.on(n, "ip link set lo up");
        }
        let links = [
            (
                "a",
                "r1",
                1500,
                "198.51.100.1/30",
                "198.51.100.2/30",
                "2001:db8:1::1/64",
                "2001:db8:1::2/64",
            ),
            (
                "r1",
                "r2",
                narrow,
                "198.51.100.5/30",
                "198.51.100.6/30",
                "2001:db8:2::1/64",
                "2001:db8:2::2/64",
            ),
            (
                "r2",
                "b",
                1500,
                "203.0.113.1/30",
                "203.0.113.2/30",
                "2001:db8:3::1/64",
                "2001:db8:3::2/64",
            ),
        ];
        for (x, y, mtu, x4, y4, x6, y6) in links {
            sh(&format!(
                "ip -n {nx} link add to-{y} type veth peer name to-{x} netns {ny}",
                nx = t.ns(x),
                ny = t.ns(y)
            ));
            for (me, other, v4, v6) in [(x, y, x4, x6), (y, x, y4, y6)] {
                t.on(
                    me,
                    &format!(
                        "ip link set to-{other} mtu {mtu} up && ip addr add {v4} dev to-{other} \
                         && ip -6 addr add {v6} dev to-{other} nodad"
                    ),
                );
            }
        }
        t.on(
            "a",
            "ip route add default via 198.51.100.2 && ip -6 route add default via 2001:db8:1::2",
        );
        t.on(
            "b",
            "ip route add default via 203.0.113.1 && ip -6 route add default via 2001:db8:3::1",
        );
        t.on("r1", "ip route add 203.0.113.0/30 via 198.51.100.6 && ip -6 route add 2001:db8:3::/64 via 2001:db8:2::2");
        t.on("r2", "ip route add 198.51.100.0/30 via 198.51.100.5 && ip -6 route add 2001:db8:1::/64 via 2001:db8:2::1");
        for r in ["r1", "r2"] {
            t.on(
                r,
                "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1 \
                 && nft add table inet icmp_errors \
                 && nft add chain inet icmp_errors out '{ type filter hook output priority 0; }' \
                 && nft add rule inet icmp_errors out icmp type destination-unreachable drop \
                 && nft add rule inet icmp_errors out icmpv6 type packet-too-big drop",
            );
        }
        // Both ends reach each other (small packets) before anything is measured.
        t.on(
            "a",
            "ping -c1 -W5 203.0.113.2 >/dev/null && ping -6 -c1 -W5 2001:db8:3::2 >/dev/null",
        );
        t
    }

    fn ns(&self, n: &str) -> String {
        format!("{}-{n}", self.tag)
    }

    fn on(&self, n: &str, cmd: &str) -> String {
        sh(&format!(
            "ip netns exec {} sh -c \"{}\"",
            self.ns(n),
            cmd.replace('"', "\\\"")
        ))
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for n in ["a", "r1", "r2", "b"] {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.ns(n)])
                .status();
        }
    }
}

/// Runs a prober in namespace `ns` measuring `targets` until every one of them has a
/// measurement (or `within` passes): what it measured, answered or not.
fn measure_from(ns: &str, targets: Vec<IpAddr>, within: Duration) -> BTreeMap<IpAddr, Option<u16>> {
    let handle = in_named_netns(ns, move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let prober =
                pathmtu::spawn(PORT, Duration::from_secs(1)).expect("binding the probe port");
            let wanted: BTreeSet<IpAddr> = targets.into_iter().collect();
            prober.targets.send_replace(Targets {
                addresses: wanted.clone(),
                max: 1500,
                // No keys: untagged probes and acks, as on vxlan or host-gw.
                ..Targets::default()
            });
            let deadline = tokio::time::Instant::now() + within;
            loop {
                let seen: BTreeMap<IpAddr, Option<u16>> = prober
                    .measurements
                    .lock()
                    .map(|m| m.iter().map(|(a, m)| (*a, m.mtu)).collect())
                    .unwrap_or_default();
                let all = wanted.iter().all(|a| seen.contains_key(a));
                if all || tokio::time::Instant::now() > deadline {
                    return seen;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    });
    handle
        .join()
        .expect("the prober's thread")
        .expect("entering the namespace")
}

/// Answers probes in namespace `ns` for as long as the returned sender is kept.
fn answer_in(ns: &str) -> std::sync::mpsc::Sender<()> {
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let (ready, is_ready) = std::sync::mpsc::channel();
    let _ = in_named_netns(ns, move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let _prober =
                pathmtu::spawn(PORT, Duration::from_secs(1)).expect("binding the probe port");
            let _ = ready.send(());
            while stopped.try_recv() == Err(std::sync::mpsc::TryRecvError::Empty) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    });
    is_ready
        .recv_timeout(Duration::from_secs(5))
        .expect("the responder started");
    stop
}

#[test]
fn both_families_measure_a_narrow_path_whose_routers_drop_icmp() {
    let t = Topology::build("pmb", 1400);
    let v4: IpAddr = "203.0.113.2".parse().unwrap();
    let v6: IpAddr = "2001:db8:3::2".parse().unwrap();
    let _responder = answer_in(&t.ns("b"));
    let measured = measure_from(&t.ns("a"), vec![v4, v6], Duration::from_secs(10));
    assert_eq!(measured.get(&v4), Some(&Some(1400)), "IPv4: {measured:?}");
    assert_eq!(measured.get(&v6), Some(&Some(1400)), "IPv6: {measured:?}");
}

#[test]
fn a_host_that_answers_no_probe_is_not_measured() {
    let t = Topology::build("pms", 1400);
    let silent: IpAddr = "203.0.113.2".parse().unwrap();
    let measured = measure_from(&t.ns("a"), vec![silent], Duration::from_secs(10));
    assert_eq!(measured.get(&silent), Some(&None), "{measured:?}");
}
