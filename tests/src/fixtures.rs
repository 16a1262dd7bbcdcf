//! Sample leases and plans for the integration tests (the unit tests in `weft-backends`
//! keep their own: they link the crate under test, not this one's copy).

use std::time::SystemTime;

use weft_backends::model::{ClusterView, DesiredState, Lease};
use weft_backends::netconf::parse;
use weft_backends::plan::{
    plan, vxlan_backend_data, wireguard_backend_data, PlanInput, PlanOptions,
};
use weft_crypto::PrivateKey;

/// A wireguard node: `subnet`, public IP `ip`, and the public key of `[seed; 32]`.
pub fn lease(node: &str, subnet: &str, ip: &str, seed: u8) -> Lease {
    Lease {
        node: node.into(),
        subnet: subnet.parse().ok(),
        subnet_v6: None,
        public_ip: ip.parse().ok(),
        public_ipv6: None,
        backend_type: "wireguard".into(),
        backend_data: Some(wireguard_backend_data(
            &PrivateKey::from_bytes([seed; 32]).public_key(),
            51820,
        )),
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

/// `me`'s plan in a cluster of `me` and `peers` under net-conf `conf`, with `--ip-masq` and
/// a 1500-byte underlay. Panics on a bad fixture: it is test input.
pub fn plan_of(conf: &str, me: &Lease, peers: Vec<Lease>) -> DesiredState {
    let options = PlanOptions {
        ip_masq: true,
        underlay_mtu: 1500,
        underlay_device: None,
        underlay_networks: vec![],
    };
    plan_with(conf, me, peers, &options)
}

/// As `plan_of`, with the node-local facts given.
pub fn plan_with(conf: &str, me: &Lease, peers: Vec<Lease>, options: &PlanOptions) -> DesiredState {
    let config = parse(conf).unwrap_or_else(|e| panic!("fixture config: {e}"));
    let mut view = ClusterView::default();
    for l in peers.into_iter().chain([me.clone()]) {
        view.insert(l);
    }
    plan(&PlanInput {
        observed: &Default::default(),
        path_mtus: &Default::default(),
        pair_psks: &Default::default(),
        local: me,
        view: &view,
        config: &config,
        options,
        now: SystemTime::now(),
    })
    .unwrap_or_else(|e| panic!("fixture plan: {e}"))
}

/// A vxlan node: `subnet`, public IP `ip`, VTEP MAC `0a:00:00:00:00:<n>`.
pub fn vxlan_lease(node: &str, subnet: &str, ip: &str, n: u8) -> Lease {
    Lease {
        backend_type: "vxlan".into(),
        backend_data: Some(vxlan_backend_data(1, &[0x0a, 0, 0, 0, 0, n])),
        ..lease(node, subnet, ip, n)
    }
}
