//! The ipip backend end to end: every pod reaches every pod through `flannel.ipip` (MTU
//! underlay − 20, routes via the peers' public IPs on-link), a deleted device comes back
//! with its routes, `DirectRouting` goes straight to the on-link peer and through the
//! tunnel to the one behind the router, and switching to and from ipip leaves nothing of
//! the previous backend.
//!
//! This machine's kernel has no ipip, so the tests are `#[ignore]`d here; the VM runner
//! runs them with `--include-ignored`, and there a kernel without ipip fails them.

use std::time::Duration;

use weft_lab::lab::{in_ns, Lab, LabConfig};
use weft_lab::wait::{until, until_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn routes(lab: &Lab, i: usize) -> String {
    in_ns(&lab.nodes[i].ns, "ip -4 route show proto 87").unwrap_or_default()
}

/// Node `i`'s route to node `j`'s subnet through the tunnel.
fn tunnel_route(lab: &Lab, j: usize) -> String {
    format!(
        "{} via {} dev flannel.ipip onlink",
        lab.nodes[j].subnet.unwrap(),
        lab.nodes[j].ip
    )
}

/// One lab for the mesh, DirectRouting and self-heal (the VM's emulated CPU makes every lab
/// cost half a minute): node 3 sits behind the router.
#[test]
#[ignore = "needs a kernel with ipip: run by the VM runner"]
fn ipip_meshes_goes_direct_on_link_tunnels_across_the_router_and_heals() {
    let mut cfg = LabConfig::backend(3, WEFT, "ipip", true);
    cfg.routed = vec![2];
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    let node = &lab.nodes[0];
    let link = in_ns(&node.ns, "ip -d link show flannel.ipip").unwrap();
    assert!(
        link.contains("mtu 1480") && link.contains("ipip") && link.contains("local 198.51.100.1"),
        "{link}"
    );
    let r = routes(&lab, 0);
    assert!(
        r.contains(&format!(
            "{} via 198.51.100.2 dev eth0",
            lab.nodes[1].subnet.unwrap()
        )),
        "node 2 is on-link: a direct route\n{r}"
    );
    assert!(
        r.contains(&tunnel_route(&lab, 2)),
        "node 3 is behind the router: ipip\n{r}"
    );
    in_ns(&node.ns, "ip link del flannel.ipip").unwrap();
    let back = until_or(
        "flannel.ipip back with its route",
        Duration::from_secs(5),
        || routes(&lab, 0).contains(&tunnel_route(&lab, 2)),
        || lab.logs(),
    );
    eprintln!("flannel.ipip deleted -> back with its route in {back:?}");
    lab.assert_all_pairs();
}

#[test]
#[ignore = "needs a kernel with ipip: run by the VM runner"]
fn switching_to_and_from_ipip_leaves_nothing_of_the_previous_backend() {
    let mut lab = Lab::start(LabConfig::backend(2, WEFT, "ipip", false)).unwrap();
    lab.assert_all_pairs();
    for (backend, gone) in [
        ("wireguard", "flannel.ipip"),
        ("ipip", "flannel-wg"),
        ("vxlan", "flannel.ipip"),
        ("ipip", "flannel.1"),
    ] {
        let watch = lab.switch_backend(backend).unwrap();
        lab.assert_all_pairs();
        if let Some(watch) = watch {
            watch.finish().unwrap();
        }
        for i in 0..2 {
            let ns = &lab.nodes[i].ns;
            // A kept old backend (wireguard, vxlan) goes once no peer runs it for its
            // grace (10 s) and 5 s more.
            until(
                &format!("{gone} gone after switching to {backend}"),
                weft_lab::wait::bound(Duration::from_secs(25), Duration::from_secs(40)),
                || in_ns(ns, &format!("ip link show {gone}")).is_err(),
            );
            // The old device's routes go with it, and the new agent's pass may come just
            // after (seen under the VM's emulation): waited for, and then exactly one.
            let peer = lab.nodes[1 - i].subnet.unwrap().to_string();
            let peer_routes = || {
                routes(&lab, i)
                    .lines()
                    .filter(|l| l.starts_with(&peer))
                    .count()
            };
            until_or(
                &format!("one route to the peer on {backend}"),
                Duration::from_secs(5),
                || peer_routes() == 1,
                || format!("{}\n{}", routes(&lab, i), lab.logs()),
            );
        }
    }
}
