//! The vxlan data plane against a real kernel, in a fresh network namespace: one reconcile
//! creates `flannel.1` (VNI, port, local address, underlay, VTEP MAC, MTU, address) with a
//! permanent neighbour and an FDB entry per peer and an on-link route, plus a direct route
//! for the on-link peer under DirectRouting; a second reconcile writes nothing; a peer
//! whose VTEP MAC changed has its entries replaced in one pass, the old ones gone.

use weft_backends::apply::wireguard::process::UserspaceProcess;
use weft_backends::apply::Dataplane;
use weft_backends::model::DesiredState;
use weft_backends::plan::PlanOptions;
use weft_lab::fixtures::{plan_with, vxlan_lease};
use weft_lab::netns::{in_new_netns, sh};

const CONF: &str =
    r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "DirectRouting": true}}"#;

fn desired(c_mac: u8) -> DesiredState {
    let options = PlanOptions {
        ip_masq: false,
        underlay_mtu: 1500,
        underlay_device: Some("eth0".into()),
        underlay_networks: vec!["198.51.100.0/24".parse().unwrap()],
    };
    plan_with(
        CONF,
        &vxlan_lease("node-a", "10.244.1.0/24", "198.51.100.1", 1),
        vec![
            vxlan_lease("node-b", "10.244.2.0/24", "198.51.100.2", 2),
            vxlan_lease("node-c", "10.244.3.0/24", "203.0.113.3", c_mac),
        ],
        &options,
    )
}

#[test]
fn one_reconcile_programs_vxlan_the_next_writes_nothing_and_a_new_mac_replaces_entries() {
    in_new_netns(|| async {
        sh("ip link add eth0 type veth peer name eth0-peer && ip addr add 198.51.100.1/24 dev eth0 && ip link set eth0 up && ip link set eth0-peer up");
        sh("ip route add 203.0.113.0/24 via 198.51.100.254");
        let (mut dp, why) = Dataplane::connect(None, UserspaceProcess::new(vec![]))
            .await
            .unwrap();
        assert_eq!(dp.implementation(), "none", "{why}");
        let state = desired(3);
        let key = weft_crypto::PrivateKey::generate().unwrap();
        let first = dp
            .reconcile(&state, &key, &Default::default())
            .await
            .unwrap();
        assert!(first.errors.is_empty(), "{:?}", first.errors);

        let link = sh("ip -d -o link show flannel.1");
        for want in [
            "mtu 1450",
            "link/ether 0a:00:00:00:00:01",
            "vxlan id 1",
            "local 198.51.100.1",
            "dev eth0",
            "dstport 8472",
            "nolearning",
        ] {
            assert!(link.contains(want), "{want} missing: {link}");
        }
        assert!(sh("ip -4 addr show dev flannel.1").contains("10.244.1.0/32"));
        let neigh = sh("ip neigh show dev flannel.1");
        assert!(
            neigh.contains("10.244.3.0 lladdr 0a:00:00:00:00:03 PERMANENT"),
            "{neigh}"
        );
        assert!(
            !neigh.contains("10.244.2.0"),
            "node-b is reached directly: {neigh}"
        );
        let fdb = sh("bridge fdb show dev flannel.1");
        assert!(
            fdb.contains("0a:00:00:00:00:03 dst 203.0.113.3 self permanent"),
            "{fdb}"
        );
        let routes = sh("ip -4 route show proto 87");
        assert!(
            routes.contains("10.244.2.0/24 via 198.51.100.2 dev eth0"),
            "{routes}"
        );
        assert!(
            routes.contains("10.244.3.0/24 via 10.244.3.0 dev flannel.1 onlink"),
            "{routes}"
        );

        let writes = dp.writes();
        let second = dp
            .reconcile(&state, &key, &Default::default())
            .await
            .unwrap();
        assert!(second.changes.is_empty(), "{:?}", second.changes);
        assert_eq!(dp.writes(), writes, "steady state writes nothing");

        // node-c comes back with another VTEP MAC: replaced in one pass.
        let moved = desired(9);
        let third = dp
            .reconcile(&moved, &key, &Default::default())
            .await
            .unwrap();
        assert!(third.errors.is_empty(), "{:?}", third.errors);
        let neigh = sh("ip neigh show dev flannel.1");
        assert!(
            neigh.contains("10.244.3.0 lladdr 0a:00:00:00:00:09 PERMANENT"),
            "{neigh}"
        );
        let fdb = sh("bridge fdb show dev flannel.1");
        assert!(fdb.contains("0a:00:00:00:00:09 dst 203.0.113.3"), "{fdb}");
        assert!(
            !fdb.contains("0a:00:00:00:00:03"),
            "the old MAC's entry stayed: {fdb}"
        );
        let writes = dp.writes();
        dp.reconcile(&moved, &key, &Default::default())
            .await
            .unwrap();
        assert_eq!(dp.writes(), writes);
    });
}
