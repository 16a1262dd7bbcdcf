//! Dual-stack and IPv6-only leases in etcd, as flannel stores them, against a real etcd:
//! the key `10.244.1.0-24&fd00:10:244:1::-64` (or `fd00:10:244:1::-64` alone), the value
//! with `PublicIPv6` and `BackendV6Data`; each family allocated on its own; a node whose
//! config gains a family keeps its subnet and replaces its old lease; a lease flannel
//! wrote is read with both subnets.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use serde_json::json;
use weft::registry::{self, AcquireRequest, EtcdConfig, EtcdRegistry, LocalAttrs, Registry};
use weft_backends::model::{ClusterView, Lease};
use weft_backends::netconf::BackendKind;
use weft_lab::Etcd;

const PREFIX: &str = "/coreos.com/network";
const DUAL: &str = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:10:244::/56", "IPv6SubnetLen": 64, "Backend": {"Type": "wireguard"}}"#;
const V6_ONLY: &str = r#"{"EnableIPv4": false, "EnableIPv6": true, "IPv6Network": "fd00:10:244::/56", "IPv6SubnetLen": 64, "Backend": {"Type": "wireguard"}}"#;
const V4_ONLY: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;

fn attrs(n: u8) -> LocalAttrs {
    LocalAttrs {
        public_ip: Some(Ipv4Addr::new(198, 51, 100, n)),
        internal_ip: None,
        public_ipv6: Some(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(n))),
        backend: BackendKind::Wireguard,
        backend_data: Some(json!({ "PublicKey": format!("k{n}"), "Port": 51820 })),
        backend_v6_data: Some(json!({ "PublicKey": format!("k{n}"), "Port": 51821 })),
        next_key: None,
        key_proof: None,
        ml_kem_key: None,
        zone: None,
        gateway: None,
        also: Default::default(),
    }
}

async fn set_config(etcd: &Etcd, conf: &str) {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    c.put(format!("{PREFIX}/config"), conf, None).await.unwrap();
}

/// Every lease key under `<prefix>/subnets/`, without the prefix.
async fn stored(etcd: &Etcd) -> Vec<(String, serde_json::Value)> {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let dir = format!("{PREFIX}/subnets/");
    let resp = c
        .get(dir.clone(), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    resp.kvs()
        .iter()
        .map(|kv| {
            let key = String::from_utf8_lossy(kv.key()).replace(&dir, "");
            (key, serde_json::from_slice(kv.value()).unwrap())
        })
        .collect()
}

async fn acquire(etcd: &Etcd, attrs: LocalAttrs, previous: &Lease) -> (EtcdRegistry, Lease) {
    let cfg = EtcdConfig::new(vec![etcd.endpoint()], PREFIX);
    let mut reg = EtcdRegistry::connect(cfg).await.unwrap();
    let net = reg.net_conf().await.unwrap();
    let request = AcquireRequest {
        attrs,
        previous: previous.subnet,
        previous_v6: previous.subnet_v6,
    };
    let lease = reg.acquire(&net, &request).await.unwrap();
    (reg, lease)
}

/// A lease with no subnets: "no previous subnets".
fn nothing() -> Lease {
    attrs(0)
        .to_lease_attrs()
        .into_lease(String::new(), None, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_leases_are_flannels_and_each_family_is_allocated() {
    let etcd = Etcd::start().unwrap();
    set_config(&etcd, DUAL).await;
    let mut leases = Vec::new();
    for n in 1..=3 {
        leases.push(acquire(&etcd, attrs(n), &nothing()).await.1);
    }
    let mut v4s: Vec<_> = leases.iter().map(|l| l.subnet.unwrap()).collect();
    let mut v6s: Vec<_> = leases.iter().map(|l| l.subnet_v6.unwrap()).collect();
    v4s.sort();
    v4s.dedup();
    v6s.sort();
    v6s.dedup();
    assert_eq!((v4s.len(), v6s.len()), (3, 3), "{leases:?}");
    for l in &leases {
        let (v4, v6) = (l.subnet.unwrap(), l.subnet_v6.unwrap());
        assert_eq!(v4.prefix_len(), 24);
        assert_eq!(v6.prefix_len(), 64);
        assert!(
            "fd00:10:244::/56"
                .parse::<ipnet::IpNet>()
                .unwrap()
                .contains(&v6),
            "{v6}"
        );
        assert_eq!(l.node, format!("{}-24&{}-64", v4.addr(), v6.addr()));
    }
    // The stored values are flannel's: PublicIPv6 and BackendV6Data beside the IPv4 ones.
    let all = stored(&etcd).await;
    assert_eq!(all.len(), 3, "{all:?}");
    let (key, value) = all.iter().find(|(k, _)| *k == leases[0].node).unwrap();
    assert_eq!(
        value.to_string(),
        r#"{"PublicIP":"198.51.100.1","PublicIPv6":"2001:db8::1","BackendType":"wireguard","BackendData":{"PublicKey":"k1","Port":51820},"BackendV6Data":{"PublicKey":"k1","Port":51821}}"#,
        "{key}"
    );
    // Another node's view holds every lease with both subnets.
    let (reg, own) = acquire(&etcd, attrs(4), &nothing()).await;
    let handle = registry::spawn(reg, own, Default::default());
    let mut views = handle.views.clone();
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let view: Arc<ClusterView> = views.borrow_and_update().clone();
            if view.leases.len() == 4 {
                return view;
            }
            views.changed().await.unwrap();
        }
    })
    .await
    .expect("the fourth node sees all four leases");
    for l in &leases {
        let got = seen.get(&l.node).unwrap();
        assert_eq!((got.subnet, got.subnet_v6), (l.subnet, l.subnet_v6));
        assert_eq!(got.public_ipv6, l.public_ipv6);
        assert_eq!(got.backend_v6_data, l.backend_v6_data);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_keeps_its_subnets_when_its_config_gains_or_loses_a_family() {
    let etcd = Etcd::start().unwrap();
    set_config(&etcd, V4_ONLY).await;
    let (_, first) = acquire(&etcd, attrs(7), &nothing()).await;
    assert!(first.subnet_v6.is_none());
    // IPv6 enabled: the same IPv4 subnet (held for this public IP), an IPv6 one added,
    // and the old IPv4-only lease replaced in the same transaction, not left beside it.
    set_config(&etcd, DUAL).await;
    let (_, dual) = acquire(&etcd, attrs(7), &nothing()).await;
    assert_eq!(dual.subnet, first.subnet);
    let v6 = dual.subnet_v6.expect("an IPv6 subnet");
    let keys: Vec<String> = stored(&etcd).await.into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, vec![dual.node.clone()]);
    // A restart with the subnet file's subnets: the same lease, key unchanged.
    let (_, again) = acquire(&etcd, attrs(7), &dual).await;
    assert_eq!(again.node, dual.node);
    // IPv6 only: the IPv6 subnet kept, the key `fd00:…-64`.
    set_config(&etcd, V6_ONLY).await;
    let (_, only) = acquire(&etcd, attrs(7), &dual).await;
    assert_eq!((only.subnet, only.subnet_v6), (None, Some(v6)));
    assert_eq!(only.node, format!("{}-64", v6.addr()));
    let keys: Vec<String> = stored(&etcd).await.into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, vec![only.node.clone()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_lease_written_by_flannel_is_read_and_never_reused() {
    let etcd = Etcd::start().unwrap();
    set_config(&etcd, DUAL).await;
    let value = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/flannel/etcd-wireguard-dual.json"
    ))
    .unwrap();
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let name = "10.244.1.0-24&fd00:10:244:1::-64";
    c.put(format!("{PREFIX}/subnets/{name}"), value, None)
        .await
        .unwrap();
    // A node whose previous subnets are flannel's own is not given them.
    let theirs = attrs(0).to_lease_attrs().into_lease(
        String::new(),
        Some("10.244.1.0/24".parse().unwrap()),
        Some("fd00:10:244:1::/64".parse().unwrap()),
    );
    let (reg, own) = acquire(&etcd, attrs(5), &theirs).await;
    assert_ne!(own.subnet, theirs.subnet);
    assert_ne!(own.subnet_v6, theirs.subnet_v6);
    let handle = registry::spawn(reg, own, Default::default());
    let mut views = handle.views.clone();
    let lease = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(l) = views.borrow_and_update().get(name).cloned() {
                return l;
            }
            views.changed().await.unwrap();
        }
    })
    .await
    .expect("flannel's lease is seen");
    assert_eq!(lease.subnet, theirs.subnet);
    assert_eq!(lease.subnet_v6, theirs.subnet_v6);
    assert_eq!(lease.public_ipv6, Some("2001:db8::2".parse().unwrap()));
    assert_eq!(lease.backend_v6_data.unwrap()["Port"], 51821);
}

/// Eight nodes claim at once, each asking for its own previous IPv4 subnet and all for
/// the same previous IPv6 one. Their keys differ (a key names both subnets), so only the
/// claim's guard over the whole directory keeps two of them off one IPv6 subnet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_claiming_at_once_never_share_a_subnet_of_either_family() {
    const NODES: u8 = 8;
    let etcd = Etcd::start().unwrap();
    set_config(&etcd, DUAL).await;
    let mut ready = Vec::new();
    for n in 1..=NODES {
        let cfg = EtcdConfig::new(vec![etcd.endpoint()], PREFIX);
        let mut reg = EtcdRegistry::connect(cfg).await.unwrap();
        let net = reg.net_conf().await.unwrap();
        let previous = attrs(0).to_lease_attrs().into_lease(
            String::new(),
            Some(format!("10.244.{n}.0/24").parse().unwrap()),
            Some("fd00:10:244:1::/64".parse().unwrap()),
        );
        let request = AcquireRequest {
            attrs: attrs(n),
            previous: previous.subnet,
            previous_v6: previous.subnet_v6,
        };
        ready.push((reg, net, request));
    }
    let start = Arc::new(tokio::sync::Barrier::new(usize::from(NODES)));
    let claims: Vec<_> = ready
        .into_iter()
        .map(|(mut reg, net, request)| {
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                let lease = reg.acquire(&net, &request).await;
                (request, lease)
            })
        })
        .collect();
    let mut v6s = Vec::new();
    for claim in claims {
        let (request, lease) = claim.await.unwrap();
        let lease = lease.unwrap_or_else(|e| panic!("{:?}: {e}", request.previous));
        // Nobody else asked for this node's IPv4 subnet: it keeps it.
        assert_eq!(lease.subnet, request.previous, "{lease:?}");
        v6s.push(lease.subnet_v6.unwrap());
    }
    v6s.sort();
    v6s.dedup();
    assert_eq!(
        v6s.len(),
        usize::from(NODES),
        "one IPv6 subnet each: {v6s:?}"
    );
    let keys = stored(&etcd).await;
    assert_eq!(keys.len(), usize::from(NODES), "{keys:?}");
}
