//! The routing and nftables reconcilers against in-memory kernels (`fake`): what a pass
//! writes, that a second pass writes nothing, that whatever is deleted behind the agent's
//! back comes back in one pass and nothing else is touched, and that the fail-closed
//! blackhole goes in before the device exists. No root needed; the lab runs the same
//! reconcilers against real kernels.

use std::net::Ipv4Addr;
use std::time::SystemTime;

use ipnet::IpNet;

use super::fake::{FakeNetlink, FakeNft};
use super::{reconcile_nft, reconcile_routing, Netlink, Nft, ObservedRoute};
use crate::model::{ClusterView, DesiredState, Lease, FAIL_CLOSED_METRIC};
use crate::netconf::parse;
use crate::plan::{
    plan, vxlan_backend_data, wireguard_backend_data, PlanInput, PlanOptions, WG_DEVICE,
};

/// Node `n<ip>`'s lease on `backend` (`wireguard` or `vxlan`), its key and VTEP MAC
/// derived from `ip`.
pub(super) fn lease_on(backend: &str, node: &str, subnet: &str, ip: u8) -> Lease {
    let backend_data = match backend {
        "vxlan" => vxlan_backend_data(1, &[0x0a, 0, 0, 0, 0, ip]),
        _ => wireguard_backend_data(
            &weft_crypto::PrivateKey::from_bytes([ip; 32]).public_key(),
            51820,
        ),
    };
    Lease {
        node: node.into(),
        subnet: Some(subnet.parse().unwrap()),
        subnet_v6: None,
        public_ip: Some(Ipv4Addr::new(198, 51, 100, ip)),
        public_ipv6: None,
        backend_type: backend.into(),
        backend_data: Some(backend_data),
        backend_v6_data: None,
        expires: None,
        reach: Default::default(),
        next_key: None,
        created: None,
        key_proof: None,
        ml_kem_key: None,
        also: Default::default(),
    }
}

/// Node 1's plan in a wireguard mesh of `peers` + 1 nodes, with masquerading.
pub(super) fn desired(peers: u8) -> DesiredState {
    mesh("wireguard", peers)
}

/// Node 1's plan in a mesh of `peers` + 1 nodes on `backend`, with masquerading.
pub(super) fn mesh(backend: &str, peers: u8) -> DesiredState {
    let mut view = ClusterView::default();
    for i in 2..=peers + 1 {
        view.insert(lease_on(
            backend,
            &format!("n{i}"),
            &format!("10.244.{i}.0/24"),
            i,
        ));
    }
    plan_for(backend, &view)
}

/// Node 1's plan on `backend` among the peers in `view`.
pub(super) fn plan_for(backend: &str, view: &ClusterView) -> DesiredState {
    let me = lease_on(backend, "n1", "10.244.1.0/24", 1);
    let mut view = view.clone();
    view.insert(me.clone());
    let config = parse(&format!(
        r#"{{"Network": "10.244.0.0/16", "Backend": {{"Type": "{backend}"}}}}"#
    ))
    .unwrap();
    plan(&PlanInput {
        path_mtus: &Default::default(),
        pair_psks: &Default::default(),
        local: &me,
        view: &view,
        config: &config,
        options: &PlanOptions {
            ip_masq: true,
            underlay_mtu: 1500,
            underlay_device: None,
            underlay_networks: vec![],
        },
        observed: &Default::default(),
        now: SystemTime::UNIX_EPOCH,
    })
    .unwrap()
}

pub(super) fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

/// Runs one routing pass; returns the writes it made.
fn routing_pass(nl: &mut FakeNetlink, state: &DesiredState) -> u64 {
    let before = nl.writes();
    let report = block_on(reconcile_routing(nl, state)).unwrap();
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    nl.writes() - before
}

pub(super) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn routing_fails_closed_converges_and_heals() {
    let state = desired(2);
    let mut nl = FakeNetlink::default();
    // Before the device exists: only the blackhole, so nothing leaves in clear; the
    // missing device is looked up once, not once per route through it.
    assert_eq!(routing_pass(&mut nl, &state), 1);
    assert_eq!(nl.lookups, 1, "one lookup of the absent device");
    let hole = &nl.routes[&(net("10.244.0.0/16"), FAIL_CLOSED_METRIC)];
    assert!(hole.blackhole);
    assert_eq!(nl.routes.len(), 1);

    // The device appears: it is set up, gets its address, the covering and peer routes.
    let index = nl.add_link(WG_DEVICE, "wireguard");
    let first = routing_pass(&mut nl, &state);
    assert_eq!(first, 1 + 1 + 3, "link, address, three routes");
    let link = &nl.links[WG_DEVICE];
    assert!(link.up);
    assert_eq!(link.mtu, 1420);
    assert_eq!(nl.addresses[&index], vec![net("10.244.1.0/32")]);
    for dst in ["10.244.0.0/16", "10.244.2.0/24", "10.244.3.0/24"] {
        assert_eq!(nl.routes[&(net(dst), 0)].oif, Some(index), "{dst}");
    }
    // Steady state: nothing to write.
    assert_eq!(routing_pass(&mut nl, &state), 0);

    // A peer route deleted and the address removed behind the agent's back: exactly
    // those come back. A route of another protocol is never touched.
    let foreign = ObservedRoute {
        dst: net("10.244.2.0/24"),
        oif: Some(index),
        gateway: None,
        protocol: 4,
        blackhole: false,
        metric: 100,
        mtu: None,
    };
    nl.routes.insert((foreign.dst, 100), foreign.clone());
    nl.routes.remove(&(net("10.244.3.0/24"), 0));
    nl.addresses.get_mut(&index).unwrap().clear();
    assert_eq!(routing_pass(&mut nl, &state), 2);
    assert!(nl.routes.contains_key(&(net("10.244.3.0/24"), 0)));
    assert_eq!(nl.routes[&(foreign.dst, 100)], foreign);

    // A peer leaves: its route goes, the rest stays.
    let smaller = desired(1);
    assert_eq!(routing_pass(&mut nl, &smaller), 1);
    assert!(!nl.routes.contains_key(&(net("10.244.3.0/24"), 0)));

    // The device deleted: its routes go with it (the foreign one too), the blackhole
    // stays; once it is back (the device reconciler recreates it), one pass restores
    // everything.
    nl.delete_link(WG_DEVICE);
    assert_eq!(nl.routes.len(), 1, "only the blackhole");
    assert!(nl.routes[&(net("10.244.0.0/16"), FAIL_CLOSED_METRIC)].blackhole);
    assert_eq!(routing_pass(&mut nl, &smaller), 0);
    nl.add_link(WG_DEVICE, "wireguard");
    assert_eq!(routing_pass(&mut nl, &smaller), 1 + 1 + 2);
    assert_eq!(routing_pass(&mut nl, &smaller), 0);
}

/// The verification the agent runs beside its control loop: it finds any difference in
/// weft's tables (masquerade, guard, a legacy table left) and never writes.
#[test]
fn the_tables_are_verified_by_reading_alone() {
    use super::tables_as_planned;
    let state = desired(2);
    let guard = [crate::model::GuardSpec {
        family: crate::model::Family::Ipv4,
        network: "10.244.0.0/16".parse().unwrap(),
        own: Some("10.244.1.0/24".parse().unwrap()),
        tunnels: vec![WG_DEVICE.into()],
        underlay: None,
        clear: vec![],
    }];
    let mut nft = FakeNft::default();
    let verify = |nft: &mut FakeNft| {
        let before = nft.writes();
        let found = block_on(tables_as_planned(nft, &state.masquerade, &guard)).unwrap();
        assert_eq!(nft.writes(), before, "a verification writes nothing");
        found
    };
    assert!(!verify(&mut nft), "no table yet");
    block_on(reconcile_nft(&mut nft, &state.masquerade)).unwrap();
    assert!(!verify(&mut nft), "the guard missing");
    block_on(super::guard::reconcile_guard(&mut nft, &guard, true)).unwrap();
    assert!(verify(&mut nft), "as planned");

    let mut broken = nft.tables.clone();
    let masq = ("ip".to_string(), "flannel-ipv4".to_string());
    broken.get_mut(&masq).unwrap()["nftables"]
        .as_array_mut()
        .unwrap()
        .pop();
    for (what, tables) in [
        ("a masquerade rule deleted", broken),
        ("the guard table deleted", {
            let mut t = nft.tables.clone();
            t.remove(&("ip".to_string(), super::guard::TABLE.to_string()));
            t
        }),
        ("an earlier version's table left", {
            let mut t = nft.tables.clone();
            let legacy = ("ip".to_string(), super::guard::LEGACY_TABLE.to_string());
            t.insert(legacy, serde_json::json!({"nftables": []}));
            t
        }),
    ] {
        let mut changed = FakeNft::default();
        changed.tables = tables;
        assert!(!verify(&mut changed), "{what}");
    }
    // Planned without masquerading or guard: weft's tables left over are a difference.
    let found = block_on(tables_as_planned(&mut nft, &[], &[])).unwrap();
    assert!(!found);
}

#[test]
fn nftables_are_replaced_only_when_they_differ() {
    let state = desired(2);
    let mut nft = FakeNft::default();
    let pass = |nft: &mut FakeNft, tables| {
        let before = nft.writes();
        let report = block_on(reconcile_nft(nft, tables)).unwrap();
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        (nft.writes() - before, report.applied)
    };
    let (writes, applied) = pass(&mut nft, &state.masquerade);
    assert_eq!(writes, 1);
    assert_eq!(applied, ["replace nftables table ip flannel-ipv4"]);
    assert_eq!(pass(&mut nft, &state.masquerade).0, 0, "steady state");

    // A rule deleted behind the agent's back: the table is replaced, once.
    let key = ("ip".to_string(), "flannel-ipv4".to_string());
    let listing = nft.tables.get_mut(&key).unwrap();
    listing["nftables"].as_array_mut().unwrap().pop();
    assert_eq!(pass(&mut nft, &state.masquerade).0, 1);
    assert_eq!(pass(&mut nft, &state.masquerade).0, 0);
    // The whole table flushed: back in one pass.
    nft.tables.clear();
    assert_eq!(pass(&mut nft, &state.masquerade).0, 1);

    // Masquerading turned off: weft's table is deleted, nothing else.
    let other = ("ip".to_string(), "filter".to_string());
    nft.tables
        .insert(other.clone(), serde_json::json!({"nftables": []}));
    let (writes, applied) = pass(&mut nft, &[]);
    assert_eq!((writes, applied.len()), (1, 1));
    assert!(!nft.tables.contains_key(&key));
    assert!(nft.tables.contains_key(&other));
    assert_eq!(pass(&mut nft, &[]).0, 0);
}
