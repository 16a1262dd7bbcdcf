//! flannel's published shapes, both ways, against golden fixtures: what weft publishes
//! for each backend (etcd value byte for byte, Node annotations key for key) equals what
//! flannel writes, and what flannel writes reads back into the same lease.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use weft_backends::model::annotations::{publish, read, DEFAULT_PREFIX};
use weft_backends::model::{Lease, LeaseAttrs};
use weft_backends::plan::ipsec;
use weft_backends::plan::{vxlan_backend_data, vxlan_mac, wireguard_backend_data, WireguardData};
use weft_crypto::esp::Epoch;
use weft_crypto::PublicKey;

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/../tests/fixtures/flannel/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn key() -> PublicKey {
    PublicKey::from_bytes([2; 32])
}

/// What weft publishes for each backend, as lease attributes.
fn ours(backend: &str) -> LeaseAttrs {
    let data = match backend {
        "wireguard" => Some(wireguard_backend_data(&key(), 51820)),
        "vxlan" => Some(vxlan_backend_data(1, &[0x0a, 0, 0, 0, 0, 2])),
        "ipsec" => Some(ipsec::backend_data(&key(), &epoch())),
        _ => None,
    };
    LeaseAttrs {
        public_ip: Some(Ipv4Addr::new(198, 51, 100, 2)),
        public_ipv6: None,
        backend_type: backend.into(),
        backend_data: data,
        backend_v6_data: None,
        next_key: None,
        key_proof: None,
        ml_kem_key: None,
        zone: None,
        internal_ip: None,
        gateway: None,
        also: Default::default(),
    }
}

fn epoch() -> Epoch {
    Epoch {
        number: 3,
        nonce: [7; 16],
    }
}

const BACKENDS: [&str; 4] = ["wireguard", "vxlan", "host-gw", "ipsec"];

#[test]
fn weft_writes_flannels_etcd_values_byte_for_byte() {
    for b in BACKENDS {
        let written = serde_json::to_string(&ours(b)).unwrap();
        assert_eq!(written, fixture(&format!("etcd-{b}.json")), "backend {b}");
    }
}

#[test]
fn weft_writes_flannels_annotations() {
    for b in BACKENDS {
        let golden: BTreeMap<String, String> =
            serde_json::from_str(&fixture(&format!("annotations-{b}.json"))).unwrap();
        assert_eq!(publish(DEFAULT_PREFIX, &ours(b)), golden, "backend {b}");
    }
}

fn check_read(b: &str, lease: &Lease) {
    assert_eq!(lease.public_ip, Some(Ipv4Addr::new(198, 51, 100, 2)), "{b}");
    assert_eq!(lease.backend_type, b);
    match b {
        "wireguard" => {
            let d = WireguardData::decode(lease.backend_data.as_ref()).unwrap();
            assert_eq!(d.public_key, key());
        }
        "vxlan" => assert_eq!(
            vxlan_mac(lease.backend_data.as_ref()).unwrap(),
            [0x0a, 0, 0, 0, 0, 2]
        ),
        "ipsec" => {
            let d = ipsec::IpsecData::decode(lease.backend_data.as_ref()).unwrap();
            assert_eq!((d.public_key, d.epoch), (key(), epoch()));
        }
        _ => assert_eq!(lease.backend_data, None, "host-gw has no backend data"),
    }
}

#[test]
fn weft_reads_flannels_etcd_values_and_annotations() {
    for b in BACKENDS {
        let attrs: LeaseAttrs = serde_json::from_str(&fixture(&format!("etcd-{b}.json"))).unwrap();
        let lease = attrs.into_lease("10.244.2.0-24".into(), None, None);
        check_read(b, &lease);

        let annotations: BTreeMap<String, String> =
            serde_json::from_str(&fixture(&format!("annotations-{b}.json"))).unwrap();
        let subnet = "10.244.2.0/24".parse().unwrap();
        let lease = read(DEFAULT_PREFIX, "node-b", &[subnet], &annotations)
            .unwrap()
            .unwrap();
        assert_eq!(lease.subnet, Some(subnet));
        check_read(b, &lease);
    }
    // flannel's own wireguard data carries no port: the peer's port is then ours.
    let attrs: LeaseAttrs =
        serde_json::from_str(&fixture("flannel-etcd-wireguard-without-port.json")).unwrap();
    let d = WireguardData::decode(attrs.backend_data.as_ref()).unwrap();
    assert_eq!((d.public_key, d.port), (key(), None));
}

#[test]
fn annotations_overwrite_unmanaged_nodes_and_bad_values() {
    let p = DEFAULT_PREFIX;
    let mut a: BTreeMap<String, String> =
        serde_json::from_str(&fixture("annotations-vxlan.json")).unwrap();
    a.insert(format!("{p}/public-ip-overwrite"), "203.0.113.9".into());
    let lease = read(p, "node-b", &[], &a).unwrap().unwrap();
    assert_eq!(lease.public_ip, Some(Ipv4Addr::new(203, 0, 113, 9)));

    let mut unmanaged = a.clone();
    unmanaged.remove(&format!("{p}/kube-subnet-manager"));
    assert_eq!(read(p, "node-b", &[], &unmanaged).unwrap(), None);

    let mut bad = a.clone();
    bad.insert(format!("{p}/backend-data"), "{not json".into());
    let err = read(p, "node-b", &[], &bad).unwrap_err().to_string();
    assert!(
        err.starts_with(
            "node node-b: annotation flannel.alpha.coreos.com/backend-data is not JSON"
        ),
        "{err}"
    );
    let mut bad = a;
    bad.insert(format!("{p}/public-ip"), "nope".into());
    bad.remove(&format!("{p}/public-ip-overwrite"));
    let err = read(p, "node-b", &[], &bad).unwrap_err().to_string();
    assert!(err.contains("\"nope\" is not an IPv4 address"), "{err}");
}

/// What a dual-stack weft node publishes: the IPv6 address and, for the backends that
/// have one, the IPv6 device's data (`BackendV6Data`).
fn ours_dual(backend: &str) -> LeaseAttrs {
    let v6 = match backend {
        "wireguard" => Some(wireguard_backend_data(&key(), 51821)),
        "vxlan" => Some(vxlan_backend_data(1, &[0x0a, 0, 0, 0, 0, 3])),
        _ => None,
    };
    LeaseAttrs {
        public_ipv6: Some("2001:db8::2".parse().unwrap()),
        backend_v6_data: v6,
        ..ours(backend)
    }
}

#[test]
fn dual_stack_values_are_flannels_both_ways() {
    // ipsec carries IPv4 only.
    for b in ["wireguard", "vxlan", "host-gw"] {
        let golden = fixture(&format!("etcd-{b}-dual.json"));
        let written = serde_json::to_string(&ours_dual(b)).unwrap();
        assert_eq!(written, golden, "backend {b}");
        let attrs: LeaseAttrs = serde_json::from_str(&golden).unwrap();
        assert_eq!(attrs, ours_dual(b), "backend {b}");
        let lease = attrs.into_lease("n".into(), None, None);
        check_read(b, &lease);
        assert_eq!(lease.public_ipv6, Some("2001:db8::2".parse().unwrap()));
    }
}

/// `attrs` as weft writes them to etcd, checked to be a wireguard node's flannel values
/// byte for byte with one field of weft's, `field`: `value`, after them.
fn flannels_and(attrs: &LeaseAttrs, field: &str, value: &str) -> String {
    let written = serde_json::to_string(attrs).unwrap();
    let flannels = serde_json::to_string(&ours("wireguard")).unwrap();
    let want = format!(
        "{},\"{field}\":\"{value}\"}}",
        flannels.strip_suffix('}').unwrap()
    );
    assert_eq!(written, want);
    written
}

/// weft's key proof rides in its own field, `WeftKeyProof`, beside flannel's (which flannel
/// ignores), and comes back as the lease's proof; one that does not decode is no proof.
#[test]
fn the_key_proof_is_a_field_of_its_own_and_round_trips() {
    let private = weft_crypto::PrivateKey::from_bytes([5; 32]);
    let proof = weft_crypto::proof::prove(&private, "10.244.3.0-24").unwrap();
    let attrs = LeaseAttrs {
        key_proof: Some(weft_crypto::proof::to_text(&proof)),
        ..ours("wireguard")
    };
    let written = flannels_and(&attrs, "WeftKeyProof", &weft_crypto::proof::to_text(&proof));
    let back: LeaseAttrs = serde_json::from_str(&written).unwrap();
    let lease = back.into_lease("10.244.3.0-24".into(), None, None);
    assert_eq!(lease.key_proof, Some(proof));
    let garbled = LeaseAttrs {
        key_proof: Some("not base64".into()),
        ..ours("wireguard")
    };
    assert_eq!(garbled.into_lease("n".into(), None, None).key_proof, None);
}

/// weft's ML-KEM key rides in its own field (etcd: `WeftMlKemKey`) and annotation
/// (`weft.dev/ml-kem-key`), beside flannel's values, which stay exactly flannel's; it comes
/// back raw for the planner to decode.
#[test]
fn the_ml_kem_key_is_a_field_and_an_annotation_of_its_own() {
    let ek = weft_crypto::pq::KemKeyPair::from_seed([3; 64])
        .encaps_key()
        .to_base64();
    let attrs = LeaseAttrs {
        ml_kem_key: Some(ek.clone()),
        ..ours("wireguard")
    };
    let written = flannels_and(&attrs, "WeftMlKemKey", &ek);
    let back: LeaseAttrs = serde_json::from_str(&written).unwrap();
    assert_eq!(
        back.into_lease("n".into(), None, None).ml_kem_key,
        Some(ek.clone())
    );

    let p = "flannel.alpha.coreos.com";
    let published = publish(p, &ours("wireguard"));
    let mut annotations = published.clone();
    annotations.insert("weft.dev/ml-kem-key".into(), ek.clone());
    let lease = read(p, "node-b", &[], &annotations).unwrap().unwrap();
    assert_eq!(lease.ml_kem_key, Some(ek));
    assert!(
        published.keys().all(|k| k.starts_with(p)),
        "flannel's annotations only: {published:?}"
    );
}
