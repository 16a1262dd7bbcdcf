//! The whole data plane's pass (`Dataplane`) against in-memory kernels (`fake`): a full
//! pass builds the mesh, a second one and an incremental one write nothing and the
//! incremental one reads no device; a new peer is one device write and one route; a device
//! deleted behind the agent's back comes back with every peer in one incremental pass, a
//! route once the kernel's report of its deletion arrives; a
//! backend change removes what the plan no longer has; vxlan's neighbour and FDB entries
//! follow the plan. No root needed; the lab runs the same pass against real kernels.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use weft_crypto::PrivateKey;

use super::fake::{FakeEntry, FakeNetlink, FakeNft, FakeWg};
use super::reconcile_tests::{block_on, desired, lease_on, mesh, net, plan_for};
use super::{Dataplane, DataplaneReport, Netlink};
use crate::model::{ClusterView, DesiredState, FAIL_CLOSED_METRIC};
use crate::plan::{PatchedNode, PlanStamp, WG_DEVICE};

type FakePlane = Dataplane<FakeNetlink, FakeNft, FakeWg>;

fn key() -> PrivateKey {
    PrivateKey::from_bytes([1; 32])
}

fn peer_key(ip: u8) -> weft_crypto::PublicKey {
    PrivateKey::from_bytes([ip; 32]).public_key()
}

/// One pass, full or incremental; returns the writes it made (links, routes and vxlan
/// entries; nftables; WireGuard devices) and its report, which must have no errors.
fn pass(dp: &mut FakePlane, state: &DesiredState, full: bool) -> ([u64; 3], DataplaneReport) {
    let before = counts(dp);
    let report = block_on(async {
        if full {
            dp.reconcile(state, &key(), &Default::default()).await
        } else {
            dp.reconcile_incremental(state, &key(), &Default::default())
                .await
        }
    })
    .unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let after = counts(dp);
    ([0, 1, 2].map(|i| after[i] - before[i]), report)
}

fn counts(dp: &mut FakePlane) -> [u64; 3] {
    use super::wireguard::WgDevices;
    use super::Nft;
    let (nl, nft, wg) = dp.kernel();
    [nl.writes(), nft.writes(), wg.map_or(0, |w| w.writes())]
}

/// A data plane over empty fakes, with a WireGuard implementation.
fn wireguard_plane() -> FakePlane {
    Dataplane::new(
        FakeNetlink::default(),
        FakeNft::default(),
        Some(FakeWg::default()),
    )
}

fn wg(dp: &mut FakePlane) -> &mut FakeWg {
    dp.kernel().2.expect("the wireguard backend runs a device")
}

fn nl(dp: &mut FakePlane) -> &mut FakeNetlink {
    dp.kernel().0
}

#[test]
fn wireguard_full_then_incremental_passes() {
    let mut dp = wireguard_plane();
    let two = desired(2);
    let (writes, report) = pass(&mut dp, &two, true);
    assert!(writes.iter().all(|w| *w > 0), "{writes:?}");
    assert!(report
        .changes
        .contains(&format!("created fake WireGuard device {WG_DEVICE}")));
    let device = wg(&mut dp).devices[WG_DEVICE].clone();
    assert_eq!(device.public_key, Some(key().public_key()));
    assert_eq!(device.peers.len(), 2);
    let endpoint = device.peers[&peer_key(2)].endpoint;
    assert_eq!(
        endpoint,
        Some(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(198, 51, 100, 2)),
            51820
        ))
    );
    assert_eq!(wg(&mut dp).primed, ["n2", "n3"]);
    assert_eq!(report.endpoints_set.len(), 2);
    let index = nl(&mut dp).links[WG_DEVICE].index;
    for dst in ["10.244.0.0/16", "10.244.2.0/24", "10.244.3.0/24"] {
        assert_eq!(nl(&mut dp).routes[&(net(dst), 0)].oif, Some(index), "{dst}");
    }
    assert!(nl(&mut dp).routes[&(net("10.244.0.0/16"), FAIL_CLOSED_METRIC)].blackhole);
    let tables: Vec<String> = dp
        .kernel()
        .1
        .tables
        .keys()
        .map(|(f, t)| format!("{f} {t}"))
        .collect();
    assert_eq!(
        tables,
        ["ip flannel-ipv4", "ip weft-guard"],
        "the masquerade table and the guard"
    );

    // Steady state: no writes; an incremental pass reads no device either.
    assert_eq!(pass(&mut dp, &two, true).0, [0, 0, 0]);
    let reads = wg(&mut dp).reads;
    assert_eq!(pass(&mut dp, &two, false).0, [0, 0, 0]);
    assert_eq!(
        wg(&mut dp).reads,
        reads,
        "an incremental pass reads no device"
    );

    // A node joins: one device write, one route, no read, one handshake started.
    let three = desired(3);
    let (writes, report) = pass(&mut dp, &three, false);
    assert_eq!(writes, [1, 0, 1]);
    assert_eq!(report.endpoints_set, [("flannel-wg".into(), peer_key(4))]);
    assert_eq!(wg(&mut dp).reads, reads);
    assert_eq!(wg(&mut dp).primed, ["n2", "n3", "n4"]);
    assert!(nl(&mut dp).routes.contains_key(&(net("10.244.4.0/24"), 0)));

    // The device deleted behind the agent's back: its routes go with it, the blackhole
    // stays; one incremental pass brings the device, every peer and every route back, and
    // starts a handshake with each peer.
    nl(&mut dp).delete_link(WG_DEVICE);
    assert_eq!(nl(&mut dp).routes.len(), 1, "only the blackhole");
    let (_, report) = pass(&mut dp, &three, false);
    assert!(report
        .changes
        .contains(&format!("created fake WireGuard device {WG_DEVICE}")));
    assert_eq!(wg(&mut dp).devices[WG_DEVICE].peers.len(), 3);
    assert_eq!(nl(&mut dp).routes.len(), 1 + 1 + 3);
    assert_eq!(wg(&mut dp).primed[3..], ["n2", "n3", "n4"]);
    assert_eq!(pass(&mut dp, &three, false).0, [0, 0, 0]);

    // A route deleted behind the agent's back: an incremental pass trusts weft's routes as
    // last listed (it lists none); once the kernel's report of the deletion reaches the
    // agent (`forget_routes`), the next pass lists them and puts the route back.
    let gone = (net("10.244.3.0/24"), 0);
    nl(&mut dp).routes.remove(&gone);
    assert_eq!(pass(&mut dp, &three, false).0, [0, 0, 0]);
    dp.forget_routes();
    assert_eq!(pass(&mut dp, &three, false).0, [1, 0, 0]);
    assert!(nl(&mut dp).routes.contains_key(&gone));

    // A peer removed from the device by hand: an incremental pass trusts its record of
    // the device; the next full pass (a resync) reads it and restores
    // the peer.
    wg(&mut dp)
        .devices
        .get_mut(WG_DEVICE)
        .unwrap()
        .peers
        .remove(&peer_key(3));
    assert_eq!(pass(&mut dp, &three, false).0, [0, 0, 0]);
    assert_eq!(pass(&mut dp, &three, true).0, [0, 0, 1]);
    assert!(wg(&mut dp).devices[WG_DEVICE]
        .peers
        .contains_key(&peer_key(3)));

    // What the plan sees: the device as last read plus this agent's changes.
    let observed = block_on(dp.observe(false)).unwrap();
    assert_eq!(observed.len(), 3);
    assert!(observed.values().all(|p| p.endpoint.is_some()));
}

#[test]
fn a_new_private_key_keeps_every_peer_and_starts_a_handshake_with_each() {
    let mut dp = wireguard_plane();
    let two = desired(2);
    pass(&mut dp, &two, true);
    let other = PrivateKey::from_bytes([9; 32]);
    let report = block_on(dp.reconcile_incremental(&two, &other, &Default::default())).unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let device = &wg(&mut dp).devices[WG_DEVICE];
    assert_eq!(device.public_key, Some(other.public_key()));
    assert_eq!(device.peers.len(), 2);
    assert_eq!(
        report.changes,
        [format!("{WG_DEVICE}: private key set")],
        "the key alone changes: removing and adding a peer again ends the sessions it \
         still receives on and sends it a second initiation that it drops"
    );
    assert_eq!(wg(&mut dp).primed, ["n2", "n3", "n2", "n3"]);
}

#[test]
fn vxlan_replaces_the_wireguard_device_and_follows_its_peers() {
    let mut kernel = FakeNetlink::default();
    // Left by a previous backend and a previous VNI.
    kernel.add_link(WG_DEVICE, "wireguard");
    kernel.add_link("flannel.2", "vxlan");
    let mut dp: FakePlane = Dataplane::new(kernel, FakeNft::default(), None);
    let state = mesh("vxlan", 2);
    let (_, report) = pass(&mut dp, &state, true);
    let links = &nl(&mut dp).links;
    assert!(!links.contains_key(WG_DEVICE), "{:?}", report.changes);
    assert!(!links.contains_key("flannel.2"));
    let device = links["flannel.1"].clone();
    assert_eq!(device.mac, [0x0a, 0, 0, 0, 0, 1]);
    assert_eq!(
        device.vxlan.as_ref().map(|v| (v.vni, v.port)),
        Some((1, 8472))
    );
    let entries = |dp: &mut FakePlane, bridge: bool| {
        let mut e: Vec<(Option<IpAddr>, Vec<u8>)> = nl(dp)
            .entries
            .iter()
            .filter(|e| e.bridge == bridge && e.index == device.index)
            .map(|e| (e.ip, e.mac.clone()))
            .collect();
        e.sort();
        e
    };
    let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
    let mac = |i: u8| vec![0x0a, 0, 0, 0, 0, i];
    assert_eq!(
        entries(&mut dp, false),
        [(ip("10.244.2.0"), mac(2)), (ip("10.244.3.0"), mac(3))]
    );
    assert_eq!(
        entries(&mut dp, true),
        [(ip("198.51.100.2"), mac(2)), (ip("198.51.100.3"), mac(3))]
    );
    for dst in ["10.244.2.0/24", "10.244.3.0/24"] {
        let route = &nl(&mut dp).routes[&(net(dst), 0)];
        assert_eq!(route.oif, Some(device.index), "{dst}");
        assert_eq!(route.gateway, ip(&dst.replace(".0/24", ".0")), "{dst}");
    }
    assert_eq!(pass(&mut dp, &state, true).0, [0, 0, 0]);
    assert_eq!(pass(&mut dp, &state, false).0, [0, 0, 0]);

    // Node 3 moves to another public IP: its FDB entry is replaced, nothing else.
    let mut view = ClusterView::default();
    view.insert(lease_on("vxlan", "n2", "10.244.2.0/24", 2));
    let mut moved = lease_on("vxlan", "n3", "10.244.3.0/24", 3);
    moved.public_ip = Some(Ipv4Addr::new(198, 51, 100, 33));
    view.insert(moved);
    let state = plan_for("vxlan", &view);
    assert_eq!(pass(&mut dp, &state, false).0, [2, 0, 0], "delete and add");
    assert_eq!(
        entries(&mut dp, true),
        [(ip("198.51.100.2"), mac(2)), (ip("198.51.100.33"), mac(3))]
    );

    // Behind the agent's back: a neighbour deleted, a stray FDB entry added, another
    // vxlan device created. An incremental pass restores the neighbour and removes the
    // stray entry; only a full pass looks for other devices.
    nl(&mut dp)
        .entries
        .retain(|e| e.bridge || e.ip != ip("10.244.2.0"));
    nl(&mut dp).entries.push(FakeEntry {
        index: device.index,
        bridge: true,
        ip: ip("203.0.113.9"),
        mac: mac(9),
    });
    nl(&mut dp).add_link("flannel.3", "vxlan");
    assert_eq!(pass(&mut dp, &state, false).0, [2, 0, 0]);
    assert_eq!(entries(&mut dp, false).len(), 2);
    assert_eq!(entries(&mut dp, true).len(), 2);
    assert!(nl(&mut dp).links.contains_key("flannel.3"));
    assert_eq!(pass(&mut dp, &state, true).0, [1, 0, 0]);
    assert!(!nl(&mut dp).links.contains_key("flannel.3"));
}

/// The guard goes in before any route, and a pass whose guard cannot be put in installs no
/// route: pod traffic stays on the blackhole rather than meet an unguarded node. Once the
/// guard goes in, the next pass installs everything.
#[test]
fn no_route_goes_in_before_the_guard() {
    let mut dp = wireguard_plane();
    let two = desired(2);
    dp.kernel().1.refuse = Some("weft-guard".into());
    let report = block_on(dp.reconcile(&two, &key(), &Default::default())).unwrap();
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.contains("no route is installed")),
        "{:?}",
        report.errors
    );
    assert!(nl(&mut dp).routes.is_empty(), "{:?}", nl(&mut dp).routes);
    dp.kernel().1.refuse = None;
    let (_, report) = pass(&mut dp, &two, false);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(
        report
            .changes
            .first()
            .is_some_and(|c| c.contains("weft-guard")),
        "{:?}",
        report.changes
    );
    assert!(nl(&mut dp).routes.contains_key(&(net("10.244.2.0/24"), 0)));
}

/// A full pass that trusts the tables (nf_tables' events vouch for them) reads every device
/// afresh but lists no table: a table changed behind its back stays as found, for the
/// checks to repair; the plain full pass puts it back. A guard the plan changes goes in
/// either way, before any route.
#[test]
fn a_full_pass_trusting_the_tables_reads_the_devices_and_leaves_the_tables() {
    let mut dp = wireguard_plane();
    let two = desired(2);
    pass(&mut dp, &two, true);
    let masq = ("ip".to_string(), "flannel-ipv4".to_string());
    dp.kernel().1.tables.remove(&masq);
    // A peer's AllowedIPs changed behind the agent: only a full read finds it.
    let peer = *wg(&mut dp).devices[WG_DEVICE].peers.keys().next().unwrap();
    wg(&mut dp)
        .devices
        .get_mut(WG_DEVICE)
        .unwrap()
        .peers
        .get_mut(&peer)
        .unwrap()
        .allowed_ips
        .clear();
    let report = block_on(dp.reconcile_trusting_tables(&two, &key(), &Default::default())).unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(!dp.kernel().1.tables.contains_key(&masq), "no table listed");
    assert!(
        !wg(&mut dp).devices[WG_DEVICE].peers[&peer]
            .allowed_ips
            .is_empty(),
        "the device read afresh and put back"
    );
    let (writes, _) = pass(&mut dp, &two, true);
    assert_eq!(
        writes[1], 1,
        "the plain full pass lists and replaces the table"
    );
    assert!(dp.kernel().1.tables.contains_key(&masq));

    // A new guard (another node's subnet) is written by the trusting pass too.
    let mut changed = two.clone();
    changed.guard[0].own = Some(net("10.244.9.0/24"));
    let before = counts(&mut dp)[1];
    let report =
        block_on(dp.reconcile_trusting_tables(&changed, &key(), &Default::default())).unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(counts(&mut dp)[1] - before, 1, "{:?}", report.changes);
}

/// A pass of a plan patched from the one a device holds compares the re-planned nodes'
/// peers alone (every other peer is as in the plan before: the planner's account,
/// checked against full plans in `incremental_tests`); a plan patched from any other, or
/// a device read since, is compared in full.
#[test]
fn a_plan_patched_from_the_one_held_is_compared_on_its_changed_peers_alone() {
    let stamp = |generation, patched| PlanStamp {
        generation: Some(generation),
        patched,
    };
    let mut dp = wireguard_plane();
    block_on(dp.reconcile(&desired(2), &key(), &stamp(1, None))).unwrap();
    // n4 joins; n2's endpoint differs too, which the stamp does not say.
    let mut three = desired(3);
    let n2 = three.tunnels[0]
        .peers
        .iter_mut()
        .find(|p| p.node == "n2")
        .unwrap();
    let moved: SocketAddr = "203.0.113.2:51820".parse().unwrap();
    n2.endpoint = moved;
    let joined = [PatchedNode {
        node: "n4".into(),
        before: vec![],
        after: vec![(0, peer_key(4))],
    }];
    let endpoint =
        |dp: &mut FakePlane, seed| wg(dp).devices[WG_DEVICE].peers[&peer_key(seed)].endpoint;
    let report =
        block_on(dp.reconcile_incremental(&three, &key(), &stamp(2, Some((1, &joined))))).unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(
        endpoint(&mut dp, 4).is_some(),
        "the joined node's peer is added"
    );
    assert_ne!(endpoint(&mut dp, 2), Some(moved), "n2 was not compared");
    // The device holds plan 2 now: a plan patched from 1 is compared in full.
    block_on(dp.reconcile_incremental(&three, &key(), &stamp(3, Some((1, &joined))))).unwrap();
    assert_eq!(endpoint(&mut dp, 2), Some(moved));
    // Read since (what a full pass's `observe` does): compared in full.
    let back = desired(3);
    block_on(dp.observe(true)).unwrap();
    block_on(dp.reconcile_incremental(&back, &key(), &stamp(4, Some((3, &joined))))).unwrap();
    assert_ne!(endpoint(&mut dp, 2), Some(moved));
}
