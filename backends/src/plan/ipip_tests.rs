//! The ipip plan: `flannel.ipip` from this node's public IP, a route per peer via its
//! public IP on-link through the device (or, with `DirectRouting`, via the underlay for a
//! peer on this node's segment), and bad peers left out with the reason.

use serde_json::json;

use super::unencrypted_tests::{lease, run_on};
use crate::model::{LeaveReason, RouteRole};

fn node(n: u8, ip: [u8; 4]) -> crate::model::Lease {
    lease(
        &format!("node-{n}"),
        &format!("10.244.{n}.0/24"),
        ip,
        "ipip",
        json!(null),
    )
}

fn routes(state: &crate::model::DesiredState) -> Vec<String> {
    state
        .routes
        .iter()
        .map(|r| {
            format!(
                "{} via {} dev {}{}",
                r.dst,
                r.via.unwrap(),
                r.device,
                if r.onlink { " onlink" } else { "" }
            )
        })
        .collect()
}

const SEGMENT: &[&str] = &["198.51.100.0/24"];

#[test]
fn peers_are_routed_onlink_through_flannel_ipip() {
    let conf = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipip"}}"#;
    let mut no_ip = node(4, [198, 51, 100, 4]);
    no_ip.public_ip = None;
    let peers = vec![node(2, [198, 51, 100, 2]), node(3, [203, 0, 113, 3]), no_ip];
    let state = run_on(conf, node(1, [198, 51, 100, 1]), peers, SEGMENT).unwrap();
    let ipip = state.ipip.as_ref().unwrap();
    assert_eq!(ipip.device, "flannel.ipip");
    assert_eq!(ipip.local.to_string(), "198.51.100.1");
    assert_eq!(ipip.mtu, 1480);
    assert_eq!(ipip.addresses, ["10.244.1.0/32".parse().unwrap()]);
    assert_eq!(
        routes(&state),
        [
            "10.244.2.0/24 via 198.51.100.2 dev flannel.ipip onlink",
            "10.244.3.0/24 via 203.0.113.3 dev flannel.ipip onlink",
        ]
    );
    assert!(matches!(state.routes[0].role, RouteRole::Peer(_)));
    assert_eq!(state.subnet_env.mtu, 1480);
    assert_eq!(state.left_out.len(), 1);
    assert!(matches!(
        state.left_out[0].reason,
        LeaveReason::NoPublicIp { .. }
    ));
}

#[test]
fn direct_routing_sends_onlink_peers_over_the_underlay() {
    let conf = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipip", "DirectRouting": true, "MTU": 9000}}"#;
    let peers = vec![node(2, [198, 51, 100, 2]), node(3, [203, 0, 113, 3])];
    let state = run_on(conf, node(1, [198, 51, 100, 1]), peers, SEGMENT).unwrap();
    assert_eq!(
        routes(&state),
        [
            "10.244.2.0/24 via 198.51.100.2 dev eth0",
            "10.244.3.0/24 via 203.0.113.3 dev flannel.ipip onlink",
        ]
    );
    assert_eq!(
        state.ipip.as_ref().unwrap().mtu,
        8980,
        "the config's MTU − 20"
    );
}
