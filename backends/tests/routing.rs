//! The routing reconciler against a real kernel, in a fresh network namespace per test: it
//! programs a planned node's device MTU, address and routes; a second pass writes nothing;
//! a route or address removed behind its back returns in one pass; stale weft routes go;
//! other software's routes stay; and a failed write names operation, object and errno.

use serde_json::json;
use weft_backends::apply::{reconcile_routing, Netlink, RtNetlink};
use weft_backends::model::DesiredState;
use weft_lab::fixtures::{lease, plan_of};
use weft_lab::netns::{in_new_netns, sh};

/// node-a's plan in a three-node cluster (one peer's data broken, so it is left out).
fn desired() -> DesiredState {
    let mut broken = lease("node-d", "10.244.4.0/24", "198.51.100.4", 4);
    broken.backend_data = Some(json!({"PublicKey": "nope"}));
    let peers = vec![
        lease("node-b", "10.244.2.0/24", "198.51.100.2", 2),
        lease("node-c", "10.244.3.0/24", "198.51.100.3", 3),
        broken,
    ];
    plan_of(
        r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#,
        &lease("node-a", "10.244.1.0/24", "198.51.100.1", 1),
        peers,
    )
}

fn weft_routes() -> String {
    sh("ip -4 route show proto 87 | sort")
}

#[test]
fn programs_the_plan_then_writes_nothing_in_steady_state() {
    in_new_netns(|| async {
        sh("ip tuntap add mode tun name flannel-wg");
        let mut nl = RtNetlink::connect().unwrap();
        let state = desired();
        let first = reconcile_routing(&mut nl, &state).await.unwrap();
        assert!(first.failed.is_empty(), "{:?}", first.failed);
        let applied: Vec<String> = first.applied.iter().map(ToString::to_string).collect();
        assert_eq!(
            applied,
            [
                "add blackhole route 10.244.0.0/16 (fail closed)",
                "set link flannel-wg mtu 1500 -> 1420 up",
                "add address 10.244.1.0/32 dev flannel-wg",
                "add route 10.244.0.0/16 dev flannel-wg",
                "add route 10.244.2.0/24 dev flannel-wg",
                "add route 10.244.3.0/24 dev flannel-wg",
            ]
        );
        assert_eq!(weft_routes(), "10.244.0.0/16 dev flannel-wg scope link linkdown \n10.244.2.0/24 dev flannel-wg scope link linkdown \n10.244.3.0/24 dev flannel-wg scope link linkdown \nblackhole 10.244.0.0/16 metric 4000000000 \n");
        let link = sh("ip -o link show flannel-wg");
        assert!(link.contains("mtu 1420") && link.contains(",UP"), "{link}");
        assert!(sh("ip -o -4 addr show dev flannel-wg").contains("inet 10.244.1.0/32"));
        // Traffic to the broken peer's subnet is captured by the covering route (fail closed).
        assert!(sh("ip route get 10.244.4.7").contains("dev flannel-wg"));

        let writes = nl.writes();
        let second = reconcile_routing(&mut nl, &state).await.unwrap();
        assert!(
            second.applied.is_empty() && second.failed.is_empty(),
            "{:?}",
            second.applied
        );
        assert_eq!(
            nl.writes(),
            writes,
            "a steady-state pass wrote to the kernel"
        );
    });
}

#[test]
fn repairs_what_was_removed_and_leaves_others_alone() {
    in_new_netns(|| async {
        sh("ip tuntap add mode tun name flannel-wg");
        sh("ip link add eth0 type veth peer name eth0-peer && ip link set eth0 up && ip addr add 198.51.100.1/24 dev eth0");
        sh("ip route add 192.0.2.0/24 via 198.51.100.254 dev eth0 proto static");
        let mut nl = RtNetlink::connect().unwrap();
        let state = desired();
        reconcile_routing(&mut nl, &state).await.unwrap();

        sh("ip route del 10.244.2.0/24");
        sh("ip route add 10.244.99.0/24 dev flannel-wg proto 87"); // stale weft route
        sh("ip link set flannel-wg mtu 1300");
        let report = reconcile_routing(&mut nl, &state).await.unwrap();
        let applied: Vec<String> = report.applied.iter().map(ToString::to_string).collect();
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(
            applied,
            [
                "set link flannel-wg mtu 1300 -> 1420",
                "add route 10.244.2.0/24 dev flannel-wg",
                "remove route 10.244.99.0/24"
            ]
        );

        // Removing the device's last IPv4 address makes the kernel drop its routes too.
        sh("ip addr flush dev flannel-wg");
        assert_eq!(
            weft_routes(),
            "blackhole 10.244.0.0/16 metric 4000000000 \n",
            "only the fail-closed blackhole survives"
        );
        let report = reconcile_routing(&mut nl, &state).await.unwrap();
        let applied: Vec<String> = report.applied.iter().map(ToString::to_string).collect();
        assert_eq!(
            applied,
            [
                "add address 10.244.1.0/32 dev flannel-wg",
                "add route 10.244.0.0/16 dev flannel-wg",
                "add route 10.244.2.0/24 dev flannel-wg",
                "add route 10.244.3.0/24 dev flannel-wg",
            ]
        );
        assert!(weft_routes().contains("10.244.2.0/24 dev flannel-wg"));
        assert!(!weft_routes().contains("10.244.99.0/24"));
        assert!(
            sh("ip route show 192.0.2.0/24").contains("via 198.51.100.254 dev eth0 proto static"),
            "foreign route touched"
        );
        assert!(
            sh("ip -o -4 addr show dev eth0").contains("198.51.100.1/24"),
            "foreign address touched"
        );
        let again = reconcile_routing(&mut nl, &state).await.unwrap();
        assert!(again.applied.is_empty());
    });
}

#[test]
fn a_missing_device_is_skipped_and_a_failed_write_names_its_object() {
    in_new_netns(|| async {
        let mut nl = RtNetlink::connect().unwrap();
        let state = desired();
        let report = reconcile_routing(&mut nl, &state).await.unwrap();
        let applied: Vec<String> = report.applied.iter().map(ToString::to_string).collect();
        assert_eq!(
            applied,
            ["add blackhole route 10.244.0.0/16 (fail closed)"],
            "no device yet: only the fail-closed blackhole"
        );
        assert!(report.failed.is_empty());
        assert_eq!(nl.writes(), 1);

        sh("ip tuntap add mode tun name flannel-wg");
        let mut state = state;
        state.routes[1].via = Some("203.0.113.9".parse().unwrap()); // not reachable from here
        let report = reconcile_routing(&mut nl, &state).await.unwrap();
        assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
        let err = report.failed[0].1.to_string();
        assert!(
            err.starts_with("adding route 10.244.2.0/24 dev flannel-wg: "),
            "{err}"
        );
        assert!(err.contains("(os error"), "{err}");
        eprintln!("failed write reported as: {err}");
        assert_eq!(
            report.applied.len(),
            4,
            "the other writes went ahead: {:?}",
            report.applied
        );
    });
}

#[test]
fn without_its_device_pod_traffic_is_dropped_not_sent_by_the_default_route() {
    in_new_netns(|| async {
        sh("ip link add eth0 type veth peer name eth0-peer && ip link set eth0 up && ip link set eth0-peer up");
        sh("ip addr add 198.51.100.1/24 dev eth0 && ip route add default via 198.51.100.254");
        sh("ip tuntap add mode tun name flannel-wg");
        let mut nl = RtNetlink::connect().unwrap();
        let state = desired();
        reconcile_routing(&mut nl, &state).await.unwrap();
        assert!(sh("ip route get 10.244.2.7").contains("dev flannel-wg"));

        // The device disappears (deleted, being recreated, or the agent that ran it is gone):
        // its routes go with it, and the blackhole is what is left.
        sh("ip link del flannel-wg");
        let out = std::process::Command::new("ip")
            .args(["route", "get", "10.244.2.7"])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !text.contains("via 198.51.100.254"),
            "pod traffic would leave in clear by the default route: {text}"
        );
        assert!(
            !out.status.success() || text.contains("blackhole"),
            "{text}"
        );
        // And without the blackhole it would indeed have leaked: prove the test can fail.
        sh("ip route del blackhole 10.244.0.0/16 metric 4000000000");
        assert!(sh("ip route get 10.244.2.7").contains("via 198.51.100.254"));
    });
}
