//! The etcd registry against a real etcd (Debian `etcd-server`) on loopback ports chosen by
//! the test: concurrent acquisition, peers appearing/changing/disappearing, an etcd
//! restart, a partition healed by re-list and diff, lease renewal and loss, and a node
//! restarted with the same public IP getting its old subnet back.

use std::net::Ipv4Addr;
use std::time::Duration;

use etcd_client::Client;
use weft::registry::{AcquireRequest, EtcdRegistry, Registry, RegistryError};
use weft_backends::model::ClusterView;
use weft_lab::wait::{found_async, until_async};
use weft_lab::{CutProxy, Etcd};

mod etcd_lab;
use etcd_lab::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_race_for_one_subnet_and_get_distinct_ones() {
    let etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    let mut cfg = config(&etcd.endpoint());
    cfg.alloc_seed = Some(41); // both start their search at the same subnet
    let (a, b) = tokio::join!(
        acquire(cfg.clone(), attrs(1, "a")),
        acquire(cfg, attrs(2, "b"))
    );
    let (sa, sb) = (a.2.subnet.unwrap(), b.2.subnet.unwrap());
    assert_ne!(sa, sb);
    let pod = a.1.ipv4.unwrap();
    assert!(pod.in_range(&sa) && pod.in_range(&sb), "{sa} {sb}");
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let listed = c
        .get(
            format!("{PREFIX}/subnets/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let mut keys: Vec<_> = listed
        .kvs()
        .iter()
        .map(|kv| kv.key_str().unwrap().to_string())
        .collect();
    keys.sort();
    let mut want = vec![
        format!("{PREFIX}/subnets/{}", a.2.node),
        format!("{PREFIX}/subnets/{}", b.2.node),
    ];
    want.sort();
    assert_eq!(keys, want);
    // Each key is bound to an etcd lease with the 24 h TTL.
    for kv in listed.kvs() {
        let ttl = c.lease_time_to_live(kv.lease(), None).await.unwrap().ttl();
        assert!(ttl > 86_000 && ttl <= 86_400, "ttl {ttl}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_appear_change_and_disappear() {
    let etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    let (a, lease_a) = node(config(&etcd.endpoint()), attrs(1, "key-a1")).await;
    let mut cfg_b = config(&etcd.endpoint());
    cfg_b.lease_ttl = Duration::from_secs(3); // so its lease visibly expires once it stops
    cfg_b.renew_margin = Duration::from_secs(2);
    let (b, lease_b) = node(cfg_b, attrs(2, "key-b1")).await;
    let (mut va, mut vb) = (a.views.clone(), b.views.clone());
    wait_view(&mut va, 10, "a sees b", |v| v.get(&lease_b.node).is_some()).await;
    wait_view(&mut vb, 10, "b sees a", |v| v.get(&lease_a.node).is_some()).await;
    assert_eq!(
        va.borrow().get(&lease_b.node).unwrap().public_ip,
        Some(Ipv4Addr::new(198, 51, 100, 2))
    );

    b.updates.send(attrs(2, "key-b2")).await.unwrap();
    wait_view(&mut va, 10, "a sees b's new key", |v| {
        key_of(v, &lease_b.node).as_deref() == Some("key-b2")
    })
    .await;
    a.updates.send(attrs(1, "key-a2")).await.unwrap();
    wait_view(&mut vb, 10, "b sees a's new key", |v| {
        key_of(v, &lease_a.node).as_deref() == Some("key-a2")
    })
    .await;

    // b renews on its short TTL while it runs...
    holds_view(&mut va, 5, "b's lease there while b renews it", |v| {
        v.get(&lease_b.node).is_some()
    })
    .await;
    // ...and once stopped, its lease expires and a sees it leave.
    b.stop().await;
    wait_view(&mut va, 15, "a sees b leave", |v| {
        v.get(&lease_b.node).is_none()
    })
    .await;
    assert!(va.borrow().get(&lease_a.node).is_some());
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_restart_loses_no_lease_and_the_watch_recovers() {
    let mut etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    let (a, lease_a) = node(config(&etcd.endpoint()), attrs(1, "ka")).await;
    let (b, lease_b) = node(config(&etcd.endpoint()), attrs(2, "kb")).await;
    let mut va = a.views.clone();
    wait_view(&mut va, 10, "a sees b", |v| v.len() == 2).await;

    etcd.restart().unwrap();
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    for lease in [&lease_a, &lease_b] {
        let got = c
            .get(format!("{PREFIX}/subnets/{}", lease.node), None)
            .await
            .unwrap();
        assert_eq!(got.kvs().len(), 1, "{} lost in the restart", lease.node);
    }
    b.updates.send(attrs(2, "kb-after-restart")).await.unwrap();
    wait_view(&mut va, 20, "a sees b's change after the restart", |v| {
        key_of(v, &lease_b.node).as_deref() == Some("kb-after-restart")
    })
    .await;
    assert_eq!(*a.local.borrow(), lease_a, "a kept its lease");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_node_relists_and_catches_up() {
    let etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    let upstream = etcd.endpoint().trim_start_matches("http://").to_string();
    let proxy = CutProxy::start(upstream).await.unwrap();
    let (a, _) = node(config(&proxy.endpoint()), attrs(1, "ka")).await;
    let (b, lease_b) = node(config(&etcd.endpoint()), attrs(2, "kb")).await;
    let (c, lease_c) = node(config(&etcd.endpoint()), attrs(3, "kc")).await;
    // Told apart by key, not by subnet: d may be given the subnet c leaves.
    let holds = |v: &ClusterView, key: &str| {
        v.leases
            .keys()
            .any(|n| key_of(v, n).as_deref() == Some(key))
    };
    let mut va = a.views.clone();
    wait_view(&mut va, 10, "a sees three nodes", |v| v.len() == 3).await;

    proxy.cut();
    // While a is cut off: b changes, c leaves (its lease deleted), d joins.
    b.updates.send(attrs(2, "kb2")).await.unwrap();
    c.stop().await;
    let mut client = Client::connect([etcd.endpoint()], None).await.unwrap();
    client
        .delete(format!("{PREFIX}/subnets/{}", lease_c.node), None)
        .await
        .unwrap();
    let (d, _) = node(config(&etcd.endpoint()), attrs(4, "kd")).await;
    holds_view(&mut va, 2, "a hears nothing while cut off", |v| {
        key_of(v, &lease_b.node).as_deref() == Some("kb") && holds(v, "kc") && !holds(v, "kd")
    })
    .await;

    proxy.restore();
    wait_view(&mut va, 20, "a's view matches etcd again", |v| {
        key_of(v, &lease_b.node).as_deref() == Some("kb2") && !holds(v, "kc") && holds(v, "kd")
    })
    .await;
    for h in [a, b, d] {
        h.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_gets_its_old_subnet_back() {
    let etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    let (_, _, first) = acquire(config(&etcd.endpoint()), attrs(7, "k1")).await;
    // Same public IP, no memory of the subnet (no subnet file): the lease held for the IP.
    let (_, _, second) = acquire(config(&etcd.endpoint()), attrs(7, "k2")).await;
    assert_eq!(second.subnet, first.subnet);
    // A new public IP but the previous subnet from the subnet file: that subnet, if free.
    let mut reg = EtcdRegistry::connect(config(&etcd.endpoint()))
        .await
        .unwrap();
    let net = reg.net_conf().await.unwrap();
    let want = "10.244.77.0/24".parse().unwrap();
    let third = reg
        .acquire(
            &net,
            &AcquireRequest {
                attrs: attrs(8, "k3"),
                previous: Some(want),
                previous_v6: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(third.subnet, Some(want));
    // A previous subnet held by another IP is not taken from it.
    let fourth = reg
        .acquire(
            &net,
            &AcquireRequest {
                attrs: attrs(9, "k4"),
                previous: first.subnet,
                previous_v6: None,
            },
        )
        .await
        .unwrap();
    assert_ne!(fourth.subnet, first.subnet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_deleted_behind_our_back_is_claimed_again() {
    let etcd = Etcd::start().unwrap();
    let (a, lease_a, _) = one_node(&etcd).await;
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    c.delete(format!("{PREFIX}/subnets/{}", lease_a.node), None)
        .await
        .unwrap();
    let key = format!("{PREFIX}/subnets/{}", lease_a.node);
    let got = found_async("the lease claimed again", Duration::from_secs(5), || {
        let (mut c, key) = (c.clone(), key.clone());
        async move { Some(c.get(key, None).await.unwrap()).filter(|got| !got.kvs().is_empty()) }
    })
    .await;
    assert_eq!(got.kvs().len(), 1, "the lease was claimed twice");
    assert_eq!(
        a.local.borrow().subnet,
        lease_a.subnet,
        "claimed again with the same subnet"
    );
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_write_to_our_lease_is_put_back_with_our_etcd_lease() {
    let etcd = Etcd::start().unwrap();
    let (a, lease_a, mut va) = one_node(&etcd).await;
    let key = format!("{PREFIX}/subnets/{}", lease_a.node);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let ours = c.get(key.clone(), None).await.unwrap().kvs()[0].clone();
    assert_ne!(ours.lease(), 0);
    // Someone else redirects the node: another key and IP, and no etcd lease (so the
    // value would never expire).
    let foreign = r#"{"PublicIP":"203.0.113.66","BackendType":"wireguard","BackendData":{"PublicKey":"attacker","Port":51820}}"#;
    c.put(key.clone(), foreign, None).await.unwrap();
    let written_back = || {
        let (mut c, key, ours) = (c.clone(), key.clone(), ours.clone());
        async move {
            let got = c.get(key, None).await.unwrap();
            let kv = got.kvs().first()?;
            (kv.value() == ours.value() && kv.lease() == ours.lease()).then_some(())
        }
    };
    found_async(
        "the node's own value and etcd lease written back",
        Duration::from_secs(2),
        written_back,
    )
    .await;
    // Counted for /metrics (just after the write-back).
    until_async("the defence counted", Duration::from_secs(2), || {
        a.alerts.leases_defended.get() > 0
    })
    .await;
    assert_eq!(a.alerts.leases_defended.get(), 1);
    assert_eq!(
        a.local.borrow().subnet,
        lease_a.subnet,
        "the subnet is kept"
    );
    // Its own later writes are not mistaken for foreign ones: the view settles on ours.
    wait_view(&mut va, 5, "a sees its own key again", |v| {
        key_of(v, &lease_a.node).as_deref() == Some("ka")
    })
    .await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_not_sent_or_read_in_clear_without_etcd_insecure() {
    let etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    assert!(etcd.endpoint().starts_with("http://"));
    // A password for a plain-HTTP endpoint: refused before anything is sent.
    let mut cfg = config(&etcd.endpoint());
    cfg.auth = Some(("weft".into(), "secret".into()));
    let err = EtcdRegistry::connect(cfg.clone()).await.err().unwrap();
    let text = err.to_string();
    assert!(
        text.contains("the etcd password would cross the network in clear")
            && text.contains(&etcd.endpoint())
            && text.contains("--etcd-insecure"),
        "{text}"
    );
    // No secret in etcd: nothing to refuse.
    let mut reg = EtcdRegistry::connect(config(&etcd.endpoint()))
        .await
        .unwrap();
    let net = reg.net_conf().await.unwrap();
    assert!(reg.secrets_in_clear(&net).await.unwrap().is_none());
    // The cluster PSK in etcd: refused, naming the key; accepted with --etcd-insecure.
    let psk = format!(
        r#"{{"PSK": "{}"}}"#,
        weft_crypto::PresharedKey::generate()
            .unwrap()
            .to_base64_secret()
    );
    put(&etcd.endpoint(), &format!("{PREFIX}/weft/psk"), &psk).await;
    let refused = refusal(&mut reg, &net).await;
    assert!(
        refused.contains(&format!("the cluster PSK at {PREFIX}/weft/psk")),
        "{refused}"
    );
    let mut insecure = config(&etcd.endpoint());
    insecure.insecure = true;
    let mut reg = EtcdRegistry::connect(insecure).await.unwrap();
    assert!(reg.secrets_in_clear(&net).await.unwrap().is_none());
    // A PSK in the network config itself: refused too.
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    c.delete(format!("{PREFIX}/weft/psk"), None).await.unwrap();
    let with_psk = format!(
        r#"{{"Network": "10.244.0.0/16", "Backend": {{"Type": "wireguard", "PSK": "{}"}}}}"#,
        weft_crypto::PresharedKey::generate()
            .unwrap()
            .to_base64_secret()
    );
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), &with_psk).await;
    let mut reg = EtcdRegistry::connect(config(&etcd.endpoint()))
        .await
        .unwrap();
    let net = reg.net_conf().await.unwrap();
    let refused = refusal(&mut reg, &net).await;
    assert!(
        refused.contains("the PSK in the network config"),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_larger_than_etcds_answer_limit_is_read_in_pages() {
    let etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    // 600 leases of about 7.5 KiB: 4.5 MB, more than one etcd answer may carry (4 MiB).
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let padding = "x".repeat(7500);
    for i in 0..600u32 {
        let value = format!(
            r#"{{"PublicIP":"198.51.100.9","BackendType":"wireguard","BackendData":{{"PublicKey":"k{i}","Port":51820,"Note":"{padding}"}}}}"#
        );
        let key = format!("{PREFIX}/subnets/10.{}.{}.0-24", 100 + i / 256, i % 256);
        c.put(key, value, None).await.unwrap();
    }
    let whole = c
        .get(
            format!("{PREFIX}/subnets/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await;
    assert!(
        whole.is_err(),
        "one unpaginated answer carried it all: the test proves nothing"
    );
    // The registry's listing reads it in pages, and a node joins the 600.
    let mut cfg = config(&etcd.endpoint());
    cfg.list_page = 250;
    let (a, lease_a) = node(cfg, attrs(1, "ka")).await;
    let mut va = a.views.clone();
    wait_view(&mut va, 20, "a sees all 601 leases", |v| v.len() == 601).await;
    assert!(va.borrow().get(&lease_a.node).is_some());
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_leases_are_skipped_and_the_rest_is_kept() {
    let etcd = Etcd::start().unwrap();
    put(&etcd.endpoint(), &format!("{PREFIX}/config"), CONFIG).await;
    put(
        &etcd.endpoint(),
        &format!("{PREFIX}/subnets/10.244.200.0-24"),
        "{not json",
    )
    .await;
    put(
        &etcd.endpoint(),
        &format!("{PREFIX}/subnets/banana"),
        r#"{"PublicIP":"198.51.100.99"}"#,
    )
    .await;
    let (a, lease_a) = node(config(&etcd.endpoint()), attrs(1, "ka")).await;
    let (b, lease_b) = node(config(&etcd.endpoint()), attrs(2, "kb")).await;
    let mut va = a.views.clone();
    wait_view(&mut va, 10, "a sees b", |v| v.get(&lease_b.node).is_some()).await;
    // Outside the network, so it cannot be a subnet a or b was just given.
    put(
        &etcd.endpoint(),
        &format!("{PREFIX}/subnets/10.245.201.0-24"),
        "[]",
    )
    .await;
    // A good lease written after it: once a sees that one, it has read the bad one too.
    put(
        &etcd.endpoint(),
        &format!("{PREFIX}/subnets/10.245.202.0-24"),
        r#"{"PublicIP":"198.51.100.203","BackendType":"wireguard","BackendData":{"PublicKey":"kz","Port":51820}}"#,
    )
    .await;
    wait_view(&mut va, 10, "a sees the lease after the bad one", |v| {
        v.get("10.245.202.0-24").is_some()
    })
    .await;
    let names: Vec<_> = va.borrow().leases.keys().map(|k| k.to_string()).collect();
    let mut want = vec![
        lease_a.node.clone(),
        lease_b.node.clone(),
        "10.245.202.0-24".to_string(),
    ];
    want.sort();
    assert_eq!(names, want);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_bad_config_is_a_clear_error() {
    let etcd = Etcd::start().unwrap();
    let mut reg = EtcdRegistry::connect(config(&etcd.endpoint()))
        .await
        .unwrap();
    let err = reg.net_conf().await.unwrap_err();
    assert!(matches!(err, RegistryError::NoConfig { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("etcdctl put /coreos.com/network/config"),
        "{err}"
    );
    put(
        &etcd.endpoint(),
        &format!("{PREFIX}/config"),
        r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "geneve"}}"#,
    )
    .await;
    let err = reg.net_conf().await.unwrap_err().to_string();
    assert!(
        err.starts_with("the network config at /coreos.com/network/config is invalid"),
        "{err}"
    );
    assert!(err.contains("unknown backend type \"geneve\""), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_is_an_error_naming_the_endpoint() {
    let etcd = Etcd::start().unwrap();
    let endpoint = etcd.endpoint();
    drop(etcd);
    let mut cfg = config(&endpoint);
    cfg.request_timeout = Duration::from_secs(2);
    let result = match EtcdRegistry::connect(cfg).await {
        Ok(mut reg) => reg.net_conf().await.map(|_| ()),
        Err(e) => Err(e),
    };
    let err = result.unwrap_err().to_string();
    assert!(err.contains(&endpoint), "{err}");
}
