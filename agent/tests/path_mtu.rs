//! A narrow path between two sites: three nodes with every interface at 1500, node 3
//! behind two routers joined by a 1400-byte link (`narrow`), so each agent sees 1500 and
//! every pod MTU is 1420. Bulk TCP across the narrow path completes both ways, with the
//! routers' ICMP "fragmentation needed" allowed and dropped; each node measures the path
//! and gives the peer's routes its MTU, so at steady state nothing is fragmented on the
//! narrow link; a path that narrows and widens again is followed; and without path MTU
//! discovery the floor holds (outer IPv4 without DF: fragmented, never lost); and a node
//! whose own link is the narrow one, with a smaller pod MTU than its peers, is reached at
//! the path MTU and reaches them at its own; vxlan's routes are sized by the same probes.

use std::net::IpAddr;
use std::sync::mpsc;
use std::time::Duration;

use weft_lab::lab::narrow::{self, Narrow};
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::live_demo::transfer_to;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
const BULK: u64 = 8 << 20;
/// 1400 less WireGuard over IPv4 (60), down to WireGuard's padding multiple of 16.
const NARROW_ROUTE_MTU: u32 = 1328;

fn narrow_lab(mtu: u32, drop_icmp: bool, extra: &[&str]) -> Lab {
    let mut cfg = LabConfig::wireguard(3, WEFT);
    cfg.extra_args.extend(extra.iter().map(|s| s.to_string()));
    behind_a_narrow_path(cfg, mtu, drop_icmp)
}

/// `cfg`'s lab with node 3 behind the narrow path, started and meshed.
fn behind_a_narrow_path(mut cfg: LabConfig, mtu: u32, drop_icmp: bool) -> Lab {
    cfg.routed = vec![2];
    cfg.narrow = Some(Narrow { mtu, drop_icmp });
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    lab
}

/// A transfer under way between two nodes' first pods.
struct Transfer {
    what: String,
    result: mpsc::Receiver<anyhow::Result<(f64, bool)>>,
}

fn start_transfer(lab: &Lab, from: usize, to: usize) -> Transfer {
    start_transfer_to(lab, from, to, lab.nodes[to].pods[0].ip.into())
}

/// A transfer to node `to`'s first pod at its address `ip` (either family).
fn start_transfer_to(lab: &Lab, from: usize, to: usize, ip: IpAddr) -> Transfer {
    let (a, b) = (&lab.nodes[from].pods[0], &lab.nodes[to].pods[0]);
    let (ns_a, ns_b) = (a.ns.clone(), b.ns.clone());
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(transfer_to(&ns_a, &ns_b, ip, BULK));
    });
    Transfer {
        what: format!("node {} -> node {} ({ip})", from + 1, to + 1),
        result,
    }
}

impl Transfer {
    /// Waits for the transfer to arrive intact, failing after `within` (a black hole never
    /// ends by itself).
    fn finish(self, lab: &Lab, within: Duration) {
        let what = self.what;
        match self.result.recv_timeout(within) {
            Ok(Ok((rate, intact))) => {
                assert!(intact, "{what}: corrupted");
                eprintln!("{what}: {rate:.0} MiB/s");
            }
            Ok(Err(e)) => panic!("{what}: {e:#}\n{}", lab.logs()),
            Err(_) => panic!(
                "{what}: {BULK} bytes not through within {within:?}\n{}",
                lab.logs()
            ),
        }
    }
}

fn transfer_within(lab: &Lab, from: usize, to: usize, within: Duration) {
    start_transfer(lab, from, to).finish(lab, within);
}

/// The MTU on node `i`'s route to node `peer`'s subnet (`None`: no MTU on it).
fn route_mtu(lab: &Lab, i: usize, peer: usize) -> Option<u32> {
    let subnet = lab.nodes[peer].subnet.unwrap();
    mtu_of(&lab.on_node(i, &format!("ip route show {subnet}")).unwrap())
}

/// The same for node `peer`'s IPv6 pod subnet.
fn route_mtu_v6(lab: &Lab, i: usize, peer: usize) -> Option<u32> {
    let subnet = lab.nodes[peer].subnet_v6.unwrap();
    mtu_of(
        &lab.on_node(i, &format!("ip -6 route show {subnet}"))
            .unwrap(),
    )
}

/// The `mtu N` of a route as `ip route` prints it.
fn mtu_of(route: &str) -> Option<u32> {
    let words: Vec<&str> = route.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "mtu")?;
    words.get(at + 1)?.parse().ok()
}

/// Waits until node `i`'s route to `peer` carries `want`; returns how long it took.
fn wait_route_mtu(
    lab: &Lab,
    i: usize,
    peer: usize,
    want: Option<u32>,
    within: Duration,
) -> Duration {
    wait_mtu(
        lab,
        want,
        within,
        || route_mtu(lab, i, peer),
        || format!("node {}'s route to node {}", i + 1, peer + 1),
    )
}

/// Waits until `read` gives `want`; returns how long it took.
fn wait_mtu(
    lab: &Lab,
    want: Option<u32>,
    within: Duration,
    read: impl Fn() -> Option<u32>,
    what: impl Fn() -> String,
) -> Duration {
    weft_lab::wait::until_or(
        &format!("{}: mtu {want:?}", what()),
        within,
        || read() == want,
        || format!("mtu {:?}\n{}", read(), lab.logs()),
    )
}

fn across_the_narrow_path(drop_icmp: bool) {
    let lab = narrow_lab(1400, drop_icmp, &[]);
    for (i, peer) in [(0, 2), (2, 0), (1, 2), (2, 1)] {
        let took = wait_route_mtu(
            &lab,
            i,
            peer,
            Some(NARROW_ROUTE_MTU),
            Duration::from_secs(10),
        );
        eprintln!("node {} -> node {}: route mtu in {took:?}", i + 1, peer + 1);
    }
    assert_eq!(
        route_mtu(&lab, 0, 1),
        None,
        "the wide path keeps the pod MTU"
    );
    assert_eq!(
        route_mtu(&lab, 1, 0),
        None,
        "the wide path keeps the pod MTU"
    );
    narrow::count_fragments(&lab.tag).unwrap();
    for (from, to) in [(0, 2), (2, 0), (1, 2)] {
        transfer_within(&lab, from, to, Duration::from_secs(30));
    }
    assert_eq!(
        narrow::fragments(&lab.tag).unwrap(),
        0,
        "IP fragments crossed the narrow link at steady state"
    );
    // `weft status` names the narrow path (once its snapshot has it; an answer that fails
    // is asked again, and the last one shown).
    let status = std::cell::RefCell::new(String::new());
    weft_lab::wait::until_or(
        "weft status to name the path MTU",
        Duration::from_secs(10),
        || {
            let now = lab
                .on_node(0, &format!("{WEFT} status"))
                .unwrap_or_else(|e| format!("weft status failed: {e:#}"));
            let named = now.contains("path MTU 1400");
            *status.borrow_mut() = now;
            named
        },
        || status.borrow().clone(),
    );
}

#[test]
fn bulk_tcp_crosses_a_narrow_path_both_ways() {
    across_the_narrow_path(false);
}

#[test]
fn bulk_tcp_crosses_a_narrow_path_whose_routers_drop_icmp() {
    across_the_narrow_path(true);
}

/// Without path MTU discovery and with ICMP dropped, nothing tells a node the path is
/// narrow: the transfer still completes, its outer IPv4 datagrams fragmented on the way.
#[test]
fn without_discovery_a_narrow_path_fragments_but_never_black_holes() {
    let lab = narrow_lab(1400, true, &["--path-mtu-port=0"]);
    assert_eq!(route_mtu(&lab, 0, 2), None);
    for (from, to) in [(0, 2), (2, 0)] {
        transfer_within(&lab, from, to, Duration::from_secs(60));
    }
}

/// The path narrows to 1300 and widens back to 1400 while transfers run: each change is
/// measured and in use within 5 s (the 2 s check period plus a search), and the
/// transfers complete throughout.
#[test]
fn a_path_that_narrows_and_widens_again_is_followed() {
    let lab = narrow_lab(1400, true, &[]);
    wait_route_mtu(&lab, 0, 2, Some(NARROW_ROUTE_MTU), Duration::from_secs(10));
    narrow::set_narrow_mtu(&lab.tag, 1300).unwrap();
    let running = start_transfer(&lab, 0, 2);
    let took = wait_route_mtu(&lab, 0, 2, Some(1232), Duration::from_secs(5));
    eprintln!("narrowed: in use after {took:?}");
    running.finish(&lab, Duration::from_secs(60));
    narrow::set_narrow_mtu(&lab.tag, 1400).unwrap();
    let took = wait_route_mtu(&lab, 0, 2, Some(NARROW_ROUTE_MTU), Duration::from_secs(5));
    eprintln!("widened: in use after {took:?}");
    transfer_within(&lab, 2, 0, Duration::from_secs(30));
}

/// Node 3's own link is the narrow one (1400 at both ends; the bridge drops larger frames
/// without a word): its pod MTU is 1320, everyone else's 1420. Node 1's route to node 3
/// gets the path's MTU, node 3's routes keep its own smaller pod MTU, and bulk TCP crosses
/// both ways.
#[test]
fn a_node_whose_own_link_is_narrow_mixes_pod_mtus() {
    let mut cfg = LabConfig::wireguard(3, WEFT);
    cfg.link_mtu = vec![(2, 1400)];
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    let env = std::fs::read_to_string(lab.nodes[2].subnet_env()).unwrap_or_default();
    assert!(
        env.contains("FLANNEL_MTU=1320"),
        "node 3's subnet.env: {env}"
    );
    for (i, peer) in [(0, 2), (1, 2)] {
        wait_route_mtu(
            &lab,
            i,
            peer,
            Some(NARROW_ROUTE_MTU),
            Duration::from_secs(10),
        );
    }
    assert_eq!(
        route_mtu(&lab, 2, 0),
        None,
        "node 3's pod MTU is already smaller"
    );
    for (from, to) in [(0, 2), (2, 0), (2, 1)] {
        transfer_within(&lab, from, to, Duration::from_secs(30));
    }
}

/// vxlan over the same narrow path: the same probes size the routes to node 3, less
/// vxlan's 50 bytes (1350), and bulk TCP crosses both ways with nothing fragmented.
#[test]
fn vxlan_routes_carry_the_narrow_paths_mtu() {
    let lab = behind_a_narrow_path(LabConfig::backend(3, WEFT, "vxlan", false), 1400, true);
    for (i, peer) in [(0, 2), (2, 0)] {
        wait_route_mtu(&lab, i, peer, Some(1350), Duration::from_secs(10));
    }
    assert_eq!(
        route_mtu(&lab, 0, 1),
        None,
        "the wide path keeps the pod MTU"
    );
    narrow::count_fragments(&lab.tag).unwrap();
    for (from, to) in [(0, 2), (2, 0)] {
        transfer_within(&lab, from, to, Duration::from_secs(30));
    }
    assert_eq!(narrow::fragments(&lab.tag).unwrap(), 0);
}

/// A dual-stack lab over the same narrow path, ICMP errors dropped: the IPv6 underlay
/// (WireGuard's `separate` mode: IPv6 pod traffic over IPv6) is measured too, node 1's route
/// to node 3's IPv6 subnet carries 1400 less 80 (IPv6, UDP, WireGuard) down to 16 (1312)
/// and its IPv4 route 1328, and bulk TCP between IPv6 pod addresses crosses both ways with
/// nothing fragmented.
#[test]
fn an_ipv6_underlay_is_measured_and_used_too() {
    let lab = behind_a_narrow_path(LabConfig::wireguard(3, WEFT).dual_stack(), 1400, true);
    wait_route_mtu(&lab, 0, 2, Some(NARROW_ROUTE_MTU), Duration::from_secs(10));
    wait_mtu(
        &lab,
        Some(1312),
        Duration::from_secs(10),
        || route_mtu_v6(&lab, 0, 2),
        || "node 1's IPv6 route to node 3".into(),
    );
    assert_eq!(
        route_mtu_v6(&lab, 0, 1),
        None,
        "the wide path keeps the pod MTU"
    );
    narrow::count_fragments(&lab.tag).unwrap();
    for (from, to) in [(0, 2), (2, 0)] {
        let to_ip = lab.nodes[to].pods[0]
            .ip6
            .expect("a dual-stack pod has an IPv6 address");
        start_transfer_to(&lab, from, to, to_ip.into()).finish(&lab, Duration::from_secs(30));
    }
    assert_eq!(narrow::fragments(&lab.tag).unwrap(), 0);
}
